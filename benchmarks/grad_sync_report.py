"""Analysis, headline, tables and plot for ``python -m benchmarks.grad_sync`` (see that module).

Everything is derived from the record's raw per-step samples, so a re-run rewrites the numbers,
the intervals, the headline and the plot together. Times are in ms; every interval is a bootstrap
95 % interval (:mod:`benchmarks.harness`); every ratio names its anchor.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.harness import (
    Estimate, difference_ci, fmt_estimate, markdown_header, median_ci, plot_style, ratio_ci, table, write_record,
)

NO_COMM = "no_comm"
# The like-for-like anchor first (no per-forward buffer broadcast, gradients in the buckets).
ANCHORS = ("ddp_tuned", "ddp_default")
HEADLINE_VARIANTS = {"bucketed_25mb": "bucketed25", "ddp_tuned": "ddp_tuned", "ddp_default": "ddp_default"}
_MiB = 2**20
_COLOURS = {"no communication (no_sync baseline)": "tab:gray", "SyncedDataParallel": "tab:blue",
            "torch DDP (anchors)": "tab:orange"}


def _ms(by_round: list[list[float]]) -> list[float]:
    """Per-step samples of all rounds, in ms."""
    return [s * 1e3 for steps in by_round for s in steps]


def _round_spread(by_round: list[list[float]]) -> float:
    """(max - min) of the per-round medians over the pooled median: run-to-run spread."""
    medians = [float(np.median(steps)) for steps in by_round if steps]
    return (max(medians) - min(medians)) / float(np.median([s for steps in by_round for s in steps]))


def _dict(estimate: Estimate | None) -> dict[str, float] | None:
    return None if estimate is None else asdict(estimate)


def variant_row(name: str, sample: dict[str, Any], samples: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """One variant's estimates (as JSON-able Estimate dicts): step, ratio to each anchor, exposure."""
    step, base = _ms(sample["step_s_by_round"]), _ms(samples[NO_COMM]["step_s_by_round"])
    communicates = name != NO_COMM
    share = ratio_ci(base, step)  # exposed share = 1 - no_comm / step
    return {
        "variant": name, "step_ms": _dict(median_ci(step)),
        **{f"vs_{a}": _dict(ratio_ci(step, _ms(samples[a]["step_s_by_round"]))) if a in samples and a != name
           else None for a in ANCHORS},
        "exposed_ms": _dict(difference_ci(step, base)) if communicates else None,
        "exposed_share": _dict(Estimate(1 - share.value, 1 - share.high, 1 - share.low, share.n))
        if communicates else None,
        "round_spread": _round_spread(sample["step_s_by_round"]),
        # Diagnostic only (a plain median): time blocked in finish(), blind to compute slowed by gloo.
        "finish_ms": float(np.median(_ms(sample["finish_s_by_round"])))
        if communicates and sample["buckets"] is not None else None,
        "peak_mib": sample["peak_bytes"] / _MiB, "collectives": sample["collectives"],
        "buckets": sample["buckets"],
    }


def analyse(record: dict[str, Any]) -> dict[str, Any]:
    """Add ``analysis`` (per model, one row per variant) and the flat ``headline`` to ``record``."""
    record["analysis"] = {model: [variant_row(name, sample, samples) for name, sample in samples.items()]
                          for model, samples in record["steps"].items()}
    record["headline"] = headline(record["analysis"], record.get("zero1", []))
    return record


def _zero_ratios(zero1: list[dict[str, Any]]) -> dict[int, float]:
    """Largest rank's sharded state over the unsharded state, worst model, per world size."""
    ratios: dict[int, float] = {}
    for r in zero1:
        ratio = max(r["sharded_bytes_per_rank"]) / r["unsharded_bytes"]
        ratios[r["world_size"]] = max(ratio, ratios.get(r["world_size"], 0.0))
    return ratios


