"""The measurement layer every benchmark shares: quietness, interleaved rounds, CIs, one record, one writer.

A benchmark is then a short statement of what it compares::

    quiet = wait_for_quiet()                                   # record load, wait for a quiet machine
    samples = interleave(["a", "b"], rounds=5, run=measure)     # a b / b a / a b ...: drift hits both
    ratio = ratio_ci(samples["a"], samples["b"])               # median ratio with a bootstrap 95 % CI
    record = make_record("name", config, quiet.finish(), rows=[...], ratios={"a/b": ratio})
    write_record(out_dir, record, markdown_body)               # results.json + results.md

Policy: a result measured while the machine was busy (1-minute load above ``threshold`` before
or after the run, after waiting up to ``max_wait_s`` for it to calm down) is written with
``comparable: false`` and the Markdown says so in its first line; its numbers must not be quoted
as a ratio. Statistics use numpy (bootstrap percentile intervals, fixed seed).
"""

from __future__ import annotations

import json
import os
import shlex
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Sequence, TypeVar

import numpy as np

from callbacks.run_info import environment, to_jsonable

__all__ = [
    "SCHEMA", "Estimate", "Quietness", "fmt_estimate", "interleave", "make_record", "markdown_header",
    "median_ci", "plot_style", "ratio_ci", "table", "wait_for_quiet", "write_record",
]

SCHEMA = "lit_cifar.bench/v2"
_T = TypeVar("_T")


@dataclass
class Quietness:
    """The machine's 1-minute load around a measurement, and whether the result is comparable."""

    threshold: float
    waited_s: float
    load_before: float
    load_after: float | None = None

    @property
    def comparable(self) -> bool:
        loads = [self.load_before] + ([] if self.load_after is None else [self.load_after])
        return all(load <= self.threshold for load in loads)

    def finish(self) -> "Quietness":
        """Record the load after the measurement; returns self."""
        self.load_after = os.getloadavg()[0]
        return self


def wait_for_quiet(threshold: float | None = None, max_wait_s: float = 300.0, poll_s: float = 5.0) -> Quietness:
    """Wait until the 1-minute load is at most ``threshold`` (default: a quarter of the cores), up to ``max_wait_s``."""
    threshold = (os.cpu_count() or 1) / 4 if threshold is None else threshold
    start = time.monotonic()
    while os.getloadavg()[0] > threshold and time.monotonic() - start < max_wait_s:
        time.sleep(poll_s)
    return Quietness(threshold, time.monotonic() - start, os.getloadavg()[0])


def interleave(names: Sequence[str], rounds: int, run: Callable[[str, int], _T]) -> dict[str, list[_T]]:
    """``run(name, round)`` for every name in every round; the order alternates so drift hits all alike."""
    results: dict[str, list[_T]] = {name: [] for name in names}
    for round_index in range(rounds):
        order = names if round_index % 2 == 0 else list(reversed(names))
        for name in order:
            results[name].append(run(name, round_index))
    return results


@dataclass(frozen=True)
class Estimate:
    """A point estimate with its bootstrap 95 % confidence interval."""

    value: float
    low: float
    high: float
    n: int


