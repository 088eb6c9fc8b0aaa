"""The layer every benchmark shares: options, rounds, verdicts, headline, record, report, plots.

    args = parse(parser("demo", __doc__), argv)                # --out, --quick, --max-wait-s
    quiet = wait_for_quiet(max_wait_s=args.max_wait_s)          # record load, wait for a quiet machine
    samples = interleave(["a", "b"], rounds=5, run=measure)     # a b / b a / a b ...: drift hits both
    record = make_record("demo", config, quiet.finish(), argv, samples=samples)
    record["headline"] = [headline_row("a / b", ratio_ci(samples["a"], samples["b"]), "x", target=1.2)]
    write_record(args.out, record, report(record, "Demo", body))  # results.json + results.md, report on stdout

Intervals, quietness, peak memory and barrier-aligned times come from the Lightning-free
measurement modules the callbacks use too (:mod:`measure.stats`, ``run_info``, ``memory``,
``timing``). Records keep times in **seconds**, memory in **bytes**, estimates as ``{"value", "low",
"high", "n"}``, verdicts as values and each run's intra-op threads. Each benchmark derives analysis,
``headline(record)`` and report in ONE module, its own ``benchmarks/<name>.py``. ``--quick``
never writes into ``benchmarks/results/``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import shlex
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from importlib.util import find_spec
from pathlib import Path
from typing import Any, Literal, TypeVar

import torch

from measure.memory import measure_peak
from measure.run_info import Quietness, environment, to_jsonable, wait_for_quiet
from measure.stats import (
    INTERVALS,
    Estimate,
    difference_ci,
    in_runs,
    median_ci,
    pair_ratio_ci,
    paired_ratio_ci,
    ratio_ci,
    share_ci,
)
from measure.timing import aligned_seconds, slowest_rank

__all__ = [
    "Estimate",
    "Quietness",
    "SCHEMA",
    "aligned_seconds",
    "difference_ci",
    "finish_run",
    "fmt_bytes",
    "fmt_value",
    "headline_row",
    "headline_table",
    "in_runs",
    "interleave",
    "machine",
    "make_record",
    "measure_peak",
    "median_ci",
    "pair_ratio_ci",
    "paired_ratio_ci",
    "parse",
    "parse_step_rounds",
    "parser",
    "plot_estimates",
    "ratio_ci",
    "report",
    "share_ci",
    "slowest_rank",
    "table",
    "timed_rounds",
    "verdict",
    "wait_for_quiet",
    "write_record",
]

SCHEMA = "lit_cifar.bench/v3"
RESULTS = Path(__file__).resolve().parent / "results"
Verdict = Literal["met", "missed", "undecided"]
_T = TypeVar("_T")


def parser(name: str, doc: str | None) -> argparse.ArgumentParser:
    """The options every benchmark has (``--out``, ``--quick``, ``--max-wait-s``); see :func:`parse`."""
    p = argparse.ArgumentParser(prog=f"python -m benchmarks.{name}", description=(doc or "").split("\n\n")[0])
    p.add_argument("--out", type=Path, help=f"default: benchmarks/results/{name}; with --quick a temporary folder")
    p.add_argument("--quick", action="store_true", help="smoke run: tiny settings, no wait for a quiet machine")
    p.add_argument("--max-wait-s", type=float, help="wait this long for a quiet machine (default 300; --quick 0)")
    p.set_defaults(benchmark=name)
    return p


def parse(p: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """Parse ``argv`` and apply the quiet policy of the module docstring."""
    args = p.parse_args(argv)
    name = p.get_default("benchmark")
    if args.out is None:
        args.out = (
            Path(tempfile.gettempdir(), f"lit_cifar_{name}_quick") if args.quick else Path("benchmarks/results", name)
        )
    if args.quick and args.out.resolve().is_relative_to(RESULTS):
        p.error(
            f"--quick never writes into the committed results, but --out {args.out} is under {RESULTS}: "
            f"pass a folder elsewhere, e.g. --out /tmp/{name}"
        )
    if args.max_wait_s is None:
        args.max_wait_s = 0.0 if args.quick else 300.0
    return args


def parse_step_rounds(
    name: str, doc: str | None, argv: Sequence[str] | None, rounds: int, steps: int, quick: tuple[int, int]
) -> tuple[argparse.Namespace, int, int, Quietness]:
    """A benchmark of whole training steps on 1-thread ranks: its options (``--rounds``, ``--steps`` with these
    defaults), the rounds and steps to run (``quick`` with ``--quick``), 1 intra-op thread here, and the
    quietness record once the machine is quiet."""
    p = parser(name, doc)
    p.add_argument("--rounds", type=int, default=rounds)
    p.add_argument("--steps", type=int, default=steps)
    args = parse(p, argv)
    rounds, steps = quick if args.quick else (args.rounds, args.steps)
    torch.set_num_threads(1)
    return args, rounds, steps, wait_for_quiet(max_wait_s=args.max_wait_s)


def interleave(names: Sequence[str], rounds: int, run: Callable[[str, int], _T]) -> dict[str, list[_T]]:
    """``run(name, round)`` for every name in every round; the order alternates so drift hits all alike."""
    results: dict[str, list[_T]] = {name: [] for name in names}
    for i in range(rounds):
        for name in names if i % 2 == 0 else list(reversed(names)):
            results[name].append(run(name, i))
    return results


def timed_rounds(
    methods: dict[str, Callable[[], Any]],
    cfg: dict[str, int],
    device: Any = None,
    prepare: Callable[[str], Any] | None = None,
) -> dict[str, list[float]]:
    """Per-call seconds of every method on this rank: ``cfg["warmup"]`` untimed calls of each, then
    ``cfg["rounds"]`` interleaved rounds of ``cfg["iters"]`` barrier-aligned calls (``prepare(name)``
    before each, untimed). Every rank runs the same order: sample i is the same call on every rank.
    Kept flat, round after round: ``in_runs(samples, cfg["iters"])`` gives the rounds back for the intervals."""

    def once(name: str) -> float:
        (prepare or (lambda _: None))(name)
        return aligned_seconds(methods[name], device)

    for name in [n for _ in range(cfg["warmup"]) for n in methods]:  # warm-up, untimed
        once(name)
    rounds = interleave(list(methods), cfg["rounds"], lambda name, _: [once(name) for _ in range(cfg["iters"])])
    return {name: [s for block in blocks for s in block] for name, blocks in rounds.items()}


def verdict(estimate: Estimate | dict[str, float] | float, target: float, at_most: bool = True) -> Verdict:
    """``met`` / ``missed`` only when the whole 95 % CI (a plain number: itself) is on one side of ``target``."""
    e = asdict(estimate) if isinstance(estimate, Estimate) else estimate
    low, high = (e["low"], e["high"]) if isinstance(e, dict) else (e, e)
    met, missed = (high <= target, low > target) if at_most else (low >= target, high < target)
    return "met" if met else "missed" if missed else "undecided"


def fmt_bytes(n: float) -> str:
    """``1.5 MiB``: the one byte formatter of every report."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f} B"


