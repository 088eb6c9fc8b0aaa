"""Uneven data per rank: one rank's loader, joined so that every rank runs the same steps.

Streaming data (an ``IterableDataset`` that shards itself, a sampler of the user's own) gives ranks
different numbers of batches. A rank whose data ends first must still take part in every collective
of the steps the others run (gradient buckets, SyncBatchNorm, synced logs), or the job hangs.
:class:`JoinedLoader` wraps one rank's loader: it yields this rank's batches, then, while another
rank still has one, **empty batches** (the same structure, every tensor cut to 0 rows), and ends on
every rank at the same step. An empty batch keeps a model's collectives in place: SyncBatchNorm
counts it as 0 samples, a layer's gradient over 0 rows is exactly zero, and metrics update by
nothing. For each step it queues a :class:`StepShare` (which ranks trained a real batch) that the
trainer side reads to weigh the step: gradients divided by the ranks that trained, buffers taken
from one of them.

How the ranks learn who has data (:func:`join_uneven` decides, one all-gather):

- every rank's length is known (a ``DataLoader`` over a map-style dataset): no communication; rank
  ``r`` has a real batch at steps ``< lengths[r]``. Equal lengths: the loader is returned unwrapped.
- otherwise: before each step, one all-reduce of ``world_size`` flags ("I have a batch").

A rank that never had a batch gets the empty structure from the lowest rank that has one (one
``broadcast_object_list``, once). ``refuse``: raise :class:`UnevenDataError` on every rank at the
first step where one rank's data has ended and another's has not, naming both counts. Pure torch.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.profiler import record_function
from torch.utils.data import DataLoader, IterableDataset

__all__ = [
    "JOIN_EXCHANGE",
    "JoinedLoader",
    "SizedJoinedLoader",
    "StepShare",
    "UnevenDataError",
    "empty_like_batch",
    "join_uneven",
    "known_length",
]

_END = object()  # the wrapped iterator is exhausted
JOIN_EXCHANGE = "JoinedLoader.who_trains"  # profiler label of the per-step flags: how CollectiveCounter finds them


class UnevenDataError(RuntimeError):
    """Ranks' data ended at different steps and joining was refused (the message names the counts)."""


@dataclass(frozen=True)
class StepShare:
    """Which ranks trained a real batch in one step (the others ran an empty one)."""

    trained: tuple[bool, ...]

    @property
    def count(self) -> int:
        """How many ranks trained."""
        return sum(self.trained)

    @property
    def joined(self) -> bool:
        """Whether some rank ran an empty batch."""
        return not all(self.trained)

    @property
    def first(self) -> int:
        """The lowest rank that trained."""
        return self.trained.index(True)


