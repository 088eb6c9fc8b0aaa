"""A fork worker's exception path: Lightning runs ``on_exception`` only in the launching process (no
rank), so ``custom_ddp``'s launcher runs the rank's own in each failing worker. What it must give: the
lost peer's diagnosis and rank 0's last checkpoint, and the desync report of both sides (its gradient
buckets then go through the process group, where torch's check sees them). popen ranks: the fault
matrix (``tests/fault_tolerance/test_fault_matrix.py``)."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from conformance_harness import custom_strategy, make_trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel

from strategies.custom_ddp import CustomDDPStrategy
from strategies.options import CustomDDPOptions

pytestmark = pytest.mark.distributed


class _RaisesOnRank1(BoringModel):
    def training_step(self, batch: Any, batch_idx: int) -> Any:
        if self.global_rank == 1 and batch_idx == 5:
            raise RuntimeError("injected: rank 1 raised at batch 5")
        return super().training_step(batch, batch_idx)


class _ExtraBackwardOnRank1(BoringModel):
    """Rank 1 runs one synced backward more at batch 2: a gradient all-reduce rank 0 never issues."""

    @property
    def automatic_optimization(self) -> bool:
        return False

    def training_step(self, batch: Any, batch_idx: int) -> None:
        backward_passes = 2 if self.global_rank == 1 and batch_idx == 2 else 1
        for _ in range(backward_passes):
            self.manual_backward(self.step(batch).sum())
        self.optimizers().step()
        self.optimizers().zero_grad()


def _fit_in_forked_workers(
    module: pl.LightningModule, root: Path, strategy: CustomDDPStrategy | None = None, **options: Any
) -> tuple[BaseException, str, float]:
    """Fit on 2 fork workers; (the error, what the workers logged, seconds). Forked workers inherit
    the file handler, so their log lines land in one file."""
    handler = logging.FileHandler(root / "workers.log")
    logger = logging.getLogger("strategies")
    logger.addHandler(handler)
    trainer = make_trainer(
        strategy or custom_strategy(timeout_s=20, **options),
        enable_checkpointing=True,
        default_root_dir=root,
        callbacks=[ModelCheckpoint(dirpath=root / "ckpt", every_n_train_steps=2)],
    )
    started = time.monotonic()
    try:
        with pytest.raises(Exception) as caught:
            trainer.fit(module)
    finally:
        logger.removeHandler(handler)
        handler.close()
    return caught.value, (root / "workers.log").read_text(), time.monotonic() - started


def test_a_fork_worker_that_loses_its_peer_writes_the_last_checkpoint_and_names_the_peer(tmp_path) -> None:
    error, logged, _ = _fit_in_forked_workers(_RaisesOnRank1(), tmp_path)
    assert "injected: rank 1 raised at batch 5" in str(error)
    assert "rank 1 ended first: RuntimeError: injected: rank 1 raised at batch 5" in logged, logged
    assert "checkpoint of the last completed optimizer step 5 written by rank 0" in logged, logged
    checkpoint = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=False)
    assert checkpoint["global_step"] == 5


def test_a_failing_exception_path_leaves_the_workers_own_error_to_raise(tmp_path) -> None:
    strategy = custom_strategy(timeout_s=20)

    def broken(trainer: pl.Trainer, exception: BaseException) -> None:
        raise OSError("disk full")

    strategy.on_worker_exception = broken  # forked workers inherit it
    error, logged, _ = _fit_in_forked_workers(_RaisesOnRank1(), tmp_path, strategy)
    assert "injected: rank 1 raised at batch 5" in str(error)
    assert "the exception path of worker 1 failed: OSError('disk full')" in logged, logged


def test_a_step_one_fork_worker_repeats_is_a_desync_report_of_both_sides_in_seconds(tmp_path) -> None:
    error, logged, seconds = _fit_in_forked_workers(_ExtraBackwardOnRank1(), tmp_path, desync_check=True)
    assert "Detected mismatch between collectives" in str(error)
    # Before: the extra bucket was summed in shared memory, unseen by the check, and both ranks waited
    # for the 20 s timeout; the launching process then reported a desync of its own after a 30 s connect.
    assert seconds < 15, (seconds, logged)
    assert "rank 1: all_reduce(float32[" in logged and "from gradient bucket (SyncedDataParallel)" in logged, logged
    assert "rank 0: " in logged and "(launch)" not in logged, logged
    assert "; torch saw rank " in logged, logged  # the peer's collective as torch's check names it


def test_the_desync_check_takes_the_buckets_through_the_process_group() -> None:
    assert CustomDDPOptions(desync_check=True).grad_sync.grad_transport == "process_group"
    assert CustomDDPOptions().grad_sync.grad_transport == "auto"
    with pytest.raises(
        ValueError, match="desync_check=True .* grad_transport='shared_memory'.* use grad_transport='auto'"
    ):
        CustomDDPOptions(desync_check=True, grad_transport="shared_memory")
