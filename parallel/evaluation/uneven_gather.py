"""Gathers of tensors whose shapes differ across ranks: layouts first, so every rank decides alike.

Scatter evaluation gives ranks shards of different lengths (11 samples on 2 ranks: 6 and 5), so
anything a rank keeps per sample has a different number of rows on each rank. A plain
``dist.all_gather`` needs equal shapes (gloo aborts the process on a mismatch, with no Python
error). Here every gather starts with ONE small all_gather of each tensor's dtype and shape
(:func:`exchange_layouts`); every rank then knows every rank's layout and takes the same decision:

- :func:`gather_tensors`: several tensors of any shapes in ONE more collective (their bytes,
  padded to the longest rank's), e.g. the "cat" states of many metrics at once;
- :func:`all_gather_rows`: each rank's rows once, concatenated in rank order (with contiguous
  evaluation shards: dataset order); differentiable with ``sync_grads=True``;
- :func:`all_gather_padded`: the shape ``torch.distributed``/Lightning's ``all_gather`` give
  (``world_size`` stacked along dim 0), shorter ranks padded with repeats of their own rows as
  ``DistributedSampler`` pads; returns how many rows are padding.

Tensors whose trailing dimensions (or dtypes) differ across ranks cannot be stacked or
concatenated: :class:`UnevenGatherError` is raised on every rank, after the same exchange.
Pure torch; no Lightning import.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = [
    "TensorLayout",
    "UnevenGatherError",
    "all_gather_padded",
    "all_gather_rows",
    "exchange_layouts",
    "gather_tensors",
]

MAX_NDIM = 8
# Dtypes that can travel as bytes; the code sent for a dtype is its index here.
_DTYPES = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.complex128,
)
_FIELDS = 2 + MAX_NDIM  # dtype code, ndim, dims (zero-filled); dtype code -1: no tensor


class UnevenGatherError(ValueError):
    """Raised on every rank when the ranks' tensors cannot be gathered into one result."""


class TensorLayout(NamedTuple):
    dtype: torch.dtype
    shape: torch.Size

    @property
    def nbytes(self) -> int:
        return self.shape.numel() * self.dtype.itemsize


def _describe(tensor: Tensor | None) -> list[int]:
    if tensor is None:
        return [-1, 0] + [0] * MAX_NDIM
    if tensor.dtype not in _DTYPES or tensor.ndim > MAX_NDIM:
        raise UnevenGatherError(
            f"cannot gather a tensor of dtype {tensor.dtype} with {tensor.ndim} dimensions: "
            f"supported are {[str(d) for d in _DTYPES]} with at most {MAX_NDIM} dimensions"
        )
    return [_DTYPES.index(tensor.dtype), tensor.ndim, *tensor.shape, *[0] * (MAX_NDIM - tensor.ndim)]


def _layout(fields: list[int]) -> TensorLayout | None:
    code, ndim = fields[0], fields[1]
    return None if code < 0 else TensorLayout(_DTYPES[code], torch.Size(fields[2 : 2 + ndim]))


def exchange_layouts(
    tensors: Sequence[Tensor | None], *, group: dist.ProcessGroup | None = None, device: torch.device | str = "cpu"
) -> list[list[TensorLayout | None]]:
    """Every rank's dtype and shape of each of its ``tensors`` (``None``: it has none); one all_gather.

    Every rank must pass the same number of tensors. Returns ``layouts[rank][i]``.
    """
    mine = torch.tensor([field for t in tensors for field in _describe(t)], dtype=torch.int64, device=device)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, mine, group=group)
    rows = [row.tolist() for row in gathered]
    return [[_layout(row[i * _FIELDS : (i + 1) * _FIELDS]) for i in range(len(tensors))] for row in rows]


def gather_tensors(
    tensors: Sequence[Tensor | None],
    layouts: list[list[TensorLayout | None]],
    *,
    group: dist.ProcessGroup | None = None,
    device: torch.device | str = "cpu",
) -> list[list[Tensor | None]]:
    """Every rank's ``tensors`` on every rank, in ONE all_gather of their bytes; returns ``out[rank][i]``.

    ``layouts`` comes from :func:`exchange_layouts` of the same ``tensors``. Bytes make the
    gather exact for every dtype (integers above 2**53 too) and mix dtypes in one buffer.
    """
    sizes = [sum(layout.nbytes for layout in rank if layout is not None) for rank in layouts]
    buffer = torch.zeros(max(sizes, default=0), dtype=torch.uint8, device=device)
    parts = [t.detach().contiguous().reshape(-1).view(torch.uint8) for t in tensors if t is not None]
    if parts:
        buffer[: sizes[dist.get_rank(group)]] = torch.cat(parts).to(device)
    gathered = [torch.empty_like(buffer) for _ in layouts]
    if buffer.numel():
        dist.all_gather(gathered, buffer, group=group)
    return [_unpack(data, rank_layouts) for data, rank_layouts in zip(gathered, layouts, strict=True)]


