"""PNG charts of the ``custom_ddp`` vs ``ddp`` comparison (matplotlib, Agg backend)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only; no display on CI or a remote box
import matplotlib.pyplot as plt  # noqa: E402

__all__ = ["plot_curves", "plot_time_memory"]

COLORS = {"custom_ddp": "tab:blue", "ddp": "tab:orange"}
# (title, y scale, train tag, val tag, test tag)
_PANELS = (("loss", 1.0, "train/loss_epoch", "val/loss", "test/loss"),
           ("top-1 accuracy (%)", 100.0, "train/acc1_epoch", "val/acc1", "test/acc1"))


def plot_curves(curves: dict[str, dict[str, list[tuple[int, float]]]], path: Path) -> None:
    """Loss and accuracy of both runs per epoch (solid: val, dashed: train, star: final test)."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, (title, scale, *tags) in zip(axes, _PANELS):
        for name, series in curves.items():
            last_epoch = 1
            for tag, style in zip(tags[:2], ("--", "-")):
                points = series.get(tag, [])
                last_epoch = max(last_epoch, len(points))
                ax.plot(range(1, len(points) + 1), [v * scale for _, v in points], color=COLORS[name],
                        linestyle=style, marker=".", label=f"{name} {tag.split('/')[0]}")
            for _, value in series.get(tags[2], []):
                ax.plot([last_epoch], [value * scale], color=COLORS[name], marker="*", markersize=12,
                        linestyle="none", label=f"{name} test")
        ax.set(title=title, xlabel="epoch")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _bars(ax: Any, groups: list[str], values: dict[str, list[float]], title: str, ylabel: str) -> None:
    width = 0.38
    for i, (name, heights) in enumerate(values.items()):
        xs = [x + (i - 0.5) * width for x in range(len(groups))]
        bars = ax.bar(xs, heights, width, color=COLORS[name], label=name)
        ax.bar_label(bars, fmt="%.1f", fontsize=7)
    ax.set_xticks(range(len(groups)), groups)
    ax.set(title=title, ylabel=ylabel)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="best")


def plot_time_memory(sweep: list[dict[str, Any]], main: dict[str, dict[str, float]], path: Path) -> None:
    """Step time per accumulation setting, epoch time and peak memory, both strategies."""
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    names = list(COLORS)
    _bars(axes[0], [f"acc {row['accumulate']}" for row in sweep],
          {n: [row[n]["step_s"] * 1e3 for row in sweep] for n in names},
          "optimizer step time (median)", "ms")
    _bars(axes[1], ["epoch"], {n: [main[n]["epoch_s"]] for n in names}, "epoch time (median)", "s")
    _bars(axes[2], ["peak", "above pre-wrap usage"],
          {n: [main[n]["peak_memory_mb"], main[n]["peak_above_start_mb"]] for n in names},
          "peak memory (max over ranks)", "MiB")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
