"""Robust summaries of timing samples.

Step times on a shared machine have a long right tail (a preempted core, a page fault, the
garbage collector), so a plain mean over-reports them. The benchmarks report the median and the
mean of the samples between the 10th and 90th percentile: the same robust estimate the seed
report used, kept here so every table and plot computes it one way.
"""

from __future__ import annotations

import math
from typing import Sequence

__all__ = ["SUMMARY_FIELDS", "Summary", "summarize"]

# Fields of a summary, in a fixed order: the benchmark callback gathers them across ranks as the
# columns of one tensor, so every rank must produce the same keys in the same order.
Summary = dict[str, float]
SUMMARY_FIELDS = ("median", "trimmed_mean", "p10", "p90", "count")


def _percentile(ordered: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile of already sorted values (numpy's default method)."""
    position = (len(ordered) - 1) * q
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def summarize(values: Sequence[float]) -> Summary:
    """Median, 10–90 percentile mean, the two percentiles and the sample count.

    Args:
        values: Samples, e.g. step times in seconds. May be empty.

    Returns:
        A dict with the keys of ``SUMMARY_FIELDS``; every statistic is NaN (and ``count`` 0)
        when ``values`` is empty, so that ranks without samples still join a gather.
    """
    if not values:
        return {"median": math.nan, "trimmed_mean": math.nan, "p10": math.nan, "p90": math.nan,
                "count": 0.0}
    ordered = sorted(float(v) for v in values)
    # Drop the lowest and highest 10 % by rank: never empty, unlike a filter on the
    # interpolated percentiles (two samples would leave nothing between them).
    cut = len(ordered) // 10
    inside = ordered[cut : len(ordered) - cut]
    return {
        "median": _percentile(ordered, 0.5),
        "trimmed_mean": sum(inside) / len(inside),
        "p10": _percentile(ordered, 0.1),
        "p90": _percentile(ordered, 0.9),
        "count": float(len(ordered)),
    }