def _bootstrap(statistic: Callable[..., float], samples: Sequence[np.ndarray], resamples: int,
               seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    draws = np.empty(resamples)
    for i in range(resamples):
        draws[i] = statistic(*(s[rng.integers(0, len(s), len(s))] for s in samples))
    return draws


def median_ci(samples: Sequence[float], resamples: int = 2000, seed: int = 0) -> Estimate:
    """Median of ``samples`` with a percentile-bootstrap 95 % interval."""
    values = np.asarray(samples, dtype=float)
    if values.size == 0:
        raise ValueError("median_ci needs at least one sample, got none")
    draws = _bootstrap(np.median, [values], resamples, seed)
    low, high = np.percentile(draws, [2.5, 97.5])
    return Estimate(float(np.median(values)), float(low), float(high), int(values.size))


def ratio_ci(numerator: Sequence[float], denominator: Sequence[float], resamples: int = 2000,
             seed: int = 0) -> Estimate:
    """``median(numerator) / median(denominator)`` with a percentile-bootstrap 95 % interval."""
    a, b = np.asarray(numerator, dtype=float), np.asarray(denominator, dtype=float)
    if a.size == 0 or b.size == 0:
        raise ValueError(f"ratio_ci needs samples on both sides, got {a.size} and {b.size}")
    draws = _bootstrap(lambda x, y: np.median(x) / np.median(y), [a, b], resamples, seed)
    low, high = np.percentile(draws, [2.5, 97.5])
    return Estimate(float(np.median(a) / np.median(b)), float(low), float(high), int(min(a.size, b.size)))


def fmt_estimate(estimate: Estimate | dict[str, Any], scale: float = 1.0, digits: int = 3, unit: str = "") -> str:
    """``1.025 [0.998, 1.051]`` (value and 95 % interval), scaled and with an optional unit."""
    e = estimate if isinstance(estimate, dict) else asdict(estimate)
    value, low, high = (e[k] * scale for k in ("value", "low", "high"))
    return f"{value:.{digits}f} [{low:.{digits}f}, {high:.{digits}f}]{unit}"


def make_record(benchmark: str, config: dict[str, Any], quiet: Quietness, **sections: Any) -> dict[str, Any]:
    """The one JSON schema: what ran, on what, how quiet it was, then the benchmark's own sections."""
    return {
        "schema": SCHEMA,
        "benchmark": benchmark,
        "command": "python -m benchmarks." + benchmark + " " + shlex.join(sys.argv[1:]),
        "config": config,
        "environment": environment(),
        "quietness": {**asdict(quiet), "comparable": quiet.comparable},
        **sections,
    }


def markdown_header(record: dict[str, Any], title: str) -> list[str]:
    """Title, the not-comparable warning if any, the command and the machine, the same in every report."""
    env, quiet = record["environment"], record["quietness"]
    lines = [f"# {title}", ""]
    if not quiet["comparable"]:
        lines += [f"**NOT COMPARABLE: the machine was busy (1-min load {quiet['load_before']:.2f} before, "
                  f"{quiet['load_after']:.2f} after; threshold {quiet['threshold']:.2f}). Do not quote these "
                  "numbers as ratios; re-run on a quiet machine.**", ""]
    gpus = ", ".join(env["gpus"]) or "none"
    lines += [f"Command: `{record['command'].strip()}`", "",
              f"Machine: {env['cpu']} ({env['cpu_count']} cores), GPUs: {gpus}; torch {env['versions']['torch']}, "
              f"lightning {env['versions']['lightning']}; 1-min load {quiet['load_before']:.2f} before, "
              f"{quiet['load_after']:.2f} after (waited {quiet['waited_s']:.0f} s for a quiet machine).",
              "Intervals are bootstrap 95 % confidence intervals of the median (or of the ratio of medians).", ""]
    return lines


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    """A Markdown table."""
    return ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers),
            *("| " + " | ".join(str(cell) for cell in row) + " |" for row in rows)]


def write_record(out_dir: Path, record: dict[str, Any], markdown: Sequence[str]) -> None:
    """``results.json`` (strict JSON, NaN as null) and ``results.md`` in ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(json.dumps(to_jsonable(record), indent=1, allow_nan=False) + "\n")
    (out_dir / "results.md").write_text("\n".join(markdown) + "\n")


class plot_style:
    """One plot style for every benchmark figure (use as ``with plot_style(): ...``)."""

    _RC = {"figure.dpi": 110, "axes.grid": True, "grid.alpha": 0.3, "axes.spines.top": False,
           "axes.spines.right": False, "legend.frameon": False, "font.size": 9}

    def __enter__(self) -> Any:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        self._context = plt.rc_context(self._RC)
        self._context.__enter__()
        return plt

    def __exit__(self, *exc: Any) -> None:
        self._context.__exit__(*exc)

