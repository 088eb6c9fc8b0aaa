"""CIFAR train-augmentation throughput: torchvision's per-sample PIL pipeline vs batched tensor ops.

    python -m benchmarks.data_pipeline                              # writes benchmarks/results/data_pipeline/
    python -m benchmarks.data_pipeline --quick --out /tmp/data_pipeline   # smoke run

All paths produce the same thing from uint8 CIFAR images: a normalised float batch after a
4-px-padded random crop and a random horizontal flip. Measured as images per second through a
DataLoader epoch (what a training step waits for), on CPU:

- ``pil_main``: PIL per sample (RandomCrop, RandomHorizontalFlip, ToTensor, Normalize) in the
  main process;
- ``pil_2workers``: the same in 2 DataLoader worker processes (competing with training for cores);
- ``batched``: uint8 tensors collated, then ``lit_cifar.transforms.augment`` + ``normalize`` on
  the whole batch (what ``CIFAR100DataModule.on_after_batch_transfer`` does).

Timing goes through ``benchmarks.harness``: one warm-up epoch per path, then interleaved rounds
of one epoch per path; images/s medians and the ratios batched / pil_main, batched / pil_2workers
with bootstrap 95 % CIs. As a decomposition, the transforms alone (no DataLoader) are timed with
``torch.utils.benchmark`` (interleaved ``Timer.timeit`` samples). Target: batched >= 3x
pil_main (the choice in lit_cifar.data).
"""

from __future__ import annotations

import argparse
import itertools
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch.utils.benchmark import Timer
from torch.utils.data import DataLoader, Dataset
from torchvision import transforms as T

from benchmarks.harness import (
    fmt_estimate, interleave, make_record, markdown_header, median_ci, plot_style, ratio_ci, save_figure, table, wait_for_quiet, write_record,
)
from lit_cifar.data import TensorImageDataset
from lit_cifar.transforms import CIFAR100_MEAN, CIFAR100_STD, augment, normalize

TARGET_SPEEDUP = 3.0
FULL = {"images": 10_240, "batch_size": 128, "rounds": 10, "kernel_rounds": 20}
QUICK = {"images": 1_024, "batch_size": 128, "rounds": 3, "kernel_rounds": 6}
PATHS = ("pil_main", "pil_2workers", "batched")


def _pil_transform() -> T.Compose:
    return T.Compose([T.RandomCrop(32, padding=4), T.RandomHorizontalFlip(), T.ToTensor(),
                      T.Normalize(CIFAR100_MEAN, CIFAR100_STD)])


class _PILDataset(Dataset):
    """torchvision-style CIFAR dataset: HWC uint8 array -> PIL image -> per-sample transforms."""

    def __init__(self, images_hwc: np.ndarray, labels: np.ndarray) -> None:
        self.images, self.labels, self.transform = images_hwc, labels, _pil_transform()

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return self.transform(Image.fromarray(self.images[i])), int(self.labels[i])


def _epoch_images_per_s(loader: DataLoader, batched: bool) -> float:
    start, count = time.perf_counter(), 0
    for images, _ in loader:
        if batched:
            images = normalize(augment(images))
        count += len(images)
    return count / (time.perf_counter() - start)


def _loaders(images: torch.Tensor, labels: torch.Tensor, batch_size: int) -> dict[str, tuple[DataLoader, bool]]:
    pil = _PILDataset(images.permute(0, 2, 3, 1).numpy().copy(), labels.numpy())
    return {
        "pil_main": (DataLoader(pil, batch_size, shuffle=True), False),
        "pil_2workers": (DataLoader(pil, batch_size, shuffle=True, num_workers=2, persistent_workers=True), False),
        "batched": (DataLoader(TensorImageDataset(images, labels), batch_size, shuffle=True), True),
    }


def _kernel_samples(images: torch.Tensor, batch_size: int, rounds: int) -> dict[str, list[float]]:
    """Images/s of the transforms alone, no DataLoader: torch.utils.benchmark ``Timer.timeit`` calls
    (each after its own warm-up calls) of ~30-50 ms, interleaved like the epochs; one sample per call."""
    batch = images[:batch_size]
    arrays = itertools.cycle(batch.permute(0, 2, 3, 1).numpy())
    timers = {  # name: (images per statement, statements per sample, timer)
        "pil_transform": (1, 64, Timer("tf(Image.fromarray(next(arrays)))",
                                       globals={"arrays": arrays, "tf": _pil_transform(), "Image": Image})),
        "batched_transform": (batch_size, 4, Timer("normalize(augment(batch))", globals={
            "batch": batch, "normalize": normalize, "augment": augment})),
    }

    def sample(name: str, _: int) -> float:
        count, number, timer = timers[name]
        return count / timer.timeit(number).median

    return interleave(list(timers), rounds, sample)


def measure(cfg: dict[str, Any]) -> dict[str, list[float]]:
    """Images/s samples: one per interleaved epoch for each DataLoader path, one per block for the transforms."""
    torch.manual_seed(0)
    images = torch.randint(0, 256, (cfg["images"], 3, 32, 32), dtype=torch.uint8)
    labels = torch.randint(0, 100, (cfg["images"],))
    loaders = _loaders(images, labels, cfg["batch_size"])
    for loader, batched in loaders.values():  # warm-up: worker start-up, allocator, first-call overheads
        _epoch_images_per_s(loader, batched)
    samples = interleave(list(loaders), cfg["rounds"], lambda name, _: _epoch_images_per_s(*loaders[name]))
    return samples | _kernel_samples(images, cfg["batch_size"], cfg["kernel_rounds"])


