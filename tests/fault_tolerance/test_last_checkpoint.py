"""The watchdog's last checkpoint (:mod:`strategies.fault_tolerance.last_checkpoint`): written only from a state
every rank shares, holding the state of the last optimizer step, and ``--ckpt_path=last`` finding the newest one; in one
process. The faults that write it run in ``tests/fault_tolerance/test_fault_matrix.py``."""

from __future__ import annotations

import copy
import os
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from conformance_harness import rank_0_fitting
from jsonargparse import Namespace
from lightning.pytorch.loops.progress import _BatchProgress
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn

from lit_cifar.cli.run_dir import resume_last_version
from strategies.fault_tolerance.last_checkpoint import LastCheckpoint


def test_ckpt_path_last_pins_the_version_with_the_newest_last_checkpoint(tmp_path: Path) -> None:
    def trainer() -> Namespace:
        init = Namespace(save_dir=str(tmp_path), name="lightning_logs", version=None)
        return Namespace(logger=Namespace(class_path="TensorBoardLogger", init_args=init))

    assert resume_last_version(trainer(), "last") is None  # first run of the job: fresh start
    for version, age in (("version_0", 100), ("version_1", 0)):
        path = tmp_path / "lightning_logs" / version / "checkpoints" / "last.ckpt"
        path.parent.mkdir(parents=True)
        path.write_bytes(b"x")
        os.utime(path, (time.time() - age, time.time() - age))
    config = trainer()
    assert resume_last_version(config, "last") == "version_1" and config.logger.init_args.version == "version_1"
    assert resume_last_version(trainer(), None) is None


def test_the_last_checkpoint_is_written_only_from_a_state_every_rank_shares() -> None:
    def trainer(**changes) -> SimpleNamespace:
        fields = {
            "is_global_zero": True,
            "global_rank": 0,
            "state": SimpleNamespace(fn=TrainerFn.FITTING),
            "sanity_checking": False,
            "global_step": 15,
        }
        return SimpleNamespace(**{**fields, **changes})

    last = LastCheckpoint()
    assert last.cannot_save(trainer()) is None
    rank1, rank2 = trainer(is_global_zero=False, global_rank=1), trainer(is_global_zero=False, global_rank=2)
    assert "only rank 0 writes checkpoints (rank 1 when rank 0 is lost)" in last.cannot_save(rank1)
    assert last.cannot_save(rank1, rank0_lost=True) is None  # rank 1 holds what rank 0 held: it writes instead
    assert "only rank 0" in last.cannot_save(rank2, rank0_lost=True) and "only rank 0" in last.cannot_save(rank2)
    assert "only rank 0" in last.cannot_save(trainer(), rank0_lost=True)  # never both
    assert "zero1" in LastCheckpoint(zero1=True).cannot_save(trainer())  # attach() passes the strategy's option
    assert "validate" in last.cannot_save(trainer(state=SimpleNamespace(fn=TrainerFn.VALIDATING)))
    last.updating = True  # on_before_optimizer_step
    assert "inside an optimizer update" in last.cannot_save(trainer())


def _batch(trainer: SimpleNamespace, last: LastCheckpoint, module: nn.Module, steps: bool, end: bool = True) -> None:
    """One training batch as Lightning counts it and the watchdog sees it; its forward moves BatchNorm."""
    progress = trainer.fit_loop.epoch_loop.batch_progress
    progress.increment_ready()
    last.batch_started(trainer, module)
    progress.increment_started()
    module(torch.randn(8, 3) + 5.0)
    if end:
        progress.increment_processed()
        last.updating = steps  # on_before_optimizer_step, on a batch that steps
        last.batch_ended()
        progress.increment_completed()


def _checkpoint(trainer: SimpleNamespace, module: nn.Module) -> dict[str, Any]:
    progress = trainer.fit_loop.epoch_loop.batch_progress.state_dict()
    return {
        "state_dict": {name: value.clone() for name, value in module.state_dict().items()},
        "loops": {"fit_loop": {"epoch_loop.batch_progress": copy.deepcopy(progress)}},
    }


def test_the_last_checkpoint_holds_the_state_of_the_last_optimizer_step() -> None:
    """Buffers and batch counters of the accumulation window's first micro-batch (accumulate 3 here)."""
    module = nn.BatchNorm1d(3)
    progress = _BatchProgress()
    trainer = rank_0_fitting(global_step=4, current_epoch=1, progress=progress)
    last = LastCheckpoint()
    for steps in (False, False, True):  # a whole window: its step done, no window open
        _batch(trainer, last, module, steps)
    window_start = {name: value.clone() for name, value in module.state_dict().items()}
    _batch(trainer, last, module, steps=False)  # the next window's first micro-batch
    _batch(trainer, last, module, steps=False, end=False)  # its second, in flight at the fault
    checkpoint = _checkpoint(trainer, module)
    last.saving(trainer, checkpoint)  # someone else's checkpoint: as it is
    assert not torch.equal(checkpoint["state_dict"]["running_mean"], window_start["running_mean"])
    assert checkpoint["loops"]["fit_loop"]["epoch_loop.batch_progress"]["current"]["completed"] == 4
    last._writing = True  # what save() sets around its own trainer.save_checkpoint
    last.saving(trainer, checkpoint)
    assert all(torch.equal(checkpoint["state_dict"][name], value) for name, value in window_start.items())
    assert last.saved_step == 4
    saved = checkpoint["loops"]["fit_loop"]["epoch_loop.batch_progress"]
    for part in ("total", "current"):  # as if the fault had come in the window's first forward: resume at batch 3
        assert saved[part] == {"ready": 4, "started": 4, "processed": 3, "completed": 3}, part
    restored = _BatchProgress()
    restored.load_state_dict(saved)
    restored.reset_on_restart()
    assert restored.current.ready == 3  # Lightning's loop goes on at batch_idx 3
    progress.increment_processed()
    last.updating = True  # the window's last micro-batch steps
    last.batch_ended()
    checkpoint = _checkpoint(trainer, module)
    last.saving(trainer, checkpoint)  # after the step the module's own state is the shared one
    assert torch.equal(checkpoint["state_dict"]["running_mean"], module.running_mean)
    assert checkpoint["loops"]["fit_loop"]["epoch_loop.batch_progress"]["current"]["processed"] == 5


def test_the_last_checkpoint_needs_the_batch_counters_where_lightning_keeps_them() -> None:
    module = nn.BatchNorm1d(3)
    trainer = rank_0_fitting(global_step=0, current_epoch=0, progress=_BatchProgress())
    last = LastCheckpoint()
    last.batch_started(trainer, module)
    last._writing = True
    with pytest.raises(RuntimeError, match="batch counters are not at loops/fit_loop/epoch_loop.batch_progress"):
        last.saving(trainer, {"state_dict": {}, "loops": {"fit_loop": {}}})
