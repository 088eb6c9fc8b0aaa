"""The layer every benchmark shares: options, rounds, estimates, the record, its report and plots.

    args = parse(parser("demo", __doc__), argv, FULL, QUICK)  # --out, --quick, --max-wait-s; args.cfg
    run_benchmark("demo", args.cfg, argv, write, measure, args.out, args.max_wait_s)  # quiet machine, record

    def measure():                                            # the record's raw sections
        return {"samples_s": interleave(["a", "b"], rounds=5, run=time_one)}  # a b / b a / a b ...

    def write(record, out):                                   # from the record alone: rederive calls it too
        record["headline"] = [headline_row("a / b", ratios(record["samples_s"], [("a", "b")])["a/b"], "x", 1.2)]
        publish(out, record, "Demo", body, {"demo.png": ("Demo", panels)})  # results.json/.md, plots

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
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from importlib.util import find_spec
from pathlib import Path
from typing import Any, Literal, TypeVar

import numpy as np
import torch

from measure.run_info import Quietness, environment, to_jsonable, wait_for_quiet
from measure.stats import INTERVALS, Estimate, in_runs, median_ci, ratio_ci
from measure.timing import aligned_seconds, slowest_rank

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


def parse(
    p: argparse.ArgumentParser, argv: Sequence[str] | None, full: dict | None = None, quick: dict | None = None
) -> argparse.Namespace:
    """Parse ``argv``, apply the quiet policy of the module docstring, refuse ``--device cuda`` without a GPU.
    With ``full`` settings, ``args.cfg`` is ``quick`` (``--quick``) or ``full``, and every option of the same
    name that was given on top."""
    args = p.parse_args(argv)
    name = p.get_default("benchmark")
    quick_out = Path(tempfile.gettempdir(), f"lit_cifar_{name}_quick")
    args.out = args.out or (quick_out if args.quick else Path("benchmarks/results", name))
    if args.quick and args.out.resolve().is_relative_to(RESULTS):
        p.error(
            f"--quick never writes into the committed results, but --out {args.out} is under {RESULTS}: "
            f"pass a folder elsewhere, e.g. --out /tmp/{name}"
        )
    if args.max_wait_s is None:
        args.max_wait_s = 0.0 if args.quick else 300.0
    if getattr(args, "device", "cpu") == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda needs a CUDA GPU; none is visible (torch.cuda.is_available(); use --device cpu)")
    if full is not None:
        given = {k: v for k, v in vars(args).items() if k in full and v is not None}
        args.cfg = (quick if args.quick else full) | given
    return args


def parse_step_rounds(
    name: str, doc: str | None, argv: Sequence[str] | None, rounds: int, steps: int, quick: tuple[int, int]
) -> tuple[argparse.Namespace, int, int]:
    """A benchmark of whole training steps on 1-thread ranks: its options (``--rounds``, ``--steps`` with these
    defaults), the rounds and steps to run (``quick`` with ``--quick``), and 1 intra-op thread here."""
    p = parser(name, doc)
    p.add_argument("--rounds", type=int, default=rounds)
    p.add_argument("--steps", type=int, default=steps)
    args = parse(p, argv)
    torch.set_num_threads(1)
    return args, *(quick if args.quick else (args.rounds, args.steps))


def settings(values: dict[str, tuple[Any, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The ``(full, quick)`` settings of a benchmark from ``{name: (full value, --quick value)}``."""
    return {k: full for k, (full, _) in values.items()}, {k: quick for k, (_, quick) in values.items()}


def run_benchmark(
    benchmark: str,
    config: dict[str, Any],
    argv: Sequence[str] | None,
    write: Callable[[dict[str, Any], Path], None],
    measure: Callable[[], dict[str, Any]],
    out: Path | str,
    max_wait_s: float,
    timed: bool = True,
) -> dict[str, Any]:
    """A benchmark's run: wait up to ``max_wait_s`` for a quiet machine, ``measure()`` the record's sections
    (with ``timed``, ``wall_s`` too), make the record of ``config`` (which ``measure`` may complete) and
    ``write(record, out)``; returns the record."""
    quiet = wait_for_quiet(max_wait_s=max_wait_s)
    started = time.monotonic()
    sections = measure()
    if timed:
        sections["wall_s"] = time.monotonic() - started
    record = make_record(benchmark, config, quiet.finish(), argv, **sections)
    write(record, Path(out))
    return record


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


def slowest_ranks(per_rank: Sequence[dict[str, Any]], names: Iterable[str] | None = None) -> dict[str, list[float]]:
    """Per series (``names``, default all): the slowest rank's time of each barrier-aligned iteration."""
    return {name: slowest_rank([rank[name] for rank in per_rank]) for name in names or per_rank[0]}


def medians(samples: dict[str, Any]) -> dict[str, dict[str, float]]:
    """The median of every series of ``samples`` with its 95 % CI, as record estimates."""
    return {name: asdict(median_ci(values)) for name, values in samples.items()}


