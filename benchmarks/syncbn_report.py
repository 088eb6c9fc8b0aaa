"""results.md and syncbn.png for ``python -m benchmarks.syncbn``, derived from its record only.

Re-render a stored run: ``python -m benchmarks.syncbn_report benchmarks/results/syncbn``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from benchmarks.harness import (
    fmt_estimate, markdown_header, plot_style, save_figure, table, verdict, write_record,
)


def includes_one(ratio: dict[str, float]) -> bool:
    """Whether a ratio's 95 % CI includes 1: no measurable difference."""
    return ratio["low"] <= 1.0 <= ratio["high"]


def _summary(record: dict[str, Any]) -> list[str]:
    cfg, rows = record["config"], record["rows"]
    key, target = f"custom/{cfg['baseline']}", cfg["target"]
    verdicts = [verdict(row["ratios"][key], target).split(" ")[0].strip("*") for row in rows]
    tied = [_shape(row) for row in rows if includes_one(row["ratios"][key])]
    lines = [f"**custom / {cfg['baseline']} <= {target}: met in {verdicts.count('met')}, missed in "
             f"{verdicts.count('missed')}, undecided in {verdicts.count('undecided')} of {len(rows)} shapes.**", ""]
    if tied:
        lines.append(f"The CI of custom / {cfg['baseline']} includes 1 for {', '.join(tied)}: there the "
                     f"measurement cannot tell the custom layer from the {cfg['baseline']} at all.")
    else:
        lines.append(f"The CI of custom / {cfg['baseline']} excludes 1 for every shape.")
    return lines


def _shape(row: dict[str, Any]) -> str:
    return "x".join(map(str, row["shape"]))


def _ms(estimate: dict[str, float]) -> str:
    return fmt_estimate(estimate, scale=1e3, digits=3)


def _table(record: dict[str, Any]) -> list[str]:
    cfg, rows = record["config"], record["rows"]
    methods = list(rows[0]["median_s"])
    key = f"custom/{cfg['baseline']}"
    keys = [key, *(k for k in rows[0]["ratios"] if k != key)]  # the target's ratio first
    headers = ["shape per rank", *(f"{m} ms" for m in methods), *(k.replace("/", " / ") for k in keys),
               f"{key} vs target {cfg['target']}", f"{key} CI includes 1?", "custom peak MiB", "local peak MiB"]
    body = [[_shape(row), *(_ms(row["median_s"][m]) for m in methods),
             *(fmt_estimate(row["ratios"][k], digits=2) for k in keys),
             verdict(row["ratios"][key], cfg["target"]), "yes" if includes_one(row["ratios"][key]) else "no",
             f"{row['peak_bytes'].get('custom', 0) / 2**20:.2f}", f"{row['peak_bytes'].get('local', 0) / 2**20:.2f}"]
            for row in rows]
    return table(headers, body)


def _one_rank(record: dict[str, Any]) -> list[str]:
    """The kernel alone: custom vs torch's BatchNorm on one rank, against the per-kind targets."""
    rows, targets = record.get("one_rank_rows"), record["config"].get("one_rank_targets", {})
    if not rows:
        return []
    body = []
    for row in rows:
        ratio, target = row["ratios"]["custom/local"], targets["conv" if len(row["shape"]) >= 4 else "nc"]
        body.append([_shape(row), _ms(row["median_s"]["custom"]), _ms(row["median_s"]["local"]),
                     fmt_estimate(ratio, digits=2), f"<= {target}", verdict(ratio, target)])
    return ["## The kernel on one rank: custom vs torch's BatchNorm", "",
            "One process in a 1-rank gloo group (the layer runs no collective), same shapes, threads and "
            "interleaved rounds as above; `native` is torch's `BatchNorm1d`/`BatchNorm2d`.", "",
            *table(["shape", "custom ms", "native ms", "custom / native", "target", "verdict"], body), ""]


def _errorbar(ax: Any, x: list[float], estimates: list[dict], scale: float = 1.0, **kwargs: Any) -> None:
    ax.errorbar(x, [scale * e["value"] for e in estimates], capsize=3, marker="o", linestyle="none", **kwargs,
                yerr=[[scale * (e["value"] - e["low"]) for e in estimates],
                      [scale * (e["high"] - e["value"]) for e in estimates]])


def _plot(record: dict[str, Any], path: Path) -> None:
    rows, cfg = record["rows"], record["config"]
    methods, ratios = list(rows[0]["median_s"]), [f"custom/{cfg['baseline']}", "custom/local"]
    with plot_style() as plt:
        fig, (ax_time, ax_ratio) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
        for i, method in enumerate(methods):  # side by side around each shape's tick
            offset = 0.6 * (i / (len(methods) - 1) - 0.5)
            _errorbar(ax_time, [j + offset for j in range(len(rows))], [r["median_s"][method] for r in rows],
                      scale=1e3, label=method)
        for offset, key in zip((-0.15, 0.15), ratios):
            _errorbar(ax_ratio, [j + offset for j in range(len(rows))], [r["ratios"][key] for r in rows], label=key)
        ax_ratio.axhline(1.0, color="grey", linewidth=1)
        ax_ratio.axhline(cfg["target"], color="red", linestyle="--", label=f"target {cfg['target']}x {cfg['baseline']}")
        ax_time.set(yscale="log", ylabel="forward+backward ms (median, slowest rank, 95 % CI)")
        ax_ratio.set(yscale="log", ylabel="ratio of medians (95 % CI)")
        ax_ratio.set_xticks(range(len(rows)), [_shape(row) for row in rows], rotation=45, ha="right")
        for ax in (ax_time, ax_ratio):
            ax.legend()
        fig.suptitle(f"SyncBatchNorm, {cfg['world_size']} ranks, {cfg['device']} / {cfg['backend']}")
        save_figure(fig, path)


def write(record: dict[str, Any], out: Path) -> None:
    """Write results.json, results.md and syncbn.png for ``record`` into ``out``."""
    cfg = record["config"]
    lines = [
        *markdown_header(record, "SyncBatchNorm: forward+backward time and peak memory"),
        f"{cfg['world_size']} ranks ({cfg['backend']}, {cfg['threads']} thread(s) each); {cfg['rounds']} interleaved "
        f"rounds x {cfg['iters']} iterations per method after {cfg['warmup']} warm-up; one sample = the slowest "
        f"rank's time of one barrier-aligned iteration. `floor` = local BN + 2 all-reduces of 2C+1 floats, "
        f"timed as one call. Wall time {record['wall_s']:.0f} s.", "",
        *_summary(record), "",
        *_table(record), "",
        *_one_rank(record),
        "Times: median ms [95 % CI]. Ratios: ratio of medians [95 % CI]. Peak memory: extra memory of one "
        "forward+backward (CPU: peak RSS, page granularity, glibc mmap threshold fixed at 128 KiB for that "
        "measurement only; CUDA: max_memory_allocated), max over ranks.", "",
        "![time and ratios per shape](syncbn.png)",
    ]
    write_record(out, record, lines)
    _plot(record, out / "syncbn.png")


if __name__ == "__main__":
    results_dir = Path(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results/syncbn")
    write(json.loads((results_dir / "results.json").read_text()), results_dir)
