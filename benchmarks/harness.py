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

import ctypes
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
    "Estimate", "Quietness", "SCHEMA", "aligned_seconds", "difference_ci", "fmt_estimate", "interleave",
    "make_record", "markdown_header", "median_ci", "plot_style", "ratio_ci", "save_figure", "slowest_rank",
    "table", "verdict", "wait_for_quiet", "write_record",
]

SCHEMA = "lit_cifar.bench/v2"
_PR_SET_CHILD_SUBREAPER = 36  # prctl option (linux/prctl.h)
_T = TypeVar("_T")


def _busy_cpu_seconds() -> float | None:
    """CPU seconds the whole machine spent busy since boot (``/proc/stat``), or ``None`` off Linux."""
    try:
        with open("/proc/stat") as stat:
            fields = [int(v) for v in stat.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _own_cpu_seconds() -> float:
    """CPU seconds of this process and of its finished (waited-for) children."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def _adopt_orphans() -> None:
    """Become the subreaper of our process tree (Linux): a grandchild whose parent exits first (a
    popen-launched rank 1 outliving rank 0) is re-parented to us, so its CPU time can be counted."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _reap_orphans() -> None:
    """Wait for adopted processes that have exited: their CPU time joins ``os.times().children_*``."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


@dataclass
class Quietness:
    """How busy the machine was around a measurement, and whether the result is comparable.

    The 1-minute load before the run must be at most ``threshold``; during the run, other
    processes (busy CPU time of the machine minus this process tree's own) may use at most
    ``max_foreign_share`` of the machine. The load after the run is recorded but not judged:
    the benchmark's own processes raise it.
    """

    threshold: float
    waited_s: float
    load_before: float
    max_foreign_share: float = 0.10
    load_after: float | None = None
    foreign_share: float | None = None
    _start: tuple[float, float | None, float] | None = None

    @property
    def comparable(self) -> bool:
        foreign_ok = self.foreign_share is None or self.foreign_share <= self.max_foreign_share
        return self.load_before <= self.threshold and foreign_ok

    def begin(self) -> "Quietness":
        """Start accounting the CPU time of other processes; returns self."""
        _adopt_orphans()
        self._start = (time.monotonic(), _busy_cpu_seconds(), _own_cpu_seconds())
        return self

    def finish(self) -> "Quietness":
        """Record the load after the run and the share of the machine other processes used."""
        self.load_after = os.getloadavg()[0]
        _reap_orphans()
        if self._start is not None and self._start[1] is not None:
            wall, busy, own = time.monotonic() - self._start[0], _busy_cpu_seconds(), _own_cpu_seconds()
            foreign = (busy or 0.0) - self._start[1] - (own - self._start[2])
            self.foreign_share = max(0.0, foreign) / (wall * (os.cpu_count() or 1))
        return self

    def as_dict(self) -> dict[str, Any]:
        return {"threshold": self.threshold, "waited_s": self.waited_s, "load_before": self.load_before,
                "load_after": self.load_after, "foreign_share": self.foreign_share,
                "max_foreign_share": self.max_foreign_share, "comparable": self.comparable}


def wait_for_quiet(threshold: float | None = None, max_wait_s: float = 300.0, poll_s: float = 5.0) -> Quietness:
    """Wait until the 1-minute load is at most ``threshold`` (default: a quarter of the cores), up to
    ``max_wait_s``; then start accounting other processes' CPU time (see :class:`Quietness`)."""
    threshold = (os.cpu_count() or 1) / 4 if threshold is None else threshold
    start = time.monotonic()
    while os.getloadavg()[0] > threshold and time.monotonic() - start < max_wait_s:
        time.sleep(poll_s)
    return Quietness(threshold, time.monotonic() - start, os.getloadavg()[0]).begin()


def interleave(names: Sequence[str], rounds: int, run: Callable[[str, int], _T]) -> dict[str, list[_T]]:
    """``run(name, round)`` for every name in every round; the order alternates so drift hits all alike."""
    results: dict[str, list[_T]] = {name: [] for name in names}
    for round_index in range(rounds):
        order = names if round_index % 2 == 0 else list(reversed(names))
        for name in order:
            results[name].append(run(name, round_index))
    return results


def aligned_seconds(fn: Callable[[], Any], device: Any = None) -> float:
    """Seconds of one call of ``fn`` on this rank, started right after a barrier so all ranks start
    together (CUDA: events around the call, after a synchronize)."""
    import torch
    import torch.distributed as dist

    if device is not None and torch.device(device).type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(device)
        dist.barrier()
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    dist.barrier()
    start_s = time.perf_counter()
    fn()
    return time.perf_counter() - start_s


def slowest_rank(per_rank: Sequence[Sequence[float]]) -> list[float]:
    """Per-iteration samples: the slowest rank's time of each barrier-aligned iteration (a
    data-parallel step is as slow as its slowest rank)."""
    return [max(iteration) for iteration in zip(*per_rank, strict=True)]


def save_figure(fig: Any, path: Path) -> None:
    """Lay out, write and close a figure made under :class:`plot_style`."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


@dataclass(frozen=True)
class Estimate:
    """A point estimate with its bootstrap 95 % confidence interval."""

    value: float
    low: float
    high: float
    n: int


def _bootstrap(statistic: Callable[..., Any], samples: Sequence[np.ndarray], resamples: int,
               seed: int) -> np.ndarray:
    """``statistic`` of ``resamples`` resamples (with replacement) of every sample set, all at once."""
    rng = np.random.default_rng(seed)
    draws = [s[rng.integers(0, len(s), (resamples, len(s)))] for s in samples]
    return np.asarray(statistic(*draws))


def median_ci(samples: Sequence[float], resamples: int = 2000, seed: int = 0) -> Estimate:
    """Median of ``samples`` with a percentile-bootstrap 95 % interval."""
    values = np.asarray(samples, dtype=float)
    if values.size == 0:
        raise ValueError("median_ci needs at least one sample, got none")
    draws = _bootstrap(lambda x: np.median(x, axis=-1), [values], resamples, seed)
    low, high = np.percentile(draws, [2.5, 97.5])
    return Estimate(float(np.median(values)), float(low), float(high), int(values.size))


def _two_sample_ci(name: str, statistic: Callable[[np.ndarray, np.ndarray], float], first: Sequence[float],
                   second: Sequence[float], resamples: int, seed: int) -> Estimate:
    a, b = np.asarray(first, dtype=float), np.asarray(second, dtype=float)
    if a.size == 0 or b.size == 0:
        raise ValueError(f"{name} needs samples on both sides, got {a.size} and {b.size}")
    draws = _bootstrap(statistic, [a, b], resamples, seed)
    low, high = np.percentile(draws, [2.5, 97.5])
    return Estimate(float(statistic(a, b)), float(low), float(high), int(min(a.size, b.size)))


def _median(x: np.ndarray) -> Any:  # along the last axis: one value per bootstrap resample
    return np.median(x, axis=-1)


def ratio_ci(numerator: Sequence[float], denominator: Sequence[float], resamples: int = 2000,
             seed: int = 0) -> Estimate:
    """``median(numerator) / median(denominator)`` with a percentile-bootstrap 95 % interval."""
    return _two_sample_ci("ratio_ci", lambda x, y: _median(x) / _median(y), numerator, denominator,
                          resamples, seed)


def difference_ci(minuend: Sequence[float], subtrahend: Sequence[float], resamples: int = 2000,
                  seed: int = 0) -> Estimate:
    """``median(minuend) - median(subtrahend)`` with a percentile-bootstrap 95 % interval."""
    return _two_sample_ci("difference_ci", lambda x, y: _median(x) - _median(y), minuend, subtrahend,
                          resamples, seed)


def fmt_estimate(estimate: Estimate | dict[str, Any], scale: float = 1.0, digits: int = 3, unit: str = "") -> str:
    """``1.025 [0.998, 1.051]`` (value and 95 % interval), scaled and with an optional unit."""
    e = estimate if isinstance(estimate, dict) else asdict(estimate)
    value, low, high = (e[k] * scale for k in ("value", "low", "high"))
    return f"{value:.{digits}f} [{low:.{digits}f}, {high:.{digits}f}]{unit}"


def make_record(benchmark: str, config: dict[str, Any], quiet: Quietness, argv: Sequence[str] | None = None,
                **sections: Any) -> dict[str, Any]:
    """The one JSON schema: what ran, on what, how quiet it was, then the benchmark's own sections.

    ``argv``: the benchmark's arguments when ``main(argv)`` was called from Python (default: the
    command line).
    """
    args = sys.argv[1:] if argv is None else list(argv)
    return {
        "schema": SCHEMA,
        "benchmark": benchmark,
        "command": ("python -m benchmarks." + benchmark + " " + shlex.join(args)).strip(),
        "config": config,
        "environment": environment(),
        "quietness": quiet.as_dict(),
        **sections,
    }


def markdown_header(record: dict[str, Any], title: str) -> list[str]:
    """Title, the not-comparable warning if any, the command and the machine, the same in every report."""
    env, quiet = record["environment"], record["quietness"]
    lines = [f"# {title}", ""]
    if not quiet["comparable"]:
        lines += [f"**NOT COMPARABLE: the machine was busy (1-min load {quiet['load_before']:.2f} before the run, "
                  f"threshold {quiet['threshold']:.2f}; other processes used {_pct(quiet['foreign_share'])} of the "
                  f"machine during it, limit {_pct(quiet['max_foreign_share'])}). Do not quote these numbers as "
                  "ratios; re-run on a quiet machine.**", ""]
    gpus = ", ".join(env["gpus"]) or "none"
    lines += [f"Command: `{record['command'].strip()}`", "",
              f"Machine: {env['cpu']} ({env['cpu_count']} cores), GPUs: {gpus}; torch {env['versions']['torch']}, "
              f"lightning {env['versions']['lightning']}; 1-min load {quiet['load_before']:.2f} before (waited "
              f"{quiet['waited_s']:.0f} s for a quiet machine); other processes used {_pct(quiet['foreign_share'])} "
              "of the machine during the run.",
              "Intervals are bootstrap 95 % confidence intervals of the median (or of the ratio of medians).", ""]
    return lines


def verdict(ratio: dict[str, float], target: float) -> str:
    """Met / missed only when the whole 95 % CI is on one side of the target."""
    if ratio["high"] <= target:
        return "met"
    if ratio["low"] > target:
        return f"**missed** (+{100 * (ratio['value'] / target - 1):.0f} %)"
    return "undecided (CI spans the target)"


def _pct(share: float | None) -> str:
    return "n/a" if share is None else f"{100 * share:.1f} %"


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

