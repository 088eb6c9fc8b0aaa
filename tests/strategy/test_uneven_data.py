"""Uneven data per rank under ``custom_ddp`` (2 CPU ranks, fork + gloo): training joins and equals one process
on the union of each step's batches; evaluation equals one process on the union of the ranks' samples;
the refusing option and manual optimization end every rank with the batch counts. The rows of the
conformance tables run the same patterns (``conformance.training.uneven_patterns``,
``conformance.evaluation.uneven``)."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from conformance_harness import make_trainer
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from conformance.evaluation.table import uneven_values
from conformance.training.patterns import ManualOptimization
from conformance.training.runs import compare, fit_pattern
from conformance.training.uneven_patterns import UNEVEN_PATTERNS, UnevenTraining
from strategies.custom_ddp import CustomDDPStrategy
from strategies.stopping.stop_signals import StopOnSignal

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("name", ["uneven_4_2", "uneven_map_style_4_2"])
def test_a_fit_on_4_plus_2_batches_equals_one_process_on_the_union_at_every_step(name: str) -> None:
    pattern = UNEVEN_PATTERNS[name]
    truth = fit_pattern(pattern, "one_process")[0]["records"]
    for rank in fit_pattern(pattern, "custom_ddp"):
        steps = rank["records"]["weights"]
        assert len(steps) == len(truth["weights"]) == 4  # rank 1 ran steps 2 and 3 on empty batches
        for step, (got, want) in enumerate(zip(steps, truth["weights"], strict=True)):
            for key in want:
                torch.testing.assert_close(got[key], want[key], rtol=0, atol=1e-6, msg=f"step {step} {key}")
        # sync_dist logs: each step's value and the epoch's are means over the samples trained, as one process's
        torch.testing.assert_close(rank["records"]["step_loss"], truth["step_loss"], rtol=1e-6, atol=0)
        torch.testing.assert_close(rank["records"]["train_loss"], truth["train_loss"], rtol=1e-6, atol=0)


class _Refused(UnevenTraining):
    custom_options = {"uneven_data": "refuse"}


class _RefusedKnownLengths(_Refused):
    iterable = False


class _Manual(ManualOptimization, UnevenTraining):
    """The manual optimization pattern on 4 + 2 batches."""


@pytest.mark.parametrize(
    ("pattern", "expected"),
    [
        (_Refused, "rank 1's training data ended after 2 batches of epoch 0; rank 0 has more (batch 3 is next)"),
        (_RefusedKnownLengths, "training loaders differ in length per epoch: rank 0's 4 batches, rank 1's 2 batches"),
        (
            _Manual,
            "rank 1's training data ended after 2 batches of epoch 0; rank 0 has more (batch 3 is next). "
            "custom_ddp joins uneven data under automatic optimization only",
        ),
    ],
    ids=["refuse", "refuse_known_lengths", "manual_optimization"],
)
def test_a_fit_that_cannot_join_ends_every_rank_naming_each_ranks_batch_count(pattern, expected: str) -> None:
    with pytest.raises(Exception, match="UnevenDataError") as raised:
        fit_pattern(pattern, "custom_ddp")
    assert expected in str(raised.value)
    assert "peer lost" not in str(raised.value)


@pytest.mark.parametrize("iterable", [False, True], ids=["dataloader_per_rank", "iterable_dataset"])
def test_validation_on_7_plus_4_samples_gives_one_process_metrics(iterable: bool) -> None:
    got, want = uneven_values("custom_ddp", iterable), uneven_values("one_process", iterable)
    assert isinstance(got, dict), got
    assert got.keys() == want.keys() == {"accuracy", "loss"}
    for key in want:
        assert got[key] == pytest.approx(want[key], rel=1e-6, abs=1e-7), key


class _TwoIterableLoaders(UnevenTraining):
    def train_dataloader(self) -> list:
        return [super().train_dataloader(), super().train_dataloader()]

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.loss(*batch[0])


def test_several_training_loaders_of_unknown_length_are_refused_with_the_fix() -> None:
    with pytest.raises(Exception, match="joins uneven data for one training loader") as raised:
        fit_pattern(_TwoIterableLoaders, "custom_ddp")
    assert "uneven_data='refuse'" in str(raised.value)


class _ValidatedMidJoin(UNEVEN_PATTERNS["uneven_2_4_batchnorm"]):
    """Rank 0's data ends after 2 batches; validation after batch 3 (a joined step), then 1 more step."""

    trainer_options = {"val_check_interval": 3, "limit_val_batches": 2, "num_sanity_val_steps": 0}

    def val_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(list(zip(self.inputs[:8], self.targets[:8], strict=True)), batch_size=4)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self.loss(*batch), sync_dist=True)

    def on_validation_epoch_end(self) -> None:
        self.records.setdefault("val_loss", []).append(self.trainer.callback_metrics["val_loss"].clone())


def test_validation_inside_a_joined_epoch_sees_the_trained_buffers_and_the_fit_goes_on_exactly() -> None:
    truth = fit_pattern(_ValidatedMidJoin, "one_process")[0]
    for rank in fit_pattern(_ValidatedMidJoin, "custom_ddp"):
        assert len(rank["records"]["weights"]) == 4
        torch.testing.assert_close(rank["records"]["val_loss"], truth["records"]["val_loss"], rtol=1e-5, atol=0)
        for key, want in truth["state"].items():  # SyncBatchNorm's running statistics included
            torch.testing.assert_close(rank["state"][key], want, rtol=0, atol=1e-6, msg=key)


class _SigtermOnRank1(Callback):
    """SIGTERM to rank 1 at the start of batch 2: a step it runs on an empty batch (4 + 2 batches)."""

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if (trainer.global_rank, batch_idx) == (1, 2):
            os.kill(os.getpid(), signal.SIGTERM)


def test_a_sigterm_on_the_rank_running_empty_batches_stops_every_rank_at_that_step(tmp_path: Path) -> None:
    trainer = make_trainer(
        CustomDDPStrategy(start_method="fork", timeout=30),
        max_epochs=1,
        use_distributed_sampler=False,
        enable_checkpointing=True,
        callbacks=[ModelCheckpoint(dirpath=tmp_path, save_top_k=0), _SigtermOnRank1()],
    )
    with pytest.raises(StopOnSignal) as stopped:
        trainer.fit(UNEVEN_PATTERNS["uneven_4_2"]())
    assert stopped.value.code == 143
    assert torch.load(tmp_path / "last.ckpt", weights_only=False)["global_step"] == 3  # that step, none after


@pytest.mark.parametrize("options", [{"zero1": True}, {"sync_mode": "flat"}], ids=["zero1", "flat"])
def test_the_join_holds_under_zero1_and_flat_sync(options: dict) -> None:
    # ZeRO-1 shards the optimizer state over the ranks, flat sends one bucket at the end of backward: a step where
    # rank 0 ran an empty batch is weighed the same way (SyncBatchNorm counting it as 0 samples, as in the row).
    pattern = type("Joined", (UNEVEN_PATTERNS["uneven_2_4_batchnorm"],), {"custom_options": options})
    result = compare(fit_pattern(pattern, "custom_ddp"), fit_pattern(pattern, "one_process"))
    assert result["max_diff"] <= 1e-6 and result["ranks_agree"], result
