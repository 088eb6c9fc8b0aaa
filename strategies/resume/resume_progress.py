"""Where a resumed fit goes on, read from Lightning's restored loop, and one training loader's first pass
checked against it (:mod:`exact_resume`).

Lightning counts a batch saved at its end as done, begins a batch saved inside it again, and makes a
resumed epoch's training iterator before it restores the checkpoint; these helpers say which, after
the restore. :class:`LoaderResume` is the bookkeeping of one rebuilt training loader: how far its
first pass skipped, in which epoch's order, and a check at the first batch that the loop resumed
there (a Lightning whose restart bookkeeping moved raises instead of training batches twice).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from parallel.resume.resume_sampler import ResumeSampler
from strategies.resume.epoch_order import changed_order_warning

__all__ = ["FALLBACK", "LoaderResume", "batches_done", "inside_a_batch", "resumed_at", "resumed_before_iterator"]

FALLBACK = "pass CustomDDPStrategy(exact_resume=False) to keep your loader (the epoch then starts over)"


def batches_done(progress: Any) -> int:
    """Batches of the interrupted epoch that Lightning's loop counts as trained when it resumes from
    ``progress`` (the restored ``fit_loop.epoch_loop.batch_progress``): it goes on at that batch index."""
    total = progress.total
    # Saved at a batch's end (ModelCheckpoint, a signal's stop): the batch is processed but not yet
    # counted completed, and the restarted loop counts it done (Lightning's RESTARTED_ON_TRAIN_BATCH_END).
    at_batch_end = total.ready == total.started == total.processed == total.completed + 1
    return progress.current.completed + int(at_batch_end)


def inside_a_batch(progress: Any) -> bool:
    """The checkpoint was written inside a training batch, before it was processed (the watchdog's last one,
    :mod:`strategies.fault_tolerance.last_checkpoint`): the restored loop begins that batch again."""
    return progress.total.ready == progress.total.started == progress.total.processed + 1


def resumed_at(trainer: pl.Trainer, epoch_batches: int | float) -> int:
    """The batch index inside an epoch of ``epoch_batches`` where the restored loop goes on; 0 at an
    epoch's start (a fresh fit, or a checkpoint from an epoch's end). Ask after the restore."""
    loop = trainer.fit_loop
    done = batches_done(loop.epoch_loop.batch_progress) if loop.restarting else 0
    return done if 0 < done < epoch_batches else 0


def resumed_before_iterator(trainer: pl.Trainer) -> bool:
    """The restored loop goes on from where the uninterrupted fit had not made the epoch's training iterator
    yet, but Lightning made it before the restore: at an epoch's start (after an epoch Lightning counts done,
    or inside the epoch's first batch). Not after an epoch's last batch that Lightning does not count done yet
    (a checkpoint written at the validation after it; one from the batch's own end, Lightning 2.6 counts done):
    the resumed loop finishes that epoch and makes the next one's iterator itself, as the uninterrupted fit
    did. Ask after the restore."""
    loop = trainer.fit_loop
    if resumed_at(trainer, trainer.num_training_batches):
        return False
    epoch = loop.epoch_progress.total
    after_last_batch = batches_done(loop.epoch_loop.batch_progress) > 0 and epoch.processed < epoch.started
    return not (loop.restarting and after_last_batch)


def _epoch_batches(length: int, limit: int | float) -> int:
    """Training batches per epoch of a loader of ``length`` under ``limit_train_batches``, as Lightning counts."""
    return min(length, limit) if isinstance(limit, int) else int(length * limit)


def _several_loaders(trainer: pl.Trainer) -> bool:
    """Whether the fit trains on more than one loader (a list or dict of them, cycled to the longest)."""
    loaders = trainer.train_dataloader
    return isinstance(loaders, (list, tuple, Mapping)) and len(loaders) > 1


class LoaderResume:
    """One training loader of a resumed fit: how far its first pass skipped, checked at the first batch.

    ``changes``: how this fit orders the epoch unlike the interrupted one (:func:`epoch_order.order_changes`; the
    resume is then not exact, and says so), ``None`` where the checkpoint does not record the interrupted order;
    ``shards``: the samples a ``DistributedSampler`` shards over the ranks."""

    def __init__(
        self,
        trainer: pl.Trainer,
        length: int,
        batch_size: int,
        reason: str | None,
        changes: Mapping[str, tuple[Any, Any]] | None = None,
        shards: int | None = None,
    ) -> None:
        self._trainer, self._length, self._batch_size, self.reason = trainer, length, batch_size, reason
        self._changes, self._shards = changes, shards
        self.done: int | None = None  # batches of the epoch the first pass left out (None: not begun)
        self.restored = False  # whether the loop's state had been restored when the first pass began
        self.pass_epoch: int | None = None  # the epoch whose order the first pass took
        self.counted_alone = False  # the first pass counted the epoch's batches from this loader alone
        self.sampler: ResumeSampler | None = None
        self.before_first_pass: Callable[[], None] | None = None  # called as the first pass begins

    def epoch(self) -> int:
        return self._trainer.current_epoch

    def _loaded(self) -> bool:
        # The checkpoint's loop state is in: one written after any training batch counts some.
        return self._trainer.fit_loop.epoch_loop.batch_progress.total.ready > 0

    def began_too_early(self) -> bool:
        """The first pass began before the checkpoint was restored (its epoch and skip were not known yet), in
        the epoch before (from an epoch's end, Lightning makes the iterator before it counts the epoch done), or
        before Lightning counted the epoch's batches while there are several loaders to count."""
        return self.done is not None and (
            (not self.restored and self._loaded())
            or self.pass_epoch != self._trainer.current_epoch
            or (self.counted_alone and _several_loaders(self._trainer))
        )

    def first_pass_skip(self) -> int:
        """Samples the loader's first pass leaves out: the batches the restored loop counts as done."""
        if self.before_first_pass is not None:
            self.before_first_pass()
        self.restored, self.pass_epoch = self._loaded(), self._trainer.current_epoch
        # The epoch's batches are the combined loader's (a shorter loader is cycled within it). Lightning counts
        # them after making the iterator, whose workers begin the pass: this loader's count stands in for them.
        epoch_batches = self._trainer.num_training_batches
        self.counted_alone = not math.isfinite(epoch_batches)
        if self.counted_alone:
            epoch_batches = _epoch_batches(self._length, self._trainer.limit_train_batches)
        self.done = resumed_at(self._trainer, epoch_batches)
        epoch = self._trainer.current_epoch
        if self.done and self._changes:
            rank_zero_warn(changed_order_warning(epoch, self.done, self._batch_size, self._changes, self._shards))
        elif self.done:
            rank_zero_info(f"custom_ddp: resuming epoch {epoch} at batch {self.done}: {self._what_is_left_out()}")
        # A shorter loader, cycled within the epoch, is that far into its current pass.
        return (self.done % self._length) * self._batch_size if self.done else 0

    def _what_is_left_out(self) -> str:
        not_resumable = "Lightning's warning that the loader is not resumable does not apply"
        if self._changes is None:
            return (
                f"the training loader leaves out the first {self.done} batches of each rank's shard of the epoch "
                "(exact_resume). The checkpoint does not record how the interrupted fit ordered the epoch (written "
                "by another strategy such as ddp, or by an older custom_ddp): that is the batches it trained if it "
                f"ran on {self._trainer.world_size} rank(s) with this loader and sampler. {not_resumable} then"
            )
        left_out = "the training loader leaves out the batches the interrupted epoch trained"
        return f"{left_out} (exact_resume; {not_resumable})"

    def check(self, epoch: int, batch_idx: int) -> None:
        """At the resumed fit's first training batch (``batch_idx``: where Lightning's loop goes on)."""
        if self.reason is None and self.done is None:
            return  # set up again before the first batch (reload_dataloaders_every_n_epochs): never iterated
        if self.reason is not None:
            if batch_idx > 0:
                rank_zero_warn(
                    f"custom_ddp: resuming epoch {epoch} at batch {batch_idx}, but the training loader is "
                    f"{self.reason}, which cannot resume by index: it starts the epoch over, as under ddp "
                    f"(its first {batch_idx} batches are trained again)."
                )
        elif batch_idx != self.done:
            raise RuntimeError(
                f"custom_ddp: the training loader resumed epoch {epoch} at batch {self.done}, but Lightning's loop "
                f"resumed at batch {batch_idx}: its restart bookkeeping differs from this version's (Lightning "
                f"{pl.__version__}). {FALLBACK}."
            )
