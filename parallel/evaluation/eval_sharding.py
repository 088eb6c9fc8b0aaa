"""Scatter-based sharding of an evaluation set by indices: every sample evaluated exactly once.

``DistributedSampler`` makes evaluation shards equal by repeating samples (11 samples on 2 ranks
become 6 + 6, one duplicate), which biases dataset metrics; ``drop_last`` would lose samples
instead. Here the source rank alone decides the shards, and only *indices* travel:

1. the source knows the sample order (its loader's sampler) and broadcasts the sample count, so
   every rank can compute the shard lengths (:func:`shard_sizes`) and agree on the layout;
2. it splits the order into contiguous shards whose lengths differ by at most one
   (:func:`make_shards`) and ``dist.scatter``s them. ``scatter`` needs equal-sized
   tensors, so each shard travels as ``[real length, indices..., padding]``;
3. every rank reads its samples from its own dataset object through a :class:`ShardSampler`
   over the received indices: no sample crosses the network and the source holds no more data
   than any other rank.

The ``strided_padded`` layout is ``DistributedSampler``'s (strided, padded with repeats to equal
lengths), for callers that must fall back to equal batch counts on every rank.

A :class:`ShardPlan` holds the whole decision for one loader, made once from numbers every rank
knows (the broadcast count, the batch size, Lightning's ``limit_*_batches``): the layout (every
rank must run at least one batch or none does, else ``strided_padded``), each rank's shard length
and batch count. A ``drop_last`` loader's shards are whole batches of the samples before the set's last partial
batch: what one process evaluates.

Collectives: one broadcast of the count plus one scatter of indices, called by every rank of
the group in the same order. Pure torch; no Lightning import.

Example (on every rank; every rank's ``dataset`` yields the same sample for the same index)::

    order = list(range(len(dataset))) if dist.get_rank() == 0 else None
    count = broadcast_count(None if order is None else len(order))
    plan = ShardPlan.decide(count, dist.get_world_size(), batch_size=256)
    indices = scatter_shard_indices(None if order is None else plan.shards(order), plan.lengths)
    loader = DataLoader(dataset, batch_size=256, sampler=ShardSampler(indices))
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Literal, get_args

import torch
import torch.distributed as dist
from torch.utils.data import Sampler

__all__ = [
    "ShardLayout",
    "ShardPlan",
    "ShardSampler",
    "broadcast_count",
    "limited_batches",
    "make_shards",
    "scatter_shard_indices",
    "shard_lengths",
    "shard_sizes",
]


def shard_sizes(num_samples: int, world_size: int) -> list[int]:
    """Contiguous shard lengths covering ``num_samples`` once; the first ``num_samples % world_size`` get one more.

    >>> shard_sizes(11, 2)
    [6, 5]
    """
    if world_size < 1 or num_samples < 0:
        raise ValueError(f"need world_size >= 1 and num_samples >= 0, got {world_size=}, {num_samples=}")
    base, extra = divmod(num_samples, world_size)
    return [base + (rank < extra) for rank in range(world_size)]


ShardLayout = Literal["contiguous", "strided_padded"]
"""``contiguous``: every sample once, lengths differ by at most one. ``strided_padded``:
``DistributedSampler(shuffle=False)``'s layout, equal lengths, some samples twice."""


