"""Exact torchmetrics on uneven evaluation shards, in a few batched collectives per evaluation loader.

With scatter-sharded evaluation (:mod:`parallel.evaluation.eval_sharding`) ranks run different numbers of
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
  states and the negated ``"min"`` states, and for list states ONE exchange of their shapes plus
  ONE padded gather of their bytes (:mod:`parallel.evaluation.uneven_gather`), preceded by ONE exchange of
  element counts when a list state is not reduced by ``"cat"`` (retrieval metrics). Each metric's
  ``dist_sync_fn`` then serves its states from that merge: torchmetrics reduces them as usual
  and restores the local states after ``compute()``. Lists are joined in rank order, which with
  contiguous shards is dataset order: the result equals one process on the whole set.
- Tensor states reduced by ``"mean"``, a custom callable or ``None`` cannot be merged exactly:
  they are gathered by torchmetrics' own ``gather_all_tensors`` when served (fixed shapes, so every
  rank gathers alike), as under Lightning's ``ddp``. Metrics built with ``sync_on_compute=False``
  are never synced. :meth:`MetricSync.end` restores every attribute it changed.

Every rank must track the same metrics in the same order (the same module and callbacks) and
run the same ``compute()`` calls after its last step, as torchmetrics requires anyway.
Pure torch + torchmetrics; no Lightning import.
"""

from __future__ import annotations

import functools
import itertools
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.distributed as dist
from torch import Tensor
from torchmetrics import Metric
from torchmetrics.utilities.data import dim_zero_cat, dim_zero_max, dim_zero_min, dim_zero_sum

from parallel.evaluation.uneven_gather import exchange_layouts, gather_tensors

__all__ = ["MetricSync", "merge_kinds"]

log = logging.getLogger(__name__)

Kind = Literal["sum", "max", "min", "cat", "list", "own"]
_SAVED_ATTRIBUTES = ("distributed_available_fn", "dist_sync_fn", "dist_sync_on_step", "compute_with_cache")
_TENSOR_KINDS = {dim_zero_sum: "sum", dim_zero_max: "max", dim_zero_min: "min"}
_told_own: set[str] = set()


def merge_kinds(metric: Metric) -> dict[str, Kind]:
    """How each state is merged, in torchmetrics' state order.

    ``sum``/``max``/``min``: tensor states, reduced exactly; ``cat``: list states concatenated;
    ``list``: list states of another reduction (``None`` in retrieval and detection metrics), whose
    elements are gathered as torchmetrics gathers them but in rank order and in one collective
    (torchmetrics would issue one gather per element: as many as this rank's updates, which uneven
    shards make differ across ranks); ``own``: tensor states reduced by ``"mean"``, a callable,
    ``None`` or ``"cat"``, gathered by torchmetrics' own ``gather_all_tensors`` (fixed shapes).
    """
    # torchmetrics exposes a state's reduction only through the private `_reductions`.
    kinds: dict[str, Kind] = {}
    for name, fx in metric._reductions.items():
        if isinstance(getattr(metric, name), list):
            kinds[name] = "cat" if fx is dim_zero_cat else "list"
        else:
            kinds[name] = _TENSOR_KINDS.get(fx, "own")
    return kinds


@dataclass(eq=False)
class _Tracked:
    """One metric under a run: what was changed on it, and what the last merge gave for it."""

    metric: Metric
    saved: dict[str, object]
    kinds: dict[str, Kind]
    start_count: int
    merged: dict[str, Tensor | list[Tensor]] = field(default_factory=dict)
    merged_count: int | None = None
    calls: list[str] = field(default_factory=list)  # the state of each call of the current sync

    @property
    def updated_this_run(self) -> bool:
        return self.metric.update_count != self.start_count