_SHOWN = {"s": (1e3, " ms"), "%": (100.0, " %"), "x": (1.0, "")}  # record unit -> (scale, shown unit)


def _shown(v: float, unit: str, scale: float) -> str:
    if unit == "B":
        return fmt_bytes(v)
    if isinstance(v, int) and scale == 1:  # a count stays a count
        return str(v)
    v = scale * v
    # Trailing zeros kept ("1.00", not "1"): a ratio of 1.004 must not read as exactly 1 next to a verdict.
    return "0" if v == 0 else f"{v:.0f}" if abs(v) >= 1000 else f"{v:#.3g}".rstrip(".")


def fmt_value(value: Any, unit: str = "") -> str:
    """A headline value in its unit (seconds shown as ms, bytes as KiB/MiB/GiB), 3 significant digits."""
    if value is None or isinstance(value, str):
        return value or "–"
    if isinstance(value, list):  # one value per setting, e.g. per accumulation setting
        return " / ".join(fmt_value(v, unit) for v in value)
    e = value if isinstance(value, dict) else {"value": value}
    scale, suffix = _SHOWN.get(unit, (1.0, "" if unit in ("", "B") else f" {unit}"))
    show = lambda v: _shown(v, unit, scale)  # noqa: E731
    return show(e["value"]) + (f" [{show(e['low'])}, {show(e['high'])}]" if "low" in e else "") + suffix


