"""results.md and plots for ``python -m benchmarks.allreduce``, derived from its record only.

Re-render a stored run: ``python -m benchmarks.allreduce_report benchmarks/results/allreduce``.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

from benchmarks.harness import (
    fmt_estimate, markdown_header, plot_style, save_figure, table, verdict, write_record,
)

RING_TARGET_RATIO = 1.5
RING_TARGET_WORLD_SIZES = (2, 4, 8)
REL_ERR_TARGET = 1e-6
METHODS = ("ring", "butterfly", "all_reduce")


def _fmt_bytes(nbytes: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{nbytes:.0f} B"


def _shared(row: dict[str, Any]) -> str:
    return "yes" if row["oversubscribed"] else "no"


def _targets(record: dict[str, Any]) -> list[str]:
    rows = record["compare"]
    numel = max((r["numel"] for r in rows), default=0)
    body = []
    for ws in RING_TARGET_WORLD_SIZES:
        row = next((r for r in rows if r["world_size"] == ws and r["numel"] == numel), None)
        name = f"ring <= {RING_TARGET_RATIO}x all_reduce, {numel:,} el., {ws} ranks"
        if row is None:
            body.append([name, "not measured in this run", "-"])
        else:
            ratio = row["ratios"]["ring/all_reduce"]
            shared = " (time-shared cores)" if row["oversubscribed"] else ""
            body.append([name + shared, fmt_estimate(ratio, digits=2), verdict(ratio, RING_TARGET_RATIO)])
    worst = max((r["accuracy"][m]["rel_err"] for r in rows for m in ("ring", "butterfly")), default=float("nan"))
    body.append([f"rel. error <= {REL_ERR_TARGET:g} (ring, butterfly, every config)", f"max {worst:.2e}",
                 "met" if worst <= REL_ERR_TARGET else f"**missed** ({worst / REL_ERR_TARGET:.1f}x the limit)"])
    return table(["target", "measured [95 % CI]", "verdict"], body)


def _compare_table(record: dict[str, Any]) -> list[str]:
    body = [[r["world_size"], _shared(r), f"{r['numel']:,}",
             *(fmt_estimate(r["median_s"][m], scale=1e3) for m in METHODS),
             *(fmt_estimate(r["ratios"][f"{m}/all_reduce"], digits=2) for m in ("ring", "butterfly"))]
            for r in record["compare"]]
    return table(["ranks", "time-shared", "elements", *(f"{m} ms" for m in METHODS),
                  "ring / all_reduce", "butterfly / all_reduce"], body)


def _accuracy_table(record: dict[str, Any]) -> list[str]:
    body = []
    for r in record["compare"]:
        for m in METHODS:
            acc, mem = r["accuracy"][m], r["memory"][m]
            rss = mem["extra_peak_rss_kib"]
            body.append([r["world_size"], f"{r['numel']:,}", m, f"{acc['max_abs_err']:.1e}", f"{acc['rel_err']:.1e}",
                         acc["identical"], _fmt_bytes(mem["torch_alloc_bytes"]),
                         "n/a" if rss is None else _fmt_bytes(rss * 1024)])
    return table(["ranks", "elements", "method", "max abs err", "rel err", "same bits all ranks",
                  "torch alloc/call", "extra peak RSS"], body)


def _bandwidth_table(record: dict[str, Any]) -> list[str]:
    body = []
    for r in record["bandwidth"]:
        head = [_fmt_bytes(r["bytes"]), r["world_size"], _shared(r), r["backend"]]
        if r["status"] != "ok":
            body.append(head + ["-", "-", "-", r["status"]])
            continue
        body.append(head + [fmt_estimate(r["median_s"], scale=1e3, digits=2), fmt_estimate(r["algbw_GBps"]),
                            fmt_estimate(r["busbw_GBps"]), "ok"])
    return table(["size", "ranks", "time-shared", "backend", "latency ms", "algbw GB/s", "busbw GB/s", "status"], body)


def _analysis(record: dict[str, Any]) -> list[str]:
    rows, cores = record["compare"], record["config"]["cores"]
    if not rows:
        return []
    numel = max(r["numel"] for r in rows)
    at_size = [r for r in rows if r["numel"] == numel and r["world_size"] > 1]
    ring = {r["world_size"]: r["ratios"]["ring/all_reduce"] for r in at_size}
    listed = ", ".join(f"{fmt_estimate(e, digits=2)} at {ws}" for ws, e in ring.items())
    tied = [str(ws) for ws, e in ring.items() if e["low"] <= 1 <= e["high"]]
    lines = [f"At {numel:,} elements the ring takes {listed} ranks the time of `dist.all_reduce` (ratio of "
             "medians [95 % CI]). "
             + (f"The CI includes 1 at {', '.join(tied)} ranks: no measurable difference there. " if tied else "")
             + "The ring runs 2(N-1) dependent steps from Python, each finishing only when the neighbour's gloo "
             "I/O thread and this rank's main thread get a core; gloo's own all-reduce runs its steps inside one "
             "C++ call. The butterfly needs fewer steps but N-1 peers at once and an N-chunk receive buffer "
             "(`torch alloc/call`). Ring and butterfly results are bit-identical on all ranks because one owner "
             "rank computes each chunk's value.", "",
             f"This machine has {cores} cores. Rows marked time-shared run more single-threaded processes than "
             "cores, so they measure OS scheduling as much as communication; the plots shade them."]
    return lines


def _mark_oversubscribed(ax: Any, world_sizes: list[int], cores: int, log: bool) -> None:
    """Integer ticks at the measured world sizes; shade the ones above the core count (time-shared)."""
    ax.set_xticks(world_sizes, [str(ws) for ws in world_sizes])
    ax.minorticks_off()
    over = [ws for ws in world_sizes if ws > cores]
    if not over:
        return
    below = max([ws for ws in world_sizes if ws <= cores], default=cores)
    left = math.sqrt(below * over[0]) if log else (below + over[0]) / 2
    right = over[-1] * 1.3 if log else over[-1] + 0.5
    ax.axvspan(left, right, color="grey", alpha=0.15, label=f"> {cores} cores: time-shared")
    ax.set_xlim(right=right)


def _errorbar(ax: Any, x: list[float], estimates: list[dict], scale: float = 1.0, **kwargs: Any) -> None:
    ax.errorbar(x, [scale * e["value"] for e in estimates], capsize=3, marker="o", **kwargs,
                yerr=[[scale * (e["value"] - e["low"]) for e in estimates],
                      [scale * (e["high"] - e["value"]) for e in estimates]])


def _plot_compare(plt: Any, record: dict[str, Any], path: Path) -> None:
    cores, numel = record["config"]["cores"], max(r["numel"] for r in record["compare"])
    rows = sorted((r for r in record["compare"] if r["numel"] == numel), key=lambda r: r["world_size"])
    world_sizes = [r["world_size"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for method in METHODS:
        _errorbar(left, world_sizes, [r["median_s"][method] for r in rows], scale=1e3, label=method)
    for method in ("ring", "butterfly"):
        _errorbar(right, world_sizes, [r["ratios"][f"{method}/all_reduce"] for r in rows],
                  label=f"{method} / all_reduce")
    right.axhline(1.0, color="grey", linewidth=1)
    right.axhline(RING_TARGET_RATIO, color="red", linestyle="--", label=f"ring target {RING_TARGET_RATIO}x")
    left.set(xscale="log", yscale="log", xlabel="ranks (processes)", ylabel="median ms per call (95 % CI)",
             title=f"float32 average, {numel:,} elements")
    right.set(xscale="log", xlabel="ranks (processes)", ylabel="ratio of medians (95 % CI)",
              title="time relative to dist.all_reduce")
    for ax in (left, right):
        _mark_oversubscribed(ax, world_sizes, cores, log=True)
        ax.legend()
    fig.suptitle(f"ring / butterfly / dist.all_reduce on gloo, {cores} cores (shaded: more ranks than cores)")
    save_figure(fig, path)


def _plot_bandwidth(plt: Any, record: dict[str, Any], path: Path) -> None:
    rows, cores = [r for r in record["bandwidth"] if r["status"] == "ok"], record["config"]["cores"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for ws in sorted({r["world_size"] for r in rows}):
        sel = [r for r in rows if r["world_size"] == ws]
        shared = any(r["oversubscribed"] for r in sel)
        _errorbar(left, [r["bytes"] for r in sel], [r["median_s"] for r in sel], scale=1e3,
                  label=f"{ws} ranks" + (" (time-shared)" if shared else ""), linestyle="--" if shared else "-")
    for nbytes in sorted({r["bytes"] for r in rows}):
        sel = sorted((r for r in rows if r["bytes"] == nbytes), key=lambda r: r["world_size"])
        _errorbar(right, [r["world_size"] for r in sel], [r["busbw_GBps"] for r in sel], label=_fmt_bytes(nbytes))
    left.set(xscale="log", yscale="log", xlabel="all-reduced tensor", ylabel="median latency ms (95 % CI)",
             title="latency")
    sizes = sorted({r["bytes"] for r in rows})
    left.set_xticks(sizes, [_fmt_bytes(b) for b in sizes])
    left.minorticks_off()
    right.set(xlabel="ranks (processes)", ylabel="bus bandwidth GB/s (95 % CI)", title="bus bandwidth")
    _mark_oversubscribed(right, sorted({r["world_size"] for r in rows}), cores, log=False)
    for ax in (left, right):
        ax.legend()
    backends = "/".join(sorted({r["backend"] for r in rows}))
    fig.suptitle(f"dist.all_reduce ({backends}), {cores} cores (dashed / shaded: more ranks than cores)")
    save_figure(fig, path)


def write(record: dict[str, Any], out_dir: Path) -> None:
    """Write results.json, results.md and the plots for ``record`` into ``out_dir``."""
    cfg = record["config"]
    lines = [*markdown_header(record, "All-reduce: ring vs butterfly vs dist.all_reduce, and bandwidth"),
             f"{cfg['rounds']} interleaved rounds x {cfg['iters']} iterations per method after {cfg['warmup']} "
             "warm-up; one sample = the slowest rank's time of one barrier-aligned call. One intra-op thread per "
             f"process, gloo over TCP loopback. Wall time {record['wall_s']:.0f} s.", "",
             "## Targets", "", *_targets(record), "",
             "## Time per call (float32 average)", "", *_compare_table(record), "",
             "## Accuracy and memory", "",
             "Errors vs the fp64 mean; memory on rank 0. `extra peak RSS` grows only when a call cannot reuse "
             "freed heap pages, so `torch alloc/call` is the allocator-independent figure.", "",
             *_accuracy_table(record), "",
             "## dist.all_reduce bandwidth", "",
             "algbw = bytes / time; busbw = algbw * 2(N-1)/N (nccl-tests' definition).", "",
             *_bandwidth_table(record), "",
             "## Analysis", "", *_analysis(record), "",
             "![time vs world size](time_vs_world_size.png) ![bandwidth](bandwidth.png)"]
    write_record(out_dir, record, lines)
    with plot_style() as plt:
        if record["compare"]:
            _plot_compare(plt, record, out_dir / "time_vs_world_size.png")
        if any(r["status"] == "ok" for r in record["bandwidth"]):
            _plot_bandwidth(plt, record, out_dir / "bandwidth.png")


if __name__ == "__main__":
    results_dir = Path(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results/allreduce")
    write(json.loads((results_dir / "results.json").read_text()), results_dir)
