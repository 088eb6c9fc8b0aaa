"""The gradient synchronisation benchmark's analysis and report (:mod:`benchmarks.grad_sync` measures):
every estimate is derived from the record's raw per-step samples (seconds), so a stored record can be
re-analysed and its report rewritten."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.harness import (
    difference_ci,
    fmt_bytes,
    fmt_value,
    headline_row,
    median_ci,
    plot_estimates,
    ratio_ci,
    report,
    share_ci,
    table,
    write_record,
)

__all__ = ["ANCHORS", "NO_COMM", "SINGLE", "TITLE", "analyse", "headline", "variant_row", "write"]

TITLE = "Gradient synchronisation: SyncedDataParallel vs torch DDP (2 CPU ranks)"
NO_COMM, SINGLE = "no_comm", "single_all_cores"
ANCHORS = ("ddp_tuned", "ddp_default")  # the like-for-like anchor first


def variant_row(name: str, sample: dict[str, Any], pooled: dict[str, list[list[float]]]) -> dict[str, Any]:
    """One variant's estimates (JSON-able, seconds) from every variant's steps by round (``pooled``: rounds are
    resampled whole): step, ratio to each anchor, exposure, speed-up; round spread: (max - min) of the per-round
    medians over the median of all steps."""
    step, base, communicates = pooled[name], pooled[NO_COMM], name not in (NO_COMM, SINGLE)
    # bf16 buckets travel through gloo (compression turns the shared-memory sum off): compare like with like.
    fp32 = (
        next((v for v in (f"{name.removesuffix('_bf16')}_gloo", name.removesuffix("_bf16")) if v in pooled), "")
        if name.endswith("_bf16")
        else ""
    )
    medians = [float(np.median(s)) for s in sample["step_s_by_round"] if s]  # one per round
    # images/s of 2 ranks over one all-cores process on one rank's batch: 2 x step(single) / step
    single = [[2 * s for s in steps] for steps in pooled.get(SINGLE, [])]
    return {
        "variant": name,
        "step_s": asdict(median_ci(step)),
        "threads": sample.get("threads"),
        **{f"vs_{a}": asdict(ratio_ci(step, pooled[a])) if a in pooled and a != name else None for a in ANCHORS},
        "exposed_s": asdict(difference_ci(step, base)) if communicates else None,
        "exposed_share": asdict(share_ci(base, step)) if communicates else None,
        "speedup_vs_single_all_cores": asdict(ratio_ci(single, step)) if communicates and single else None,
        "round_spread": (max(medians) - min(medians)) / float(np.median(np.concatenate(step))),
        "vs_fp32": asdict(ratio_ci(step, pooled[fp32])) if fp32 in pooled else None,
        # The shared-memory sum (grad_transport="auto" here) against gloo's over TCP loopback.
        **{
            f"vs_{other}": asdict(ratio_ci(step, pooled[f"{name}_{other}"])) if f"{name}_{other}" in pooled else None
            for other in ("gloo", "gloo_barriers")
        },
        # Diagnostic only (a plain median): time blocked in finish(), blind to compute slowed by gloo.
        "finish_s": float(np.median(np.concatenate(sample["finish_s_by_round"])))
        if communicates and sample["buckets"] is not None
        else None,
        "peak_bytes": sample["peak_bytes"],
        "collectives": sample["collectives"],
        "buckets": sample["buckets"],
    }


def analyse(record: dict[str, Any]) -> dict[str, Any]:
    """Per model, one row per variant, all from the raw samples."""
    return {
        model: [
            variant_row(name, sample, {v: s["step_s_by_round"] for v, s in samples.items()})
            for name, sample in samples.items()
        ]
        for model, samples in record["steps"].items()
    }


def headline(record: dict[str, Any]) -> list[dict[str, Any]]:
    """The README's rows per model: bucketed 25 MiB against both anchors, its exposed share, bf16
    against fp32, the speed-up over one all-cores process; then ZeRO-1's state per rank."""
    rows = []
    for model, model_rows in analyse(record).items():
        by_variant = {r["variant"]: r for r in model_rows}
        bucketed, bf16 = by_variant.get("bucketed_25mb"), by_variant.get("bucketed_25mb_bf16", {})
        if bucketed is None:
            continue
        rows += [
            headline_row(f"bucketed 25 MiB / {a.replace('_', ' ')}: step time, {model}", bucketed[f"vs_{a}"], "x")
            for a in ANCHORS
        ]
        rows += [
            headline_row(f"{what}, {model}", value, unit)
            for what, value, unit in (
                (
                    "bucketed 25 MiB: exposed communication share of the step (vs no_sync)",
                    bucketed["exposed_share"],
                    "%",
                ),
                ("bucketed 25 MiB, bf16 / fp32 gradients, both summed by gloo: step time", bf16.get("vs_fp32"), "x"),
                ("bucketed 25 MiB, buckets summed in shared memory / by gloo: step time", bucketed.get("vs_gloo"), "x"),
                (
                    "bucketed 25 MiB, shared-memory sums with futex / gloo barriers: step time",
                    bucketed.get("vs_gloo_barriers"),
                    "x",
                ),
                (
                    "bucketed 25 MiB, 2 ranks / 1 process on all cores: images per second",
                    bucketed["speedup_vs_single_all_cores"],
                    "x",
                ),
            )
            if value is not None
        ]
    zero1 = record.get("zero1", [])
    for n in sorted({r["world_size"] for r in zero1}):  # the largest rank's state / the unsharded one, worst model
        ratio = max(max(r["sharded_bytes_per_rank"]) / r["unsharded_bytes"] for r in zero1 if r["world_size"] == n)
        rows.append(
            headline_row(
                f"ZeRO-1: AdamW state of the largest rank / unsharded, {n} ranks (ideal {1 / n:g})", ratio, "x"
            )
        )
    return rows


