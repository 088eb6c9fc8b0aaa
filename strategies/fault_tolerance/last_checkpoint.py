"""The checkpoint rank 0 writes when a stall or a peer's failure ends the job: the last completed optimizer step.

Rank 0 writes it; when rank 0 is the rank lost (its process gone or stopped on this machine, or
stalled), rank 1 writes it instead: without ZeRO-1 every rank holds the same weights, optimizer
state and, with SyncBatchNorm and ``broadcast_buffers``, buffers, so rank 1's checkpoint is the one
rank 0 would have written. No other rank writes (the two never race for the file: rank 1 writes
only once rank 0 can no longer).

:class:`LastCheckpoint` belongs to :class:`watchdog.Watchdog`, which hands it the training
hooks it needs. It is written only from a state every rank shares: fitting, outside the optimizer
update (between ``on_before_optimizer_step`` and the batch end the update may be half done), without
ZeRO-1 (the optimizer state's shards on a lost rank cannot be consolidated). The fault usually comes
inside a training batch, whose forward may already have moved some buffers (the BatchNorm layers
before the collective rank 0 waits in): rank 0 keeps a copy of the module's buffers from the start
of the batch and writes those, so the checkpoint holds exactly the state after the last completed
optimizer step and a resume from it (with ``exact_resume``) ends bitwise as an uninterrupted run.
With gradient accumulation (``accumulate_grad_batches``, or manual optimization that steps every few
batches) that state is the start of the accumulation window, not of the batch: the window's earlier
micro-batches live only in the ranks' gradients, which no checkpoint holds. The copy is therefore
taken at the window's first micro-batch (the first batch after an optimizer step), and a checkpoint
written later in the window also moves the loop back to that batch
(``loops.fit_loop["epoch_loop.batch_progress"]``, as if the fault had come in its forward): the
resume trains the whole window again and takes its step from every micro-batch.
The copy is rank 0's only and small: a ResNet-18's 60 buffers (9.6 k numbers) take 0.14 ms per window
(``torch.utils.benchmark`` median, AMD EPYC, 1 thread).
With ``exact_resume`` it also holds every rank's random generators at the window's start, the lost
rank's included, from the job's store (:mod:`window_generators`), so that the resume draws
the uninterrupted fit's dropout masks and noise; when a rank's are missing it holds none and says why.
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.trainer.states import TrainerFn

from strategies.fault_tolerance.window_generators import WindowGenerators
from strategies.resume import CHECKPOINT_KEY
from strategies.stopping import stop_checkpoint_path

__all__ = ["LastCheckpoint"]

_BATCH_PROGRESS = ("loops", "fit_loop", "epoch_loop.batch_progress")  # where a checkpoint keeps the batch counters


@dataclass(frozen=True)
class _Window:
    """The state every rank shared at the first micro-batch since the last optimizer step."""

    epoch: int
    total_completed: int  # batch_progress.total.completed then: training batches before the window
    current_completed: int  # the same within the epoch (batch_progress.current)
    buffers: dict[str, torch.Tensor]


def _at_window_start(progress: dict[str, Any], window: _Window) -> None:
    """Set checkpointed batch counters to those of a fault in the window's first batch: begun, not processed."""
    for counters, completed in (
        (progress["total"], window.total_completed),
        (progress["current"], window.current_completed),
    ):
        counters.update(ready=completed + 1, started=completed + 1, processed=completed, completed=completed)
    progress["is_last_batch"] = False


