"""Scatter-based sharding of an evaluation dataset: every sample evaluated exactly once.

``DistributedSampler`` makes evaluation shards equal by repeating samples (11 samples on 2 ranks
become 6 + 6, one duplicate), which biases dataset metrics; ``drop_last`` would lose samples
instead. Here the source rank alone decides the shards and ships them:

1. it materialises the dataset as tensors, one per sample field (:func:`materialize`);
2. it splits them into contiguous shards whose lengths differ by at most one
   (:func:`shard_sizes`) and broadcasts a small header: field shapes/dtypes and the real length
   of every shard;
3. ``dist.scatter`` needs equal-sized tensors, so each field is padded to the longest shard,
   scattered once, and every rank trims its part to the real length from the header.

Collectives: one header broadcast plus one scatter per field, called by every rank of the group
in the same order. Pure torch; no Lightning import.

Example (on every rank; only the source needs the dataset)::

    fields = materialize(dataset) if dist.get_rank() == 0 else None
    shard = scatter_shards(fields)               # shard.fields[0][i] is sample shard.offset + i
    loader = DataLoader(TensorDataset(*shard.fields), batch_size=256)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, Subset, default_collate

__all__ = ["Shard", "materialize", "scatter_shards", "shard_sizes"]


@dataclass(frozen=True)
class Shard:
    """One rank's part of a scattered dataset.

    Attributes:
        fields: One tensor per sample field (e.g. images, labels), leading dim = shard length.
        offset: Index of this shard's first sample in the materialised dataset.
        num_samples: Length of the whole dataset (sum of all shard lengths).
    """

    fields: tuple[Tensor, ...]
    offset: int
    num_samples: int

    def __len__(self) -> int:
        return self.fields[0].shape[0] if self.fields else 0


def shard_sizes(num_samples: int, world_size: int) -> list[int]:
    """Contiguous shard lengths covering ``num_samples`` once; the first ``num_samples % world_size`` get one more.

    >>> shard_sizes(11, 2)
    [6, 5]
    """
    if world_size < 1 or num_samples < 0:
        raise ValueError(f"need world_size >= 1 and num_samples >= 0, got {world_size=}, {num_samples=}")
    base, extra = divmod(num_samples, world_size)
    return [base + (rank < extra) for rank in range(world_size)]


def materialize(
    dataset: Dataset, indices: Sequence[int] | None = None, *, batch_size: int = 1024, num_workers: int = 0
) -> tuple[Tensor, ...]:
    """Stack ``dataset[i]`` (for ``i`` in ``indices``, default all) into one tensor per sample field.

    Samples must be tuples/lists of tensors or numbers (``(uint8 image, int label)``), or a single
    tensor; numbers become 1-D tensors exactly as ``default_collate`` batches them.

    Raises:
        TypeError: a sample is a mapping or another structure that is not a flat tuple.
    """
    source = dataset if indices is None else Subset(dataset, list(indices))
    loader = DataLoader(source, batch_size=batch_size, num_workers=num_workers, collate_fn=default_collate)
    columns: list[list[Tensor]] | None = None
    for batch in loader:
        batch = (batch,) if isinstance(batch, Tensor) else batch
        if not isinstance(batch, (tuple, list)) or not all(isinstance(f, Tensor) for f in batch):
            raise TypeError(
                f"cannot materialise samples that collate to {type(batch).__name__}: return a flat tuple of "
                "tensors/numbers from __getitem__ (e.g. (uint8 image, int label))"
            )
        columns = columns or [[] for _ in batch]
        for column, field in zip(columns, batch):
            column.append(field)
    if columns is None:  # empty dataset: nothing tells us the field layout
        raise ValueError("cannot scatter an empty evaluation dataset (len 0)")
    return tuple(torch.cat(column) for column in columns)


def _header(fields: Sequence[Tensor], world_size: int) -> dict[str, Any]:
    lengths = {field.shape[0] for field in fields}
    if len(lengths) != 1:
        raise ValueError(f"every field needs the same number of samples, got leading dims {sorted(lengths)}")
    return {
        "sizes": shard_sizes(lengths.pop(), world_size),
        "layouts": [(tuple(field.shape[1:]), field.dtype) for field in fields],
    }


def _padded_chunks(field: Tensor, sizes: list[int], device: torch.device) -> list[Tensor]:
    """Split ``field`` by ``sizes`` and zero-pad each chunk to ``max(sizes)`` rows (scatter needs equal sizes)."""
    padded = field.new_zeros((len(sizes) * max(sizes), *field.shape[1:]), device=device)
    padded = padded.view(len(sizes), max(sizes), *field.shape[1:])
    for rank, chunk in enumerate(field.split(sizes)):
        padded[rank, : chunk.shape[0]].copy_(chunk)
    return list(padded.unbind(0))


def scatter_shards(
    fields: Sequence[Tensor] | None,
    *,
    src: int = 0,
    group: dist.ProcessGroup | None = None,
    device: torch.device | str = "cpu",
) -> Shard:
    """Give every rank of ``group`` its contiguous shard of ``fields``, held by rank ``src`` only.

    Args:
        fields: On ``src``: the whole dataset, one tensor per field with equal leading dims.
            Ignored on other ranks (pass ``None``).
        src: Global rank that holds the data and decides the shards.
        group: Process group; the default group when ``None``.
        device: Where the collectives run and the shard lands (``"cpu"`` for gloo, the rank's
            CUDA device for NCCL).

    Returns:
        This rank's :class:`Shard` (possibly empty when the dataset is shorter than the group).
    """
    device = torch.device(device)
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    is_src = dist.get_rank() == src
    if is_src and not fields:
        raise ValueError(f"rank {src} is the scatter source and needs the dataset fields, got {fields!r}")
    header = [_header(fields, world_size) if is_src else None]
    dist.broadcast_object_list(header, src=src, group=group, device=device)
    sizes, layouts = header[0]["sizes"], header[0]["layouts"]
    received = []
    for index, (tail_shape, dtype) in enumerate(layouts):
        out = torch.empty((max(sizes), *tail_shape), dtype=dtype, device=device)
        chunks = _padded_chunks(fields[index].to(device), sizes, device) if is_src else None
        dist.scatter(out, chunks, src=src, group=group)
        received.append(out[: sizes[rank]])
    return Shard(fields=tuple(received), offset=sum(sizes[:rank]), num_samples=sum(sizes))