def _unpack(data: Tensor, layouts: list[TensorLayout | None]) -> list[Tensor | None]:
    out: list[Tensor | None] = []
    offset = 0
    for layout in layouts:
        if layout is None:
            out.append(None)
            continue
        # clone(): a view of another dtype needs a storage offset aligned to that dtype.
        chunk = data[offset : offset + layout.nbytes].clone()
        out.append(chunk.view(layout.dtype).reshape(layout.shape))
        offset += layout.nbytes
    return out


def _row_counts(tensor: Tensor, group: dist.ProcessGroup | None, device: torch.device | str) -> list[int]:
    """Every rank's number of rows of ``tensor``; raises on every rank if the rest of the shape differs."""
    layouts = [rank[0] for rank in exchange_layouts([tensor], group=group, device=device)]
    mine = TensorLayout(tensor.dtype, tensor.shape)
    if any(
        layout.dtype != mine.dtype or layout.shape[1:] != mine.shape[1:] or len(layout.shape) != tensor.ndim
        for layout in layouts
    ):
        described = ", ".join(f"rank {r}: {tuple(other.shape)} {other.dtype}" for r, other in enumerate(layouts))
        raise UnevenGatherError(
            f"cannot gather tensors whose dimensions after the first (or dtypes) differ across ranks ({described}). "
            "Pad them to a common size yourself (e.g. torch.nn.functional.pad to the longest length, with a mask), "
            "or keep variable-length outputs as Python objects and gather them with "
            "torch.distributed.all_gather_object."
        )
    return [layout.shape[0] if len(layout.shape) else 1 for layout in layouts]


def _gather_equal(tensor: Tensor, group: dist.ProcessGroup | None, sync_grads: bool) -> list[Tensor]:
    if sync_grads:
        from torch.distributed.nn.functional import all_gather as differentiable_all_gather

        return list(differentiable_all_gather(tensor.contiguous(), group))
    out = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, tensor.detach().contiguous(), group=group)
    return out


def _repeat_rows(tensor: Tensor, rows: int) -> Tensor:
    """``tensor`` padded to ``rows`` rows with repeats of its own rows (zeros if it has none)."""
    if tensor.shape[0] == rows:
        return tensor
    if tensor.shape[0] == 0:
        return tensor.new_zeros((rows, *tensor.shape[1:]))
    index = torch.arange(rows, device=tensor.device) % tensor.shape[0]
    return tensor.index_select(0, index)


def all_gather_padded(
    tensor: Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    sync_grads: bool = False,
    device: torch.device | str = "cpu",
) -> tuple[Tensor, int]:
    """``torch.stack`` of every rank's ``tensor``, shorter ones padded with repeats of their rows.

    Returns ``(gathered of shape (world_size, max_rows, ...), number of padding rows)``. Two
    collectives (layouts, data); equal shapes need no padding and give ``torch.distributed``'s result.
    """
    if tensor.ndim == 0:
        return torch.stack(_gather_equal(tensor, group, sync_grads)), 0
    counts = _row_counts(tensor, group, device)
    rows = max(counts)
    gathered = _gather_equal(_repeat_rows(tensor, rows), group, sync_grads)
    return torch.stack(gathered), sum(rows - n for n in counts)


def all_gather_rows(
    tensor: Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    sync_grads: bool = False,
    device: torch.device | str = "cpu",
) -> Tensor:
    """Every rank's rows of ``tensor`` exactly once, concatenated in rank order (two collectives).

    With contiguous evaluation shards (scatter evaluation) rank order is dataset order. A 0-d
    tensor counts as one row.
    """
    if tensor.ndim == 0:
        tensor = tensor.reshape(1)
    counts = _row_counts(tensor, group, device)
    gathered = _gather_equal(_repeat_rows(tensor, max(counts)), group, sync_grads)
    return torch.cat([part[:n] for part, n in zip(gathered, counts, strict=True)])