def headline(analysis: dict[str, list[dict[str, Any]]], zero1: list[dict[str, Any]]) -> dict[str, Any]:
    """Flat ``name -> Estimate dict or number``: the figures the README quotes, anchors in the names."""
    out: dict[str, Any] = {}
    for model, model_rows in analysis.items():
        rows = {r["variant"]: r for r in model_rows}
        for variant, short in HEADLINE_VARIANTS.items():
            row = rows.get(variant)
            if row is None:
                continue
            for anchor in ANCHORS:  # ddp_default vs ddp_tuned would only invert ddp_tuned's ratio
                if row[f"vs_{anchor}"] is not None and (variant, anchor) != ("ddp_default", "ddp_tuned"):
                    out[f"{model}_{short}_vs_{anchor}"] = row[f"vs_{anchor}"]
            out[f"{model}_step_ms_{short}"] = row["step_ms"]
            out[f"{model}_exposed_comm_ms_{short}"] = row["exposed_ms"]
            out[f"{model}_exposed_comm_share_{short}"] = row["exposed_share"]
            out[f"{model}_peak_mib_{short}"] = row["peak_mib"]
            allreduce = row["collectives"].get("allreduce", {"count": 0, "bytes": 0})
            out[f"{model}_allreduce_calls_{short}"] = allreduce["count"]
            out[f"{model}_allreduce_mib_{short}"] = allreduce["bytes"] / _MiB
        if NO_COMM in rows:
            out[f"{model}_step_ms_no_comm"] = rows[NO_COMM]["step_ms"]
    for world_size, ratio in sorted(_zero_ratios(zero1).items()):
        out[f"zero1_state_ratio_{world_size}ranks"] = ratio
    return out


def _est(e: dict[str, float] | None, digits: int = 2, scale: float = 1.0, unit: str = "") -> str:
    return "-" if e is None else fmt_estimate(e, scale=scale, digits=digits, unit=unit)


def _size(n_bytes: float) -> str:
    return f"{n_bytes / _MiB:.1f} MiB" if n_bytes >= _MiB else f"{n_bytes / 1024:.1f} KiB"


def _collectives(counts: dict[str, dict[str, float]]) -> str:
    parts = [f"{op} {c['count']:.0f} ({_size(c['bytes'])})" for op, c in sorted(counts.items())]
    return ", ".join(parts) or "none"


def _variant_table(rows: list[dict[str, Any]]) -> list[str]:
    headers = ["variant", "step ms", "x ddp_tuned", "x ddp_default", "exposed comm ms", "exposed share",
               "peak MiB", "collectives per step (calls, payload)", "buckets", "round spread",
               "diagnostic: finish() ms (median)"]
    cells = [[r["variant"], _est(r["step_ms"], 1), _est(r["vs_ddp_tuned"]), _est(r["vs_ddp_default"]),
              _est(r["exposed_ms"], 1), _est(r["exposed_share"], 0, 100, " %"), f"{r['peak_mib']:.0f}",
              _collectives(r["collectives"]), "-" if r["buckets"] is None else r["buckets"],
              f"{r['round_spread']:.0%}", "-" if r["finish_ms"] is None else f"{r['finish_ms']:.1f}"] for r in rows]
    return table(headers, cells)


def _zero_table(rows: list[dict[str, Any]]) -> list[str]:
    cells = [[r["model"], r["world_size"], f"{r['param_bytes'] / _MiB:.1f}", f"{r['unsharded_bytes'] / _MiB:.1f}",
              ", ".join(f"{b / _MiB:.1f}" for b in r["sharded_bytes_per_rank"]),
              f"{max(r['sharded_bytes_per_rank']) / r['unsharded_bytes']:.3f} (ideal {1 / r['world_size']:.3f})"]
             for r in rows]
    return table(["model", "ranks", "params MiB", "AdamW state unsharded MiB", "sharded MiB per rank",
                  "largest rank / unsharded"], cells)


def _headline_value(value: Any) -> str:
    return fmt_estimate(value, digits=3) if isinstance(value, dict) else f"{value:.3g}"


