"""What a benchmark record looks like to a reader: values with their units, headline rows, the markdown report,
tables and figures, and :func:`publish`, which writes them beside the record.

    record["headline"] = [headline_row("a / b: step time", estimate, "x", 1.2)]       # value, unit, target
    publish(out, record, "Demo", body, {"demo.png": ("Demo", [Panel(...)])})         # results.json/.md, plots

The record itself (options, rounds, estimates, quietness) is :mod:`benchmarks.harness`'s.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.harness import verdict
from measure.run_info import to_jsonable
from measure.stats import INTERVALS

__all__ = [
    "Panel",
    "fmt_bytes",
    "fmt_value",
    "foreign_shown",
    "headline_row",
    "headline_table",
    "machine",
    "plot_estimates",
    "publish",
    "report",
    "table",
    "write_record",
]


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


def _verdict_shown(verdict: str | list[str]) -> str:
    """A verdict as a headline shows it; one per setting side by side, each in a word."""
    if isinstance(verdict, list):
        return " / ".join("**missed**" if v == "missed" else v for v in verdict)
    return {"met": "met", "missed": "**missed**", "undecided": "undecided (the CI spans it)"}[verdict]


def headline_table(rows: Sequence[dict[str, Any]]) -> list[str]:
    """The headline rows as a Markdown table: what, value [95 % CI], verdict against the target."""
    verdicts = [f"{_verdict_shown(r['verdict'])}, target {r['target']}" if r.get("verdict") else "–" for r in rows]
    cells = [[r["what"], fmt_value(r["value"], r.get("unit", "")), v] for r, v in zip(rows, verdicts, strict=True)]
    return table("what | value [95 % CI] | verdict", cells)


def machine(env: dict[str, Any]) -> str:
    """A record's machine as reports name it: the CPU's model, vendor/family/model/stepping where kept, core count;
    the GPUs, if any."""
    cpu_id = f" [{env['cpu_id']}]" if env.get("cpu_id") else ""  # absent from records made before it was kept
    gpus = f", {' + '.join(env['gpus'])}" if env.get("gpus") else ""  # a GPU record names its device too
    return f"{env['cpu']}{cpu_id} ({env['cpu_count']} cores){gpus}"


def foreign_shown(quiet: dict[str, Any]) -> str:
    """The share of the machine others used during a run, with the hypervisor's part (steal) where it was kept."""
    steal = quiet.get("steal_share")
    stolen = f" (the hypervisor's steal: {fmt_value(steal, '%')})" if steal else ""
    return fmt_value(quiet.get("foreign_share"), "%") + stolen


def report(record: dict[str, Any], title: str, body: Sequence[str]) -> list[str]:
    """A benchmark's ``results.md``: title, the not-comparable warning if any, command, machine, the
    headline table, ``body``, then the method: the benchmark module's docstring, the one place it is told."""
    env, quiet = record["environment"], record["quietness"]
    share, limit = foreign_shown(quiet), fmt_value(quiet["max_foreign_share"], "%")
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
