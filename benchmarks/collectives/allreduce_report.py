"""The all-reduce benchmark's analysis and report (:mod:`benchmarks.collectives.allreduce` measures): estimates,
headline, tables and figures, from the record's raw slowest-rank samples alone, so a stored record can be
re-analysed and its report rewritten (``python -m benchmarks.rederive allreduce``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.harness import round_estimates
from benchmarks.report import Panel, fmt_bytes, fmt_value, headline_row, publish, table

__all__ = ["METHOD_NAMES", "PAIRS", "REL_ERR_TARGET", "TITLE", "headline", "slow_call_share", "write"]

TITLE = "All-reduce: ring vs butterfly vs dist.all_reduce, and bandwidth"
METHOD_NAMES = ("ring", "butterfly", "all_reduce")
RING_TARGET_RATIO, RING_TARGET_WORLD_SIZES, REL_ERR_TARGET = 1.5, (2, 4, 8), 1e-6
SLOW_CALL_S = 2e-3  # between the fast mode (~0.3-0.5 ms at 2 ranks) and the ~3.5 ms stall mode
RATIOS = ("ring/all_reduce", "butterfly/all_reduce")
PAIRS = [key.split("/") for key in RATIOS]


def headline(record: dict[str, Any]) -> list[dict[str, Any]]:
    """Ring (with its target) and butterfly over dist.all_reduce at the largest size, worst error, peak busbw."""
    compare, rows = record["compare"], []
    numel = max((r["numel"] for r in compare), default=0)
    for row in (r for r in compare if r["numel"] == numel and r["world_size"] in RING_TARGET_WORLD_SIZES):
        at = f"{numel:,} float32, {row['world_size']} ranks" + (" (time-shared cores)" if row["oversubscribed"] else "")
        for key, target in zip(RATIOS, (RING_TARGET_RATIO, None), strict=True):
            what = f"{key.split('/')[0]} / dist.all_reduce: time per call, {at}"
            rows.append(headline_row(what, row["ratios"][key], "x", target))
    if compare:
        worst = max(r["accuracy"][m]["rel_err"] for r in compare for m in ("ring", "butterfly"))
        what = "ring and butterfly: worst relative error vs the fp64 mean, every configuration"
        rows.append(headline_row(what, worst, "", REL_ERR_TARGET))
    ok = [r for r in record["bandwidth"] if r["status"] == "ok"]
    if ok:
        best = max(ok, key=lambda r: r["busbw_GBps"]["value"])
        at = f"{best['backend']}, {fmt_bytes(best['bytes'])}, {best['world_size']} ranks"
        rows.append(headline_row(f"dist.all_reduce peak bus bandwidth ({at})", best["busbw_GBps"], "GB/s"))
    return rows


def slow_call_share(samples_s: list[float]) -> float:
    """The share of calls slower than ``SLOW_CALL_S``: how much of a bimodal time sits in the slow mode."""
    return sum(t > SLOW_CALL_S for t in samples_s) / max(len(samples_s), 1)


def _time_table(compare: list[dict[str, Any]]) -> list[str]:
    methods = " / ".join(METHOD_NAMES)
    cells = [
        [r["world_size"], r["oversubscribed"], f"{r['numel']:,}"]
        + [fmt_value(r["median_s"][m], "s") for m in METHOD_NAMES]
        + [fmt_value(r["ratios"][key]) for key in RATIOS]
        + [" / ".join(f"{slow_call_share(r['samples_s'][m]):.0%}" for m in METHOD_NAMES)]
        for r in compare
    ]
    headers = f"ranks | time-shared | elements | {methods.replace('/', '|')} | ring / all_reduce | "
    return table(headers + f"butterfly / all_reduce | calls > {SLOW_CALL_S * 1e3:g} ms ({methods})", cells)


def _accuracy_table(compare: list[dict[str, Any]]) -> list[str]:
    cells = [
        [r["world_size"], f"{r['numel']:,}", m, f"{a['max_abs_err']:.1e}", f"{a['rel_err']:.1e}", a["identical"]]
        + [fmt_bytes(r["memory"][m][key]) for key in ("torch_alloc_bytes", "extra_peak_bytes")]
        for r in compare
        for m, a in r["accuracy"].items()
    ]
    headers = "ranks | elements | method | max abs err | rel err | same bits all ranks | torch alloc/call | "
    return table(headers + "extra peak memory", cells)


def _bandwidth_table(bandwidth: list[dict[str, Any]]) -> list[str]:
    measured = {"median_s": "s", "algbw_GBps": "", "busbw_GBps": ""}  # key: unit
    cells = [
        [fmt_bytes(r["bytes"]), r["world_size"], r["oversubscribed"], r["backend"]]
        + [fmt_value(r[key], unit) if r["status"] == "ok" else "-" for key, unit in measured.items()]
        + [r["status"]]
        for r in bandwidth
    ]
    return table("size | ranks | time-shared | backend | latency | algbw GB/s | busbw GB/s | status", cells)


def _tables(record: dict[str, Any]) -> list[str]:
    cfg = record["config"]
    return [
        f"{cfg['rounds']} interleaved rounds x {cfg['iters']} iterations per method after {cfg['warmup']} "
        f"warm-up; wall time {record['wall_s']:.0f} s.",
        "",
        "## Time per call (float32 average)",
        "",
        *_time_table(record["compare"]),
        "",
        "## Accuracy and memory (rank 0)",
        "",
        "`extra peak memory` grows only when a call cannot reuse freed heap pages; `torch alloc/call` is the "
        "allocator-independent figure.",
        "",
        *_accuracy_table(record["compare"]),
        "",
        "## dist.all_reduce bandwidth",
        "",
        *_bandwidth_table(record["bandwidth"]),
        "",
    ]


def _compare_panels(compare: list[dict[str, Any]], cores: int) -> list[Panel]:
    """Time per call at the largest size per world size, and its ratio to dist.all_reduce."""
    numel = max(r["numel"] for r in compare)
    rows = sorted((r for r in compare if r["numel"] == numel), key=lambda r: r["world_size"])
    groups = [f"{r['world_size']}{'*' * r['oversubscribed']} rank{'s' * (r['world_size'] > 1)}" for r in rows]
    title = f"float32 average, {numel:,} elements (* time-shared: more ranks than {cores} cores)"
    times = {m: [r["median_s"][m] for r in rows] for m in METHOD_NAMES}
    ratio = {
        key.replace("/", " / "): [r["ratios"][key] if r["world_size"] > 1 else None for r in rows] for key in RATIOS
    }
    lines = {"1": 1.0, f"ring target {RING_TARGET_RATIO}x": RING_TARGET_RATIO}
    return [
        Panel(title, "median ms per call", groups, times, scale=1e3, log=True),
        Panel("time relative to dist.all_reduce", "ratio of medians", groups, ratio, lines=lines),
    ]


def _bandwidth_panels(ok: list[dict[str, Any]]) -> list[Panel]:
    """dist.all_reduce's latency and bus bandwidth per size, a series per world size."""
    sizes, world_sizes = sorted({r["bytes"] for r in ok}), sorted({r["world_size"] for r in ok})
    at = {(r["world_size"], r["bytes"]): r for r in ok}
    shown = {"latency": ("median_s", "median ms", 1e3), "bus bandwidth": ("busbw_GBps", "GB/s", 1.0)}
    return [
        Panel(f"dist.all_reduce {name}", unit, [fmt_bytes(b) for b in sizes], series, scale, log=True)
        for name, (key, unit, scale) in shown.items()
        for series in [{f"{ws} ranks": [at.get((ws, b), {}).get(key) for b in sizes] for ws in world_sizes}]
    ]


def write(record: dict[str, Any], out_dir: Path) -> None:
    """Write results.json, results.md and allreduce.png for ``record`` into ``out_dir``."""
    # compare_row's estimates again, from the kept samples, so a stored record re-derives the same way
    for row in record["compare"]:
        row.update(round_estimates(row["samples_s"], record["config"]["iters"], PAIRS))
    record["headline"] = headline(record)
    ok = [r for r in record["bandwidth"] if r["status"] == "ok"]
    panels = (_compare_panels(record["compare"], record["config"]["cores"]) if record["compare"] else []) + (
        _bandwidth_panels(ok) if ok else []
    )
    publish(out_dir, record, TITLE, _tables(record), {"allreduce.png": (TITLE, panels)})