def analyse(samples: dict[str, list[float]]) -> dict[str, Any]:
    """Medians per path and the speed-ups with CIs (ratios of median images/s)."""
    ratios = {"batched/pil_main": ("batched", "pil_main"), "batched/pil_2workers": ("batched", "pil_2workers"),
              "pil_2workers/pil_main": ("pil_2workers", "pil_main"),
              "batched_transform/pil_transform": ("batched_transform", "pil_transform")}
    return {
        "images_per_s": {name: asdict(median_ci(values)) for name, values in samples.items()},
        "speedups": {key: asdict(ratio_ci(samples[a], samples[b])) for key, (a, b) in ratios.items()},
        "samples_images_per_s": samples,
    }


def headline(result: dict[str, Any]) -> dict[str, Any]:
    """Flat README-ready numbers."""
    speedups, rates = result["speedups"], result["images_per_s"]
    return {"batched_vs_pil_main": speedups["batched/pil_main"],
            "batched_vs_pil_2workers": speedups["batched/pil_2workers"],
            "pil_2workers_vs_pil_main": speedups["pil_2workers/pil_main"],
            "transform_only_batched_vs_pil": speedups["batched_transform/pil_transform"],
            **{f"images_per_s_{name}": rates[name] for name in PATHS}}


def _markdown(record: dict[str, Any]) -> list[str]:
    cfg, speedups = record["config"], record["speedups"]
    main_speedup = speedups["batched/pil_main"]
    verdict = ("met" if main_speedup["low"] >= TARGET_SPEEDUP else
               "**missed**" if main_speedup["high"] < TARGET_SPEEDUP else "undecided (CI spans the target)")
    rates = [[name, fmt_estimate(e, digits=0)] for name, e in record["images_per_s"].items()]
    ratios = [[key.replace("/", " / "), fmt_estimate(e, digits=2)] for key, e in speedups.items()]
    return [*markdown_header(record, "CIFAR train augmentation throughput (CPU)"),
            f"{cfg['images']:,} random uint8 images, batch {cfg['batch_size']}, torch threads "
            f"{cfg['torch_threads']}; {cfg['rounds']} interleaved rounds of one epoch per path after a warm-up "
            f"epoch. `*_transform` rows: the transforms alone, no DataLoader: {cfg['kernel_rounds']} interleaved "
            "`torch.utils.benchmark` `Timer.timeit` samples each (64 single images / 4 batches per sample).", "",
            f"**Batched vs PIL per-sample in the main process: {fmt_estimate(main_speedup, digits=2)}x "
            f"(target >= {TARGET_SPEEDUP:.0f}x: {verdict}).**", "",
            *table(["path", "images/s, median [95 % CI]"], rates), "",
            *table(["speed-up", "ratio of medians [95 % CI]"], ratios), "",
            "![throughput](throughput.png)"]


def _plot(record: dict[str, Any], path: Path) -> None:
    rates = record["images_per_s"]
    with plot_style() as plt:
        fig, ax = plt.subplots(figsize=(6, 3.2))
        names = list(rates)
        ax.bar(names, [rates[n]["value"] for n in names], color=["C7", "C7", "C0", "C7", "C0"][: len(names)],
               yerr=[[rates[n]["value"] - rates[n]["low"] for n in names],
                     [rates[n]["high"] - rates[n]["value"] for n in names]], capsize=3)
        ax.set(ylabel="images / s (median, 95 % CI)", yscale="log", title="CIFAR train augmentation, CPU")
        ax.tick_params(axis="x", labelrotation=20)
        save_figure(fig, path)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.data_pipeline", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/data_pipeline"))
    parser.add_argument("--quick", action="store_true", help="smoke run: 1,024 images, 3 rounds")
    parser.add_argument("--images", type=int, help=f"images per epoch (default {FULL['images']:,})")
    parser.add_argument("--rounds", type=int, help=f"interleaved rounds (default {FULL['rounds']})")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads of the main process")
    parser.add_argument("--max-wait-s", type=float, help="wait this long for a quiet machine (300; --quick: 0)")
    args = parser.parse_args(argv)
    cfg = {**(QUICK if args.quick else FULL), "torch_threads": args.threads}
    cfg.update({k: v for k, v in (("images", args.images), ("rounds", args.rounds)) if v is not None})
    torch.set_num_threads(args.threads)
    quiet = wait_for_quiet(max_wait_s=args.max_wait_s if args.max_wait_s is not None else 0 if args.quick else 300)
    result = analyse(measure(cfg))
    record = make_record("data_pipeline", cfg, quiet.finish(), argv=argv, headline=headline(result), **result)
    lines = _markdown(record)
    write_record(args.out, record, lines)
    _plot(record, args.out / "throughput.png")
    print("\n".join(lines))
    return record


if __name__ == "__main__":
    main()
