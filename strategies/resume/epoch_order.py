"""What decides which samples a training epoch's batches hold: saved in every checkpoint of a fit, compared when a
fit resumes mid-epoch (:mod:`exact_resume`).

A resume by index leaves out the batches Lightning's loop counts as done, and those hold the samples the
interrupted epoch trained only if the loader orders the epoch as it did: the same number of ranks (Lightning
counts batches per rank; a ``DistributedSampler`` shards by it), samples, batch size, ``drop_last``, sampler and
the ``DistributedSampler``'s seed and shuffle. :func:`epoch_order` records those for each training loader;
:func:`order_changes` names what differs, and :func:`changed_order_warning` says what the resume trains then
instead of claiming it exact.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch.utils.data import DistributedSampler

from parallel.resume.resume_sampler import ResumeSampler
from strategies.loaders import flat_loaders, index_batching

__all__ = ["ORDER_KEY", "changed_order_warning", "epoch_order", "order_changes", "training_orders"]

ORDER_KEY = "custom_ddp_epoch_order"  # a list: one order per training loader, in Lightning's order of them


def epoch_order(dataloader: object, ranks: int) -> dict[str, Any] | None:
    """The settings that order ``dataloader``'s epoch on ``ranks`` ranks; ``None`` for a loader that cannot
    resume by index (exact resume does not rebuild it, so it has nothing to compare)."""
    batching = index_batching(dataloader)
    if isinstance(batching, str):
        return None
    sampler = dataloader.sampler  # type: ignore[attr-defined]
    if isinstance(sampler, ResumeSampler):  # a resumed fit's rebuilt loader: the user's sampler inside
        sampler = sampler.sampler
    order = {
        "ranks": ranks,
        "samples": len(dataloader.dataset),  # type: ignore[attr-defined]
        "batch_size": batching[0],
        "drop_last": batching[1],
        "sampler": type(sampler).__name__,
    }
    if isinstance(sampler, DistributedSampler):
        order.update(seed=sampler.seed, shuffle=sampler.shuffle)
    return order


def training_orders(train_dataloader: Any, ranks: int) -> list[dict[str, Any] | None]:
    """:func:`epoch_order` of each loader of a trainer's ``train_dataloader`` (a loader, or lists and dicts)."""
    return [epoch_order(loader, ranks) for loader in flat_loaders(train_dataloader)]


def order_changes(interrupted: Mapping[str, Any], now: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
    """The settings whose value differs, as ``{name: (interrupted, now)}``."""
    return {name: (interrupted.get(name), value) for name, value in now.items() if interrupted.get(name) != value}


def changed_order_warning(
    epoch: int, done: int, batch_size: int, changes: Mapping[str, tuple[Any, Any]], shards: int | None
) -> str:
    """Why an epoch resumed at batch ``done`` with the order ``changes`` is not exact. ``shards``: the samples a
    ``DistributedSampler`` shards over the ranks; when only the number of ranks changed it counts the samples
    the resume trains again, or leaves out."""
    changed = ", ".join(f"{name} {before} -> {after}" for name, (before, after) in changes.items())
    head = (
        f"custom_ddp: resuming epoch {epoch} at batch {done}, but the training loader does not order the epoch as "
        f"the interrupted fit's did ({changed}): each rank leaves out its first {done} batches (Lightning's loop "
        "counts batches per rank)"
    )
    tail = "An epoch resumes exactly with the interrupted fit's loader and ranks, or from a checkpoint at its end."
    if set(changes) != {"ranks"} or shards is None:
        return f"{head}, which hold other samples than the ones the interrupted epoch trained. {tail}"
    trained, left_out = (min(done * batch_size * count, shards) for count in changes["ranks"])
    if left_out < trained:
        what = f"{trained - left_out} samples the interrupted epoch trained are trained again"
    else:
        what = f"{left_out - trained} samples it had not trained are left out of this epoch"
    counts = f"{left_out} samples of this run's shards, not the {trained} the interrupted epoch trained"
    return f"{head}: {counts}: {what}. {tail}"
