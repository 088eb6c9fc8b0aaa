"""CIFAR train-augmentation throughput: torchvision's per-sample PIL pipeline vs batched tensor ops.

    python -m benchmarks.costs.data_pipeline           # about 2 minutes
    python -m benchmarks.costs.data_pipeline --quick   # smoke run into a temporary folder

From uint8 images to a normalised batch after a 4-px-padded random crop and a horizontal flip,
images/s through a DataLoader epoch on CPU: ``pil_main`` (PIL per sample in the main process),
``pil_2workers`` (the same in 2 workers, competing with training for cores), ``batched`` (uint8
tensors collated, then ``lit_cifar.transforms.augment`` + ``normalize`` on the batch, as the
DataModule does). A warm-up epoch per path, then interleaved rounds of one epoch per path; the
transforms alone as interleaved ``torch.utils.benchmark`` samples. Target: batched >= 3x pil_main.
"""

from __future__ import annotations

import itertools
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch.utils.benchmark import Timer
from torch.utils.data import DataLoader, Dataset
from torchvision import transforms as T

from benchmarks.harness import interleave, medians, parse, parser, ratios, run_benchmark
from benchmarks.report import Panel, fmt_value, headline_row, publish, table
from lit_cifar.data import TensorImageDataset
from lit_cifar.transforms import CIFAR100_MEAN, CIFAR100_STD, augment, normalize

TITLE = "CIFAR train augmentation throughput (CPU)"
TARGET_SPEEDUP = 3.0
FULL = {"images": 10_240, "batch_size": 128, "rounds": 10, "kernel_rounds": 20}
QUICK = {"images": 1_024, "batch_size": 128, "rounds": 3, "kernel_rounds": 6}
SPEEDUPS = {
    "batched/pil_main": "batched tensor ops / PIL per sample in the main process",
    "batched/pil_2workers": "batched tensor ops / PIL per sample in 2 DataLoader workers",
    "pil_2workers/pil_main": "PIL in 2 workers / PIL in the main process",
    "batched_transform/pil_transform": "the transforms alone (no DataLoader): batched / PIL",
}


def _pil_transform() -> T.Compose:
    crop_and_flip = [T.RandomCrop(32, padding=4), T.RandomHorizontalFlip()]
    return T.Compose([*crop_and_flip, T.ToTensor(), T.Normalize(CIFAR100_MEAN, CIFAR100_STD)])


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
        count += len(normalize(augment(images)) if batched else images)
    return count / (time.perf_counter() - start)


def _kernel_samples(images: torch.Tensor, batch_size: int, rounds: int) -> dict[str, list[float]]:
    """Images/s of the transforms alone: ``Timer.timeit`` calls (each after its own warm-up) of ~30-50 ms,
    interleaved like the epochs; one sample per call."""
    batch = images[:batch_size]
    arrays = itertools.cycle(batch.permute(0, 2, 3, 1).numpy())
    pil = Timer("tf(Image.fromarray(next(arrays)))", globals={"arrays": arrays, "tf": _pil_transform(), "Image": Image})
    batched = Timer("normalize(augment(batch))", globals={"batch": batch, "normalize": normalize, "augment": augment})
    timers = {"pil_transform": (1, 64, pil), "batched_transform": (batch_size, 4, batched)}

    def images_per_s(name: str, _: int) -> float:
        images_per_statement, statements_per_sample, timer = timers[name]
        return images_per_statement / timer.timeit(statements_per_sample).median

    return interleave(list(timers), rounds, images_per_s)


def measure(cfg: dict[str, Any]) -> dict[str, Any]:
    """Images/s per DataLoader epoch and per transform block, their medians and speed-ups (ratios, CIs)."""
    torch.manual_seed(0)
    images = torch.randint(0, 256, (cfg["images"], 3, 32, 32), dtype=torch.uint8)
    labels = torch.randint(0, 100, (cfg["images"],))
    pil, size = _PILDataset(images.permute(0, 2, 3, 1).numpy().copy(), labels.numpy()), cfg["batch_size"]
    loaders = {
        "pil_main": (DataLoader(pil, size, shuffle=True), False),
        "pil_2workers": (DataLoader(pil, size, shuffle=True, num_workers=2, persistent_workers=True), False),
        "batched": (DataLoader(TensorImageDataset(images, labels), size, shuffle=True), True),
    }
    for loader, batched in loaders.values():  # warm-up: worker start-up, allocator, first-call overheads
        _epoch_images_per_s(loader, batched)
    samples = interleave(list(loaders), cfg["rounds"], lambda name, _: _epoch_images_per_s(*loaders[name]))
    samples |= _kernel_samples(images, size, cfg["kernel_rounds"])
    return {"samples_images_per_s": samples}


def estimates(samples: dict[str, list[float]]) -> dict[str, Any]:
    """Medians and speed-ups (CIs) of the rates; a sample is one round (an epoch, or one Timer call)."""
    return {"images_per_s": medians(samples), "speedups": ratios(samples, [key.split("/") for key in SPEEDUPS])}


def headline(record: dict[str, Any]) -> list[dict[str, Any]]:
    """The speed-ups (the first against its target) and the batched path's rate."""
    return [
        headline_row(
            f"{text}: images/s",
            record["speedups"][key],
            "x",
            TARGET_SPEEDUP if key == "batched/pil_main" else None,
            at_most=False,
        )
        for key, text in SPEEDUPS.items()
    ] + [headline_row("batched path through a DataLoader epoch", record["images_per_s"]["batched"], "images/s")]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = parser("costs.data_pipeline", __doc__)
    p.add_argument("--images", type=int, help=f"images per epoch (default {FULL['images']:,})")
    p.add_argument("--rounds", type=int, help=f"interleaved rounds (default {FULL['rounds']})")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads of the main process")
    args = parse(p, argv, FULL, QUICK)
    torch.set_num_threads(args.threads)
    cfg = args.cfg | {"torch_threads": torch.get_num_threads()}
    return run_benchmark(
        "costs.data_pipeline", cfg, argv, write, lambda: measure(cfg), args.out, args.max_wait_s, timed=False
    )


def write(record: dict[str, Any], out: Path) -> None:
    """Derive the estimates from the kept samples, write results.json, results.md and throughput.png into ``out``."""
    cfg = record["config"]
    record.update(estimates(record["samples_images_per_s"]))
    record["headline"] = headline(record)
    rates = record["images_per_s"]
    body = [
        f"{cfg['images']:,} random uint8 images, batch {cfg['batch_size']}, torch threads {cfg['torch_threads']}; "
        f"{cfg['rounds']} interleaved rounds of one epoch per path after a warm-up epoch. `*_transform` rows: the "
        f"transforms alone, no DataLoader: {cfg['kernel_rounds']} interleaved `torch.utils.benchmark` `Timer.timeit` "
        "samples each (64 single images / 4 batches per sample).",
        "",
        *table("path | images/s, median [95 % CI]", [[name, fmt_value(e, "images/s")] for name, e in rates.items()]),
        "",
        "![throughput](throughput.png)",
    ]
    panel = Panel(
        "CIFAR train augmentation, CPU",
        "images / s (median)",
        list(rates),
        {"images/s": list(rates.values())},
        log=True,
    )
    publish(out, record, TITLE, body, {"throughput.png": (TITLE, [panel])})


if __name__ == "__main__":
    main()