class LastCheckpoint:
    """What rank 0 can save of a job that ends abnormally (module docstring)."""

    def __init__(self, zero1: bool = False) -> None:
        self.zero1 = zero1  # optimizer state sharded over ranks: a lost rank's shard cannot be saved
        self.saved_step: int | None = None  # global step of the newest checkpoint written
        self.updating = False  # between on_before_optimizer_step and the batch end: weights half updated
        self.ending = False  # a last checkpoint is being written: the strategy's barrier must not communicate
        self._window: _Window | None = None  # inside an accumulation window only (a batch without one)
        self.window_open = False  # on every rank: a training batch began since the last step or epoch end
        self._writing = False
        self._generators_note = ""  # what the newest of this class's checkpoints holds of the random generators

    @property
    def writing(self) -> bool:
        """This rank is writing it now (on rank 1, the strategy's save must write too)."""
        return self._writing

    @staticmethod
    def writer(rank0_lost: bool) -> int:
        """The rank that writes it: rank 0, or rank 1 when rank 0 is the rank lost."""
        return 1 if rank0_lost else 0

    # ------------------------------------------------------------- training hooks (from the watchdog)

    def batch_started(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.window_open = True
        if trainer.global_rank > 1 or self.zero1:  # the only ranks that may write it
            return
        if self._window is None or self._window.epoch != trainer.current_epoch:  # a new accumulation window
            progress = trainer.fit_loop.epoch_loop.batch_progress
            buffers = {name: buffer.detach().clone() for name, buffer in pl_module.named_buffers()}
            self._window = _Window(trainer.current_epoch, progress.total.completed, progress.current.completed, buffers)

    def batch_ended(self) -> bool:
        """A training batch ended; ``True`` when it stepped (the next batch begins a window)."""
        stepped, self.updating = self.updating, False
        if stepped:
            self._window = None  # the step is done: the module's own state is the shared one
            self.window_open = False
        return stepped

    def epoch_ended(self) -> None:
        """The next batch begins a window, stepped or not (:meth:`batch_started` opens one per epoch)."""
        self.window_open = False

    def saving(
        self, trainer: pl.Trainer, checkpoint: dict[str, Any], generators: WindowGenerators | None = None
    ) -> None:
        """Every checkpoint about to be written; this class's own gets the window's start (module docstring)."""
        self.saved_step = trainer.global_step
        window = self._window
        if not self._writing:
            return
        if generators is not None:
            states, why = generators.every_rank()  # at the window's start, or now when none is open
            if states is not None:
                checkpoint[CHECKPOINT_KEY] = states
            self._generators_note = "every rank's at that step" if states is not None else f"none ({why})"
        if window is None:
            return
        state = checkpoint["state_dict"]
        state.update({name: value for name, value in window.buffers.items() if name in state})
        # Always: a fault after the window's first batch was processed would otherwise count it done.
        _at_window_start(self._batch_progress(checkpoint), window)

    @staticmethod
    def _batch_progress(checkpoint: dict[str, Any]) -> dict[str, Any]:
        counters = ("ready", "started", "processed", "completed")
        try:
            progress = checkpoint[_BATCH_PROGRESS[0]][_BATCH_PROGRESS[1]][_BATCH_PROGRESS[2]]
            if all(name in progress[part] for part in ("total", "current") for name in counters):
                return progress
        except (KeyError, TypeError):
            pass
        raise RuntimeError(
            f"custom_ddp: cannot move the checkpoint back to the accumulation window's start: its "
            f"batch counters are not at {'/'.join(_BATCH_PROGRESS)} in Lightning {pl.__version__}"
        )

    # ------------------------------------------------------------- writing it

    def note(self, trainer: pl.Trainer | None, parked: bool, rank0_lost: bool = False) -> str:
        """Write it if this rank can (``parked``: its main thread waits in a collective and touches no
        state; ``rank0_lost``: rank 1 writes); the report's line on what to resume."""
        if trainer is None:
            return "no checkpoint: the stage is over"
        if parked:
            return self.save(trainer, rank0_lost)
        why = self.cannot_save(trainer, rank0_lost) or "this rank's main thread is not parked in a collective"
        return self._newest_note(trainer, why)

    def save(self, trainer: pl.Trainer, rank0_lost: bool = False) -> str:
        """Write the checkpoint of the last completed optimizer step, or say why not and name the newest one.
        The save's barrier is skipped (:attr:`ending`): there is no peer left to meet."""
        why = self.cannot_save(trainer, rank0_lost)
        if why:
            return self._newest_note(trainer, why)
        path = stop_checkpoint_path(trainer)
        self.ending = self._writing = True
        self._generators_note = "none kept (exact_resume=False)"  # saving() says otherwise when it was given some
        try:
            if os.path.islink(path):
                os.remove(path)  # save_last="link": write a file, not through the link
            trainer.save_checkpoint(path)
        except Exception as error:  # noqa: BLE001 - the job ends either way; say what happened
            return self._newest_note(trainer, f"writing {path} failed: {type(error).__name__}: {error}")
        finally:
            self._writing = False
        writer = "rank 0" if trainer.is_global_zero else f"rank {trainer.global_rank}, rank 0 being lost"
        return (
            f"checkpoint of the last completed optimizer step {trainer.global_step} written by {writer}: {path} "
            f"(resume: --ckpt_path {path} or --ckpt_path last); random generators: {self._generators_note}"
        )

    def cannot_save(self, trainer: Any, rank0_lost: bool = False) -> str | None:
        if trainer.global_rank != self.writer(rank0_lost):
            return "only rank 0 writes checkpoints (rank 1 when rank 0 is lost) and it is not among the healthy ranks"
        if trainer.state.fn != TrainerFn.FITTING or trainer.sanity_checking:
            return f"nothing trained to save during {trainer.state.fn.value if trainer.state.fn else 'setup'}"
        if self.zero1:
            return "zero1: part of the optimizer state is sharded on the stalled or failed rank"
        if trainer.global_step == 0:  # a restart from nothing begins the fit again, exactly
            return "no optimizer step completed yet"
        if self.updating:
            return "the fault came inside an optimizer update: the weights may differ between ranks"
        if self.saved_step == trainer.global_step:
            return "the newest checkpoint already holds this step"
        return None

    def _newest_note(self, trainer: pl.Trainer, why: str) -> str:
        callback = trainer.checkpoint_callback
        dirpath = callback.dirpath if isinstance(callback, ModelCheckpoint) else None
        files = glob.glob(os.path.join(dirpath, "*.ckpt")) if dirpath else []
        if not files:
            return f"no checkpoint written ({why}) and none before"
        newest = max(files, key=os.path.getmtime)
        step = f" (step {self.saved_step})" if self.saved_step is not None else ""
        return f"no checkpoint written ({why}); newest checkpoint: {newest}{step}; resume: --ckpt_path {newest}"
