"""The compare benchmark's analysis and report (:mod:`benchmarks.fits.compare` runs the fits): step-time ratios,
SyncBN share, exposed communication, scaling efficiency, collectives and accuracy, derived from the record (and
the accuracy runs' TensorBoard logs beside it) alone, so a stored record can be re-analysed and rewritten."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchmarks.fits.compare_runs import setting_title, step_rows, step_table
from benchmarks.harness import ratios
from benchmarks.report import Panel, fmt_bytes, fmt_value, headline_row, plot_estimates, publish, table
from measure.stats import difference_ci, ratio_ci, share_ci

__all__ = ["GPU_TARGET", "RATIOS", "TITLE", "analyse", "headline", "read_scalars", "title", "write"]

TITLE = "custom_ddp vs Lightning ddp, 2 CPU processes, synthetic data"
GPU_TARGET = 1.05  # custom_ddp (defaults) / ddp on one GPU, median step (issue 45)
CURVES = ("train/loss_epoch", "train/acc1_epoch", "val/loss", "val/acc1", "test/loss", "test/acc1")  # loss, acc
# (numerator, denominator): every ratio names its anchor.
RATIOS = (
    ("custom_ddp", "ddp_default"),
    ("custom_ddp", "ddp_tuned"),
    ("custom_ddp_localbn", "ddp_tuned"),
    ("custom_ddp", "custom_ddp_localbn"),
    ("custom_ddp_bf16", "custom_ddp"),
    ("custom_ddp_compiled", "ddp_tuned"),
    ("custom_ddp_compiled", "custom_ddp"),
    ("custom_ddp_localbn_gloo", "ddp_tuned"),
    ("custom_ddp_localbn", "custom_ddp_localbn_gloo"),
)
# The SyncBN share of a step, 1 - step(local BN) / step(SyncBN): record key -> (SyncBN variant, its name in the text).
SYNCBN_SHARES = {
    "syncbn_share": ("custom_ddp", "custom_ddp"),
    "syncbn_share_compiled": ("custom_ddp_compiled", "custom_ddp (SyncBN, compiled)"),
}
BASELINES = {"single_matched": "thread-matched", "single": "all cores"}
COMMUNICATION = [
    "exposed comm. vs 1 process, thread-matched",
    *(f"scaling eff. vs 1 process, {k}" for k in BASELINES.values()),
]


def analyse(timing: dict[str, Any], variants: dict[str, Any]) -> dict[str, Any]:
    """Per net and accumulation setting: step medians, threads, ratios, SyncBN share, exposed
    communication (thread-matched) and scaling efficiency against each 1-process baseline."""

    def estimates(samples: dict[str, list], *_: Any) -> dict[str, Any]:
        two, local = [v for v in samples if variants[v]["processes"] > 1], samples.get("custom_ddp_localbn")
        matched = samples.get("single_matched")
        efficiency = {b: {v: asdict(ratio_ci(samples[b], samples[v])) for v in two} for b in BASELINES if b in samples}
        shares = {key: samples.get(variant) for key, (variant, _) in SYNCBN_SHARES.items()}
        return {
            "ratios": ratios(samples, RATIOS),
            "exposed_comm_s": {v: asdict(difference_ci(samples[v], matched)) for v in two if matched is not None},
            "scaling_efficiency": efficiency,
        } | {key: asdict(share_ci(local, s)) for key, s in shares.items() if s is not None and local is not None}

    return step_rows(timing, estimates)


def _on_gpu(cfg: dict[str, Any]) -> bool:
    return cfg.get("accelerator") == "gpu"  # compare --device cuda


def _where(cfg: dict[str, Any]) -> str:
    return f"{cfg['devices']} GPU" if _on_gpu(cfg) else "2 CPU processes"


def title(record: dict[str, Any]) -> str:
    """The record's title: :data:`TITLE` with where the fits ran (``compare --device cuda``: one GPU)."""
    return TITLE.replace("2 CPU processes", _where(record["config"]))


