"""CIFAR train-augmentation throughput: torchvision's per-sample PIL pipeline vs batched tensor ops.

Both paths produce the same thing from uint8 CIFAR images: a normalised float batch after a
4-px-padded random crop and a random horizontal flip. Measured as images per second through a
DataLoader (what a training step waits for), on CPU, median of repeats after a warm-up epoch:

- ``pil_workers0``: PIL per sample (RandomCrop, RandomHorizontalFlip, ToTensor, Normalize) in the
  main process;
- ``pil_workers2``: the same in 2 DataLoader worker processes (competing with training for cores);
- ``batched``: uint8 tensors collated, then ``lit_cifar.transforms.augment`` + ``normalize`` on
  the whole batch (what ``CIFAR100DataModule.on_after_batch_transfer`` does).

Target: batched >= 3x the per-sample path in the main process (the choice in lit_cifar.data).

    python -m benchmarks.data_pipeline                      # full size, writes benchmarks/results/data_pipeline/
    python -m benchmarks.data_pipeline --images 2048 --repeats 3   # quick
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import lightning
import numpy as np
import torch
import torchvision
from PIL import Image
from torch.utils.data import DataLoader, Dataset
from torchvision import transforms as T

from lit_cifar.data import TensorImageDataset
from lit_cifar.transforms import CIFAR100_MEAN, CIFAR100_STD, augment, normalize

TARGET_SPEEDUP = 3.0


class _PILDataset(Dataset):
    """torchvision-style CIFAR dataset: HWC uint8 array -> PIL image -> per-sample transforms."""

    def __init__(self, images_hwc: np.ndarray, labels: np.ndarray) -> None:
        self.images, self.labels = images_hwc, labels
        self.transform = T.Compose([T.RandomCrop(32, padding=4), T.RandomHorizontalFlip(), T.ToTensor(),
                                    T.Normalize(CIFAR100_MEAN, CIFAR100_STD)])

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        return self.transform(Image.fromarray(self.images[i])), int(self.labels[i])


def _epoch_seconds(loader: DataLoader, batched: bool) -> float:
    start = time.perf_counter()
    for images, _ in loader:
        if batched:
            images = normalize(augment(images))
    return time.perf_counter() - start


def _measure(loaders: dict[str, tuple[DataLoader, bool]], repeats: int) -> dict[str, float]:
    """Median epoch seconds per path; repeats interleave the paths so load drift hits all alike."""
    for loader, batched in loaders.values():
        _epoch_seconds(loader, batched)  # warm-up: worker start-up, allocator, first-call overheads
    times: dict[str, list[float]] = {name: [] for name in loaders}
    for _ in range(repeats):
        for name, (loader, batched) in loaders.items():
            times[name].append(_epoch_seconds(loader, batched))
    return {name: statistics.median(values) for name, values in times.items()}


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def run(num_images: int, batch_size: int, repeats: int, threads: int) -> dict:
    torch.manual_seed(0)
    torch.set_num_threads(threads)
    images = torch.randint(0, 256, (num_images, 3, 32, 32), dtype=torch.uint8)
    labels = torch.randint(0, 100, (num_images,))
    pil = _PILDataset(images.permute(0, 2, 3, 1).numpy().copy(), labels.numpy())
    loaders = {
        "pil_workers0": (DataLoader(pil, batch_size, shuffle=True), False),
        "pil_workers2": (DataLoader(pil, batch_size, shuffle=True, num_workers=2, persistent_workers=True), False),
        "batched": (DataLoader(TensorImageDataset(images, labels), batch_size, shuffle=True), True),
    }
    seconds = _measure(loaders, repeats)
    throughput = {name: num_images / s for name, s in seconds.items()}
    return {
        "images_per_s": throughput,
        "speedup_batched_vs_pil_workers0": throughput["batched"] / throughput["pil_workers0"],
        "speedup_batched_vs_pil_workers2": throughput["batched"] / throughput["pil_workers2"],
        "target_speedup": TARGET_SPEEDUP,
        "config": {"images": num_images, "batch_size": batch_size, "repeats": repeats, "torch_threads": threads},
        "environment": {"cpu": _cpu_model(), "cores": os.cpu_count(),
                        "torch": torch.__version__, "torchvision": torchvision.__version__,
                        "lightning": lightning.__version__, "python": platform.python_version(),
                        "device": "cpu", "world_size": 1, "backend": "none"},
        "command": "python -m benchmarks.data_pipeline " + " ".join(sys.argv[1:]),
    }


def _markdown(result: dict) -> str:
    rows = "\n".join(f"| {name} | {value:,.0f} |" for name, value in result["images_per_s"].items())
    speedup, target = result["speedup_batched_vs_pil_workers0"], result["target_speedup"]
    verdict = "met" if speedup >= target else f"MISSED by {target - speedup:.2f}x"
    env = ", ".join(f"{k}={v}" for k, v in result["environment"].items())
    cfg = ", ".join(f"{k}={v}" for k, v in result["config"].items())
    return (f"# Train augmentation throughput (CPU)\n\nCommand: `{result['command']}`\n\n"
            f"Environment: {env}\n\nConfig: {cfg}\n\n| path | images/s (median) |\n|---|---|\n{rows}\n\n"
            f"Batched vs PIL per-sample (main process): **{speedup:.1f}x** (target >= {target:.0f}x: {verdict}); "
            f"vs PIL with 2 workers: {result['speedup_batched_vs_pil_workers2']:.1f}x.\n\n"
            "Caveat: measured on a shared 2-core machine; other processes add noise to every row.\n")


def _plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3))
    names, values = zip(*result["images_per_s"].items())
    ax.bar(names, values, color=["#999999", "#777777", "#1f77b4"])
    ax.set_ylabel("images / s")
    ax.set_title("CIFAR train augmentation, CPU")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=10_240)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads of the main process")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/data_pipeline"))
    args = parser.parse_args()
    result = run(args.images, args.batch_size, args.repeats, args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / "results.md").write_text(_markdown(result))
    _plot(result, args.out / "throughput.png")
    print(_markdown(result))


if __name__ == "__main__":
    main()
