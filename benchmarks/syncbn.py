"""SyncBatchNorm benchmark: forward+backward time and peak memory of ``parallel.syncbn``.

Run from the repository root::

    python -m benchmarks.syncbn --out benchmarks/results/syncbn                 # CPU, 2 ranks
    python -m benchmarks.syncbn --out /tmp/syncbn --quick                       # smoke run
    python -m benchmarks.syncbn --out benchmarks/results/syncbn_gpu --device cuda

Configurations (shapes are PER RANK): the assignment's 8, (batch 32 / 64) x hid_dim
128-1024 as (N, C), plus conv-shaped (N, C, H, W) ones.

CPU (gloo, one intra-op thread per rank): ``custom`` (synchronised) vs ``local`` (torch's
``BatchNorm``, no communication) vs the FLOOR = ``local`` + two ``all_reduce`` calls of 2C+1
floats, timed in the same iterations. Target: custom <= 1.2x floor in every configuration.

CUDA (``--device cuda``; NCCL when there is a GPU per rank, else every rank on GPU 0 over gloo):
``custom`` vs ``torch.nn.SyncBatchNorm``, CUDA-event timing, ``max_memory_allocated``.
Targets: <= 0.9x its time and <= 1.0x its peak memory.

Method: the methods are interleaved within each iteration (order rotating) after a barrier, so
machine noise hits them alike; warm-up iterations first; per-rank median over ``--iters``, then
the maximum over ranks. Peak memory is the extra memory of one forward+backward over what was
allocated before it (CPU: peak RSS via ``/proc/self/clear_refs``, with glibc's mmap threshold
fixed so freed tensors leave RSS; CUDA: ``max_memory_allocated``). Writes ``results.json``,
``README.md`` and ``syncbn.png`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from benchmarks import syncbn_report
from callbacks.memory import return_freed_memory_above
from callbacks.run_info import environment
from collectives.launcher import run_workers
from parallel.syncbn import SyncBatchNorm

ASSIGNMENT_SHAPES = [(batch, hid) for hid in (128, 256, 512, 1024) for batch in (32, 64)]
CONV_SHAPES = [(32, 64, 16, 16), (32, 128, 32, 32), (64, 256, 16, 16), (128, 64, 32, 32)]
QUICK_SHAPES = [(32, 128), (64, 1024), (32, 64, 16, 16)]


def _fwd_bwd(layer: nn.Module, x: torch.Tensor, grad: torch.Tensor) -> Callable[[], None]:
    def run() -> None:
        layer(x.detach().requires_grad_()).backward(grad)

    return run


def _all_reduce_twice(stats: torch.Tensor) -> Callable[[], None]:
    def run() -> None:
        dist.all_reduce(stats)
        dist.all_reduce(stats)

    return run


def _timer(device: torch.device) -> Callable[[Callable[[], None]], float]:
    """Seconds one call takes on this rank, started after a barrier."""
    if device.type == "cuda":
        def cuda_time(fn: Callable[[], None]) -> float:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(device)
            dist.barrier()
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3

        return cuda_time

    def cpu_time(fn: Callable[[], None]) -> float:
        dist.barrier()
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    return cpu_time


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith(field + ":"))
    return int(line.split()[1])


def _peak_bytes(fn: Callable[[], None], device: torch.device) -> int:
    """Memory one call needs beyond what is allocated before it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    before = _status_kib("VmRSS")
    fn()
    return (_status_kib("VmHWM") - before) * 1024


def _methods(shape: tuple[int, ...], device: torch.device, rank: int) -> dict[str, Callable]:
    generator = torch.Generator().manual_seed(rank)
    x = torch.randn(shape, generator=generator).to(device)
    grad = torch.randn(shape, generator=generator).to(device)
    num_features = shape[1]
    methods = {"custom": _fwd_bwd(SyncBatchNorm(num_features).to(device), x, grad)}
    if device.type == "cuda":
        methods["torch_syncbn"] = _fwd_bwd(nn.SyncBatchNorm(num_features).to(device), x, grad)
    else:
        local = (nn.BatchNorm1d if len(shape) < 4 else nn.BatchNorm2d)(num_features)
        methods["local"] = _fwd_bwd(local, x, grad)
        methods["all_reduce_x2"] = _all_reduce_twice(torch.zeros(2 * num_features + 1))
    return methods