def _variant_table(rows: list[dict[str, Any]]) -> list[str]:
    headers = [
        "variant",
        "threads",
        "step",
        "x ddp_tuned",
        "x ddp_default",
        "exposed comm",
        "exposed share",
        "images/s vs 1 process all cores",
        "peak memory",
        "collectives per step by source (payload)",
        "buckets",
        "round spread",
        "diagnostic: finish() at the end of backward (median)",
    ]
    cells = [
        [
            r["variant"],
            r["threads"],
            fmt_value(r["step_s"], "s"),
            fmt_value(r["vs_ddp_tuned"]),
            fmt_value(r["vs_ddp_default"]),
            fmt_value(r["exposed_s"], "s"),
            fmt_value(r["exposed_share"], "%"),
            fmt_value(r["speedup_vs_single_all_cores"]),
            fmt_bytes(r["peak_bytes"]),
            ", ".join(
                f"{source} {n} ({fmt_bytes(r['collectives']['bytes'][source])})"
                for source, n in sorted(r["collectives"]["counts"].items())
            )
            or "none",
            "-" if r["buckets"] is None else r["buckets"],
            f"{r['round_spread']:.0%}",
            fmt_value(r["finish_s"], "s"),
        ]
        for r in rows
    ]
    return table(headers, cells)


_NOTES = (
    "Step: forward, backward (its end waits for the buckets: finish()), optimizer step, zero_grad; x anchor: ratio of "
    "medians. Peak memory: "
    "above the built model, max over ranks. Round spread: (max - min) of the per-round medians over the "
    "median of all steps; the intervals resample rounds whole, so a large spread widens them."
)


def write(record: dict[str, Any], out_dir: Path) -> None:
    """Analyse ``record`` and write ``results.json``, ``results.md`` and ``grad_sync.png`` into ``out_dir``."""
    record["analysis"], record["headline"] = analyse(record), headline(record)
    cfg = record["config"]
    ddp = {v: s.get("ddp_settings") for m in record["steps"].values() for v, s in m.items() if s.get("ddp_settings")}
    body = [
        f"{cfg['optimizer']}; {cfg['warmup']} warm-up + {cfg['steps']} timed steps per run x {cfg['rounds']} "
        f"rounds; MLP {cfg['mlp_depth']}x{cfg['mlp_width']} batch {cfg['mlp_batch']}/rank, ResNet-18 batch "
        f"{cfg['resnet_batch']}/rank; total {record['wall_s']:.0f} s. Anchors as torch DDP reports them: {ddp}."
    ]
    for model, rows in record["analysis"].items():
        body += ["", f"## {model}: per training step", "", *_variant_table(rows)]
    zero1 = [
        [
            r["model"],
            r["world_size"],
            fmt_bytes(r["param_bytes"]),
            fmt_bytes(r["unsharded_bytes"]),
            ", ".join(fmt_bytes(b) for b in r["sharded_bytes_per_rank"]),
            f"{max(r['sharded_bytes_per_rank']) / r['unsharded_bytes']:.3f} (ideal {1 / r['world_size']:.3f})",
        ]
        for r in record["zero1"]
    ]
    body += [
        "",
        _NOTES,
        "",
        "## ZeRO-1: AdamW state per rank",
        "",
        *table(
            ["model", "ranks", "params", "AdamW state unsharded", "sharded per rank", "largest rank / unsharded"], zero1
        ),
        "",
        "![step time per variant with 95 % intervals](grad_sync.png)",
    ]
    write_record(out_dir, record, report(record, TITLE, body))
    panels = [
        {
            "title": f"{model}: median step time (slower rank)",
            "ylabel": "ms per step",
            "scale": 1e3,
            "groups": [r["variant"] for r in rows],
            "series": {"step": [r["step_s"] for r in rows]},
        }
        for model, rows in record["analysis"].items()
    ]
    plot_estimates(out_dir / "grad_sync.png", panels, TITLE, record["quietness"]["comparable"])
