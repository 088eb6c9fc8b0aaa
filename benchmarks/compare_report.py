"""Numbers, ratios, targets and the Markdown of the ``custom_ddp`` vs ``ddp`` comparison.

Reads what each training run left in its log directory: ``benchmark.json`` (written by
:class:`callbacks.BenchmarkMonitor`) and the TensorBoard scalars the LightningModule logged.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

__all__ = ["CURVES", "headline", "read_scalars", "ratio", "render_markdown", "targets"]

CURVES = ("train/loss_epoch", "train/acc1_epoch", "val/loss", "val/acc1", "test/loss", "test/acc1")
MB = 2**20

# (key, label, unit, lower is better); rows of the main table in this order.
ROWS = (
    ("epoch_s", "epoch time (median over epochs)", "s", True),
    ("step_s", "optimizer step time (median)", "ms", True),
    ("step_trimmed_s", "optimizer step time (10-90 % mean)", "ms", True),
    ("micro_batch_s", "micro-batch time (median)", "ms", True),
    ("data_wait_s", "data wait per step (median)", "ms", True),
    ("samples_per_s", "throughput, steady state (samples/s, all ranks)", "", False),
    ("peak_memory_mb", "peak memory (max over ranks)", "MiB", True),
    ("peak_above_start_mb", "peak memory above pre-wrap usage (what training adds)", "MiB", True),
    ("peak_reserved_mb", "peak CUDA reserved (max over ranks)", "MiB", True),
    ("val_acc1", "final val top-1 accuracy", "%", False),
    ("val_loss", "final val loss", "", True),
    ("test_acc1", "final test top-1 accuracy", "%", False),
    ("test_loss", "final test loss", "", True),
)


def read_scalars(log_dir: Path, tags: tuple[str, ...] = CURVES) -> dict[str, list[tuple[int, float]]]:
    """``(step, value)`` series of the wanted TensorBoard tags found in ``log_dir``."""
    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    events.Reload()
    present = set(events.Tags()["scalars"])
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in tags if tag in present}


def _last(curves: dict[str, list[tuple[int, float]]], tag: str, scale: float = 1.0) -> float:
    series = curves.get(tag)
    return series[-1][1] * scale if series else math.nan


def headline(benchmark: dict[str, Any], curves: dict[str, list[tuple[int, float]]]) -> dict[str, float]:
    """The compared numbers of one run (times in s, memory in MiB, accuracy in %)."""
    fit = benchmark["summary"]["global"]
    epochs = [e["global"]["time_s"] for e in benchmark["epochs"] if e["global"]["time_s"]]

    def num(value: Any) -> float:
        return math.nan if value is None else float(value)

    return {
        "epoch_s": statistics.median(epochs) if epochs else math.nan,
        "step_s": num(fit["step_s_median"]),
        "step_trimmed_s": num(fit["step_s_trimmed_mean"]),
        "micro_batch_s": num(fit["micro_batch_s_median"]),
        "data_wait_s": num(fit["data_wait_s_median"]),
        "samples_per_s": num(fit["steady_samples_per_s"]),
        "peak_memory_mb": num(fit["peak_bytes"]) / MB,
        "peak_above_start_mb": num(fit.get("peak_above_start_bytes")) / MB,
        "peak_reserved_mb": num(fit["peak_reserved_bytes"]) / MB,
        "val_acc1": _last(curves, "val/acc1", 100.0),
        "val_loss": _last(curves, "val/loss"),
        "test_acc1": _last(curves, "test/acc1", 100.0),
        "test_loss": _last(curves, "test/loss"),
    }


def ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator and not math.isnan(denominator) else math.nan


def targets(custom: dict[str, float], ddp: dict[str, float], on_gpu: bool) -> list[dict[str, Any]]:
    """The issue's targets for ``custom_ddp / ddp`` at the main accumulation setting."""
    accuracy = "test_acc1" if not math.isnan(custom["test_acc1"]) else "val_acc1"
    memory_limit = 0.85 if on_gpu else 1.0
    rows = [
        ("step time custom/ddp", ratio(custom["step_s"], ddp["step_s"]), 0.95, "ratio"),
        (f"peak memory custom/ddp ({'CUDA allocated' if on_gpu else 'RSS'})",
         ratio(custom["peak_memory_mb"], ddp["peak_memory_mb"]), memory_limit, "ratio"),
        (f"Δ final {accuracy.split('_')[0]} top-1 accuracy, absolute (pp)",
         abs(custom[accuracy] - ddp[accuracy]), 0.5, "pp"),
    ]
    out = []
    for name, measured, limit, unit in rows:
        met = not math.isnan(measured) and measured <= limit
        out.append({"target": name, "limit": limit, "measured": measured, "met": met,
                    "missed_by": 0.0 if met else measured - limit, "unit": unit})
    return out


def _fmt(value: float, unit: str = "") -> str:
    if value is None or math.isnan(value):
        return "–"
    if unit == "ms":
        return f"{value * 1e3:.1f}"
    return f"{value:.3f}" if abs(value) < 10 else f"{value:.1f}"


