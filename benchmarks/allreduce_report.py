"""Markdown tables, analysis and plots for ``python -m benchmarks.allreduce`` (see that module).

Everything here is derived from the ``results.json`` record, so a re-run on another machine
rewrites the numbers, the target verdicts and the analysis sentences together.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 - the backend must be chosen first

RING_TARGET_RATIO = 1.5
RING_TARGET_WORLD_SIZES = (2, 4, 8)
REL_ERR_TARGET = 1e-6
METHODS = ("ring", "butterfly", "all_reduce")


def _fmt_bytes(nbytes: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{nbytes:.0f} B"


def _find(rows: list[dict], **match: Any) -> dict | None:
    return next((r for r in rows if all(r.get(k) == v for k, v in match.items())), None)


def ring_ratio(rows: list[dict], world_size: int, numel: int) -> float | None:
    """Ring median time over ``dist.all_reduce`` median time, or None if not measured."""
    ring = _find(rows, world_size=world_size, numel=numel, method="ring")
    torch_ = _find(rows, world_size=world_size, numel=numel, method="all_reduce")
    return ring["median_s"] / torch_["median_s"] if ring and torch_ else None


def _target_rows(record: dict) -> list[str]:
    rows, cores = record["compare"], record["environment"]["cpu_count"]
    numel = max((r["numel"] for r in rows), default=0)
    lines = _table_head("target", "measured", "met?")
    for world_size in RING_TARGET_WORLD_SIZES:
        ratio = ring_ratio(rows, world_size, numel)
        if ratio is None:
            lines.append(f"| ring <= {RING_TARGET_RATIO}x all_reduce, {numel:,} el., "
                         f"{world_size} ranks | not measured in this run | - |")
            continue
        verdict = "yes" if ratio <= RING_TARGET_RATIO else (
            f"**no**, missed by {ratio / RING_TARGET_RATIO - 1:.0%}")
        lines.append(f"| ring <= {RING_TARGET_RATIO}x all_reduce, {numel:,} el., {world_size} "
                     f"ranks ({world_size / cores:g} procs/core) | {ratio:.2f}x | {verdict} |")
    custom = [r for r in rows if r["method"] != "all_reduce"]
    worst = max((r["rel_err"] for r in custom), default=float("nan"))
    ok = "yes" if worst <= REL_ERR_TARGET else f"**no**, {worst / REL_ERR_TARGET:.1f}x the limit"
    lines.append(f"| rel. error <= {REL_ERR_TARGET:g} (ring, butterfly, every config) "
                 f"| max {worst:.2e} | {ok} |")
    return lines


def _table_head(*columns: str) -> list[str]:
    return ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]


def _compare_table(record: dict) -> list[str]:
    cores = record["environment"]["cpu_count"]
    lines = _table_head("ranks", "procs/core", "elements", "method", "median ms", "x all_reduce",
                        "max abs err", "rel err", "same bits all ranks", "torch alloc/call",
                        "extra peak RSS")
    for r in record["compare"]:
        base = _find(record["compare"], world_size=r["world_size"], numel=r["numel"],
                     method="all_reduce")
        rss = r["extra_peak_rss_kib"]
        lines.append(
            f"| {r['world_size']} | {r['world_size'] / cores:g} | {r['numel']:,} | {r['method']} "
            f"| {r['median_s'] * 1e3:.3f} | {r['median_s'] / base['median_s']:.2f} "
            f"| {r['max_abs_err']:.1e} | {r['rel_err']:.1e} | {r['identical_on_all_ranks']} "
            f"| {_fmt_bytes(r['torch_alloc_bytes'])} "
            f"| {'n/a' if rss is None else _fmt_bytes(rss * 1024)} |"
        )
    return lines


def _bandwidth_table(record: dict) -> list[str]:
    cores = record["environment"]["cpu_count"]
    lines = _table_head("size", "ranks", "procs/core", "backend", "median latency ms",
                        "algbw GB/s", "busbw GB/s", "peak RSS/process", "config wall s", "status")
    for r in record["bandwidth"]:
        head = (f"| {_fmt_bytes(r['bytes'])} | {r['world_size']} | {r['world_size'] / cores:g} "
                f"| {r['backend']} ")
        if r["status"] != "ok":
            lines.append(head + f"| - | - | - | - | - | {r['status']} |")
            continue
        lines.append(
            head + f"| {r['median_s'] * 1e3:.2f} | {r['algbw_GBps']:.3f} | {r['busbw_GBps']:.3f} "
            f"| {_fmt_bytes(r['max_peak_rss_kib'] * 1024)} | {r['config_wall_s']:.1f} | ok |"
        )
    return lines


def _ring_sentence(record: dict) -> str:
    rows, env = record["compare"], record["environment"]
    numel = max(r["numel"] for r in rows)
    ratios = {ws: ring_ratio(rows, ws, numel) for ws in sorted({r["world_size"] for r in rows})}
    listed = ", ".join(f"{ratios[ws]:.2f}x at {ws}" for ws in ratios if ratios[ws] and ws > 1)
    text = (
        f"At {numel:,} elements the ring takes {listed} ranks the time of `dist.all_reduce`. "
        "It runs 2(N-1) dependent steps from Python, and each step completes only after the "
        "neighbour's gloo I/O thread and then this rank's main thread get a core; gloo's own "
        "ring runs its steps inside one C++ call. The butterfly needs 2 steps but N-1 peers at "
        "once and an N-chunk receive buffer (`torch alloc/call`). Ring and butterfly results "
        "are bit-identical on all ranks because one owner rank computes each chunk's value."
    )
    if env["load_avg_start"][0] > env["cpu_count"]:
        text += (
            f" This run started at load average {env['load_avg_start'][0]:.1f} on "
            f"{env['cpu_count']} cores, so every step could wait a scheduler time slice: read "
            "the ratios as noisy upper bounds and re-run on an idle machine."
        )
    return text


def _analysis(record: dict) -> list[str]:
    bw = [r for r in record["bandwidth"] if r["status"] == "ok"]
    cores = record["environment"]["cpu_count"]
    out = [_ring_sentence(record)] if record["compare"] else []
    if bw:
        best = max(bw, key=lambda r: r["busbw_GBps"])
        small = min(bw, key=lambda r: (r["bytes"], r["world_size"]))
        out.append(
            f"Gloo's `dist.all_reduce` peaks at {best['busbw_GBps']:.2f} GB/s bus bandwidth "
            f"({_fmt_bytes(best['bytes'])}, {best['world_size']} ranks), while "
            f"{_fmt_bytes(small['bytes'])} on {small['world_size']} ranks takes "
            f"{small['median_s'] * 1e3:.2f} ms and is latency-bound; with more processes than "
            f"the {cores} cores the ranks time-share cores and memory bandwidth, so these "
            "figures understate what dedicated cores (or NCCL on GPUs) deliver."
        )
    return out


def _environment_lines(record: dict) -> list[str]:
    env = record["environment"]
    versions = ", ".join(f"{k} {v}" for k, v in env["versions"].items())
    gpus = ", ".join(env["gpus"]) or "none"
    nccl = ("NCCL measured on the GPU(s) above." if record["config"]["device"] == "cuda" else
            "NCCL not measured: no GPU was available to this run (gloo on CPU only); "
            "`--device cuda` runs NCCL with one rank per GPU, so a single GPU gives world "
            "size 1 only.")
    load = env["load_avg_start"][0], env["load_avg_end"][0]
    caveat = [] if max(load) <= env["cpu_count"] else [
        f"- **Caveat: shared, overloaded machine** (1-min load average {load[0]:.1f} at start, "
        f"{load[1]:.1f} at end, on {env['cpu_count']} cores): other jobs competed for the cores, "
        "so times are upper bounds and ratios are noisy. Re-run on an idle machine."]
    return caveat + [
        f"- Command: `{record['command']}`",
        f"- CPU: {env['cpu']}, {env['cpu_count']} logical cores; memory available at start "
        f"{env['mem_available_gib']:.1f} GiB; GPUs: {gpus}. {nccl}",
        f"- Software: {versions}; Python {env['python']}; {env['platform']}",
        f"- One intra-op thread per process; gloo over TCP loopback, `file://` rendezvous, "
        f"fork-started workers. Load average (1/5/15 min) at start "
        f"{tuple(round(x, 2) for x in env['load_avg_start'])}, at end "
        f"{tuple(round(x, 2) for x in env['load_avg_end'])}; total {env['total_wall_s']:.0f} s.",
    ]


def _plot_compare(ax, rows: list[dict], x_key: str) -> None:
    """Left panel: time per call vs elements (a few world sizes) or vs ranks (largest size)."""
    numel = max((r["numel"] for r in rows), default=0)
    world_sizes = sorted({r["world_size"] for r in rows if r["world_size"] > 1})
    by_size = x_key == "numel"
    # Colour = method, line style = world size: three sizes keep the panel readable.
    shown = sorted({world_sizes[0], world_sizes[len(world_sizes) // 2], world_sizes[-1]}) if (
        by_size and world_sizes) else [None]
    for style, world_size in zip(("-", "--", ":"), shown):
        for colour, method in zip(("C0", "C1", "C2"), METHODS):
            sel = [r for r in rows if r["method"] == method and r["world_size"] > 1 and (
                r["world_size"] == world_size if by_size else r["numel"] == numel)]
            if sel:
                ax.plot([r[x_key] for r in sel], [r["median_s"] * 1e3 for r in sel], style,
                        color=colour, marker="o",
                        label=method + (f", {world_size} ranks" if by_size else ""))
    ax.set(xscale="log", yscale="log", ylabel="median time per call (ms)",
           xlabel="elements (float32)" if by_size else "ranks (processes)",
           title="ring / butterfly / dist.all_reduce" + ("" if by_size else f", {numel:,} el."))
    if not by_size and world_sizes:
        ax.set_xticks(world_sizes, [str(ws) for ws in world_sizes])
        ax.minorticks_off()


def _plot_bandwidth(ax, rows: list[dict], x_key: str) -> None:
    """Right panel: dist.all_reduce latency vs bytes (per world size) or vs ranks (per size)."""
    by_size = x_key == "numel"
    series_key, x_field = ("world_size", "bytes") if by_size else ("bytes", "world_size")
    for key in sorted({r[series_key] for r in rows}):
        sel = [r for r in rows if r[series_key] == key]
        label = f"{key} ranks" if by_size else _fmt_bytes(key)
        ax.plot([r[x_field] for r in sel], [r["median_s"] * 1e3 for r in sel],
                marker="o", label=label)
    backends = "/".join(sorted({r["backend"] for r in rows})) or "gloo"
    ax.set(xscale="log" if by_size else "linear", yscale="log", ylabel="median latency (ms)",
           xlabel="bytes" if by_size else "ranks (processes)",
           title=f"dist.all_reduce ({backends}) latency")


def _plots(record: dict, out_dir: Path) -> None:
    bandwidth = [r for r in record["bandwidth"] if r["status"] == "ok"]
    for name, x_key in (("time_vs_size", "numel"), ("time_vs_world_size", "world_size")):
        fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
        _plot_compare(left, record["compare"], x_key)
        _plot_bandwidth(right, bandwidth, x_key)
        for ax in (left, right):
            ax.grid(True, which="both", alpha=0.3)
            if ax.lines:
                ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out_dir / f"{name}.png", dpi=120)
        plt.close(fig)


def write(record: dict, out_dir: Path) -> None:
    """Write ``README.md`` and the two PNG plots for ``record`` into ``out_dir``."""
    cores = record["environment"]["cpu_count"]
    lines = ["# All-reduce benchmark", "", *_environment_lines(record), "",
             "## Targets", "", *_target_rows(record), "",
             "## Ring vs butterfly vs dist.all_reduce (float32 average, gloo, CPU)", "",
             "Median over repeats of the slowest rank's time per call (barrier before each "
             "call); errors vs the fp64 mean; memory measured on rank 0. `extra peak RSS` grows "
             "only when a call cannot reuse heap pages freed earlier, so `torch alloc/call` is "
             "the allocator-independent figure.", "",
             *_compare_table(record), "",
             "## dist.all_reduce bandwidth", "",
             "algbw = bytes / time; busbw = algbw * 2(N-1)/N (nccl-tests' definition).", "",
             *_bandwidth_table(record), "",
             "## Analysis", "", "\n\n".join(_analysis(record)), "",
             "## Oversubscription", "",
             f"This machine has {cores} logical cores and runs up to "
             f"{max([r['world_size'] for r in record['compare'] + record['bandwidth']] or [0])} "
             "single-threaded processes. Rows with procs/core > 1 measure time-sharing as much "
             "as communication: collective latency there includes OS scheduling of every rank, "
             "and bandwidth is shared; a load average above the core count at start or end means "
             "other work competed too. ![time vs size](time_vs_size.png) "
             "![time vs world size](time_vs_world_size.png)", ""]
    (out_dir / "README.md").write_text("\n".join(lines))
    _plots(record, out_dir)


if __name__ == "__main__":  # re-render: python -m benchmarks.allreduce_report RESULTS_DIR
    import json
    import sys

    results_dir = Path(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results/allreduce")
    write(json.loads((results_dir / "results.json").read_text()), results_dir)