def shard_lengths(num_samples: int, world_size: int, layout: ShardLayout = "contiguous") -> list[int]:
    """Each rank's shard length under ``layout``: computable on every rank from the count alone."""
    if layout == "contiguous":
        return shard_sizes(num_samples, world_size)
    if layout == "strided_padded":
        shard_sizes(num_samples, world_size)  # same argument checks
        return [-(-num_samples // world_size)] * world_size
    raise ValueError(f"layout={layout!r} is not one of {get_args(ShardLayout)}")


def make_shards(order: Sequence[int], world_size: int, layout: ShardLayout = "contiguous") -> list[list[int]]:
    """Split the sample ``order`` into one index list per rank under ``layout``."""
    lengths = shard_lengths(len(order), world_size, layout)
    if layout == "contiguous":
        bounds = [0, *itertools.accumulate(lengths)]
        return [list(order[a:b]) for a, b in itertools.pairwise(bounds)]
    # DistributedSampler pads with the head of the order (repeatedly if world_size > len(order)).
    padded = list(itertools.islice(itertools.cycle(order), lengths[0] * world_size)) if order else []
    return [padded[rank::world_size] for rank in range(world_size)]


def limited_batches(num_batches: int, limit: int | float) -> int:
    """One rank's batch count under a ``limit_{val,test}_batches`` (an int caps it, a float scales it)."""
    return min(num_batches, limit) if isinstance(limit, int) else int(num_batches * limit)


@dataclass(frozen=True)
class ShardPlan:
    """How one evaluation loader is split over ``world_size`` ranks; :meth:`decide` makes it.

    Attributes:
        num_samples: The loader's sample count (rank 0's, broadcast).
        layout: ``contiguous`` (each sample once), or ``strided_padded`` where a contiguous split
            would leave some rank without a batch while another has some: a rank with no batch skips
            the loop and its collectives, so the others would wait for it.
        lengths: Each rank's shard length under ``layout``.
        contiguous_batches: Each rank's batch count under the contiguous split, limit applied (what
            the decision was made on; the reason of a fallback).
    """

    num_samples: int
    layout: ShardLayout
    lengths: tuple[int, ...]
    contiguous_batches: tuple[int, ...]

    @classmethod
    def decide(
        cls, num_samples: int, world_size: int, *, batch_size: int, drop_last: bool = False, limit: int | float = 1.0
    ) -> ShardPlan:
        """The plan every rank computes alike from the count, the batching and the batch limit."""
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be >= 1")
        if drop_last:
            # Whole batches only, in order: the samples one process evaluates (it drops the set's last partial batch),
            # where shards of any length would each drop their own.
            sizes = [batch_size * n for n in shard_sizes(num_samples // batch_size, world_size)]
        else:
            sizes = shard_sizes(num_samples, world_size)
        batches = tuple(limited_batches(math.ceil(n / batch_size), limit) for n in sizes)
        layout: ShardLayout = "contiguous" if all(batches) or not any(batches) else "strided_padded"
        lengths = sizes if layout == "contiguous" else shard_lengths(num_samples, world_size, layout)
        return cls(num_samples, layout, tuple(lengths), batches)

    @property
    def world_size(self) -> int:
        return len(self.lengths)

    def shards(self, order: Sequence[int]) -> list[list[int]]:
        """The sample ``order`` (on the source rank) split into one index list per rank."""
        if len(order) != self.num_samples:
            raise ValueError(f"the plan is for {self.num_samples} samples, the order has {len(order)}")
        if self.layout == "strided_padded":
            return make_shards(order, self.world_size, self.layout)
        bounds = [0, *itertools.accumulate(self.lengths)]  # a drop_last plan leaves the last partial batch out
        return [list(order[a:b]) for a, b in itertools.pairwise(bounds)]


def broadcast_count(
    count: int | None, *, src: int = 0, group: dist.ProcessGroup | None = None, device: torch.device | str = "cpu"
) -> int:
    """Rank ``src``'s ``count`` on every rank of ``group`` (one 1-element broadcast)."""
    is_src = dist.get_rank() == src
    if is_src and (count is None or count < 0):
        raise ValueError(f"rank {src} is the source and needs a count >= 0, got {count!r}")
    value = torch.tensor([count if is_src else 0], dtype=torch.int64, device=device)
    dist.broadcast(value, src=src, group=group)
    return int(value.item())


def scatter_shard_indices(
    shards: Sequence[Sequence[int]] | None,
    lengths: Sequence[int],
    *,
    src: int = 0,
    group: dist.ProcessGroup | None = None,
    device: torch.device | str = "cpu",
) -> list[int]:
    """Give every rank of ``group`` its list of indices, decided by rank ``src`` alone (one scatter).

    Args:
        shards: On ``src``: one index list per group rank (:func:`make_shards`). Ignored
            elsewhere (pass ``None``).
        lengths: Every rank's shard length, known on every rank (:func:`shard_lengths` of the
            broadcast count): it sizes the receive buffer.
        src: Global rank that decides the shards.
        group: Process group; the default group when ``None``.
        device: Where the collective runs (``"cpu"`` for gloo, the rank's CUDA device for NCCL).

    Returns:
        This rank's indices, possibly empty.
    """
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    is_src = dist.get_rank() == src
    if is_src and (shards is None or [len(s) for s in shards] != list(lengths)):
        raise ValueError(
            f"rank {src} needs one index list per rank with lengths {list(lengths)}, "
            f"got {None if shards is None else [len(s) for s in shards]}"
        )
    # Row layout: [real length, indices..., zero padding]: scatter needs equal-sized tensors.
    out = torch.empty(max(lengths, default=0) + 1, dtype=torch.int64, device=device)
    rows = None
    if is_src:
        rows = list(torch.zeros(world_size, out.numel(), dtype=torch.int64, device=device).unbind(0))
        for row, shard in zip(rows, shards, strict=True):
            row[0] = len(shard)
            row[1 : len(shard) + 1] = torch.as_tensor(list(shard), dtype=torch.int64)
    dist.scatter(out, rows, src=src, group=group)
    real_length = int(out[0])
    assert real_length == lengths[rank], (real_length, lengths)  # both sides computed the same plan
    return out[1 : real_length + 1].tolist()


class ShardSampler(Sampler[int]):
    """Yields a fixed list of dataset indices in order (this rank's evaluation shard)."""

    def __init__(self, indices: Sequence[int]) -> None:
        self._indices = list(indices)

    @property
    def indices(self) -> list[int]:
        return list(self._indices)

    def __iter__(self) -> Iterator[int]:
        return iter(self._indices)

    def __len__(self) -> int:
        return len(self._indices)
