"""Every rank's numbers on rank 0's desk: :class:`~callbacks.benchmark.BenchmarkMonitor`'s cross-rank gathers.

A span's per-rank summary travels as one float64 row in ONE ``all_gather``; raw samples of uneven lengths in two
(their lengths, then the NaN-padded values), however many series. Across ranks, times and memory take the maximum
(a data-parallel step is as slow as its slowest rank) and sample counts the sum.

Lightning's ``strategy.all_gather`` goes through ``torch.distributed.nn.functional.all_gather``, which torch 2.14
deprecates (a FutureWarning on every rank). These numbers need no gradient: the plain c10d collective does
(:func:`parallel.torch_compat.all_gather_single` names it on every supported torch).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import Trainer

from parallel.torch_compat import all_gather_single

__all__ = ["gather_rows", "gather_samples", "nanmax"]

_SUMMED = ("samples", "steady_samples")


def gather_rows(trainer: Trainer, row: dict[str, float]) -> dict[str, Any]:
    """All ranks' rows in ONE all_gather; returns ``per_rank`` lists and the ``global`` view."""
    keys = sorted(row)
    local = torch.tensor([row[k] for k in keys], dtype=torch.float64, device=trainer.strategy.root_device)
    table = _all_gather(trainer, local).reshape(-1, len(keys)).cpu()
    per_rank = {k: table[:, i].tolist() for i, k in enumerate(keys)}
    merged = {k: (math.fsum(v) if k in _SUMMED else nanmax(v)) for k, v in per_rank.items()}
    merged["samples_per_s"] = _ratio(merged["samples"], merged["time_s"])
    merged["steady_samples_per_s"] = _ratio(merged["steady_samples"], merged["steady_s"])
    return {"per_rank": per_rank, "global": merged}


def _all_gather(trainer: Trainer, tensor: torch.Tensor) -> torch.Tensor:
    """``(world_size, *tensor.shape)``: every rank's ``tensor`` in rank order, in one collective."""
    if trainer.world_size == 1 or not (dist.is_available() and dist.is_initialized()):
        return tensor.unsqueeze(0)
    flat = tensor.contiguous().reshape(-1)
    gathered = flat.new_empty(trainer.world_size * flat.numel())  # gloo takes only the concatenated layout
    all_gather_single(gathered, flat)
    return gathered.view(trainer.world_size, *tensor.shape)


def gather_samples(trainer: Trainer, *series: list[float]) -> list[list[list[float]]]:
    """Every rank's values of each series (lengths may differ), per series then per rank: one gather of
    the lengths, one of the padded samples, however many series."""
    device = trainer.strategy.root_device
    lengths = (
        _all_gather(trainer, torch.tensor([len(v) for v in series], device=device)).reshape(-1, len(series)).tolist()
    )
    width = max(1, *(n for row in lengths for n in row))
    padded = torch.full((len(series), width), math.nan, dtype=torch.float64, device=device)
    for i, values in enumerate(series):
        padded[i, : len(values)] = torch.tensor(values, dtype=torch.float64, device=device)
    table = _all_gather(trainer, padded).reshape(len(lengths), len(series), width).cpu()
    return [[table[rank, i, : row[i]].tolist() for rank, row in enumerate(lengths)] for i in range(len(series))]


def nanmax(values: list[float]) -> float:
    """The largest value that is not NaN; NaN when there is none."""
    present = [v for v in values if not math.isnan(v)]
    return max(present) if present else math.nan


def _ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator > 0 else math.nan
