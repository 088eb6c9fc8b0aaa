"""custom_ddp's evaluation is exact for every metric and gather a user writes (2 CPU ranks, fork + gloo).

11 samples: shards of 6 and 5 under custom_ddp. Every pattern of :mod:`conformance.evaluation.patterns`
is compared with one process evaluating all 11 (floats within 1e-6, counts equal); patterns whose
result is defined otherwise (a metric made local, a "mean" state) are compared with that definition.
"""

from __future__ import annotations

import json
import warnings
from collections import Counter
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from conformance_harness import custom_strategy, make_trainer, one_process_trainer
from lightning.pytorch.callbacks import Callback, EarlyStopping
from torch.utils.data import DataLoader
from torchmetrics import MaxMetric, MeanMetric
from torchmetrics.classification import BinaryAccuracy, BinaryAUROC

from collectives.launcher import run_workers
from conformance.evaluation.patterns import (
    NUM_SAMPLES,
    CallbackAUROC,
    DropLastModule,
    IteratorStepsModule,
    PatternModule,
    TwoLoadersModule,
    ValidateInsideFit,
    dataset,
)
from measure.collective_count import count_collectives
from strategies.custom_ddp import CustomDDPStrategy
from strategies.evaluation.scatter_eval import shard_loader

pytestmark = pytest.mark.distributed
# Defined by something other than the data: a local metric, torchmetrics' mean-of-ranks sync,
# a running window over batches (batch boundaries differ between one process and two ranks).
NOT_DATASET_DEFINED = {"local_acc", "mean_state", "running_mean"}


def _validate(trainer: pl.Trainer, module: pl.LightningModule) -> dict[str, float]:
    return {key: float(value) for key, value in trainer.validate(module, verbose=False)[0].items()}


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> tuple[dict[str, float], dict]:
    out = tmp_path_factory.mktemp("one")
    metrics = _validate(one_process_trainer(callbacks=[CallbackAUROC()]), PatternModule(out))
    return metrics, json.loads((out / "gather.json").read_text())


def test_every_metric_pattern_equals_one_process(tmp_path, one_process) -> None:
    expected, expected_gather = one_process
    actual = _validate(make_trainer(custom_strategy(), callbacks=[CallbackAUROC()]), PatternModule(tmp_path))
    assert actual.keys() == expected.keys()
    for key in expected.keys() - NOT_DATASET_DEFINED:
        assert actual[key] == pytest.approx(expected[key], rel=1e-6, abs=1e-6), key
    scores = torch.sigmoid(PatternModule(tmp_path).net(dataset().tensors[0]).squeeze(1)).detach()
    labels = dataset().tensors[1]
    # sync_on_compute=False: rank 0's own 6 samples; "mean" states: the mean over ranks of each state
    assert actual["local_acc"] == pytest.approx(float(BinaryAccuracy()(scores[:6], labels[:6])))
    batch_means = [scores[0:4].mean() + scores[4:6].mean(), scores[6:10].mean() + scores[10:11].mean()]
    assert actual["mean_state"] == pytest.approx(float(sum(batch_means) / 2 / 2))
    assert actual["running_mean"] == pytest.approx(float(scores.mean()))  # both windows hold all batches
    gather = json.loads((tmp_path / "gather.json").read_text())
    assert gather["all_gather_shape"] == [2, 6]  # ddp's shape, rank 1 padded with a repeat of its own row
    assert gather["all_gather_samples_rows"] == NUM_SAMPLES
    assert gather["all_gather_samples_sum"] == pytest.approx(expected_gather["all_gather_sum"], rel=1e-6)