def headline_row(
    what: str, value: Any, unit: str = "", target: float | None = None, at_most: bool = True
) -> dict[str, Any]:
    """One headline row: what against what, its value (an estimate, a number or a text) in the record
    unit, and, with a ``target``, the verdict as a value."""
    row = {"what": what, "value": value, "unit": unit}
    if target is not None and value is not None:
        row |= {"target": f"{'<=' if at_most else '>='} {target:g}", "verdict": verdict(value, target, at_most)}
    return row


def headline_table(rows: Sequence[dict[str, Any]]) -> list[str]:
    """The headline rows as a Markdown table: what, value [95 % CI], verdict against the target."""
    shown = {"met": "met", "missed": "**missed**", "undecided": "undecided (the CI spans it)"}
    return table(
        ["what", "value [95 % CI]", "verdict"],
        [
            [
                r["what"],
                fmt_value(r["value"], r.get("unit", "")),
                f"{shown[r['verdict']]}, target {r['target']}" if r.get("verdict") else "–",
            ]
            for r in rows
        ],
    )


def make_record(
    benchmark: str, config: dict[str, Any], quiet: Quietness, argv: Sequence[str] | None = None, **sections: Any
) -> dict[str, Any]:
    """The one JSON schema: what ran (``argv``, default the command line), on what, how quiet, then ``sections``."""
    args = sys.argv[1:] if argv is None else list(argv)
    return {
        "schema": SCHEMA,
        "benchmark": benchmark,
        "command": ("python -m benchmarks." + benchmark + " " + shlex.join(map(str, args))).strip(),
        "config": config,
        "environment": environment(),
        "quietness": quiet.as_dict(),
        **sections,
    }


def finish_run(
    benchmark: str,
    config: dict[str, Any],
    quiet: Quietness,
    argv: Sequence[str] | None,
    write: Callable[[dict[str, Any], Path], None],
    out: Path,
    started: float | None = None,
    **sections: Any,
) -> dict[str, Any]:
    """The end of a benchmark's ``main()``: its record (``wall_s`` since ``started``, a ``time.monotonic()``),
    written into ``out`` by the benchmark's ``write``; returns the record."""
    if started is not None:
        sections["wall_s"] = time.monotonic() - started
    record = make_record(benchmark, config, quiet.finish(), argv=argv, **sections)
    write(record, Path(out))
    return record


def machine(env: dict[str, Any]) -> str:
    """A record's CPU as reports name it: model, vendor/family/model/stepping where kept, core count."""
    cpu_id = f" [{env['cpu_id']}]" if env.get("cpu_id") else ""  # absent from records made before it was kept
    return f"{env['cpu']}{cpu_id} ({env['cpu_count']} cores)"


def report(record: dict[str, Any], title: str, body: Sequence[str]) -> list[str]:
    """A benchmark's ``results.md``: title, the not-comparable warning if any, command, machine, the
    headline table, ``body``, then the method: the benchmark module's docstring, the one place it is told."""
    env, quiet = record["environment"], record["quietness"]
    share, limit = (fmt_value(quiet[k], "%") for k in ("foreign_share", "max_foreign_share"))
    warning = [
        f"**NOT COMPARABLE: the machine was busy (1-min load {quiet['load_before']:.2f} before the run, "
        f"threshold {quiet['threshold']:.2f}; other processes used {share} of the machine during it, limit "
        f"{limit}). Do not quote these numbers as ratios; re-run on a quiet machine.**",
        "",
    ]
    module = f"benchmarks.{record['benchmark']}"
    method = (importlib.import_module(module).__doc__ or "").split("\n", 1)[1:] if find_spec(module) else []
    return [
        f"# {title}",
        "",
        *(warning if not quiet["comparable"] else []),
        f"Command: `{record['command']}`",
        "",
        f"Machine: {machine(env)}, GPUs: {', '.join(env['gpus']) or 'none'}; torch "
        f"{env['versions']['torch']}, lightning {env['versions']['lightning']}; 1-min load "
        f"{quiet['load_before']:.2f} before (waited {quiet['waited_s']:.0f} s for a quiet machine); other "
        f"processes used {share} of the machine during the run. Intervals: bootstrap 95 % CIs of the median or of "
        "the ratio of medians, drawing whole runs (rounds), then the samples inside them.",
        "",
        "## Headline",
        "",
        *headline_table(record.get("headline", [])),
        "",
        *body,
        "",
        "## Method",
        *method,
    ]


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    """A Markdown table."""
    return [
        "| " + " | ".join(headers) + " |",
        "|" + "---|" * len(headers),
        *("| " + " | ".join(str(cell) for cell in row) + " |" for row in rows),
    ]


