"""Scatter-based validation/test under custom_ddp on 2 CPU ranks (fork launching).

11 samples on 2 ranks: shards of 6 and 5, batches of 4 -> 2 batches per rank of unequal sizes.
The logged metrics must equal one process evaluating all 11, each sample seen exactly once,
with one all-reduce per evaluation epoch and no hang from the uneven batch counts.
"""

from __future__ import annotations

import json
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from conformance_harness import custom_strategy, ddp_strategy, make_trainer, one_process_trainer
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.profiler import ProfilerActivity, profile
from torch.utils.data import BatchSampler, DataLoader, Dataset, SequentialSampler
from torchmetrics import MeanMetric, SumMetric
from torchmetrics.classification import MulticlassAccuracy

from parallel.evaluation.eval_sharding import ShardPlan
from strategies.evaluation.scatter_eval import _warn_fallback

pytestmark = pytest.mark.distributed
NUM_SAMPLES = 11


class IndexedDataset(Dataset):
    """(features, label, index): the index lets the test check that each sample is seen once."""

    def __init__(self, n: int = NUM_SAMPLES, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.features = torch.randn(n, 4, generator=generator)
        self.labels = torch.randint(0, 3, (n,), generator=generator)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int, int]:
        return self.features[i], int(self.labels[i]), i


