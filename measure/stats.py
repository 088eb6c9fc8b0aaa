"""Robust summaries of timing samples, and their confidence intervals.

Step times on a shared machine have a long right tail (a preempted core, a page fault, the
garbage collector), so a plain mean over-reports them. The benchmarks report the median and the
mean of the samples between the 10th and 90th percentile: the same robust estimate the seed
report used, kept here so every table and plot computes it one way. Their intervals are
percentile-bootstrap 95 % intervals of the median, of a ratio or of a difference of medians
(numpy, fixed seed, every resample drawn at once). Pure Python and numpy; no Lightning import.

Samples come flat (each value its own draw) or as runs: the steps of one run or one round share
the machine's state of those seconds (a neighbour's load, the clock), so they are not
independent, and resampling them one by one gives intervals far too narrow (on a shared host
whose speed drifts by 40 % over tens of seconds: 2-3.5x too narrow). Runs are resampled first, then
the steps inside each drawn run: the interval then reflects how much whole runs disagree.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = [
    "INTERVALS",
    "SUMMARY_FIELDS",
    "Estimate",
    "Samples",
    "Summary",
    "difference_ci",
    "in_runs",
    "median_ci",
    "pair_ratio_ci",
    "paired_ratio_ci",
    "ratio_ci",
    "share_ci",
    "summarize",
]

# Fields of a summary, in a fixed order: the benchmark callback gathers them across ranks as the
# columns of one tensor, so every rank must produce the same keys in the same order.
Summary = dict[str, float]
SUMMARY_FIELDS = ("median", "trimmed_mean", "p10", "p90", "count")
# Flat values (each its own draw), or runs of values (a run is drawn whole, then its steps).
Samples = Sequence[float] | Sequence[Sequence[float]]
# How the intervals are drawn, as records keep it (records without it drew single steps).
INTERVALS = "runs"


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
        return {"median": math.nan, "trimmed_mean": math.nan, "p10": math.nan, "p90": math.nan, "count": 0.0}
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


def in_runs(values: Sequence[float], run_length: int) -> list[list[float]]:
    """``values`` cut into runs of ``run_length`` consecutive samples (the last may be shorter): the
    per-round blocks of a series that :func:`benchmarks.harness.timed_rounds` kept flat."""
    if run_length < 1:
        raise ValueError(f"in_runs needs a run_length >= 1, got {run_length}")
    return [list(values[i : i + run_length]) for i in range(0, len(values), run_length)]


def _as_runs(samples: Samples, name: str) -> list[np.ndarray]:
    """Runs of floats; flat samples become runs of one value (so drawing runs is drawing values)."""
    items = list(samples)
    nested = [np.ndim(item) > 0 for item in items]
    if any(nested) and not all(nested):
        raise ValueError(f"{name} needs flat values or runs of values, not a mix of both")
    runs = (
        [np.asarray(item, dtype=float).ravel() for item in items]
        if all(nested)
        else [np.asarray([item], dtype=float) for item in items]
    )
    return [run for run in runs if run.size]  # a rank or round without samples draws nothing


def _draw(
    runs: list[np.ndarray], resamples: int, rng: np.random.Generator, picked: np.ndarray | None = None
) -> np.ndarray:
    """``(resamples, len(runs), longest run)``: each row len(runs) runs drawn with replacement (``picked``:
    the run indices already drawn, one row per resample) and, inside each drawn run, its steps drawn
    with replacement; NaN pads the runs drawn shorter than the longest."""
    lengths = np.array([run.size for run in runs])
    padded = np.full((len(runs), lengths.max()), np.nan)
    for i, run in enumerate(runs):
        padded[i, : run.size] = run
    if picked is None:
        picked = rng.integers(0, len(runs), (resamples, len(runs)))
    if padded.shape[1] == 1:  # flat values: one draw each, as a plain bootstrap
        return padded[picked]
    drawn_lengths = lengths[picked][..., None]
    steps = (rng.random((resamples, len(runs), padded.shape[1])) * drawn_lengths).astype(np.int64)
    drawn = padded[picked[..., None], steps]
    drawn[np.arange(padded.shape[1]) >= drawn_lengths] = np.nan
    return drawn


def _resample(
    runs: list[np.ndarray], resamples: int, rng: np.random.Generator, picked: np.ndarray | None = None
) -> np.ndarray:
    """:func:`_draw`'s resamples, each row's runs side by side: one row of values per resample."""
    return _draw(runs, resamples, rng, picked).reshape(resamples, -1)


# A record's ratios share their sides (custom / local, custom / floor, median of custom: the same seed, so the same
# draws of custom), and a draw is the costly part of an interval: its medians are kept, by the generator's state
# before it and the runs drawn, with the generator's state after it. A hit gives the same numbers, and leaves the
# generator where drawing would have.
_MEDIANS_KEPT = 256
_medians: dict[tuple, tuple[np.ndarray, dict[str, Any]]] = {}


def _resampled_medians(runs: list[np.ndarray], resamples: int, rng: np.random.Generator) -> np.ndarray:
    """The median of each of ``resamples`` two-level resamples of ``runs``."""
    state = rng.bit_generator.state
    key = (repr(state), resamples, tuple(run.tobytes() for run in runs))
    if key in _medians:
        medians, rng.bit_generator.state = _medians[key]
        return medians
    medians = _median(_resample(runs, resamples, rng))
    medians.flags.writeable = False  # shared by every interval that draws it
    if len(_medians) >= _MEDIANS_KEPT:
        _medians.pop(next(iter(_medians)))  # the oldest
    _medians[key] = (medians, rng.bit_generator.state)
    return medians


def _bootstrap(
    statistic: Callable[..., Any], samples: Sequence[list[np.ndarray]], resamples: int, seed: int
) -> np.ndarray:
    """``statistic`` of the medians of ``resamples`` two-level resamples of every sample set."""
    rng = np.random.default_rng(seed)
    return np.asarray(statistic(*[_resampled_medians(runs, resamples, rng) for runs in samples]))


def _median(x: np.ndarray) -> Any:  # along the last axis: one value per bootstrap resample
    return np.nanmedian(x, axis=-1) if np.isnan(x).any() else np.median(x, axis=-1)


def median_ci(samples: Samples, resamples: int = 2000, seed: int = 0) -> Estimate:
    """Median of ``samples`` (flat, or runs: see the module's docstring) with a bootstrap 95 % interval."""
    runs = _as_runs(samples, "median_ci")
    if not runs:
        raise ValueError("median_ci needs at least one sample, got none")
    values = np.concatenate(runs)
    low, high = np.percentile(_bootstrap(lambda medians: medians, [runs], resamples, seed), [2.5, 97.5])
    return Estimate(float(np.median(values)), float(low), float(high), int(values.size))


def _two_sample_ci(
    name: str,
    statistic: Callable[[Any, Any], Any],  # of the two sides' medians
    first: Samples,
    second: Samples,
    resamples: int,
    seed: int,
) -> Estimate:
    a_runs, b_runs = _as_runs(first, name), _as_runs(second, name)
    a, b = (np.concatenate(runs) if runs else np.empty(0) for runs in (a_runs, b_runs))
    if a.size == 0 or b.size == 0:
        raise ValueError(f"{name} needs samples on both sides, got {a.size} and {b.size}")
    low, high = np.percentile(_bootstrap(statistic, [a_runs, b_runs], resamples, seed), [2.5, 97.5])
    return Estimate(float(statistic(_median(a), _median(b))), float(low), float(high), int(min(a.size, b.size)))


def ratio_ci(numerator: Samples, denominator: Samples, resamples: int = 2000, seed: int = 0) -> Estimate:
    """``median(numerator) / median(denominator)`` with a percentile-bootstrap 95 % interval."""
    return _two_sample_ci("ratio_ci", np.divide, numerator, denominator, resamples, seed)


def _paired_runs(
    name: str, numerator: Sequence[Sequence[float]], denominator: Sequence[Sequence[float]]
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    a_runs, b_runs = ([np.asarray(run, dtype=float).ravel() for run in side] for side in (numerator, denominator))
    if len(a_runs) != len(b_runs) or not a_runs or any(run.size == 0 for run in a_runs + b_runs):
        raise ValueError(
            f"{name} needs the same number of non-empty runs on both sides (one per pair), "
            f"got {[run.size for run in a_runs]} and {[run.size for run in b_runs]} samples per run"
        )
    return a_runs, b_runs


def paired_ratio_ci(
    numerator: Sequence[Sequence[float]], denominator: Sequence[Sequence[float]], resamples: int = 2000, seed: int = 0
) -> Estimate:
    """``median(numerator) / median(denominator)`` of paired runs: run ``i`` of both sides ran side by side
    (one pair, seconds apart), so every resample draws the same pairs for both sides, then the steps
    inside each drawn run. Drift the two runs of a pair share (the host slowing down for a minute)
    then cancels in the ratio instead of widening its interval, as it does when runs are drawn apart.
    Only partly, though: a pair run in a slow minute still moves both pooled medians, by different
    amounts; :func:`pair_ratio_ci` takes each pair's ratio first."""
    a_runs, b_runs = _paired_runs("paired_ratio_ci", numerator, denominator)
    rng = np.random.default_rng(seed)
    pairs = rng.integers(0, len(a_runs), (resamples, len(a_runs)))
    draws = [_resample(runs, resamples, rng, pairs) for runs in (a_runs, b_runs)]
    low, high = np.percentile(_median(draws[0]) / _median(draws[1]), [2.5, 97.5])
    a, b = np.concatenate(a_runs), np.concatenate(b_runs)
    return Estimate(float(np.median(a) / np.median(b)), float(low), float(high), int(min(a.size, b.size)))


def pair_ratio_ci(
    numerator: Sequence[Sequence[float]], denominator: Sequence[Sequence[float]], resamples: int = 2000, seed: int = 0
) -> Estimate:
    """The geometric mean over pairs of each pair's ``median(numerator run) / median(denominator run)``,
    with a bootstrap 95 % interval drawing the same pairs on both sides, then the steps inside each
    drawn run. A pair's ratio is taken before pairs are combined, so the host's speed in the minute
    of a pair (shared by its two runs) cancels in it whole: pairs run in a slow minute weigh no
    more than others, as they do when every pair's steps are pooled first (:func:`paired_ratio_ci`).
    The estimate's ``n`` counts pairs."""
    a_runs, b_runs = _paired_runs("pair_ratio_ci", numerator, denominator)
    rng = np.random.default_rng(seed)
    pairs = rng.integers(0, len(a_runs), (resamples, len(a_runs)))
    a, b = (_median(_draw(runs, resamples, rng, pairs)) for runs in (a_runs, b_runs))
    low, high = np.exp(np.percentile(np.mean(np.log(a / b), axis=-1), [2.5, 97.5]))
    log_ratios = [np.log(np.median(x) / np.median(y)) for x, y in zip(a_runs, b_runs, strict=True)]
    return Estimate(float(np.exp(np.mean(log_ratios))), float(low), float(high), len(a_runs))


def difference_ci(minuend: Samples, subtrahend: Samples, resamples: int = 2000, seed: int = 0) -> Estimate:
    """``median(minuend) - median(subtrahend)`` with a percentile-bootstrap 95 % interval."""
    return _two_sample_ci("difference_ci", np.subtract, minuend, subtrahend, resamples, seed)


def share_ci(without: Samples, whole: Samples) -> Estimate:
    """``1 - median(without) / median(whole)``: the share of ``whole`` taken by what ``without``
    lacks (e.g. the SyncBN share of a step, ``without`` = the local-BN step)."""
    r = ratio_ci(without, whole)
    return Estimate(1 - r.value, 1 - r.high, 1 - r.low, r.n)