def _time(shape: tuple[int, ...], device: torch.device, rank: int, cfg: dict) -> dict:
    methods = _methods(shape, device, rank)
    names, timer = list(methods), _timer(device)
    times: dict[str, list[float]] = {name: [] for name in names}
    for it in range(cfg["warmup"] + cfg["iters"]):
        for name in names[it % len(names) :] + names[: it % len(names)]:
            elapsed = timer(methods[name])
            if it >= cfg["warmup"]:
                times[name].append(elapsed)
    if "local" in times:  # the floor of each iteration, from the same iteration's timings
        times["floor"] = [a + b for a, b in zip(times["local"], times["all_reduce_x2"])]
    return {f"{name}_s": statistics.median(values) for name, values in times.items()}


def _memory(shape: tuple[int, ...], device: torch.device, rank: int) -> dict:
    methods = _methods(shape, device, rank)
    for run in methods.values():  # warm-up: lazy initialisation is not the layer's memory
        run()
    result = {}
    for name, run in methods.items():
        if name != "all_reduce_x2":
            dist.barrier()
            result[f"{name}_peak_bytes"] = _peak_bytes(run, device)
    return result


def _worker(rank: int, world_size: int, shapes: list, cfg: dict) -> list[dict]:
    if cfg["device"] == "cuda":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    results = [_time(tuple(shape), device, rank, cfg) for shape in shapes]
    # Only now (it slows allocation down): make glibc unmap every freed tensor, so that
    # peak RSS sees each allocation instead of reused heap pages.
    cfg["mmap_threshold_fixed"] = device.type == "cpu" and return_freed_memory_above(128 * 1024)
    for result, shape in zip(results, shapes):
        result.update(_memory(tuple(shape), device, rank), mmap_threshold_fixed=cfg["mmap_threshold_fixed"])
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/syncbn"))
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    parser.add_argument("--quick", action="store_true", help="3 small shapes, 10 iterations")
    args = parser.parse_args(argv)
    if args.world_size < 2:
        parser.error(f"--world-size must be >= 2 to synchronise anything, got {args.world_size}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs a CUDA device; none is visible (torch.cuda.is_available())")
    if args.quick:
        args.iters, args.warmup = 10, 2
    shapes = QUICK_SHAPES if args.quick else ASSIGNMENT_SHAPES + CONV_SHAPES
    gpus = torch.cuda.device_count() if args.device == "cuda" else 0
    backend = "nccl" if gpus >= args.world_size else "gloo"
    cfg = {"device": args.device, "iters": args.iters, "warmup": args.warmup}
    load_before = os.getloadavg()
    start = time.monotonic()
    per_rank = run_workers(_worker, args.world_size, args=(shapes, cfg), backend=backend,
                           timeout_s=1800.0, threads=args.threads)
    record = {
        "command": "python -m benchmarks.syncbn " + shlex.join(sys.argv[1:] if argv is None else argv),
        "config": {**cfg, "world_size": args.world_size, "backend": backend, "threads": args.threads, "gpus_used": min(gpus, args.world_size)},
        "environment": environment(),
        "load_average": {"before": load_before, "after": os.getloadavg()},
        "wall_s": time.monotonic() - start,
        # Per configuration, every figure is the maximum over ranks.
        "results": [{"shape": list(shape), **{key: max(rank[i][key] for rank in per_rank)
                                              for key in per_rank[0][i]}}
                    for i, shape in enumerate(shapes)],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(record, indent=2) + "\n")
    syncbn_report.write(record, args.out)
    print((args.out / "README.md").read_text())


if __name__ == "__main__":
    main()
