"""Exact torchmetrics on uneven evaluation shards, in a few batched collectives per evaluation loader.

With scatter-sharded evaluation (:mod:`parallel.eval_sharding`) ranks run different numbers of
batches, so nothing may communicate per batch, and a metric's value must be computed from every
rank's state. torchmetrics already syncs states when ``compute()`` runs, one state at a time
(two all_gathers per state), through two public seams: the metric's ``distributed_available_fn``
(is there anything to sync with?) and its ``dist_sync_fn`` (how a state is gathered).
:class:`MetricSync` takes both over for one evaluation run:

- **When**: ``distributed_available_fn`` answers "not yet" until this rank has run the last step
  of the current loader (:meth:`MetricSync.set_ready`). A ``compute()`` inside the steps is this
  rank's own (as a step value is), and ``dist_sync_on_step`` is off for the run: per-step syncs
  would pair with another rank's different step. ``compute_with_cache`` is off too, so a value
  computed locally in a step is never returned later as the dataset value.
- **How**: the first sync after that point merges the states of EVERY tracked metric at once
  (:meth:`MetricSync._merge`), so one loader costs at most one collective per reduction kind:
  ONE all_reduce (SUM, float64) of all ``"sum"`` states, ONE all_reduce (MAX) of all ``"max"``
  states and the negated ``"min"`` states, and for ``"cat"`` (list) states ONE exchange of their
  shapes plus ONE padded gather of their bytes (:mod:`parallel.uneven_gather`). Each metric's
  ``dist_sync_fn`` then serves its states from that merge: torchmetrics reduces them as usual
  and restores the local states after ``compute()``. Cat states are concatenated in rank order,
  which with contiguous shards is dataset order: the result equals one process on the whole set.
- Metrics with a state reduced by ``"mean"``, a custom callable or ``None`` cannot be merged
  exactly: they keep torchmetrics' own sync (gated the same way), as under Lightning's ``ddp``.
  Metrics built with ``sync_on_compute=False`` are never synced. :meth:`MetricSync.end` restores
  every attribute it changed.

Every rank must track the same metrics in the same order (the same module and callbacks) and
run the same ``compute()`` calls after its last step, as torchmetrics requires anyway.
Pure torch + torchmetrics; no Lightning import.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field
from typing import Iterable, Literal

import torch
import torch.distributed as dist
from torch import Tensor
from torchmetrics import Metric
from torchmetrics.utilities.data import dim_zero_cat, dim_zero_max, dim_zero_min, dim_zero_sum

from parallel.uneven_gather import exchange_layouts, gather_tensors

__all__ = ["MetricSync", "merge_kinds"]

log = logging.getLogger(__name__)

Kind = Literal["sum", "max", "min", "cat"]
_SAVED_ATTRIBUTES = ("distributed_available_fn", "dist_sync_fn", "dist_sync_on_step", "compute_with_cache")
_told_unmergeable: set[str] = set()


def merge_kinds(metric: Metric) -> dict[str, Kind] | None:
    """Each state's merge kind in torchmetrics' state order, or ``None`` if one cannot be merged exactly."""
    # torchmetrics exposes a state's reduction only through the private `_reductions`.
    kinds: dict[str, Kind] = {}
    for name, fx in metric._reductions.items():
        is_list = isinstance(getattr(metric, name), list)
        kind = {dim_zero_sum: "sum", dim_zero_max: "max", dim_zero_min: "min", dim_zero_cat: "cat"}.get(fx)
        if kind is None or is_list != (kind == "cat"):
            return None
        kinds[name] = kind
    return kinds


@dataclass(eq=False)
class _Tracked:
    """One metric under a run: what was changed on it, and what the last merge gave for it."""

    metric: Metric
    saved: dict[str, object]
    kinds: dict[str, Kind] | None  # None: keeps torchmetrics' own sync
    start_count: int
    merged: dict[str, Tensor] = field(default_factory=dict)
    merged_count: int | None = None
    cursor: int = 0


class MetricSync:
    """Batched, exact compute-time sync of torchmetrics states for one evaluation run.

    Args:
        process_group: The group the evaluation shards were scattered over; the default group when
            ``None``. Metrics' own ``process_group`` is not used: every rank holds part of the set.
        device: Where collectives run (``"cpu"`` for gloo, the rank's CUDA device for NCCL).
    """

    def __init__(self, process_group: dist.ProcessGroup | None = None, device: torch.device | str = "cpu") -> None:
        self._process_group = process_group
        self._device = torch.device(device)
        self._tracked: list[_Tracked] = []
        self._ready = False
        self.merges = 0  # collective rounds run, for tests and logs

    @property
    def active(self) -> bool:
        return bool(self._tracked)

    def begin(self, metrics: Iterable[Metric]) -> None:
        """Take over the sync of ``metrics`` (deduplicated, order kept) until :meth:`end`."""
        self.end()
        seen: set[int] = set()
        for metric in metrics:
            if id(metric) not in seen and metric.metric_state:
                seen.add(id(metric))
                self._track(metric)

    def _track(self, metric: Metric) -> None:
        kinds = merge_kinds(metric)
        tracked = _Tracked(metric, {name: getattr(metric, name) for name in _SAVED_ATTRIBUTES}, kinds,
                           metric.update_count)
        metric.distributed_available_fn = self._is_ready
        metric.dist_sync_on_step = False
        metric.compute_with_cache = False
        if kinds is not None:
            metric.dist_sync_fn = functools.partial(self._serve, tracked)
        elif type(metric).__name__ not in _told_unmergeable:
            _told_unmergeable.add(type(metric).__name__)
            reductions = {name: getattr(fx, "__name__", fx) for name, fx in metric._reductions.items()}
            log.debug("%s keeps torchmetrics' own compute-time sync (reductions %s cannot be merged exactly)",
                      type(metric).__name__, reductions)
        self._tracked.append(tracked)

    def _is_ready(self) -> bool:
        return self._ready

    def set_ready(self, ready: bool) -> None:
        """Whether this rank has run the last step of its current loader (merges only then)."""
        if not ready:
            for tracked in self._tracked:  # a new loader's steps make earlier merges stale
                tracked.merged, tracked.merged_count = {}, None
        self._ready = ready

    def end(self) -> None:
        """Give every metric back its own settings."""
        for tracked in self._tracked:
            for name, value in tracked.saved.items():
                setattr(tracked.metric, name, value)
        self._tracked, self._ready = [], False

    # ------------------------------------------------------------------ serving torchmetrics' sync

    def _serve(self, tracked: _Tracked, tensor: Tensor, group: object = None) -> list[Tensor]:
        """``dist_sync_fn`` of a tracked metric: called once per state, in ``_reductions`` order."""
        if tracked.merged_count != tracked.metric.update_count:
            self._merge()
        names = list(tracked.kinds)
        name = names[tracked.cursor]
        tracked.cursor = (tracked.cursor + 1) % len(names)
        if name not in tracked.merged:  # a cat state no rank added to during this run
            from torchmetrics.utilities.distributed import gather_all_tensors
            return gather_all_tensors(tensor, group=self._process_group)
        value = tracked.merged[name]
        if tracked.kinds[name] != "cat" and value.shape != tensor.shape:
            raise RuntimeError(f"internal: {type(tracked.metric).__name__}.{name} served out of order "
                               f"({tuple(value.shape)} for {tuple(tensor.shape)})")
        return [value.to(tensor.device)]

    def _merge(self) -> None:
        """Merge every tracked metric's states across ranks: at most four collectives."""
        mergeable = [t for t in self._tracked if t.kinds is not None]
        states = [(t, name, kind, getattr(t.metric, name)) for t in mergeable for name, kind in t.kinds.items()]
        merged: dict[tuple[int, str], Tensor] = {}
        self._reduce([s for s in states if s[2] == "sum"], dist.ReduceOp.SUM, merged)
        self._reduce([s for s in states if s[2] in ("max", "min")], dist.ReduceOp.MAX, merged)
        self._concatenate([s for s in states if s[2] == "cat"], merged)
        for tracked in mergeable:
            tracked.merged = {name: merged[(id(tracked), name)] for name in tracked.kinds if (id(tracked), name) in merged}
            tracked.merged_count, tracked.cursor = tracked.metric.update_count, 0
        self.merges += 1

    def _reduce(self, states: list, op: dist.ReduceOp, merged: dict) -> None:
        """One all_reduce of all ``states`` in float64 (exact for integer counts below 2**53)."""
        if not states:
            return
        signs = [-1.0 if kind == "min" else 1.0 for _, _, kind, _ in states]  # min(x) = -max(-x)
        flat = torch.cat([sign * value.detach().reshape(-1).to(self._device, torch.float64)
                          for sign, (_, _, _, value) in zip(signs, states)])
        dist.all_reduce(flat, op=op, group=self._process_group)
        for sign, chunk, (tracked, name, _, value) in zip(signs, flat.split([s[3].numel() for s in states]), states):
            merged[(id(tracked), name)] = (sign * chunk).view_as(value).to(value.device, value.dtype)

    def _concatenate(self, states: list, merged: dict) -> None:
        """Cat states: one exchange of their layouts, one padded gather of their bytes, rank order kept."""
        if not states:
            return
        # A rank sends a cat state only if it updated the metric during this run: a metric the run
        # never touched (a training metric) is not shipped at every evaluation.
        local = [dim_zero_cat(value) if value and tracked.metric.update_count != tracked.start_count else None
                 for tracked, _, _, value in states]
        layouts = exchange_layouts(local, group=self._process_group, device=self._device)
        gathered = gather_tensors(local, layouts, group=self._process_group, device=self._device)
        for i, (tracked, name, _, _) in enumerate(states):
            parts = [rank[i] for rank in gathered if rank[i] is not None]
            if parts:
                merged[(id(tracked), name)] = torch.cat(parts)
