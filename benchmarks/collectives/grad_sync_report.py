"""The gradient synchronisation benchmark's analysis and report (:mod:`benchmarks.collectives.grad_sync` measures):
every estimate is derived from the record's raw per-step samples (seconds), so a stored record can be
re-analysed and its report rewritten."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.report import Panel, fmt_bytes, fmt_value, headline_row, publish, table
from measure.stats import difference_ci, median_ci, ratio_ci, share_ci

TITLE = "Gradient synchronisation: SyncedDataParallel vs torch DDP (2 CPU ranks)"
NO_COMM, SINGLE = "no_comm", "single_all_cores"
ANCHORS = ("ddp_tuned", "ddp_default")  # the like-for-like anchor first
# The headline's rows of bucketed 25 MiB after its ratios to the anchors: (what, variant, estimate, unit).
_BUCKETED = (
    ("bucketed 25 MiB: exposed communication share of the step (vs no_sync)", "", "exposed_share", "%"),
    ("bucketed 25 MiB, bf16 / fp32 gradients, both summed by gloo: step time", "_bf16", "vs_fp32", "x"),
    ("bucketed 25 MiB, buckets summed in shared memory / by gloo: step time", "", "vs_gloo", "x"),
    ("bucketed 25 MiB, shared-memory sums with futex / gloo barriers: step time", "", "vs_gloo_barriers", "x"),
    ("bucketed 25 MiB, 2 ranks / 1 process on all cores: images per second", "", "speedup_vs_single_all_cores", "x"),
)


def _ratio(step: list[list[float]], pooled: dict[str, Any], other: str) -> dict[str, float] | None:
    return asdict(ratio_ci(step, pooled[other])) if other in pooled else None


def variant_row(name: str, sample: dict[str, Any], pooled: dict[str, list[list[float]]]) -> dict[str, Any]:
    """One variant's estimates (JSON-able, seconds) from every variant's steps by round (``pooled``: rounds are
    resampled whole): step, ratio to each anchor, exposure, speed-up; round spread: (max - min) of the per-round
    medians over the median of all steps."""
    step, base, communicates = pooled[name], pooled[NO_COMM], name not in (NO_COMM, SINGLE)
    # bf16 buckets travel through gloo (compression turns the shared-memory sum off): compare like with like.
    fp32 = [v for v in (f"{name.removesuffix('_bf16')}_gloo", name.removesuffix("_bf16")) if v in pooled]
    medians = [float(np.median(s)) for s in sample["step_s_by_round"] if s]  # one per round
    # images/s of 2 ranks over one all-cores process on one rank's batch: 2 x step(single) / step
    single = [[2 * s for s in steps] for steps in pooled.get(SINGLE, [])]
    finish = sample["finish_s_by_round"]
    return {
        "variant": name,
        "step_s": asdict(median_ci(step)),
        "threads": sample.get("threads"),
        **{f"vs_{a}": _ratio(step, pooled, a) if a != name else None for a in ANCHORS},
        "exposed_s": asdict(difference_ci(step, base)) if communicates else None,
        "exposed_share": asdict(share_ci(base, step)) if communicates else None,
        "speedup_vs_single_all_cores": asdict(ratio_ci(single, step)) if communicates and single else None,
        "round_spread": (max(medians) - min(medians)) / float(np.median(np.concatenate(step))),
        "vs_fp32": _ratio(step, pooled, fp32[0]) if name.endswith("_bf16") and fp32 else None,
        # The shared-memory sum (grad_transport="auto" here) against gloo's over TCP loopback.
        **{f"vs_{other}": _ratio(step, pooled, f"{name}_{other}") for other in ("gloo", "gloo_barriers")},
        # Diagnostic only (a plain median): time blocked in finish(), blind to compute slowed by gloo.
        "finish_s": float(np.median(np.concatenate(finish)))
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
        if "bucketed_25mb" not in by_variant:
            continue
        bucketed = by_variant["bucketed_25mb"]
        for a in ANCHORS:
            rows.append(
                headline_row(f"bucketed 25 MiB / {a.replace('_', ' ')}: step time, {model}", bucketed[f"vs_{a}"], "x")
            )
        for what, suffix, key, unit in _BUCKETED:
            value = by_variant.get(f"bucketed_25mb{suffix}", {}).get(key)
            rows += [headline_row(f"{what}, {model}", value, unit)] if value is not None else []
    zero1 = record.get("zero1", [])
    for n in sorted({r["world_size"] for r in zero1}):  # the largest rank's state / the unsharded one, worst model
        ratio = max(max(r["sharded_bytes_per_rank"]) / r["unsharded_bytes"] for r in zero1 if r["world_size"] == n)
        what = f"ZeRO-1: AdamW state of the largest rank / unsharded, {n} ranks (ideal {1 / n:g})"
        rows.append(headline_row(what, ratio, "x"))
    return rows


def _variant_table(rows: list[dict[str, Any]]) -> list[str]:
    headers = (
        "variant | threads | step | x ddp_tuned | x ddp_default | exposed comm | exposed share | "
        "images/s vs 1 process all cores | peak memory | collectives per step by source (payload) | buckets | "
        "round spread | diagnostic: finish() at the end of backward (median)"
    )
    cells = [
        [r["variant"], r["threads"], fmt_value(r["step_s"], "s"), fmt_value(r["vs_ddp_tuned"])]
        + [fmt_value(r["vs_ddp_default"]), fmt_value(r["exposed_s"], "s"), fmt_value(r["exposed_share"], "%")]
        + [fmt_value(r["speedup_vs_single_all_cores"]), fmt_bytes(r["peak_bytes"]), _collectives(r["collectives"])]
        + ["-" if r["buckets"] is None else r["buckets"], f"{r['round_spread']:.0%}", fmt_value(r["finish_s"], "s")]
        for r in rows
    ]
    return table(headers, cells)


def _collectives(collectives: dict[str, dict[str, int]]) -> str:
    counts = sorted(collectives["counts"].items())
    return ", ".join(f"{source} {n} ({fmt_bytes(collectives['bytes'][source])})" for source, n in counts) or "none"


_NOTES = (
    "Step: forward, backward (its end waits for the buckets: finish()), optimizer step, zero_grad; x anchor: ratio of "
    "medians. Peak memory: above the built model, max over ranks. Round spread: (max - min) of the per-round medians "
    "over the median of all steps; the intervals resample rounds whole, so a large spread widens them."
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
        [r["model"], r["world_size"], *map(fmt_bytes, (r["param_bytes"], r["unsharded_bytes"]))]
        + [", ".join(fmt_bytes(b) for b in r["sharded_bytes_per_rank"])]
        + [f"{max(r['sharded_bytes_per_rank']) / r['unsharded_bytes']:.3f} (ideal {1 / r['world_size']:.3f})"]
        for r in record["zero1"]
    ]
    headers = "model | ranks | params | AdamW state unsharded | sharded per rank | largest rank / unsharded"
    body += ["", _NOTES, "", "## ZeRO-1: AdamW state per rank", "", *table(headers, zero1)]
    body += ["", "![step time per variant with 95 % intervals](grad_sync.png)"]
    panels = [
        Panel(
            f"{model}: median step time (slower rank)",
            "ms per step",
            [r["variant"] for r in rows],
            {"step": [r["step_s"] for r in rows]},
            scale=1e3,
        )
        for model, rows in record["analysis"].items()
    ]
    publish(out_dir, record, TITLE, body, {"grad_sync.png": (TITLE, panels)})