class EvalModule(pl.LightningModule):
    """Logs torchmetrics objects only; knows nothing about the strategy."""

    def __init__(self, out_dir: Path | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Linear(4, 3)
        self.out_dir = out_dir
        self.metrics = nn.ModuleDict(
            {
                "acc1": MulticlassAccuracy(3, top_k=1, average="micro"),
                "acc2": MulticlassAccuracy(3, top_k=2, average="micro"),
                "loss": MeanMetric(),
                "count": SumMetric(),
            }
        )
        self.seen: list[int] = []

    def _evaluate(self, batch, stage: str) -> None:
        features, labels, indices = batch
        logits = self.net(features)
        self.metrics["acc1"](logits, labels)
        self.metrics["acc2"](logits, labels)
        self.metrics["loss"](F.cross_entropy(logits, labels, reduction="none"))
        self.metrics["count"](torch.tensor(float(labels.numel())))
        self.seen.extend(indices.tolist())
        for name, metric in self.metrics.items():
            self.log(f"{stage}/{name}", metric)

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        features, labels, _ = batch
        return F.cross_entropy(self.net(features), labels)

    def validation_step(self, batch, batch_idx: int) -> None:
        self._evaluate(batch, "val")

    def test_step(self, batch, batch_idx: int) -> None:
        self._evaluate(batch, "test")

    def on_validation_epoch_end(self) -> None:
        self._dump_seen("val")

    def on_test_epoch_end(self) -> None:
        self._dump_seen("test")

    def _dump_seen(self, stage: str) -> None:
        if self.out_dir is not None and not self.trainer.sanity_checking:
            (self.out_dir / f"{stage}_seen_rank{self.global_rank}.json").write_text(json.dumps(self.seen))
        self.seen = []

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(IndexedDataset(16, seed=1), batch_size=4)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(IndexedDataset(), batch_size=4)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(IndexedDataset(), batch_size=4)


class _CountEvalCollectives(Callback):
    """All collectives from evaluation epoch start to evaluation end (metric compute included)."""

    def __init__(self, out_dir: Path) -> None:
        self.out_dir = out_dir

    def on_validation_epoch_start(self, trainer, pl_module) -> None:
        self._profiler = profile(activities=[ProfilerActivity.CPU])
        self._profiler.__enter__()

    def on_validation_end(self, trainer, pl_module) -> None:
        self._profiler.__exit__(None, None, None)
        counts = {e.key: e.count for e in self._profiler.key_averages() if e.key.startswith("c10d::")}
        (self.out_dir / f"collectives_rank{trainer.global_rank}.json").write_text(json.dumps(counts))


def _single_process(stage: str, module: EvalModule) -> dict[str, float]:
    run = one_process_trainer().validate if stage == "val" else one_process_trainer().test
    return run(module, verbose=False)[0]


def _assert_metrics_equal(actual: dict, expected: dict, stage: str) -> None:
    for name in ("acc1", "acc2", "count"):  # ratios of integer counts: bit-exact
        assert actual[f"{stage}/{name}"] == expected[f"{stage}/{name}"], name
    assert actual[f"{stage}/count"] == NUM_SAMPLES
    assert actual[f"{stage}/loss"] == pytest.approx(expected[f"{stage}/loss"], rel=1e-6, abs=0)


def _assert_each_sample_once(out_dir: Path, stage: str) -> None:
    seen = [json.loads((out_dir / f"{stage}_seen_rank{rank}.json").read_text()) for rank in range(2)]
    assert [len(part) for part in seen] == [6, 5]
    assert sorted(seen[0] + seen[1]) == list(range(NUM_SAMPLES))


@pytest.mark.parametrize("stage", ["val", "test"])
def test_uneven_shards_give_the_single_process_metric(tmp_path, stage: str) -> None:
    trainer = make_trainer(custom_strategy(), callbacks=[_CountEvalCollectives(tmp_path)])
    run = trainer.validate if stage == "val" else trainer.test
    actual = run(EvalModule(tmp_path), verbose=False)[0]
    _assert_metrics_equal(actual, _single_process(stage, EvalModule()), stage)
    _assert_each_sample_once(tmp_path, stage)
    if stage == "val":
        for rank in range(2):
            counts = json.loads((tmp_path / f"collectives_rank{rank}.json").read_text())
            assert counts == {"c10d::allreduce_": 1}, counts  # one reduction per epoch, nothing per batch


def test_fit_validation_is_exact_after_sanity_check(tmp_path) -> None:
    module = EvalModule(tmp_path)
    trainer = make_trainer(custom_strategy(), num_sanity_val_steps=2, max_epochs=2)
    trainer.fit(module)  # the parent's module gets rank 0's final weights
    actual = {name: float(value) for name, value in trainer.callback_metrics.items()}
    _assert_each_sample_once(tmp_path, "val")
    module.out_dir = None
    _assert_metrics_equal(actual, _single_process("val", module), "val")


def test_without_scatter_lightning_pads_with_duplicates() -> None:
    # The failure mode scatter evaluation removes: DistributedSampler pads 11 samples to 12.
    actual = make_trainer(custom_strategy(scatter_eval=False)).validate(EvalModule(), verbose=False)[0]
    assert actual["val/count"] == NUM_SAMPLES + 1


def test_more_ranks_than_samples_falls_back_to_the_padded_layout() -> None:
    # 1 sample, 2 ranks: a rank without a batch would skip the collectives, so both evaluate it.
    module = EvalModule()
    module.val_dataloader = lambda: DataLoader(IndexedDataset(1), batch_size=4)
    actual = make_trainer(custom_strategy()).validate(module, verbose=False)[0]  # warns in the (forked) ranks
    assert actual["val/count"] == 2


def test_a_fallback_warning_names_the_batch_counts_and_the_fixes() -> None:
    plan = ShardPlan.decide(5, 2, batch_size=2, limit=0.5)
    with pytest.warns(UserWarning, match=r"per-rank batch counts \[1, 0\].*padded layout.*an int limit"):
        _warn_fallback(plan, 2, 0.5)


@pytest.mark.parametrize("limit", [0.5, 1, 2])
def test_limit_val_batches_runs_on_every_rank(limit) -> None:
    # 5 samples, batches of 2: contiguous shards 3 + 2 give 2 + 1 batches, and 0.5 would leave
    # rank 1 with int(0.5) = 0 batches: that case must fall back, the others stay exact.
    module = EvalModule()
    module.val_dataloader = lambda: DataLoader(IndexedDataset(5), batch_size=2)
    actual = make_trainer(custom_strategy(), limit_val_batches=limit).validate(module, verbose=False)[0]
    assert actual["val/count"] == {0.5: 4, 1: 4, 2: 5}[limit]


def test_reloaded_dataloaders_are_rescattered_every_epoch(tmp_path) -> None:
    module = EvalModule(tmp_path)
    trainer = make_trainer(custom_strategy(), max_epochs=3, num_sanity_val_steps=0, reload_dataloaders_every_n_epochs=1)
    trainer.fit(module)
    _assert_each_sample_once(tmp_path, "val")  # the last epoch's loaders: re-scattered, still once each
    actual = {name: float(value) for name, value in trainer.callback_metrics.items()}
    module.out_dir = None
    _assert_metrics_equal(actual, _single_process("val", module), "val")


class _IterableSamples(torch.utils.data.IterableDataset):
    def __iter__(self):
        data = IndexedDataset()
        return (data[i] for i in range(len(data)))


def test_iterable_eval_loader_is_used_as_lightning_makes_it() -> None:
    # Lightning does not shard an IterableDataset (ddp neither): every rank evaluates what it
    # yields, and the metrics keep their own sync, so the count is world_size x the samples.
    module = EvalModule()
    module.val_dataloader = lambda: DataLoader(_IterableSamples(), batch_size=4)
    actual = make_trainer(custom_strategy()).validate(module, verbose=False)[0]
    assert actual["val/count"] == 2 * NUM_SAMPLES


class _OwnBatchSampler(BatchSampler):
    """A batch sampler class of the user's own: its batches cannot be re-made by index."""


class _Batches(Dataset):
    """Whole batches as items, for a loader with batch_size=None (each item is a step)."""

    def __init__(self) -> None:
        self.data = IndexedDataset()

    def __len__(self) -> int:
        return 3

    def __getitem__(self, index: int):
        rows = torch.arange(4 * index, min(4 * index + 4, NUM_SAMPLES))
        return self.data.features[rows], self.data.labels[rows], rows


def test_a_loader_that_cannot_be_scattered_is_sharded_as_under_ddp() -> None:
    # Before, the identity sampler injected for scatter evaluation stayed: every rank evaluated the whole set.
    results = {}
    for name, strategy in (("ddp", ddp_strategy), ("custom_ddp", custom_strategy)):
        module = EvalModule()
        module.val_dataloader = lambda: DataLoader(
            IndexedDataset(), batch_sampler=_OwnBatchSampler(SequentialSampler(range(11)), 4, False)
        )
        results[name] = make_trainer(strategy()).validate(module, verbose=False)[0]
    assert results["custom_ddp"] == results["ddp"]
    assert results["custom_ddp"]["val/count"] < 2 * NUM_SAMPLES


def test_a_batch_size_none_loader_is_scattered_by_item(tmp_path) -> None:
    # 3 items (batches of 4, 4, 3 samples) on 2 ranks: items 0-1 on rank 0, item 2 on rank 1. ddp's
    # DistributedSampler pads the items to 4: the first batch counts twice (before, custom_ddp did the same).
    module = EvalModule(tmp_path)
    module.val_dataloader = lambda: DataLoader(_Batches(), batch_size=None)
    actual = make_trainer(custom_strategy()).validate(module, verbose=False)[0]
    seen = [json.loads((tmp_path / f"val_seen_rank{rank}.json").read_text()) for rank in range(2)]
    assert seen == [list(range(8)), list(range(8, NUM_SAMPLES))]
    module.out_dir = None
    _assert_metrics_equal(actual, _single_process("val", module), "val")
    module.val_dataloader = lambda: DataLoader(_Batches(), batch_size=None)
    assert make_trainer(ddp_strategy()).validate(module, verbose=False)[0]["val/count"] == NUM_SAMPLES + 4