def write_record(out_dir: Path, record: dict[str, Any], markdown: Sequence[str]) -> None:
    """``results.json`` (strict JSON, NaN as null) and ``results.md`` in ``out_dir``; the report also on stdout.
    The record says how its intervals were drawn (``intervals``: today's method, the one that wrote it)."""
    record["intervals"] = INTERVALS
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(json.dumps(to_jsonable(record), indent=1, allow_nan=False) + "\n")
    (out_dir / "results.md").write_text("\n".join(markdown) + "\n")
    print("\n".join(markdown) + f"\n\nwrote {out_dir / 'results.json'} and results.md", flush=True)


def plot_estimates(path: Path, panels: Sequence[dict[str, Any]], title: str, comparable: bool = True) -> None:
    """The one figure maker: a panel per entry, estimates with their 95 % CI as error bars (the one
    error-bar rule), per group (x) and series, in one style.

    A panel is ``{"title", "ylabel", "groups": [x labels], "series": {label: [estimate, number or None per group]}}``
    with optional ``"scale"`` (e.g. 1e3: s -> ms), ``"log"`` (log y axis) and ``"lines"`` ({label: y}).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with plt.rc_context(
        {
            "figure.dpi": 110,
            "axes.grid": True,
            "grid.alpha": 0.3,
            "axes.spines.top": False,
            "axes.spines.right": False,
            "legend.frameon": False,
            "font.size": 9,
        }
    ):
        fig, axes = plt.subplots(len(panels), 1, figsize=(10, 3.8 * len(panels)), squeeze=False, layout="constrained")
        for ax, panel in zip(axes[:, 0], panels, strict=True):
            series = {k: v for k, v in panel["series"].items() if any(e is not None for e in v)}
            scale = panel.get("scale", 1.0)
            for i, (label, estimates) in enumerate(series.items()):
                offset = 0.6 * (i / (len(series) - 1) - 0.5) if len(series) > 1 else 0.0
                xs, es = zip(
                    *[
                        (j + offset, e if isinstance(e, dict) else {"value": e, "low": e, "high": e})
                        for j, e in enumerate(estimates)
                        if e is not None
                    ],
                    strict=True,
                )  # a number: no interval
                ax.errorbar(
                    xs,
                    [scale * e["value"] for e in es],
                    marker="o",
                    linestyle="none",
                    capsize=3,
                    label=label,
                    yerr=[
                        [scale * (e["value"] - e["low"]) for e in es],
                        [scale * (e["high"] - e["value"]) for e in es],
                    ],
                )
            for label, y in panel.get("lines", {}).items():
                ax.axhline(y, color="grey", linestyle="--", linewidth=1, label=label)
            tilt = len(panel["groups"]) > 6
            ax.set_xticks(
                range(len(panel["groups"])),
                panel["groups"],
                rotation=30 if tilt else 0,
                ha="right" if tilt else "center",
            )
            ax.set(title=panel["title"], ylabel=panel["ylabel"], yscale="log" if panel.get("log") else "linear")
            ax.legend(fontsize=7, ncol=3)
        fig.suptitle(
            title if comparable else f"NOT COMPARABLE (busy machine): {title}", color=None if comparable else "tab:red"
        )
        fig.savefig(path)
        plt.close(fig)