def _strategy_gather_worker(rank: int, world_size: int) -> tuple[list, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gathered = CustomDDPStrategy().all_gather(torch.arange(6.0 - rank))
    return gathered.shape, [str(w.message) for w in caught]


def test_strategy_all_gather_of_uneven_rows_warns_once_with_the_padding_and_the_fix(tmp_path) -> None:
    (shape, messages), _ = run_workers(_strategy_gather_worker, 2, init_file=tmp_path / "store")
    assert shape == (2, 6) and len(messages) == 1
    assert "1 of the 12 gathered rows are padding" in messages[0] and "all_gather_samples" in messages[0]


class _SumMaxCat(pl.LightningModule):
    """One loader, one metric of each mergeable kind, logged the usual way."""

    def __init__(self, out_dir: Path) -> None:
        super().__init__()
        self.net = torch.nn.Linear(4, 1)
        self.out_dir = out_dir
        self.mean, self.max, self.auroc = MeanMetric(), MaxMetric(), BinaryAUROC()

    def validation_step(self, batch, batch_idx: int) -> None:
        scores = torch.sigmoid(self.net(batch[0]).squeeze(1))
        self.mean.update(scores)
        self.max.update(scores)
        self.auroc.update(scores, batch[1])
        self.log_dict({"mean": self.mean, "max": self.max, "auroc": self.auroc})

    def val_dataloader(self) -> DataLoader:
        return DataLoader(dataset(), batch_size=4)


class _CountEvalCollectives(Callback):
    """Every collective from a validation epoch's start to the run's end (Lightning's computes included)."""

    def on_validation_epoch_start(self, trainer, pl_module) -> None:
        self._counting = count_collectives()
        self._collectives = self._counting.__enter__()

    def on_validation_end(self, trainer, pl_module) -> None:
        self._counting.__exit__(None, None, None)
        counts = Counter(c.kind for c in self._collectives)
        (pl_module.out_dir / f"collectives_rank{trainer.global_rank}.json").write_text(json.dumps(counts))


def test_a_loader_with_sum_max_and_cat_metrics_costs_four_collectives_per_epoch(tmp_path) -> None:
    make_trainer(custom_strategy(), callbacks=[_CountEvalCollectives()]).validate(_SumMaxCat(tmp_path), verbose=False)
    for rank in range(2):
        counts = json.loads((tmp_path / f"collectives_rank{rank}.json").read_text())
        # sum states: 1 all_reduce; max: 1 all_reduce; cat: 1 layout exchange + 1 padded gather
        assert counts == {"all_reduce": 2, "all_gather": 2}, counts


def test_dataloader_iter_steps_are_exact_and_non_dataloader_loaders_run_as_under_ddp() -> None:
    trainer = make_trainer(custom_strategy())
    assert _validate(trainer, IteratorStepsModule()) == {"count": float(NUM_SAMPLES)}
    assert trainer.test(IteratorStepsModule(), [0, 1, 2], verbose=False) == [{"count": 6.0}]  # each rank: all 3, as ddp
    loader = [0, 1, 2]
    with pytest.warns(UserWarning, match="is a list, not a torch DataLoader: it is used as it is"):
        assert shard_loader(loader, trainer, device=torch.device("cpu")) is loader


def test_a_second_trainer_call_inside_fit_fails_with_one_clear_message_on_every_rank() -> None:
    trainer = make_trainer(custom_strategy(), callbacks=[ValidateInsideFit()], num_sanity_val_steps=0)
    with pytest.raises(Exception, match=r"trainer.validate\(\) was called while trainer.fit\(\) is running"):
        trainer.fit(IteratorStepsModule())


class _FrozenAUROC(pl.LightningModule):
    """lr=0: validation values never improve, so EarlyStopping(patience=2) stops at the 3rd check, mid-epoch."""

    def __init__(self, out_dir: Path) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Linear(4, 1)
        self.auroc = BinaryAUROC()
        self.out_dir = out_dir

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        return self.net(batch[0]).sum()

    def validation_step(self, batch, batch_idx: int) -> None:
        self.auroc.update(torch.sigmoid(self.net(batch[0]).squeeze(1)), batch[1])
        self.log("val_auroc", self.auroc)

    def on_train_end(self) -> None:
        if self.global_rank == 0:  # where it stopped, in optimizer steps per rank
            (self.out_dir / "stopped.json").write_text(
                json.dumps([self.trainer.current_epoch, self.trainer.global_step])
            )

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(dataset(32, seed=1), batch_size=4)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(dataset(), batch_size=4)


def test_mid_epoch_validation_with_early_stopping_on_a_cat_state_metric_stops_like_one_process(tmp_path) -> None:
    def run(strategy, devices: int) -> tuple[dict, list]:
        trainer = make_trainer(
            strategy,
            devices=devices,
            max_epochs=5,
            val_check_interval=0.5,
            num_sanity_val_steps=0,
            callbacks=[EarlyStopping(monitor="val_auroc", mode="max", patience=2)],
        )
        trainer.fit(_FrozenAUROC(tmp_path))
        metrics = {key: float(value) for key, value in trainer.callback_metrics.items()}
        return metrics, json.loads((tmp_path / "stopped.json").read_text())

    (expected, one_stop), (actual, custom_stop) = run("auto", 1), run(custom_strategy(), 2)
    assert actual == pytest.approx(expected, rel=1e-6) and set(actual) == {"val_auroc"}
    # the 3rd check: mid-epoch of epoch 1 (8 batches per epoch in one process, 4 per rank on two)
    assert one_stop == [2, 12] and custom_stop == [2, 6]  # stopped in epoch 1, which then ends


def test_two_validation_loaders_with_metrics_per_loader_equal_one_process() -> None:
    expected = one_process_trainer().validate(TwoLoadersModule(), verbose=False)
    got = make_trainer(custom_strategy()).validate(TwoLoadersModule(), verbose=False)
    assert [sorted(results) for results in got] == [sorted(results) for results in expected]
    assert sorted(expected[1]) == ["accuracy/dataloader_idx_1", "auroc/dataloader_idx_1", "loss/dataloader_idx_1"]
    for ours, theirs in zip(got, expected, strict=True):
        for name, value in theirs.items():
            assert abs(float(ours[name]) - float(value)) <= 1e-6, name


def test_a_drop_last_loader_evaluates_the_samples_one_process_evaluates() -> None:
    expected = _validate(one_process_trainer(), DropLastModule())
    assert expected == {"index_sum": float(sum(range(8)))}  # samples 0-7; 8-10 are the last partial batch
    assert _validate(make_trainer(custom_strategy()), DropLastModule()) == expected