def empty_like_batch(batch: Any) -> Any:
    """``batch`` with every tensor of at least one dimension cut to 0 rows (same dtypes, devices, nesting
    through mappings, named tuples, tuples and lists); other leaves are kept as they are."""
    if isinstance(batch, torch.Tensor):
        return batch[:0] if batch.dim() else batch
    if isinstance(batch, Mapping):
        return type(batch)({key: empty_like_batch(value) for key, value in batch.items()})
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a named tuple
        return type(batch)(*(empty_like_batch(value) for value in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(empty_like_batch(value) for value in batch)
    return batch


def known_length(loader: object) -> int | None:
    """The number of batches ``loader`` yields per pass where it can be trusted (a torch ``DataLoader``
    over a map-style dataset), else ``None`` (an ``IterableDataset``'s ``len`` is only a hint)."""
    if isinstance(loader, DataLoader) and not isinstance(loader.dataset, IterableDataset):
        return len(loader)
    return None


class JoinedLoader:
    """One rank's ``loader`` joined with the other ranks' (module docstring). Attributes it lacks are
    the wrapped loader's (``sampler``, ``dataset``, ``state_dict``, ...).

    Args:
        loader: This rank's loader (any iterable; iterated once per pass).
        group: The process group of the ranks that join (``None``: the default group).
        device: Where the per-step flags travel (the CPU for gloo, the rank's GPU for NCCL).
        lengths: Every rank's batch count per pass, when known: no per-step exchange.
        refuse: ``None`` to join; else the advice that ends :class:`UnevenDataError`'s message.
        what: The loader's name in messages (``"training"``).
        epoch: The current epoch, for messages; default: this loader's pass count.
    """

    def __init__(
        self,
        loader: Iterable[Any],
        *,
        group: dist.ProcessGroup | None = None,
        device: torch.device | None = None,
        lengths: Sequence[int] | None = None,
        refuse: str | None = None,
        what: str = "training",
        epoch: Callable[[], int] | None = None,
    ) -> None:
        self._loader = loader
        self._group, self._device = group, device or torch.device("cpu")
        self._rank, self._world_size = dist.get_rank(group), dist.get_world_size(group)
        self._lengths = None if lengths is None else list(lengths)
        self._refuse, self._what, self._epoch = refuse, what, epoch
        self._passes = -1
        self._shares: deque[StepShare] = deque()
        self._empty: Any = None  # this rank's empty batch, once it has one
        self._has_empty = [False] * self._world_size  # which ranks hold an empty batch

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name == "_loader":
            raise AttributeError(name)
        return getattr(self._loader, name)

    def __setattr__(self, name: str, value: Any) -> None:
        # Lightning sets worker_init_fn on the loader it is handed: it belongs to the wrapped one.
        if name.startswith("_"):
            object.__setattr__(self, name, value)
        else:
            setattr(self._loader, name, value)

    def take_share(self) -> StepShare | None:
        """The oldest step's share not taken yet (in the order the batches were yielded)."""
        return self._shares.popleft() if self._shares else None

    def __iter__(self) -> Iterator[Any]:
        self._passes += 1
        self._shares.clear()
        return self._steps(iter(self._loader))

    def _steps(self, batches: Iterator[Any]) -> Iterator[Any]:
        counts, step, ended = [0] * self._world_size, 0, False
        while True:
            batch = _END if ended else next(batches, _END)
            ended = batch is _END
            share = StepShare(self._who_trains(step, has_batch=not ended))
            if not any(share.trained):
                return
            if share.joined and self._refuse is not None:
                raise UnevenDataError(self._refusal(share, counts))
            if not ended and self._empty is None:
                self._empty = empty_like_batch(batch)
            self._share_empty_batches(share)
            counts = [count + trained for count, trained in zip(counts, share.trained, strict=True)]
            self._shares.append(share)
            yield self._empty if ended else batch
            step += 1

    def _who_trains(self, step: int, has_batch: bool) -> tuple[bool, ...]:
        if self._lengths is not None:
            if has_batch != (step < self._lengths[self._rank]):
                raise RuntimeError(
                    f"rank {self._rank}'s {self._what} loader has len {self._lengths[self._rank]} but "
                    f"{'yielded more' if has_batch else f'ended after {step} batches'}: its length "
                    "must be the number of batches it yields"
                )
            return tuple(step < length for length in self._lengths)
        flags = torch.zeros(self._world_size, dtype=torch.int64, device=self._device)
        flags[self._rank] = int(has_batch)
        with record_function(JOIN_EXCHANGE):
            dist.all_reduce(flags, group=self._group)
        return tuple(bool(flag) for flag in flags.tolist())

    def _share_empty_batches(self, share: StepShare) -> None:
        """Ranks running an empty batch that never had a batch get its structure from one that did."""
        self._has_empty = [held or trained for held, trained in zip(self._has_empty, share.trained, strict=True)]
        if all(self._has_empty):
            return
        needed = [not trained and not held for trained, held in zip(share.trained, self._has_empty, strict=True)]
        if not any(needed):
            return
        source = self._has_empty.index(True)
        box = [self._empty if self._rank == source else None]
        src = source if self._group is None else dist.get_global_rank(self._group, source)
        dist.broadcast_object_list(box, src=src, group=self._group)
        if needed[self._rank]:
            self._empty = box[0]
        self._has_empty = [held or need for held, need in zip(self._has_empty, needed, strict=True)]

    def _refusal(self, share: StepShare, counts: list[int]) -> str:
        epoch = self._passes if self._epoch is None else self._epoch()
        ended = [rank for rank, trained in enumerate(share.trained) if not trained]
        going = [rank for rank, trained in enumerate(share.trained) if trained]
        return (
            "; ".join(f"rank {r}'s {self._what} data ended after {_batches(counts[r])} of epoch {epoch}" for r in ended)
            + "; "
            + ", ".join(f"rank {r} has more (batch {counts[r] + 1} is next)" for r in going)
            + f". {self._refuse}"
        )


class SizedJoinedLoader(JoinedLoader):
    """A :class:`JoinedLoader` of known lengths: as long as the longest rank's loader."""

    def __len__(self) -> int:
        assert self._lengths is not None
        return max(self._lengths)


def _batches(count: int) -> str:
    return f"{count} batch" if count == 1 else f"{count} batches"


def join_uneven(
    loader: Iterable[Any],
    *,
    group: dist.ProcessGroup | None = None,
    device: torch.device | None = None,
    refuse: str | None = None,
    what: str = "training",
    epoch: Callable[[], int] | None = None,
) -> Iterable[Any]:
    """Every rank of ``group``: ``loader`` itself when every rank's length is known and equal, else a
    :class:`JoinedLoader` (or the :class:`UnevenDataError` ``refuse`` asks for, when the lengths already
    differ). One all-gather of the lengths; arguments as :class:`JoinedLoader`'s."""
    device = device or torch.device("cpu")
    length = known_length(loader)
    mine = torch.tensor([-1 if length is None else length], dtype=torch.int64, device=device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    lengths = [int(t.item()) for t in every]
    if min(lengths) >= 0 and len(set(lengths)) == 1:
        return loader
    options = {"group": group, "device": device, "refuse": refuse, "what": what, "epoch": epoch}
    if min(lengths) < 0:
        return JoinedLoader(loader, **options)
    if refuse is not None:
        counts = ", ".join(f"rank {rank}'s {_batches(n)}" for rank, n in enumerate(lengths))
        raise UnevenDataError(f"the ranks' {what} loaders differ in length per epoch: {counts}. {refuse}")
    return SizedJoinedLoader(loader, lengths=lengths, **options)
