"""PNG charts of the ``custom_ddp`` vs ``ddp`` comparison, in the harness's one plot style."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.compare_runs import VARIANTS
from benchmarks.harness import plot_style, save_figure

__all__ = ["plot_curves", "plot_step_time"]

COLORS = {"custom_ddp": "tab:blue", "custom_ddp_localbn": "tab:cyan", "ddp_default": "tab:orange",
          "ddp_tuned": "tab:red", "single": "tab:gray"}
_PANELS = (("loss", 1.0, "train/loss_epoch", "val/loss", "test/loss"),
           ("top-1 accuracy (%)", 100.0, "train/acc1_epoch", "val/acc1", "test/acc1"))


def plot_step_time(analysis: dict[str, dict[str, Any]], path: Path, comparable: bool) -> None:
    """Median step time per variant and accumulation, with 95 % CI error bars."""
    with plot_style() as plt:
        fig, ax = plt.subplots(figsize=(9, 4))
        settings = list(analysis)
        variants = [v for v in VARIANTS if all(v in analysis[a]["step_s"] for a in settings)]
        width = 0.8 / len(variants)
        for i, variant in enumerate(variants):
            steps = [analysis[a]["step_s"][variant] for a in settings]
            xs = [x + (i - (len(variants) - 1) / 2) * width for x in range(len(settings))]
            heights = [s["value"] * 1e3 for s in steps]
            errors = [[(s["value"] - s["low"]) * 1e3 for s in steps], [(s["high"] - s["value"]) * 1e3 for s in steps]]
            ax.bar(xs, heights, width, yerr=errors, capsize=3, color=COLORS[variant], label=VARIANTS[variant].label)
        ax.set_xticks(range(len(settings)), [f"accumulate {a}" for a in settings])
        title = "optimizer step time, median and 95 % CI (2 CPU processes; ddp uses local BN on CPU)"
        ax.set(ylabel="ms", title=title if comparable else "NOT COMPARABLE (busy machine): " + title)
        ax.legend(ncol=3, fontsize=8)
        save_figure(fig, path)


def plot_curves(curves: dict[str, dict[str, list[tuple[int, float]]]], path: Path) -> None:
    """Loss and accuracy of the accuracy runs per epoch (solid: val, dashed: train, star: final test)."""
    with plot_style() as plt:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        for ax, (title, scale, *tags) in zip(axes, _PANELS):
            for name, series in curves.items():
                last_epoch = 1
                for tag, style in zip(tags[:2], ("--", "-")):
                    points = series.get(tag, [])
                    last_epoch = max(last_epoch, len(points))
                    ax.plot(range(1, len(points) + 1), [v * scale for _, v in points], color=COLORS[name],
                            linestyle=style, marker=".", label=f"{VARIANTS[name].label} {tag.split('/')[0]}")
                for _, value in series.get(tags[2], []):
                    ax.plot([last_epoch], [value * scale], color=COLORS[name], marker="*", markersize=12,
                            linestyle="none", label=f"{VARIANTS[name].label} test")
            ax.set(title=f"{title}: SYNTHETIC stand-in data, not CIFAR-100", xlabel="epoch")
            ax.legend(fontsize=7)
        save_figure(fig, path)