class MetricSync:
    """Batched, exact compute-time sync of torchmetrics states for one evaluation run.

    Args:
        process_group: The group the evaluation shards were scattered over; the default group when
            ``None``. Metrics' own ``process_group`` is not used for merged states: every rank
            holds part of the set.
        device: Where collectives run (``"cpu"`` for gloo, the rank's CUDA device for NCCL).
    """

    def __init__(self, process_group: dist.ProcessGroup | None = None, device: torch.device | str = "cpu") -> None:
        self._process_group = process_group
        self._device = torch.device(device)
        self._tracked: list[_Tracked] = []
        self._ready = False
        self.merges = 0  # merge rounds run, for tests and logs

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
        tracked = _Tracked(
            metric, {name: getattr(metric, name) for name in _SAVED_ATTRIBUTES}, kinds, metric.update_count
        )
        metric.distributed_available_fn = self._is_ready
        metric.dist_sync_on_step = False
        metric.compute_with_cache = False
        metric.dist_sync_fn = functools.partial(self._serve, tracked)
        own = [name for name, kind in kinds.items() if kind == "own"]
        if own and type(metric).__name__ not in _told_own:
            _told_own.add(type(metric).__name__)
            log.debug(
                "%s: states %s keep torchmetrics' own gather (their reductions cannot be merged exactly)",
                type(metric).__name__,
                own,
            )
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
        """``dist_sync_fn`` of a tracked metric, called by torchmetrics' ``_sync_dist``.

        torchmetrics calls it in state order: once per tensor state and per pre-concatenated
        ``cat`` list, once per element of any other list. The first call of a sync plans the calls.
        """
        if not tracked.calls:
            if tracked.merged_count != tracked.metric.update_count:
                self._merge()
            tracked.calls = [
                name
                for name, kind in tracked.kinds.items()
                for _ in range(len(getattr(tracked.metric, name)) if kind == "list" else 1)
            ]
            tracked.calls.reverse()  # popped from the end
        name = tracked.calls.pop()
        kind, merged = tracked.kinds[name], tracked.merged.get(name)
        if kind == "own" or merged is None:  # not merged: no rank added to it during this run
            from torchmetrics.utilities.distributed import gather_all_tensors

            return gather_all_tensors(tensor, group=group)
        if kind == "list":  # every rank's elements on the state's last call, none on the others
            last = name not in tracked.calls  # (torchmetrics flattens the answers into one list)
            return [t.to(tensor.device) for t in merged] if last else []
        if kind != "cat" and merged.shape != tensor.shape:
            raise RuntimeError(
                f"internal: {type(tracked.metric).__name__}.{name} served out of order "
                f"({tuple(merged.shape)} for {tuple(tensor.shape)})"
            )
        return [merged.to(tensor.device)]

    def _merge(self) -> None:
        """Merge every tracked metric's states across ranks: at most five collectives."""
        states = [(t, name, kind, getattr(t.metric, name)) for t in self._tracked for name, kind in t.kinds.items()]
        merged: dict[tuple[int, str], Tensor | list[Tensor]] = {}
        self._reduce([s for s in states if s[2] == "sum"], dist.ReduceOp.SUM, merged)
        self._reduce([s for s in states if s[2] in ("max", "min")], dist.ReduceOp.MAX, merged)
        self._gather_lists([s for s in states if s[2] in ("cat", "list")], merged)
        for tracked in self._tracked:
            tracked.merged = {
                name: merged[(id(tracked), name)] for name in tracked.kinds if (id(tracked), name) in merged
            }
            tracked.merged_count = tracked.metric.update_count
        self.merges += 1

    def _reduce(self, states: list, op: dist.ReduceOp, merged: dict) -> None:
        """One all_reduce of all ``states`` in float64 (exact for integer counts below 2**53)."""
        if not states:
            return
        signs = [-1.0 if kind == "min" else 1.0 for _, _, kind, _ in states]  # min(x) = -max(-x)
        flat = torch.cat(
            [
                sign * value.detach().reshape(-1).to(self._device, torch.float64)
                for sign, (_, _, _, value) in zip(signs, states, strict=True)
            ]
        )
        dist.all_reduce(flat, op=op, group=self._process_group)
        for sign, chunk, (tracked, name, _, value) in zip(
            signs, flat.split([s[3].numel() for s in states]), states, strict=True
        ):
            merged[(id(tracked), name)] = (sign * chunk).view_as(value).to(value.device, value.dtype)

    def _gather_lists(self, states: list, merged: dict) -> None:
        """List states, in rank order: cat ones concatenated, others as lists of elements.

        A rank sends a state only if it updated the metric during this run (a training metric is
        not shipped at every evaluation). Collectives: an exchange of element counts (only if a
        non-cat list state exists), one of layouts, one padded gather of bytes.
        """
        if not states:
            return
        local = [
            ([dim_zero_cat(value)] if kind == "cat" else list(value)) if value and tracked.updated_this_run else []
            for tracked, _, kind, value in states
        ]
        longest = [1] * len(states)  # a cat state is one tensor (or none) per rank
        if any(kind == "list" for _, _, kind, _ in states):
            counts = self._exchange_counts([len(parts) for parts in local])
            longest = [max(rank[i] for rank in counts) for i in range(len(states))]
        flat = [part for parts, n in zip(local, longest, strict=True) for part in parts + [None] * (n - len(parts))]
        layouts = exchange_layouts(flat, group=self._process_group, device=self._device)
        gathered = gather_tensors(flat, layouts, group=self._process_group, device=self._device)
        bounds = [0, *itertools.accumulate(longest)]
        for i, (tracked, name, kind, _) in enumerate(states):
            parts = [t for rank in gathered for t in rank[bounds[i] : bounds[i + 1]] if t is not None]
            if parts:
                merged[(id(tracked), name)] = torch.cat(parts) if kind == "cat" else parts

    def _exchange_counts(self, counts: list[int]) -> list[list[int]]:
        mine = torch.tensor(counts, dtype=torch.int64, device=self._device)
        gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(self._process_group))]
        dist.all_gather(gathered, mine, group=self._process_group)
        return [row.tolist() for row in gathered]
