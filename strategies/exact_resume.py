"""Exact mid-epoch resume for :class:`strategies.custom_ddp.CustomDDPStrategy`: the resumed epoch trains
exactly the batches the interrupted one had not.

A fit resumed from a mid-epoch checkpoint (a signal's stop checkpoint, the watchdog's last one,
``ModelCheckpoint(every_n_train_steps=...)``) counts on from the batch it stopped at, while a plain
``DataLoader`` starts the epoch over: the epoch's first batches are trained twice and its last ones
never (Lightning warns that the loader "is not resumable"; ``ddp`` does the same). Here, when the
training loader is set up for a fit that restarts mid-epoch, it is rebuilt
(:mod:`strategies.loaders`) around a :class:`~parallel.resume_sampler.ResumeSampler` that leaves
out the batches the loop counts as done; the first training batch then checks that the loop's batch
index is where the loader resumed, so a Lightning whose restart bookkeeping moved raises instead of
silently training batches twice.

It applies to a torch ``DataLoader`` over a map-style dataset, batched by torch's ``BatchSampler``,
whose sampler repeats its order in the resumed run: the ``DistributedSampler`` Lightning injects (its
order is a function of seed and epoch) or a ``SequentialSampler``. Any other loader (an
``IterableDataset``, a sampler or batch sampler of your own, ``overfit_batches``) starts the epoch
over as under ``ddp``, with a warning. Random number generators are not restored: the resumed epoch
sees the same samples, not the same random draws (dropout, random augmentation).
"""

from __future__ import annotations

from typing import Any, Optional

import lightning.pytorch as pl
from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.utils.data import DistributedSampler, SequentialSampler
from typing_extensions import override

from parallel.resume_sampler import ResumeSampler
from strategies.loaders import index_batching, with_sampler

__all__ = ["ExactResume", "batches_done"]

_FALLBACK = "pass CustomDDPStrategy(exact_resume=False) to keep your loader (the epoch then starts over)"
_REPEATABLE_ORDER = (DistributedSampler, SequentialSampler)


def batches_done(progress: Any) -> int:
    """Batches of the interrupted epoch that Lightning's loop counts as trained when it resumes from
    ``progress`` (the restored ``fit_loop.epoch_loop.batch_progress``): it goes on at that batch index."""
    total = progress.total
    # Saved at a batch's end (ModelCheckpoint, a signal's stop): the batch is processed but not yet
    # counted completed, and the restarted loop counts it done (Lightning's RESTARTED_ON_TRAIN_BATCH_END).
    at_batch_end = total.ready == total.started == total.processed == total.completed + 1
    return progress.current.completed + int(at_batch_end)


def _epoch_batches(length: int, limit: int | float) -> int:
    """Training batches per epoch of a loader of ``length`` under ``limit_train_batches``, as Lightning counts."""
    return min(length, limit) if isinstance(limit, int) else int(length * limit)


class ExactResume:
    """Strategy hooks of exact mid-epoch resume; mix in before ``DDPStrategy`` (module docstring).

    Reads the strategy's ``options.exact_resume``.
    """

    options: Any  # the strategy's CustomDDPOptions
    lightning_module: Optional[pl.LightningModule]
    _resume_check: Optional[tuple[int, int]] = None  # (epoch, batch index) of the first resumed batch

    @override
    def process_dataloader(self, dataloader: object) -> object:
        dataloader = super().process_dataloader(dataloader)  # type: ignore[misc]
        module = self.lightning_module
        if not self.options.exact_resume or module is None or module._trainer is None:
            return dataloader
        trainer = module.trainer
        if trainer.state.stage != RunningStage.TRAINING or not trainer.fit_loop.restarting:
            return dataloader
        done, epoch = batches_done(trainer.fit_loop.epoch_loop.batch_progress), trainer.current_epoch
        length = len(dataloader) if hasattr(dataloader, "__len__") else None
        if length is None or not 0 < done < _epoch_batches(length, trainer.limit_train_batches):
            return dataloader  # not mid-epoch (or an unsized loader: Lightning cannot resume it mid-epoch either)
        batching = index_batching(dataloader)
        if isinstance(batching, str) or trainer.overfit_batches > 0 or type(dataloader.sampler) not in _REPEATABLE_ORDER:
            why = batching if isinstance(batching, str) else f"sampled by a {type(dataloader.sampler).__name__}"
            rank_zero_warn(f"custom_ddp: resuming epoch {epoch} at batch {done}, but the training loader is {why}, "
                           "which cannot resume by index: it starts the epoch over, as under ddp (its first "
                           f"{done} batches are trained again).")
            return dataloader
        self._resume_check = (epoch, done)
        skip = (done % length) * batching[0]  # a shorter loader cycled within the epoch is that far into its pass
        rank_zero_info(f"custom_ddp: resuming epoch {epoch} at batch {done}: the training loader leaves out the "
                       f"{skip} samples per rank the interrupted epoch trained (exact_resume; Lightning's warning "
                       "that the loader is not resumable does not apply)")
        return with_sampler(dataloader, ResumeSampler(dataloader.sampler, skip, epoch), batching, "training loader",
                            _FALLBACK)

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self._resume_check is not None:
            (epoch, expected), self._resume_check = self._resume_check, None
            if batch_idx != expected:
                raise RuntimeError(
                    f"custom_ddp: the training loader resumed epoch {epoch} at batch {expected}, but Lightning's "
                    f"loop resumed at batch {batch_idx}: its restart bookkeeping differs from this version's "
                    f"(Lightning {pl.__version__}). {_FALLBACK}.")
        super().on_train_batch_start(batch, batch_idx)  # type: ignore[misc]