def _main_table(custom: dict[str, float], ddp: dict[str, float], name: str = "custom_ddp") -> list[str]:
    lines = [f"| metric | unit | {name} | ddp | {name} / ddp |", "|---|---|---:|---:|---:|"]
    for key, label, unit, _ in ROWS:
        if math.isnan(custom[key]) and math.isnan(ddp[key]):
            continue
        lines.append(f"| {label} | {unit} | {_fmt(custom[key], unit)} | {_fmt(ddp[key], unit)} | "
                     f"{_fmt(ratio(custom[key], ddp[key]))} |")
    return lines


def _sweep_table(sweep: list[dict[str, Any]]) -> list[str]:
    lines = ["| accumulate | custom_ddp step (ms) | ddp step (ms) | custom / ddp | "
             "custom_ddp per micro-batch (ms) | ddp per micro-batch (ms) |",
             "|---:|---:|---:|---:|---:|---:|"]
    for row in sweep:
        c, d = row["custom_ddp"], row["ddp"]
        lines.append(f"| {row['accumulate']} | {_fmt(c['step_s'], 'ms')} | {_fmt(d['step_s'], 'ms')} | "
                     f"{_fmt(ratio(c['step_s'], d['step_s']))} | "
                     f"{_fmt(c['step_s'] / row['accumulate'], 'ms')} | "
                     f"{_fmt(d['step_s'] / row['accumulate'], 'ms')} |")
    return lines


def _local_bn_section(result: dict[str, Any]) -> list[str]:
    """CPU only: custom_ddp without SyncBatchNorm vs ddp, and what syncing BN statistics costs."""
    local, ddp, custom = result.get("local_bn"), result["main"]["ddp"], result["main"]["custom_ddp"]
    if not local:
        return []
    lines = ["## Like-for-like on CPU: both with local BatchNorm", "",
             *_main_table(local, ddp, name="custom_ddp, local BN")]
    cost = custom["step_s"] - local["step_s"]
    accumulate = result["config"]["accumulate"]
    lines += ["", f"Synchronising BatchNorm statistics (2 collectives per micro-batch, {2 * accumulate} per "
              f"optimizer step) costs custom_ddp {_fmt(cost, 'ms')} ms per step here "
              f"({_fmt(ratio(custom['step_s'], local['step_s']))}x its local-BN step time); Lightning's "
              "ddp cannot pay that cost on CPU because torch.nn.SyncBatchNorm does not run there.", ""]
    return lines


def _target_table(rows: list[dict[str, Any]]) -> list[str]:
    lines = ["| target | limit | measured | met? |", "|---|---:|---:|---|"]
    for row in rows:
        verdict = "yes" if row["met"] else f"**no**, missed by {_fmt(row['missed_by'])} {row['unit']}"
        lines.append(f"| {row['target']} | ≤ {row['limit']} | {_fmt(row['measured'])} | {verdict} |")
    return lines


def render_markdown(result: dict[str, Any]) -> str:
    """The whole report; ``result`` is what :mod:`benchmarks.compare` saves as JSON."""
    env, cfg = result["environment"], result["config"]
    main = result["main"]
    versions = ", ".join(f"{k} {v}" for k, v in env["versions"].items())
    lines = [
        f"# custom_ddp vs Lightning ddp — {cfg['net']} net, {cfg['dataset']} data, "
        f"{cfg['devices']} processes",
        "",
        "## Infrastructure",
        f"- CPU: {env['cpu']} ({env['cpu_count']} cores); GPUs: {', '.join(env['gpus']) or 'none'}",
        f"- {versions}; Python {env['python']}; {env['platform']}",
        f"- accelerator `{cfg['accelerator']}`, backend `{result['backend']}`, world size {cfg['devices']}, "
        f"precision `{cfg['precision']}`, seed {cfg['seed']}",
        f"- load average (1 min) before / after: {result['load_before']:.2f} / {result['load_after']:.2f}"
        f" on {env['cpu_count']} cores; total wall time {result['wall_s'] / 60:.1f} min",
        "",
        "Reproduce (from the repository root):",
        "",
        f"    {result['command']}",
        "",
        "## Settings",
        *[f"- **{name}**: {desc}" for name, desc in result["strategy_notes"].items()],
        f"- both: same seed, data, net and hyper-parameters; accumulate {cfg['accumulate']}, "
        f"{cfg['epochs']} epoch(s); timing excludes the first {cfg['warmup_steps']} optimizer steps "
        "and validation",
        "",
        f"## Results at accumulate {cfg['accumulate']}",
        "",
        *_main_table(main["custom_ddp"], main["ddp"]),
        "",
        "## Targets",
        "",
        *_target_table(result["targets"]),
        "",
        *_local_bn_section(result),
        "## Step time vs gradient accumulation",
        "",
        *_sweep_table(result["sweep"]),
        "",
        "## Plots",
        "",
        "![loss and accuracy](curves.png)",
        "",
        "![time and memory](time_memory.png)",
        "",
        "TensorBoard, both runs side by side: `tensorboard --logdir " + result["tb_root"] + "`",
        "",
        "## Notes",
        *[f"- {note}" for note in result["notes"]],
        "",
        "## Runs",
        "",
        "| run | epochs | fit wall time (s) | command |",
        "|---|---:|---:|---|",
        *[f"| {name} | {run['epochs']} | {run['fit_wall_s']:.0f} | `python {run['fit_command']}` |"
          for name, run in result["runs"].items()],
    ]
    return "\n".join(lines) + "\n"