def headline(record: dict[str, Any]) -> list[dict[str, Any]]:
    """Per net, one row per quantity with its value at every accumulation setting; bf16; accuracy. One GPU at one
    accumulation setting: custom_ddp / ddp default judged against :data:`GPU_TARGET`."""
    rows, label = [], lambda v: record["variants"].get(v, {}).get("label", v)  # noqa: E731
    gpu = _on_gpu(record["config"])
    for net, by_acc in record["analysis"].items():
        at = f"{net} net, accumulate {' / '.join(by_acc)}"

        def add(
            what: str, get: Callable, unit: str = "", by_acc: dict = by_acc, at: str = at, target: float | None = None
        ) -> None:
            values = [get(row) for row in by_acc.values()]
            if any(v is not None for v in values):
                judged = target is not None and len(values) == 1
                rows.append(headline_row(f"{what}, {at}", values[0] if judged else values, unit, target))

        for a, b in RATIOS[:1] + RATIOS[2:3] + RATIOS[4:]:  # vs ddp default, like for like, bf16 vs fp32
            target = GPU_TARGET if gpu and (a, b) == RATIOS[0] else None
            ratio = lambda r, key=f"{a}/{b}": r["ratios"].get(key)  # noqa: E731
            add(f"{label(a)} / {label(b)}: step time", ratio, "x", target=target)
        for key, (_, name) in SYNCBN_SHARES.items():
            add(f"SyncBN share of the {name} step (1 - local BN / SyncBN)", lambda r, key=key: r.get(key), "%")
        exposed = "custom_ddp (SyncBN): exposed communication vs 1 process, thread-matched"
        add(exposed, lambda r: r["exposed_comm_s"].get("custom_ddp"), "s")
        for base, kind in BASELINES.items():
            efficiency = lambda r, base=base: r["scaling_efficiency"].get(base, {}).get("custom_ddp")  # noqa: E731
            add(f"custom_ddp (SyncBN): scaling efficiency vs 1 process, {kind}", efficiency)
    counted = record.get("collectives") or {"nets": {}}
    for net, runs in counted["nets"].items():
        if "custom_ddp_bf16" in runs:
            fp32, bf16 = (runs[v]["bytes"].get("grad_buckets", 0) for v in ("custom_ddp", "custom_ddp_bf16"))
            what = "custom_ddp gradient all-reduce bytes per optimizer step, fp32 -> bf16"
            what += f", {net} net, accumulate {counted['accumulate']}"
            rows.append(headline_row(what, f"{fmt_bytes(fp32)} -> {fmt_bytes(bf16)} ({bf16 / fp32:.3g}x)"))
    accuracy = record["accuracy"].items()
    return rows + [
        headline_row(f"final test top-1 (%), {label(v)}, template net", a.get("test_acc1")) for v, a in accuracy
    ]


def read_scalars(log_dir: Path, tags: tuple[str, ...] = CURVES) -> dict[str, list[tuple[int, float]]]:
    """``(step, value)`` series of the wanted TensorBoard tags found in ``log_dir``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    events.Reload()
    present = set(events.Tags()["scalars"])
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in tags if tag in present}


def _communication(row: dict[str, Any], variant: str) -> list[str]:
    """A variant's exposed communication and scaling efficiency against each 1-process baseline."""
    efficiency = (fmt_value(row["scaling_efficiency"].get(b, {}).get(variant)) for b in BASELINES)
    return [fmt_value(row["exposed_comm_s"].get(variant), "s"), *efficiency]


def _step_tables(record: dict[str, Any]) -> list[str]:
    """Per net and setting: the step time per variant, the ratios, the SyncBN share."""
    lines, label = [], lambda v: record["variants"][v]["label"]  # noqa: E731
    for net, by_acc in record["analysis"].items():
        for acc, row in by_acc.items():
            cells = functools.partial(_communication, row)
            tables = step_table(label, row, COMMUNICATION, cells)
            shares = [
                f"SyncBN share of the {name} step: {fmt_value(row[key], '%')}."
                for key, (_, name) in SYNCBN_SHARES.items()
                if key in row
            ]
            ratio_rows = [[k, fmt_value(e)] for k, e in row["ratios"].items()]
            lines += [setting_title(record["config"], net, acc), "", *tables, ""]
            lines += [*table("ratio of median step times | value [95 % CI]", ratio_rows), "", *shares, ""]
    return lines