def _setup_lines(record: dict[str, Any]) -> list[str]:
    cfg = record["config"]
    ddp = {v: s.get("ddp_settings") for m in record["steps"].values() for v, s in m.items() if s.get("ddp_settings")}
    return [f"{cfg['world_size']} ranks, {cfg['backend']} on {cfg['device']}, {cfg['threads_per_process']} "
            f"intra-op thread per rank; {cfg['optimizer']}; {cfg['warmup']} warm-up + {cfg['steps']} timed steps "
            f"per run x {cfg['rounds']} interleaved rounds (fresh processes each); MLP {cfg['mlp_depth']}x"
            f"{cfg['mlp_width']} batch {cfg['mlp_batch']}/rank, ResNet-18 (100 classes, 32x32) batch "
            f"{cfg['resnet_batch']}/rank; total {record['wall_s']:.0f} s.", "",
            f"Anchors (effective settings read back from torch DDP): {ddp}.", ""]


_NOTES = (
    "Step: median over all timed steps of all rounds of the slower rank (forward, backward, finish(), "
    "optimizer step, zero_grad), each step started after a barrier. x anchor: ratio of medians to that torch "
    "DDP anchor. Exposed comm: step minus the `no_comm` step (same model, batch and wrapper on the same two "
    "ranks, every backward inside no_sync(): no collective at all), not clipped; it also charges the compute "
    "that gloo's reductions slow down on the shared cores. Exposed share: exposed / step. Peak: RSS "
    "high-water mark above the built model, max over ranks, from a separate untimed run. Collectives: one "
    "profiled step (torch.profiler `c10d::` calls; payload from gloo's events), per rank. Round spread: "
    "(max - min) of the per-round medians over the median; when it is large, the intervals (which treat steps "
    "as independent) are too narrow. finish() ms is a diagnostic (time blocked in finish(), SyncedDataParallel "
    "only); it is not a measure of overlap."
)


def markdown(record: dict[str, Any]) -> list[str]:
    lines = [*markdown_header(record, "Gradient synchronisation benchmark"), *_setup_lines(record),
             "## Headline", "",
             *table(["figure", "value [95 % CI]"],
                    [[f"`{k}`", _headline_value(v)] for k, v in record["headline"].items()]), ""]
    for model, rows in record["analysis"].items():
        lines += [f"## {model}: per training step", "", *_variant_table(rows), ""]
    return lines + [_NOTES, "", "## ZeRO-1: AdamW state per rank", "", *_zero_table(record["zero1"]), "",
                    "![step time per variant with 95 % intervals](grad_sync.png)", ""]


def _family(variant: str) -> str:
    if variant == NO_COMM:
        return "no communication (no_sync baseline)"
    return "torch DDP (anchors)" if variant.startswith("ddp") else "SyncedDataParallel"


def plot(record: dict[str, Any], path: Path) -> None:
    """Median step time per variant with 95 % interval error bars, one panel per model."""
    models = list(record["analysis"])
    with plot_style() as plt:
        from matplotlib.lines import Line2D
        from matplotlib.patches import Patch

        fig, axes = plt.subplots(1, len(models), figsize=(5.5 * len(models), 5), squeeze=False)
        for ax, model in zip(axes[0], models):
            rows = record["analysis"][model]
            steps = [r["step_ms"] for r in rows]
            ax.barh([r["variant"] for r in rows], [e["value"] for e in steps],
                    xerr=[[e["value"] - e["low"] for e in steps], [e["high"] - e["value"] for e in steps]],
                    color=[_COLOURS[_family(r["variant"])] for r in rows], ecolor="black", capsize=2)
            ax.invert_yaxis()
            ax.set(title=f"{model}: median step time", xlabel="ms per step (slower rank)")
        handles = [Patch(color=c, label=label) for label, c in _COLOURS.items()]
        handles.append(Line2D([], [], color="black", marker="|", linestyle="-", label="95 % bootstrap CI"))
        fig.legend(handles=handles, loc="lower center", ncol=len(handles))
        if not record["quietness"]["comparable"]:
            fig.suptitle("NOT COMPARABLE: measured on a busy machine", color="tab:red")
        fig.tight_layout(rect=(0, 0.07, 1, 1))
        fig.savefig(path)
        plt.close(fig)


def write(record: dict[str, Any], out_dir: Path) -> None:
    """``results.json``, ``results.md`` and ``grad_sync.png`` for an :func:`analyse`d ``record``."""
    write_record(out_dir, record, markdown(record))
    plot(record, out_dir / "grad_sync.png")
