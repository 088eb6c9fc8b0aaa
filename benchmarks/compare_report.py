"""Analysis and Markdown of the ``custom_ddp`` vs ``ddp`` comparison (intervals from :mod:`benchmarks.harness`).

A data-parallel step is as slow as its slowest rank, so a step's time is the maximum over ranks
of that step's time on each rank (``BenchmarkMonitor`` keeps every rank's raw step times); the
steps of all rounds of a variant are pooled. Derived numbers, each with a bootstrap 95 % CI:

- step-time ratios against named anchors (``ddp_default``, ``ddp_tuned``);
- exposed communication: a 2-process variant's median step minus the 1-process median step at
  the same per-process batch (what communication and waiting add, overlapped or not);
- scaling efficiency: 2-process throughput / (2 x 1-process throughput), which at the same
  per-process batch is ``step(1 process) / step(2 processes)``.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from benchmarks.compare_runs import VARIANTS
from benchmarks.harness import (
    difference_ci, fmt_estimate, markdown_header, median_ci, ratio_ci, slowest_rank, table,
)

__all__ = ["analyse", "read_scalars", "render_markdown", "step_samples"]

CURVES = ("train/loss_epoch", "train/acc1_epoch", "val/loss", "val/acc1", "test/loss", "test/acc1")
# (numerator, denominator): every headline ratio names its anchor.
RATIOS = (("custom_ddp", "ddp_default"), ("custom_ddp", "ddp_tuned"), ("custom_ddp_localbn", "ddp_tuned"),
          ("custom_ddp", "custom_ddp_localbn"))
TWO_PROCESS = ("custom_ddp", "custom_ddp_localbn", "ddp_default", "ddp_tuned")


def step_samples(runs: list[dict[str, Any]]) -> list[float]:
    """Per-step times (max over ranks) of every round of one variant, pooled."""
    return [step for run in runs for step in slowest_rank(run["benchmark"]["step_s_per_rank"])]


def _estimate(e: Any) -> dict[str, float]:
    return asdict(e)


def analyse(timing: dict[str, dict[str, list[dict[str, Any]]]]) -> dict[str, dict[str, Any]]:
    """Per accumulation setting: step medians, anchored ratios, exposed communication, scaling efficiency."""
    analysis: dict[str, dict[str, Any]] = {}
    for acc, by_variant in timing.items():
        samples = {variant: step_samples(runs) for variant, runs in by_variant.items()}
        row: dict[str, Any] = {"step_s": {v: _estimate(median_ci(s)) for v, s in samples.items()}}
        row["ratios"] = {f"{a}/{b}": _estimate(ratio_ci(samples[a], samples[b]))
                         for a, b in RATIOS if a in samples and b in samples}
        if "single" in samples:
            row["exposed_comm_s"] = {v: _estimate(difference_ci(samples[v], samples["single"]))
                                     for v in TWO_PROCESS if v in samples}
            row["scaling_efficiency"] = {v: _estimate(ratio_ci(samples["single"], samples[v]))
                                         for v in TWO_PROCESS if v in samples}
        analysis[acc] = row
    return analysis


def read_scalars(log_dir: Path, tags: tuple[str, ...] = CURVES) -> dict[str, list[tuple[int, float]]]:
    """``(step, value)`` series of the wanted TensorBoard tags found in ``log_dir``."""
    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    events.Reload()
    present = set(events.Tags()["scalars"])
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in tags if tag in present}


def headline(analysis: dict[str, dict[str, Any]], accuracy: dict[str, Any]) -> dict[str, Any]:
    """The flat numbers the README quotes (generated from this record, never typed by hand)."""
    out: dict[str, Any] = {}
    for acc, row in analysis.items():
        for name, estimate in row["ratios"].items():
            out[f"step_ratio_{name.replace('/', '_vs_')}_acc{acc}"] = estimate
        for variant, estimate in row.get("scaling_efficiency", {}).items():
            out[f"scaling_efficiency_{variant}_acc{acc}"] = estimate
    for variant, numbers in accuracy.items():
        out[f"test_acc1_{variant}"] = numbers.get("test_acc1")
    return out


def _ms(e: dict[str, float]) -> str:
    return fmt_estimate(e, scale=1e3, digits=1)


def _timing_tables(analysis: dict[str, dict[str, Any]]) -> list[str]:
    lines = []
    for acc, row in analysis.items():
        rows = []
        for variant, step in row["step_s"].items():
            exposed = row.get("exposed_comm_s", {}).get(variant)
            efficiency = row.get("scaling_efficiency", {}).get(variant)
            rows.append([VARIANTS[variant].label, _ms(step), step["n"], _ms(exposed) if exposed else "–",
                         fmt_estimate(efficiency) if efficiency else "–"])
        lines += [f"### accumulate {acc}", "",
                  *table(["variant", "step (ms)", "steps", "exposed comm. (ms)", "scaling efficiency"], rows), "",
                  *table(["ratio of median step times", "value [95 % CI]"],
                         [[name, fmt_estimate(e)] for name, e in row["ratios"].items()]), ""]
    return lines


def render_markdown(record: dict[str, Any]) -> str:
    """The whole report; ``record`` is what :mod:`benchmarks.compare` saves as ``results.json``."""
    cfg = record["config"]
    lines = markdown_header(record, f"custom_ddp vs Lightning ddp: {cfg['net']} net, SYNTHETIC data, 2 CPU processes")
    lines += ["Synthetic stand-in data (official CIFAR-100 layout, not CIFAR-100): accuracies are not CIFAR-100 "
              "results. On CPU torch.nn.SyncBatchNorm cannot run, so every ddp variant uses LOCAL BatchNorm; "
              "`custom_ddp (local BN)` vs `ddp tuned` is the like-for-like comparison of the gradient sync, and "
              "`custom_ddp / custom_ddp_localbn` is what synchronising BatchNorm costs.", "",
              "## Variants", "", *[f"- **{v.label}** (`{k}`): {v.description}" for k, v in VARIANTS.items()],
              "", f"Timing: {cfg['rounds']} interleaved rounds per setting, each a fresh `train.py fit` of "
              f"{cfg['warmup_steps']} warm-up + {cfg['steps']} timed optimizer steps (batch {cfg['batch_size']} per "
              "process); a step's time is the max over ranks; data loading excluded.", "",
              "## Step time", "", *_timing_tables(record["analysis"])]
    lines += ["## Accuracy (same seed, data and schedule)", "",
              *table(["variant", "epochs", "accumulate", "final test top-1 (%)", "final test loss"],
                     [[VARIANTS[v].label, cfg["accuracy_epochs"], a["accumulate"], f"{a['test_acc1']:.1f}",
                       f"{a['test_loss']:.3f}"] for v, a in record["accuracy"].items()]), "",
              "![step time](step_time.png)", "", "![curves](curves.png)", "",
              f"TensorBoard, the accuracy runs side by side: `tensorboard --logdir {cfg['out']}/tb`", ""]
    if record.get("collectives"):
        lines += _collective_tables(record["collectives"])
    return "\n".join(lines) + "\n"


def _collective_tables(collectives: dict[str, Any]) -> list[str]:
    """Count and bytes per optimizer step by source, per net: exact, whatever the machine."""
    lines = [f"## Collectives per optimizer step at accumulate {collectives['accumulate']}, by source", "",
             "Counted by the profiler on rank 0 (`callbacks.collective_count`), the last of 3 steps; bytes are "
             "this rank's payload. `lightning_sigterm` is Lightning's own per-batch broadcast, paid by every "
             "strategy.", ""]
    for net, by_variant in collectives["nets"].items():
        sources = sorted({s for run in by_variant.values() for s in run["counts"]})
        rows = [[source, *(f"{run['counts'].get(source, 0)} / {_bytes(run['bytes'].get(source, 0))}"
                           for run in by_variant.values())] for source in sources]
        rows.append(["**total**", *(f"{sum(run['counts'].values())} / {_bytes(sum(run['bytes'].values()))}"
                                    for run in by_variant.values())])
        lines += [f"### {net}", "", *table(["source", *(VARIANTS[v].label for v in by_variant)], rows), ""]
    return lines


def _bytes(n: float) -> str:
    for unit, size in (("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"
