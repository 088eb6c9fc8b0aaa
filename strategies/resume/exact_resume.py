"""Exact mid-epoch resume for :class:`strategies.custom_ddp.CustomDDPStrategy`: the resumed epoch trains
exactly the batches the interrupted one had not.

A fit resumed from a mid-epoch checkpoint (a signal's stop checkpoint, the watchdog's last one,
``ModelCheckpoint(every_n_train_steps=...)``) counts on from the batch it stopped at, while a plain
``DataLoader`` starts the epoch over: the epoch's first batches are trained twice and its last ones
never (Lightning warns that the loader "is not resumable"; ``ddp`` does the same). Here, when the
training loader of a fit resumed from a checkpoint is set up, it is rebuilt (:mod:`strategies.loaders`)
around a :class:`~parallel.resume.resume_sampler.ResumeSampler` whose first pass leaves out the batches the
loop counts as done, in the resumed epoch's order. How many, and which epoch, are read when that pass
begins, from the restored loop: a module whose ``configure_optimizers`` asks for
``trainer.estimated_stepping_batches`` (a OneCycle schedule) makes Lightning set the loader up, and
make its iterator, before it restores the checkpoint, and a fit resumed from an epoch's end makes it
before it counts that epoch done; with workers, that iterator draws indices at once, in the wrong
epoch's order (``ddp`` then trains the finished epoch's order again), so at ``on_train_start`` (after
the restore) such a pass is rewound and the loop's iterator made anew (``FitLoop._data_fetcher``, a
private name listed in :mod:`strategies.lightning_seams`). The first
training batch then checks that the loop resumed at that batch index; a Lightning whose restart
bookkeeping moved raises there instead of silently training batches twice.

It applies to a torch ``DataLoader`` (not a subclass) over a map-style dataset, batched by torch's
``BatchSampler``, whose sampler repeats its order in the resumed run: the ``DistributedSampler``
Lightning injects (its order is a function of seed and epoch) or a ``SequentialSampler``. Any other
loader starts the epoch over as under ``ddp``, with a warning at the first batch, except one resumable
the way Lightning's docs ask (``state_dict``/``load_state_dict``, torchdata's ``StatefulDataLoader``):
Lightning loads its position from the checkpoint, and it is left as it is but for its sampler's epoch,
set at once to the one Lightning sets after making the iterator, whose workers draw indices at once.
The bookkeeping of where the restored loop goes on is :mod:`resume_progress`.
The resumed epoch also draws the same random numbers: every checkpoint saved while fitting holds every
rank's generators, restored at ``on_train_start`` (:mod:`resume_rng`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from torch.utils.data import DataLoader, DistributedSampler, SequentialSampler
from typing_extensions import override

from parallel.resume.resume_sampler import ResumeSampler
from parallel.resume.rng_state import RngState, gather_rng_states, rng_state, set_rng_state
from strategies.loaders import index_batching, keeps_its_position, set_sampler_epoch, with_sampler
from strategies.resume.epoch_order import ORDER_KEY, epoch_order, order_changes, training_orders
from strategies.resume.resume_progress import (
    FALLBACK,
    LoaderResume,
    inside_a_batch,
    resumed_at,
    resumed_before_iterator,
)
from strategies.resume.resume_rng import CHECKPOINT_KEY, redraw_base_seeds, rng_state_to_restore

__all__ = ["ExactResume"]

_REPEATABLE_ORDER = (DistributedSampler, SequentialSampler)


def _not_by_index(dataloader: object, trainer: pl.Trainer) -> str | None:
    """Why ``dataloader`` cannot resume by index, or ``None``."""
    batching = index_batching(dataloader)
    if isinstance(batching, str):
        return batching
    if type(dataloader) is not DataLoader:
        return f"a {type(dataloader).__name__} (a DataLoader subclass iterates its own way)"
    if type(dataloader.sampler) not in _REPEATABLE_ORDER:
        return f"sampled by a {type(dataloader.sampler).__name__}"
    return "overfit_batches" if trainer.overfit_batches > 0 else None


class ExactResume:
    """Strategy hooks of exact mid-epoch resume; mix in before ``DDPStrategy`` (module docstring).

    Reads the strategy's ``options.exact_resume``.
    """

    options: Any  # the strategy's CustomDDPOptions
    lightning_module: pl.LightningModule | None
    global_rank: int
    world_size: int
    _resumes: tuple[LoaderResume, ...] = ()  # this resumed fit's training loaders, until its first batch
    _rng_state: RngState | None = None  # this rank's generators from the resumed checkpoint, until on_train_start
    _interrupted_orders: list[dict[str, Any] | None] | None = None  # the resumed checkpoint's (epoch_order)
    _training_loaders_seen = 0  # training loaders this fit has set up: the next one's place among them
    _rng_before_iterator: RngState | None = None  # this fit's, as they were before its first training iterator
    _rng_at_epoch_start: RngState | None = None  # restored at an epoch's start: set again at its first fetch
    _redraw_at_first_fetch = False  # resumed from an epoch's end: its iterator's base seed drawn at the first fetch

    def _fitting_trainer(self) -> pl.Trainer | None:
        """The trainer when this call fits and resumes exactly (``None`` otherwise)."""
        module = self.lightning_module
        trainer = None if module is None else module._trainer
        return (
            trainer
            if self.options.exact_resume and trainer is not None and trainer.state.fn == TrainerFn.FITTING
            else None
        )

    def save_rng_states(self, checkpoint: dict[str, Any]) -> None:
        """Every rank's generators into ``checkpoint`` while fitting; call from the save every rank makes."""
        if self._fitting_trainer() is not None:
            checkpoint[CHECKPOINT_KEY] = gather_rng_states()  # a collective: every rank's save calls it

    def save_epoch_order(self, checkpoint: dict[str, Any]) -> None:
        """How the training loaders order the epoch into ``checkpoint`` while fitting (local: any save may call it)."""
        trainer = self._fitting_trainer()
        if trainer is not None:
            checkpoint[ORDER_KEY] = training_orders(trainer.train_dataloader, self.world_size)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)  # type: ignore[misc]
        if self._fitting_trainer() is not None:
            self._rng_state = rng_state_to_restore(checkpoint, self.global_rank, self.world_size)
            self._interrupted_orders = checkpoint.get(ORDER_KEY)
        return checkpoint

    @override
    def process_dataloader(self, dataloader: object) -> object:
        dataloader = super().process_dataloader(dataloader)  # type: ignore[misc]
        trainer = self._fitting_trainer()
        if trainer is None or trainer.state.stage != RunningStage.TRAINING:
            return dataloader
        self._rng_before_iterator = rng_state()  # Lightning makes the epoch's iterator right after this hook
        index, self._training_loaders_seen = self._training_loaders_seen, self._training_loaders_seen + 1
        if not trainer.ckpt_path:
            return dataloader
        if keeps_its_position(dataloader):  # a resumable loader: Lightning loads its position from the checkpoint
            # and makes its iterator before it sets the sampler's epoch (with workers, indices are drawn at once):
            # the epoch Lightning sets next (one past an epoch that ended, after the restore), set now
            set_sampler_epoch(dataloader, trainer.fit_loop.epoch_progress.current.processed)
            return dataloader
        reason = _not_by_index(dataloader, trainer) if hasattr(dataloader, "__len__") else "of unknown length"
        if reason is not None:
            self._resumes += (LoaderResume(trainer, 0, 0, reason),)
            return dataloader
        batching, sampler = index_batching(dataloader), dataloader.sampler
        shards = len(sampler.dataset) if isinstance(sampler, DistributedSampler) else None
        changes = self._changes_since_interrupted(dataloader, index)
        resume = LoaderResume(trainer, len(dataloader), batching[0], None, changes, shards)
        resume.sampler = ResumeSampler(dataloader.sampler, resume.first_pass_skip, resume.epoch)
        resume.before_first_pass = self._first_fetch
        self._resumes += (resume,)
        return with_sampler(dataloader, resume.sampler, batching, "training loader", FALLBACK)

    def _changes_since_interrupted(self, dataloader: object, index: int) -> dict[str, tuple[Any, Any]] | None:
        """How training loader ``index`` orders the epoch unlike the interrupted fit's loader at its place; ``None``
        where the checkpoint does not record it (another strategy's, ``ddp``'s, or an older one)."""
        orders, now = self._interrupted_orders or [], epoch_order(dataloader, self.world_size)
        saved = orders[index] if index < len(orders) else None
        if saved is None:
            return None
        return order_changes(saved, now) if now is not None else {}

    def _restore_rng(self, remake_iterators: Callable[[], None] | None) -> None:
        """Set the resumed checkpoint's generators; ``remake_iterators``: make the loop's training iterators
        anew (their first pass began too early), before the restore or after it, as the uninterrupted fit
        drew their base seeds before or after the checkpoint."""
        state, self._rng_state = self._rng_state, None
        trainer = self.lightning_module.trainer  # type: ignore[union-attr]
        before_iterator = state is not None and resumed_before_iterator(trainer)
        if remake_iterators is not None and not before_iterator:
            remake_iterators()  # mid-epoch: the interrupted fit drew their base seeds before the checkpoint
        if state is None:
            return
        set_rng_state(state)
        self._rng_before_iterator = state  # the interrupted fit's, where the resumed loop goes on
        if not before_iterator:
            return
        if remake_iterators is not None:
            remake_iterators()  # draws the base seed (its workers' too) as the uninterrupted fit did after it
        elif not self._first_pass_pending():
            redraw_base_seeds(trainer.train_dataloader)  # that iterator came after the checkpoint
        if inside_a_batch(trainer.fit_loop.epoch_loop.batch_progress):
            self._rng_at_epoch_start = state  # see _first_fetch
        else:
            self._redraw_at_first_fetch = remake_iterators is None and self._first_pass_pending()

    def _first_pass_pending(self) -> bool:
        """A training loader's first pass begins at the first fetch (no workers began it): :meth:`_first_fetch`
        comes after ``on_train_epoch_start``, where the uninterrupted fit made the epoch's iterator."""
        return any(resume.sampler is not None and not resume.sampler.first_pass_begun for resume in self._resumes)

    def _start_epoch_from(self, state: RngState) -> None:
        """The generators as the uninterrupted fit had them after making the epoch's training iterator."""
        set_rng_state(state)
        redraw_base_seeds(self.lightning_module.trainer.train_dataloader)  # type: ignore[union-attr]

    def _first_fetch(self) -> None:
        """A resumed epoch's first training batch is about to be read (a loader without workers begins its
        first pass then; one with workers began it before the restore).

        From an epoch's end, the uninterrupted fit made the next epoch's iterator here, after
        ``on_train_epoch_start`` (whose draws the resumed fit makes again, from the restored generators): its
        base seed is drawn now. Resuming at an epoch's first batch from a checkpoint written inside that batch
        (the watchdog's last one), Lightning 2.6 makes the validation loaders' iterators in between (its
        fast-forward of a validation it counts as due at batch -1; each iterator draws a base seed), which the
        uninterrupted fit did not: the generators are set again as :meth:`_restore_rng` set them. (From an
        epoch's end, the validation Lightning runs there is one the uninterrupted fit ran too.)"""
        state, self._rng_at_epoch_start = self._rng_at_epoch_start, None
        redraw, self._redraw_at_first_fetch = self._redraw_at_first_fetch, False
        if state is not None:
            self._start_epoch_from(state)
        elif redraw:
            redraw_base_seeds(self.lightning_module.trainer.train_dataloader)  # type: ignore[union-attr]

    def generators_at_train_start(self) -> RngState | None:
        """The generators a checkpoint of where training starts must hold (after :meth:`on_train_start`): the
        ones now, or at an epoch's start those before its iterator was made (resuming there makes that draw
        again, :func:`~resume_rng.redraw_base_seeds`); ``None`` without ``exact_resume``."""
        trainer = self._fitting_trainer()
        if trainer is None:
            return None
        return rng_state() if resumed_at(trainer, trainer.num_training_batches) else self._rng_before_iterator

    @override
    def on_train_start(self) -> None:
        # After the restore, before the first batch: a pass begun too early (by workers drawing indices when
        # the loop made its iterator before the restore) is begun again, in the resumed epoch's order.
        early = [resume for resume in self._resumes if resume.began_too_early()]
        for resume in early:
            resume.sampler.rewind()  # type: ignore[union-attr]
        self._training_loaders_seen = 0  # loaders set up again later (reload_dataloaders_every_n_epochs) count anew
        loop = self.lightning_module.trainer.fit_loop  # type: ignore[union-attr]
        self._restore_rng((lambda: iter(loop._data_fetcher)) if early else None)  # type: ignore[arg-type]
        super().on_train_start()  # type: ignore[misc]

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        resumes, self._resumes = self._resumes, ()
        for resume in resumes:
            resume.check(self.lightning_module.current_epoch, batch_idx)  # type: ignore[union-attr]
        super().on_train_batch_start(batch, batch_idx)  # type: ignore[misc]

    @override
    def teardown(self) -> None:
        self._resumes, self._rng_state, self._rng_before_iterator, self._rng_at_epoch_start = (), None, None, None
        self._interrupted_orders, self._training_loaders_seen = None, 0
        self._redraw_at_first_fetch = False
        super().teardown()  # type: ignore[misc]
