"""A user's ``DataLoader`` rebuilt around another sampler, every other setting kept.

Shared by scatter evaluation (:mod:`strategies.evaluation.scatter_eval`: a rank's shard of the evaluation set)
and exact mid-epoch resume (:mod:`strategies.resume.exact_resume`: the rest of the interrupted epoch). Only
a torch ``DataLoader`` over a map-style dataset, batched by torch's own ``BatchSampler``, can be
rebuilt by index: its batches are re-made from the new sampler exactly as the user's loader made
them, with the user's batch size, ``collate_fn``, workers, pinning and transforms.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.utils.data import BatchSampler, DataLoader, IterableDataset

__all__ = [
    "flat_loaders",
    "index_batching",
    "keeps_its_position",
    "loader_samplers",
    "set_sampler_epoch",
    "with_sampler",
]

# DataLoader settings carried over to the rebuilt loader unchanged (all but dataset/batching/sampling).
_KEPT_LOADER_ARGS = (
    "num_workers",
    "collate_fn",
    "pin_memory",
    "timeout",
    "worker_init_fn",
    "multiprocessing_context",
    "generator",
    "prefetch_factor",
    "persistent_workers",
    "pin_memory_device",
    "in_order",
)


def flat_loaders(iterables: Any) -> list[Any]:
    """The loaders of a trainer's ``train_dataloader`` (a loader, or lists and dicts of them, nested), in the
    order Lightning flattens and sets them up; ``[]`` for ``None``."""
    if iterables is None:
        return []
    if isinstance(iterables, Mapping):
        iterables = list(iterables.values())
    if not isinstance(iterables, (list, tuple)):
        return [iterables]
    return [loader for item in iterables for loader in flat_loaders(item)]


def keeps_its_position(dataloader: object) -> bool:
    """Whether ``dataloader`` is resumable the way Lightning's docs ask: ``state_dict`` and ``load_state_dict``
    (torchdata's ``StatefulDataLoader``). Lightning saves that state in every checkpoint and loads it on
    resuming, so the loader goes on where it stopped by itself. Duck-typed as Lightning's own check is."""
    return callable(getattr(dataloader, "state_dict", None)) and callable(getattr(dataloader, "load_state_dict", None))


def loader_samplers(dataloader: object) -> list[Any]:
    """The loader's sampler and its batch sampler's (where Lightning injects its sampler when a batch sampler of the
    user's own is given), each once."""
    batch_sampler = getattr(dataloader, "batch_sampler", None)
    found = (getattr(dataloader, "sampler", None), getattr(batch_sampler, "sampler", None))
    return list({id(sampler): sampler for sampler in found if sampler is not None}.values())


def set_sampler_epoch(dataloader: object, epoch: int) -> None:
    """``set_epoch(epoch)`` on the loader's sampler and its batch sampler's, those that have it (as Lightning's
    loop does at an epoch's start; its helper for that is private)."""
    for sampler in loader_samplers(dataloader):
        if callable(getattr(sampler, "set_epoch", None)):
            sampler.set_epoch(epoch)


def index_batching(dataloader: object, *, unbatched: bool = False) -> tuple[int | None, bool] | str:
    """``(batch_size, drop_last)`` of a loader that can be rebuilt by index, else why not. ``unbatched``: a
    ``batch_size=None`` loader (each item is a step) gives ``(None, False)`` instead of a reason."""
    if not isinstance(dataloader, DataLoader):
        return f"a {type(dataloader).__name__}, not a torch DataLoader"
    if isinstance(dataloader.dataset, IterableDataset):
        return "over an IterableDataset"
    if dataloader.batch_size is not None:
        return dataloader.batch_size, dataloader.drop_last
    if type(dataloader.batch_sampler) is BatchSampler:  # torch's own: its batches are re-made from the sampler
        return dataloader.batch_sampler.batch_size, dataloader.batch_sampler.drop_last
    if dataloader.batch_sampler is None:
        if unbatched:
            return None, False
        return "unbatched (batch_size=None: each item is a step)"
    return f"batched by a {type(dataloader.batch_sampler).__name__} of your own"


def with_sampler(
    dataloader: DataLoader, sampler: Any, batching: tuple[int | None, bool], what: str, fallback: str
) -> DataLoader:
    """``dataloader`` reading its dataset in ``sampler``'s order, every other setting kept.

    ``what`` names the rebuilt loader in the warning a ``DataLoader`` subclass gets (its own
    iteration is not kept); ``fallback`` is the option that keeps the user's loader instead.
    """
    kept = {name: getattr(dataloader, name) for name in _KEPT_LOADER_ARGS if hasattr(dataloader, name)}
    if type(dataloader) is not DataLoader:
        rank_zero_warn(
            f"custom_ddp: the {what} of class {type(dataloader).__name__} is rebuilt as a torch "
            f"DataLoader (same settings); {fallback} if the subclass changes iteration."
        )
    batch_size, drop_last = batching
    return DataLoader(dataloader.dataset, batch_size=batch_size, drop_last=drop_last, sampler=sampler, **kept)