def ratios(samples: dict[str, Any], pairs: Iterable[tuple[str, str]], ci: Callable = ratio_ci) -> dict[str, dict]:
    """``{"a/b": ci(samples[a], samples[b])}`` (record estimates) for every pair whose two series are kept."""
    return {f"{a}/{b}": asdict(ci(samples[a], samples[b])) for a, b in pairs if a in samples and b in samples}


def round_estimates(samples: dict[str, list[float]], run_length: int, pairs: Iterable[tuple[str, str]]) -> dict:
    """:func:`medians` (``median_s``) and :func:`ratios` (``ratios``) of per-call samples kept flat in rounds of
    ``run_length`` calls (:func:`timed_rounds`), each round resampled whole."""
    runs = {name: in_runs(values, run_length) for name, values in samples.items()}
    return {"median_s": medians(runs), "ratios": ratios(runs, pairs)}


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
    verdicts = [f"{shown[r['verdict']]}, target {r['target']}" if r.get("verdict") else "–" for r in rows]
    cells = [[r["what"], fmt_value(r["value"], r.get("unit", "")), v] for r, v in zip(rows, verdicts, strict=True)]
    return table("what | value [95 % CI] | verdict", cells)


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


def table(headers: str | Sequence[str], rows: Iterable[Sequence[Any]]) -> list[str]:
    """A Markdown table; ``headers`` a list or one string, ``"a | b"``."""
    headers = headers.split(" | ") if isinstance(headers, str) else headers
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    return lines + ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]


def write_record(out_dir: Path, record: dict[str, Any], markdown: Sequence[str]) -> None:
    """``results.json`` (strict JSON, NaN as null) and ``results.md`` in ``out_dir``; the report also on stdout.
    The record says how its intervals were drawn (``intervals``: today's method, the one that wrote it)."""
    record["intervals"] = INTERVALS
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(json.dumps(to_jsonable(record), indent=1, allow_nan=False) + "\n")
    (out_dir / "results.md").write_text("\n".join(markdown) + "\n")
    print("\n".join(markdown) + f"\n\nwrote {out_dir / 'results.json'} and results.md", flush=True)


def publish(
    out: Path, record: dict[str, Any], title: str, body: Sequence[str], figures: dict[str, tuple] | None = None
) -> None:
    """``record`` and its :func:`report` written into ``out`` (:func:`write_record`), then every figure of
    ``figures`` (``{file name: (title, panels)}``, :func:`plot_estimates`), flagged when the machine was busy."""
    write_record(out, record, report(record, title, body))
    for name, (figure_title, panels) in (figures or {}).items():
        plot_estimates(out / name, panels, figure_title, record["quietness"]["comparable"])


@dataclass
class Panel:
    """One panel of :func:`plot_estimates`: per x group, per series, an estimate (a number: no interval; None:
    no point); ``scale`` (e.g. 1e3: s -> ms), a ``log`` y axis, horizontal ``lines`` (``{label: y}``)."""

    title: str
    ylabel: str
    groups: Sequence[str]
    series: dict[str, Sequence[Any]]
    scale: float = 1.0
    log: bool = False
    lines: dict[str, float] = field(default_factory=dict)


_STYLE = {
    "figure.dpi": 110,
    "axes.grid": True,
    "grid.alpha": 0.3,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "legend.frameon": False,
    "font.size": 9,
}


def plot_estimates(path: Path, panels: Sequence[Panel], title: str, comparable: bool = True) -> None:
    """The one figure maker: a :class:`Panel` per row, estimates with their 95 % CI as error bars (the one
    error-bar rule), per group (x) and series, in one style."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with plt.rc_context(_STYLE):
        fig, axes = plt.subplots(len(panels), 1, figsize=(10, 3.8 * len(panels)), squeeze=False, layout="constrained")
        for ax, panel in zip(axes[:, 0], panels, strict=True):
            _draw(ax, panel)
        shown = title if comparable else f"NOT COMPARABLE (busy machine): {title}"
        fig.suptitle(shown, color=None if comparable else "tab:red")
        fig.savefig(path)
        plt.close(fig)


def _draw(ax: Any, panel: Panel) -> None:
    series = {k: v for k, v in panel.series.items() if any(e is not None for e in v)}
    for i, (label, estimates) in enumerate(series.items()):
        offset = 0.6 * (i / (len(series) - 1) - 0.5) if len(series) > 1 else 0.0
        shown = [(j + offset, e) for j, e in enumerate(estimates) if e is not None]
        # an estimate's value and CI bounds, a plain number without an interval
        value, low, high = (
            panel.scale * np.array([e[k] if isinstance(e, dict) else e for _, e in shown], dtype=float)
            for k in ("value", "low", "high")
        )
        xs = [x for x, _ in shown]
        ax.errorbar(xs, value, yerr=[value - low, high - value], marker="o", linestyle="none", capsize=3, label=label)
    for label, y in panel.lines.items():
        ax.axhline(y, color="grey", linestyle="--", linewidth=1, label=label)
    tilt = len(panel.groups) > 6
    ax.set_xticks(range(len(panel.groups)), panel.groups, rotation=30 if tilt else 0, ha="right" if tilt else "center")
    ax.set(title=panel.title, ylabel=panel.ylabel, yscale="log" if panel.log else "linear")
    ax.legend(fontsize=7, ncol=3)
