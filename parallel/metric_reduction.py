"""Exact dataset metrics from uneven evaluation shards: ONE all-reduce per evaluation epoch.

With scatter-sharded evaluation (:mod:`parallel.eval_sharding`) ranks run different numbers of
batches, so nothing may communicate per batch. What is exact and cheap is to add up *sums*:
correct counts per top-k, loss sums, sample counts. torchmetrics keeps exactly such states
(``MulticlassAccuracy``: tp/fp/tn/fn; ``MeanMetric``: weighted sum and weight; ``SumMetric``),
but by default it syncs each state of each metric separately when ``compute()`` is called
(two all-gathers per state).

:class:`EpochMetricReducer` replaces that with one collective:

- :meth:`~EpochMetricReducer.begin` (evaluation start) records every metric's update count and
  switches its compute-time sync off (through the public ``distributed_available_fn`` hook);
- :meth:`~EpochMetricReducer.reduce` (after a rank's last evaluation step) packs the states of
  the metrics updated since then into one float64 buffer, all-reduces it (SUM) and writes the
  global sums back, so every later ``compute()`` returns the dataset metric on every rank;
- :meth:`~EpochMetricReducer.end` restores the metrics' own sync.

float64 keeps integer counts exact (below 2**53) and float sums at least as accurate as an fp32
all-reduce. An all-reduce rather than a reduce-to-rank-0: the cost is the same single collective,
and callbacks that monitor the metric (checkpointing, early stopping) see one value on every rank.
Only ``"sum"`` states can be added across ranks; other reductions raise a ``TypeError`` naming
the metric. Every rank must update the same metrics (the same code runs on every batch).
Pure torch + torchmetrics; no Lightning import.
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch
import torch.distributed as dist
from torch import Tensor
from torchmetrics import Metric
from torchmetrics.utilities.data import dim_zero_sum

__all__ = ["EpochMetricReducer", "stateful_metrics"]


def stateful_metrics(module: torch.nn.Module) -> list[Metric]:
    """Every torchmetrics ``Metric`` under ``module`` that owns states, in a rank-independent order."""
    # Compositional metrics own no states; their operands are listed on their own.
    return [m for m in module.modules() if isinstance(m, Metric) and m.metric_state]


def _never_distributed() -> bool:
    return False


def _sum_states(metric: Metric) -> dict[str, Tensor]:
    """The metric's states, all of which must be added across ranks (``reduce_fx="sum"``)."""
    # torchmetrics exposes the reduction of a state only through the private `_reductions`.
    reductions = metric._reductions
    bad = {name: getattr(fx, "__name__", fx) for name, fx in reductions.items() if fx is not dim_zero_sum}
    states = metric.metric_state
    lists = [name for name, value in states.items() if not isinstance(value, Tensor)]
    if bad or lists:
        raise TypeError(
            f"{type(metric).__name__} has states that are not sums (reductions {bad}, list states {lists}); "
            "scatter evaluation reduces only sum states exactly. Use sum-state metrics (accuracy, MeanMetric, "
            "SumMetric) or turn scatter evaluation off (CustomDDPStrategy(scatter_eval=False))."
        )
    return states


class EpochMetricReducer:
    """Reduce the sum states of the metrics updated during an evaluation run in one all-reduce.

    Args:
        process_group: Group to reduce over; the default group when ``None``.
    """

    def __init__(self, process_group: dist.ProcessGroup | None = None) -> None:
        self._process_group = process_group
        # (metric, update count at the last snapshot, its own distributed_available_fn). A list, not
        # a dict: a torchmetrics Metric hashes its current state tensors, so its hash moves.
        self._tracked: list[tuple[Metric, int, Callable[[], bool] | None]] = []

    @property
    def active(self) -> bool:
        """Whether :meth:`begin` ran without a matching :meth:`end`."""
        return bool(self._tracked)

    def begin(self, metrics: Iterable[Metric]) -> None:
        """Start an evaluation run: snapshot update counts, switch compute-time sync off."""
        self.end()
        for metric in metrics:
            self._tracked.append((metric, metric.update_count, metric.distributed_available_fn))
            metric.distributed_available_fn = _never_distributed

    def reduce(self) -> list[Metric]:
        """All-reduce (SUM) the states of the metrics updated since the last snapshot; returns them."""
        updated = [metric for metric, count, _ in self._tracked if metric.update_count != count]
        states = [(metric, _sum_states(metric)) for metric in updated]
        tensors = [value for _, named in states for value in named.values()]
        if tensors:
            flat = torch.cat([t.detach().reshape(-1).to(torch.float64) for t in tensors])
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self._process_group)
            chunks = iter(flat.split([t.numel() for t in tensors]))
            for metric, named in states:
                for name, value in named.items():
                    setattr(metric, name, next(chunks).view_as(value).to(value.dtype))
                metric._computed = None  # drop a compute() cached from local states
        self._tracked = [(m, m.update_count, fn) for m, _, fn in self._tracked]
        return updated

    def end(self) -> None:
        """Restore every metric's own compute-time sync."""
        for metric, _, sync_fn in self._tracked:
            metric.distributed_available_fn = sync_fn
        self._tracked = []
