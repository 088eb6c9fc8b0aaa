"""Markdown table, target verdicts and plot for ``python -m benchmarks.syncbn`` (see that module).

Everything is derived from the ``results.json`` record, so a re-run on another machine rewrites
numbers, verdicts and caveats together.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 - the backend must be chosen first

CPU_TIME_TARGET = 1.2  # custom / (local BN + 2 all-reduces of 2C+1 floats)
GPU_TIME_TARGET = 0.9  # custom / torch.nn.SyncBatchNorm
GPU_MEMORY_TARGET = 1.0


def _targets(row: dict) -> list[tuple[str, float, float]]:
    """(name, measured ratio, target) for one configuration."""
    if "floor_s" in row:
        return [("time / floor", row["custom_s"] / row["floor_s"], CPU_TIME_TARGET)]
    return [
        ("time / nn.SyncBatchNorm", row["custom_s"] / row["torch_syncbn_s"], GPU_TIME_TARGET),
        ("peak memory / nn.SyncBatchNorm",
         row["custom_peak_bytes"] / max(row["torch_syncbn_peak_bytes"], 1), GPU_MEMORY_TARGET),
    ]


def _verdict(ratio: float, target: float) -> str:
    if ratio <= target:
        return f"met ({ratio:.2f} <= {target})"
    return f"MISSED by {100 * (ratio / target - 1):.0f}% ({ratio:.2f} > {target})"


def _ms(seconds: float) -> str:
    return f"{1e3 * seconds:.3f}"


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.2f}"


def _table(record: dict) -> list[str]:
    rows = record["results"]
    cpu = "floor_s" in rows[0]
    if cpu:
        header = ("| shape per rank | custom ms | local BN ms | 2 all-reduces ms | floor ms | custom / floor "
                  "| custom peak MiB | local peak MiB | target |")
    else:
        header = ("| shape per rank | custom ms | nn.SyncBatchNorm ms | time ratio | custom peak MiB "
                  "| nn.SyncBatchNorm peak MiB | memory ratio | target |")
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    for row in rows:
        shape = "x".join(map(str, row["shape"]))
        verdicts = "; ".join(f"{name}: {_verdict(r, t)}" for name, r, t in _targets(row))
        if cpu:
            cells = [shape, _ms(row["custom_s"]), _ms(row["local_s"]), _ms(row["all_reduce_x2_s"]),
                     _ms(row["floor_s"]), f"{row['custom_s'] / row['floor_s']:.2f}",
                     _mib(row["custom_peak_bytes"]), _mib(row["local_peak_bytes"]), verdicts]
        else:
            ratios = _targets(row)
            cells = [shape, _ms(row["custom_s"]), _ms(row["torch_syncbn_s"]), f"{ratios[0][1]:.2f}",
                     _mib(row["custom_peak_bytes"]), _mib(row["torch_syncbn_peak_bytes"]),
                     f"{ratios[1][1]:.2f}", verdicts]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _summary(record: dict) -> list[str]:
    checks = [(name, ratio, target) for row in record["results"] for name, ratio, target in _targets(row)]
    missed = [(name, ratio, target) for name, ratio, target in checks if ratio > target]
    lines = [f"**Targets met in {len(checks) - len(missed)} of {len(checks)} checks.**"]
    if missed:
        worst = max(missed, key=lambda m: m[1] / m[2])
        lines.append(f"Worst miss: {worst[0]} = {worst[1]:.2f} vs target {worst[2]} "
                     f"({100 * (worst[1] / worst[2] - 1):.0f}% over).")
    return lines


def _caveats(record: dict) -> list[str]:
    env, load = record["environment"], record["load_average"]
    busy = max(load["before"][0], load["after"][0])
    lines = []
    if busy > 0.5 * env["cpu_count"]:
        lines.append(f"- The machine was busy during this run (1-min load average up to {busy:.1f} on "
                     f"{env['cpu_count']} cores): absolute times are inflated and noisy; the ratios "
                     "come from interleaved timings in the same iterations but still carry that noise.")
    if record["config"]["device"] == "cpu":
        lines.append("- CPU peak memory is extra peak RSS over one forward+backward (page granularity, "
                     "glibc mmap threshold fixed at 128 KiB for that measurement only).")
    return lines


def _plot(record: dict, path: Path) -> None:
    rows = record["results"]
    labels = ["x".join(map(str, row["shape"])) for row in rows]
    baseline = "floor_s" if "floor_s" in rows[0] else "torch_syncbn_s"
    target = CPU_TIME_TARGET if baseline == "floor_s" else GPU_TIME_TARGET
    fig, (ax_time, ax_ratio) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    series = ["custom_s", "local_s", baseline] if baseline == "floor_s" else ["custom_s", baseline]
    width = 0.8 / len(series)
    for i, key in enumerate(series):
        ax_time.bar([x + i * width for x in range(len(rows))], [1e3 * row[key] for row in rows],
                    width, label=key.removesuffix("_s"))
    ax_time.set_yscale("log")
    ax_time.set_ylabel("forward+backward, ms (median, max over ranks)")
    ax_time.legend()
    ax_ratio.bar(range(len(rows)), [row["custom_s"] / row[baseline] for row in rows])
    ax_ratio.axhline(target, color="red", linestyle="--", label=f"target {target}x")
    ax_ratio.set_ylabel(f"custom / {baseline.removesuffix('_s')}")
    ax_ratio.set_xticks(range(len(rows)), labels, rotation=45, ha="right")
    ax_ratio.legend()
    config = record["config"]
    fig.suptitle(f"SyncBatchNorm, {config['world_size']} ranks, {config['device']} / {config['backend']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write(record: dict, out: Path) -> None:
    """Write ``README.md`` and ``syncbn.png`` for ``record`` into ``out``."""
    config, env = record["config"], record["environment"]
    lines = [
        "# SyncBatchNorm: forward+backward time and peak memory",
        "",
        f"Command: `{record['command']}`",
        "",
        f"- Device: {config['device']} ({', '.join(env['gpus']) or env['cpu']}), backend "
        f"{config['backend']}, world size {config['world_size']}, {config['threads']} thread(s) per rank",
        f"- torch {env['versions'].get('torch')}, lightning {env['versions'].get('lightning')}, "
        f"Python {env['python']}, {env['platform']}",
        f"- {config['iters']} timed iterations after {config['warmup']} warm-up; median per rank, "
        f"then max over ranks; methods interleaved within each iteration. Wall time "
        f"{record['wall_s']:.0f} s.",
        "",
        *_summary(record),
        "",
        *_table(record),
        "",
        *_caveats(record),
        "",
        "![time and ratio per configuration](syncbn.png)",
    ]
    (out / "README.md").write_text("\n".join(lines) + "\n")
    _plot(record, out / "syncbn.png")
