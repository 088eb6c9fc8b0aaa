"""Tables, target verdicts and plots for ``python -m benchmarks.grad_sync`` (see that module).

Everything is derived from the ``results.json`` record, so a re-run on another machine rewrites
the numbers, the verdicts and the plots together.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 - the backend must be chosen first

from callbacks.stats import summarize  # noqa: E402

STEP_RATIO_TARGET = 1.0
HIDDEN_TARGET = 0.70
ANCHOR = "ddp"
_MiB = 2**20


def _hidden(exposed_s: float, comm_s: float) -> float:
    """Share of ``comm_s`` that did not show up as ``exposed_s``, clipped to [0, 1]."""
    if not comm_s > 0 or math.isnan(exposed_s):
        return math.nan
    return min(1.0, max(0.0, 1.0 - exposed_s / comm_s))


def variant_rows(samples: dict[str, dict]) -> list[dict[str, Any]]:
    """One row per variant: medians, the ratio to DDP, exposed and hidden communication."""
    compute = summarize(samples["none"]["step_s"])["median"]
    anchor = summarize(samples[ANCHOR]["step_s"])["median"] if ANCHOR in samples else math.nan
    rows = []
    for variant, s in samples.items():
        step = summarize(s["step_s"])
        comm = summarize(s["comm_alone_s"])["median"]
        exposed = max(0.0, step["median"] - compute)
        wait = summarize(s["wait_s"])["median"] if s["buckets"] is not None else math.nan
        rows.append({
            "variant": variant, "step_ms": step["median"] * 1e3, "p10_ms": step["p10"] * 1e3,
            "p90_ms": step["p90"] * 1e3, "vs_ddp": step["median"] / anchor,
            "wait_ms": wait * 1e3, "comm_alone_ms": comm * 1e3, "exposed_ms": exposed * 1e3,
            "hidden_wait": _hidden(wait, comm), "hidden_step": _hidden(exposed, comm),
            "peak_mib": s["peak_bytes"] / _MiB, "buckets": s["buckets"],
        })
    return rows


def _plain_bucketed(rows: list[dict]) -> list[dict]:
    return [r for r in rows if r["variant"].startswith("bucketed_") and r["variant"].endswith("mb")]


def best_bucketed(rows: list[dict]) -> dict | None:
    """The plain ``bucketed_<cap>mb`` variant with the lowest median step time."""
    return min(_plain_bucketed(rows), key=lambda r: r["step_ms"], default=None)


def _meets_all(row: dict, ddp: dict) -> bool:
    return (row["vs_ddp"] <= STEP_RATIO_TARGET and row["hidden_wait"] >= HIDDEN_TARGET
            and row["peak_mib"] < ddp["peak_mib"])


def _verdict(ok: bool, missed_by: str) -> str:
    return "yes" if ok else f"**no**, missed by {missed_by}"


def target_lines(model: str, rows: list[dict]) -> list[str]:
    best = best_bucketed(rows)
    ddp = next((r for r in rows if r["variant"] == ANCHOR), None)
    if best is None or ddp is None:
        return [f"| {model} | bucketed and ddp not both measured | - | - |"]
    name = best["variant"]
    ratio, hidden = best["vs_ddp"], best["hidden_wait"]
    extra_mib = best["peak_mib"] - ddp["peak_mib"]
    lines = [
        f"| {model} | {name} step time <= {STEP_RATIO_TARGET:.1f}x DDP | {ratio:.2f}x "
        f"| {_verdict(ratio <= STEP_RATIO_TARGET, f'{ratio / STEP_RATIO_TARGET - 1:.0%}')} |",
        f"| {model} | {name} hides >= {HIDDEN_TARGET:.0%} of communication (1 - finish() wait / "
        f"comm alone) | {hidden:.0%} (step-based: {_pct(best['hidden_step'])}) "
        f"| {_verdict(hidden >= HIDDEN_TARGET, f'{(HIDDEN_TARGET - hidden) * 100:.0f} points')} |",
        f"| {model} | {name} peak memory < DDP (defaults) | {best['peak_mib']:.0f} vs "
        f"{ddp['peak_mib']:.0f} MiB | {_verdict(extra_mib < 0, f'{extra_mib:.0f} MiB')} |",
    ]
    # The caps' step times are often within noise of each other: say which meet all three.
    passing = [r["variant"] for r in _plain_bucketed(rows) if _meets_all(r, ddp)]
    lines.append(f"| {model} | some bucket cap meets all three at once | "
                 f"{', '.join(passing) or 'none'} | {'yes' if passing else '**no**'} |")
    return lines


def _pct(share: float) -> str:
    return "-" if math.isnan(share) else f"{share:.0%}"


def _ms(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.1f}"


def _variant_table(rows: list[dict]) -> list[str]:
    lines = ["| variant | step ms (p10-p90) | x DDP | finish() wait ms | comm alone ms "
             "| hidden (wait) | exposed ms | hidden (step) | peak MiB | buckets |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['variant']} | {r['step_ms']:.1f} ({r['p10_ms']:.1f}-{r['p90_ms']:.1f}) "
            f"| {r['vs_ddp']:.2f} | {_ms(r['wait_ms'])} | {_ms(r['comm_alone_ms'])} "
            f"| {_pct(r['hidden_wait'])} | {r['exposed_ms']:.1f} | {_pct(r['hidden_step'])} "
            f"| {r['peak_mib']:.0f} | {r['buckets'] if r['buckets'] is not None else '-'} |"
        )
    return lines


def _zero_table(rows: list[dict]) -> list[str]:
    lines = ["| model | ranks | params MiB | AdamW state unsharded MiB | sharded MiB per rank "
             "| max rank / unsharded |", "|---|---|---|---|---|---|"]
    for r in rows:
        per_rank = r["sharded_bytes_per_rank"]
        lines.append(
            f"| {r['model']} | {r['world_size']} | {r['param_bytes'] / _MiB:.1f} "
            f"| {r['unsharded_bytes'] / _MiB:.1f} "
            f"| {', '.join(f'{b / _MiB:.1f}' for b in per_rank)} "
            f"| {max(per_rank) / r['unsharded_bytes']:.3f} (ideal {1 / r['world_size']:.3f}) |"
        )
    return lines


def _ddp_settings(record: dict, variant: str) -> Any:
    found = [s[variant]["ddp_settings"] for s in record["steps"].values() if variant in s]
    return found[0] if found else "not measured"


def _environment_lines(record: dict) -> list[str]:
    env, cfg = record["environment"], record["config"]
    versions = ", ".join(f"{k} {v}" for k, v in env["versions"].items())
    load_start, load_end = (
        tuple(round(x, 2) for x in env[key]) for key in ("load_avg_start", "load_avg_end")
    )
    busy = load_start[0] > 1.0  # measured before the benchmark started: other work
    lines = [
        f"- Command: `{record['command']}`",
        f"- CPU: {env['cpu']}, {env['cpu_count']} logical cores; "
        f"GPUs: {', '.join(env['gpus']) or 'none'}",
        f"- Software: {versions}; Python {env['python']}",
        f"- World size {cfg['world_size']}, backend {cfg['backend']}, device {cfg['device']}, "
        f"{cfg['threads_per_process']} intra-op thread per rank, fork-started workers; optimizer "
        f"{cfg['optimizer']}; {cfg['warmup']} warm-up + {cfg['steps']} timed steps x "
        f"{cfg['rounds']} interleaved rounds; MLP {cfg['mlp_depth']}x{cfg['mlp_width']} batch "
        f"{cfg['mlp_batch']}/rank, "
        f"ResNet-18 (100 classes, 32x32) batch {cfg['resnet_batch']}/rank",
        f"- torch DDP anchor `ddp`: no options, effective {_ddp_settings(record, 'ddp')}; "
        f"`ddp_tuned`: {cfg['ddp_tuned_options']}, effective {_ddp_settings(record, 'ddp_tuned')}",
        f"- Load average (1/5/15 min) at start {load_start}, at end {load_end}; total "
        f"{env['total_wall_s']:.0f} s.",
    ]
    if busy:
        lines.append("- **Caveat: other work was loading the machine when this run started** "
                     "(1-minute load average > 1 before any rank ran): step times and overlap "
                     "figures are noisy; re-run on a quiet machine before quoting them.")
    return lines


def _plots(record: dict, out_dir: Path) -> None:
    models = list(record["steps"])
    fig, axes = plt.subplots(2, len(models), figsize=(6 * len(models), 8), squeeze=False)
    for col, model in enumerate(models):
        rows = variant_rows(record["steps"][model])
        names = [r["variant"] for r in rows]
        panels = (("step_ms", "median step time (ms)"), ("peak_mib", "peak memory (MiB)"))
        for row, (key, label) in enumerate(panels):
            ax = axes[row][col]
            ax.bar(names, [r[key] for r in rows],
                   color=["tab:gray" if n.startswith(("ddp", "none")) else "tab:blue"
                          for n in names])
            if row == 0:
                ax.bar(names, [r["exposed_ms"] for r in rows], color="tab:red", alpha=0.5,
                       label="exposed communication")
                ax.legend(fontsize=8)
            ax.set_title(f"{model}: {label}")
            ax.tick_params(axis="x", rotation=70, labelsize=7)
    fig.tight_layout()
    fig.savefig(out_dir / "grad_sync.png", dpi=110)
    plt.close(fig)


def _find(rows: list[dict], variant: str) -> dict | None:
    return next((r for r in rows if r["variant"] == variant), None)


def analysis_lines(model: str, rows: list[dict]) -> list[str]:
    """A few sentences per model, computed from the rows so that a re-run rewrites them."""
    best, ddp = best_bucketed(rows), _find(rows, ANCHOR)
    if best is None or ddp is None:
        return []
    lines = [f"- {model}: the fastest bucket cap, `{best['variant']}` (picked on this run's "
             f"noisy medians), runs at {best['vs_ddp']:.2f}x torch DDP's step time with a peak of "
             f"{best['peak_mib']:.0f} vs {ddp['peak_mib']:.0f} MiB (gradients live in the "
             "buckets; DDP's default keeps a second gradient-sized copy)."]
    tuned, zero1 = _find(rows, "ddp_tuned"), _find(rows, "bucketed_25mb_zero1")
    if tuned is not None:
        lines.append(f"  DDP with `gradient_as_bucket_view=True` and no buffer sync: "
                     f"{tuned['vs_ddp']:.2f}x, {tuned['peak_mib']:.0f} MiB.")
    if zero1 is not None:
        plain = _find(rows, "bucketed_25mb")
        slowdown = zero1["step_ms"] / plain["step_ms"]
        lines.append(f"  ZeRO-1 (SGD momentum sharded) costs {slowdown:.2f}x the step time of "
                     "`bucketed_25mb`: the parameter broadcast after the step is not overlapped "
                     "with anything.")
    return lines


def write(record: dict, out_dir: Path) -> None:
    """Write ``README.md`` and ``grad_sync.png`` for ``record`` into ``out_dir``."""
    lines = ["# Gradient synchronisation benchmark", "", *_environment_lines(record), "",
             "## Targets", "", "| model | target | measured | met? |", "|---|---|---|---|"]
    for model, samples in record["steps"].items():
        lines += target_lines(model, variant_rows(samples))
    lines += ["", "## Analysis", ""]
    for model, samples in record["steps"].items():
        lines += analysis_lines(model, variant_rows(samples))
    for model, samples in record["steps"].items():
        lines += ["", f"## {model}: per training step", "", *_variant_table(variant_rows(samples))]
    lines += [
        "", "Step: median over timed steps of the slower rank (forward, backward, finish(), "
        "optimizer step, zero_grad). `none`: the same training with no communication. comm "
        "alone: the variant's buckets all-reduced with nothing else running (for DDP: its "
        "25 MiB layout rebuilt with our bucket assignment). finish() wait: from the end of the "
        "last rank's backward to the end of the last finish() (a faster rank's own wait also "
        "covers the slower rank's backward, which is skew, not communication); hidden (wait) = "
        "1 - finish() wait / comm alone (SyncedDataParallel only; DDP waits inside backward). "
        "exposed = step - none; hidden (step) = 1 - exposed / comm alone, which also charges "
        "the slowdown communication causes to compute running beside it (the two share the CPU "
        "cores). Peak: RSS high-water mark above the built model (gradients, buckets, "
        "activations, optimizer state), max over ranks, from a separate untimed run with a fixed "
        "1 MiB glibc mmap threshold so freed tensors leave the RSS.",
        "", "## ZeRO-1: AdamW state per rank", "", *_zero_table(record["zero1"]),
        "", "![step time and memory](grad_sync.png)", "",
    ]
    (out_dir / "README.md").write_text("\n".join(lines))
    _plots(record, out_dir)