def _collective_tables(record: dict[str, Any]) -> list[str]:
    """The collectives per optimizer step by source, per net, a column per variant."""
    collectives = record["collectives"]
    lines = [
        f"## Collectives per optimizer step at accumulate {collectives['accumulate']}, by source",
        "",
        "Counted by the profiler on rank 0 (`measure.collective_count`), the last of 3 steps; bytes are this "
        "rank's payload. `lightning_sigterm` is Lightning's own per-batch broadcast, paid by every strategy.",
        "",
    ]
    for net, runs in collectives["nets"].items():
        sources = sorted({s for run in runs.values() for s in run["counts"]})
        per_source = {s: [(run["counts"].get(s, 0), run["bytes"].get(s, 0)) for run in runs.values()] for s in sources}
        per_source["**total**"] = [(sum(run["counts"].values()), sum(run["bytes"].values())) for run in runs.values()]
        cells = [[source, *(f"{n} / {fmt_bytes(b)}" for n, b in counts)] for source, counts in per_source.items()]
        lines += [f"### {net}", "", *table(["source", *(record["variants"][v]["label"] for v in runs)], cells), ""]
    return lines


def _accuracy(record: dict[str, Any]) -> list[str]:
    cfg, variants = record["config"], record["variants"]
    cells = [
        [
            variants[v]["label"],
            cfg["accuracy_epochs"],
            a["accumulate"],
            f"{a['test_acc1']:.1f}",
            f"{a['test_loss']:.3f}",
        ]
        for v, a in record["accuracy"].items()
    ]
    return [
        "## Accuracy (same seed, data and schedule; SYNTHETIC data)",
        "",
        *table("variant | epochs | accumulate | final test top-1 (%) | final test loss", cells),
        "",
        f"![step time](step_time.png) ![curves](curves.png) `tensorboard --logdir {cfg['out']}/tb` shows the "
        "accuracy runs side by side.",
    ]


def _curve_panels(curves: dict[str, dict[str, list]], variants: dict[str, Any]) -> list[Panel]:
    """Loss and top-1 accuracy per epoch of each accuracy run, train, validation and test."""
    epochs = max((len(series.get("val/loss", [])) for series in curves.values()), default=1)
    groups = [f"epoch {e}" for e in range(1, epochs + 1)]
    panels = []
    for title, scale, tags in (("loss", 1.0, CURVES[0::2]), ("top-1 accuracy (%)", 100.0, CURVES[1::2])):
        series = {
            f"{variants[v]['label']} {tag.split('/')[0]}": [None] * (epochs - len(points))
            + [value for _, value in points]
            for v, by_tag in curves.items()
            for tag in tags
            for points in [by_tag.get(tag, [])]
        }
        panels.append(Panel(f"{title}: SYNTHETIC stand-in data, not CIFAR-100", title, groups, series, scale))
    return panels


def write(record: dict[str, Any], out: Path) -> None:
    """Read the accuracy runs' logs under ``out/tb``, analyse, write results.json/.md and the plots."""
    cfg, variants = record["config"], record["variants"]
    curves = {
        v: {**read_scalars(out / "tb" / v / "fit"), **read_scalars(out / "tb" / v / "test")} for v in record["accuracy"]
    }
    for v, log in curves.items():
        record["accuracy"][v] |= {"test_acc1": 100 * log["test/acc1"][-1][1], "test_loss": log["test/loss"][-1][1]}
    record["analysis"] = analyse(record["timing"], variants)
    record["headline"] = headline(record)
    timed = cfg.get("variants", list(variants))  # records before --variants timed every variant
    body = [
        "## Variants",
        "",
        *[f"- **{v['label']}** (`{k}`): {v['description']}" for k, v in variants.items() if k in timed],
        "",
        f"Timing: {cfg['rounds']} rounds per setting; {'; '.join(f'{n}: {s}' for n, s in cfg['nets'].items())}.",
        "",
        "## Step time",
        "",
        *_step_tables(record),
        *(_collective_tables(record) if record["collectives"]["nets"] else []),  # none with --timing-only
        *(_accuracy(record) if record["accuracy"] else ["![step time](step_time.png)"]),
    ]
    panels = []
    for net, by_acc in record["analysis"].items():
        series = {v["label"]: [row["step_s"].get(k) for row in by_acc.values()] for k, v in variants.items()}
        groups = [f"accumulate {acc}" for acc in by_acc]
        panels.append(Panel(f"{net} net", "optimizer step, ms (median)", groups, series, scale=1e3))
    detail = cfg["precision"] if _on_gpu(cfg) else "ddp with local BN on CPU"
    step_time = (f"step time; {_where(cfg)}, {detail}", panels)
    publish(out, record, title(record), body, {"step_time.png": step_time})
    if curves:  # none with --timing-only
        curves_title = "accuracy runs (last epoch: the one-process test)"
        plot_estimates(out / "curves.png", _curve_panels(curves, variants), curves_title)
