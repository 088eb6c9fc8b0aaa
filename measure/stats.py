"""Robust summaries of timing samples, and their confidence intervals.

Step times on a shared machine have a long right tail (a preempted core, a page fault, the
garbage collector), so a plain mean over-reports them. The benchmarks report the median and the
mean of the samples between the 10th and 90th percentile: the same robust estimate the seed
report used, kept here so every table and plot computes it one way. Their intervals are
percentile-bootstrap 95 % intervals of the median, of a ratio or of a difference of medians
(numpy, fixed seed, every resample drawn at once). Pure Python and numpy; no Lightning import.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

__all__ = ["SUMMARY_FIELDS", "Estimate", "Summary", "difference_ci", "median_ci", "ratio_ci", "share_ci", "summarize"]

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


@dataclass(frozen=True)
class Estimate:
    """A point estimate with its bootstrap 95 % confidence interval."""

    value: float
    low: float
    high: float
    n: int


def _bootstrap(statistic: Callable[..., Any], samples: Sequence[np.ndarray], resamples: int, seed: int) -> np.ndarray:
    """``statistic`` of ``resamples`` resamples (with replacement) of every sample set, all at once."""
    rng = np.random.default_rng(seed)
    return np.asarray(statistic(*[s[rng.integers(0, len(s), (resamples, len(s)))] for s in samples]))


def _median(x: np.ndarray) -> Any:  # along the last axis: one value per bootstrap resample
    return np.median(x, axis=-1)


def median_ci(samples: Sequence[float], resamples: int = 2000, seed: int = 0) -> Estimate:
    """Median of ``samples`` with a percentile-bootstrap 95 % interval."""
    values = np.asarray(samples, dtype=float)
    if values.size == 0:
        raise ValueError("median_ci needs at least one sample, got none")
    low, high = np.percentile(_bootstrap(_median, [values], resamples, seed), [2.5, 97.5])
    return Estimate(float(np.median(values)), float(low), float(high), int(values.size))


def _two_sample_ci(name: str, statistic: Callable[[np.ndarray, np.ndarray], Any], first: Sequence[float],
                   second: Sequence[float], resamples: int, seed: int) -> Estimate:
    a, b = np.asarray(first, dtype=float), np.asarray(second, dtype=float)
    if a.size == 0 or b.size == 0:
        raise ValueError(f"{name} needs samples on both sides, got {a.size} and {b.size}")
    low, high = np.percentile(_bootstrap(statistic, [a, b], resamples, seed), [2.5, 97.5])
    return Estimate(float(statistic(a, b)), float(low), float(high), int(min(a.size, b.size)))


def ratio_ci(numerator: Sequence[float], denominator: Sequence[float], resamples: int = 2000,
             seed: int = 0) -> Estimate:
    """``median(numerator) / median(denominator)`` with a percentile-bootstrap 95 % interval."""
    return _two_sample_ci("ratio_ci", lambda x, y: _median(x) / _median(y), numerator, denominator, resamples, seed)


def difference_ci(minuend: Sequence[float], subtrahend: Sequence[float], resamples: int = 2000,
                  seed: int = 0) -> Estimate:
    """``median(minuend) - median(subtrahend)`` with a percentile-bootstrap 95 % interval."""
    return _two_sample_ci("difference_ci", lambda x, y: _median(x) - _median(y), minuend, subtrahend, resamples, seed)


def share_ci(without: Sequence[float], whole: Sequence[float]) -> Estimate:
    """``1 - median(without) / median(whole)``: the share of ``whole`` taken by what ``without``
    lacks (e.g. the SyncBN share of a step, ``without`` = the local-BN step)."""
    r = ratio_ci(without, whole)
    return Estimate(1 - r.value, 1 - r.high, 1 - r.low, r.n)
