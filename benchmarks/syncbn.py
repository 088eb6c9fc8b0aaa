"""SyncBatchNorm benchmark: does ``parallel.syncbn.SyncBatchNorm`` cost more than local BN plus its all-reduces?

Run from the repository root::

    python -m benchmarks.syncbn                                   # CPU, 2 gloo ranks, 12 shapes
    python -m benchmarks.syncbn --quick --out /tmp/syncbn         # smoke run: 3 shapes, few rounds
    python -m benchmarks.syncbn --device cuda --out benchmarks/results/syncbn_gpu

Per shape (PER RANK: the assignment's 8 (N, C) shapes and 4 conv (N, C, H, W) ones), one
forward+backward of

- ``custom``: ``parallel.syncbn.SyncBatchNorm`` (statistics synchronised over the ranks);
- ``local``: torch's BatchNorm, no communication;
- ``floor``: that local BN and then two ``all_reduce`` calls of 2C+1 floats, timed as ONE call:
  the least any synchronised BN has to do. (Timing the pieces apart and adding their medians
  made the floor mostly noise on small shapes: it came out above ``custom`` in 5 of 12.)
- ``torch_syncbn`` (CUDA only): ``torch.nn.SyncBatchNorm``.

And the kernel alone: the same shapes on ONE rank (a 1-rank gloo group, so no collective runs),
``custom`` against ``local`` (torch's native ``BatchNorm``), targets custom/native <= 1.10 on the
conv (N, C, H, W) shapes and <= 1.5 on the (N, C) ones, where a Python kernel's ~30 torch calls
cost more than the arithmetic.

Timing goes through ``benchmarks.harness``: interleaved rounds of the methods, ``--iters``
iterations of one method per round; each iteration starts after a barrier and its sample is the
slowest rank's time, because a synchronised step finishes only when its slowest rank does.
Reported: medians and the ratios custom/floor, custom/local (custom/torch_syncbn on CUDA) with
bootstrap 95 % CIs. Target custom <= 1.2x floor (CPU), <= 0.9x torch_syncbn (CUDA): "met" only
when the whole CI lies below it, "missed" when it lies above, otherwise "undecided".
``torch.utils.benchmark`` is not used for the timing: its Timer chooses block sizes and warm-up
calls per process, so the ranks would neither issue their collectives in step nor yield
barrier-aligned per-iteration samples.

Peak memory (one forward+backward, beyond what was allocated before): CPU extra peak RSS via
``/proc/self/clear_refs`` with glibc's mmap threshold fixed, CUDA ``max_memory_allocated``.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from benchmarks import syncbn_report
from benchmarks.harness import (
    aligned_seconds, interleave, make_record, median_ci, ratio_ci, slowest_rank, wait_for_quiet,
)
from callbacks.memory import return_freed_memory_above
from collectives.launcher import run_workers
from parallel.syncbn import SyncBatchNorm

ASSIGNMENT_SHAPES = [(batch, hid) for hid in (128, 256, 512, 1024) for batch in (32, 64)]
CONV_SHAPES = [(32, 64, 16, 16), (32, 128, 32, 32), (64, 256, 16, 16), (128, 64, 32, 32)]
QUICK_SHAPES = [(32, 128), (64, 1024), (32, 64, 16, 16)]
FULL = {"rounds": 10, "iters": 20, "warmup": 5}
QUICK = {"rounds": 3, "iters": 5, "warmup": 2}
TARGETS = {"cpu": ("floor", 1.2), "cuda": ("torch_syncbn", 0.9)}  # baseline, max custom/baseline
ONE_RANK_METHODS = ("custom", "local")
ONE_RANK_TARGETS = {"conv": 1.10, "nc": 1.5}  # max custom/native BN on one rank, by shape_kind


def shape_kind(shape: list[int] | tuple[int, ...]) -> str:
    """``conv`` for (N, C, H, W) shapes, ``nc`` for (N, C) ones."""
    return "conv" if len(shape) >= 4 else "nc"


def _fwd_bwd(layer: nn.Module, x: torch.Tensor, grad: torch.Tensor,
             stats: torch.Tensor | None = None) -> Callable[[], None]:
    def run() -> None:
        layer(x.detach().requires_grad_()).backward(grad)
        if stats is not None:  # the floor: the two all-reduces a synchronised BN cannot avoid
            dist.all_reduce(stats)
            dist.all_reduce(stats)

    return run


def _methods(shape: tuple[int, ...], device: torch.device, rank: int) -> dict[str, Callable[[], None]]:
    generator = torch.Generator().manual_seed(rank)
    x = torch.randn(shape, generator=generator).to(device)
    grad = torch.randn(shape, generator=generator).to(device)
    channels = shape[1]
    local = nn.BatchNorm1d if len(shape) < 4 else nn.BatchNorm2d
    methods = {
        "custom": _fwd_bwd(SyncBatchNorm(channels).to(device), x, grad),
        "local": _fwd_bwd(local(channels).to(device), x, grad),
        "floor": _fwd_bwd(local(channels).to(device), x, grad, torch.zeros(2 * channels + 1, device=device)),
    }
    if device.type == "cuda":
        methods["torch_syncbn"] = _fwd_bwd(nn.SyncBatchNorm(channels).to(device), x, grad)
    return methods


def _time(methods: dict[str, Callable[[], None]], device: torch.device, cfg: dict) -> dict[str, list[float]]:
    """Per-iteration seconds of every method on this rank, in interleaved rounds after a warm-up."""
    for _ in range(cfg["warmup"]):
        for fn in methods.values():
            aligned_seconds(fn, device)
    rounds = interleave(list(methods), cfg["rounds"],
                        lambda name, _: [aligned_seconds(methods[name], device) for _ in range(cfg["iters"])])
    # Every rank runs the same order, so sample i of a method is the same iteration on every rank.
    return {name: [s for block in blocks for s in block] for name, blocks in rounds.items()}


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        return int(next(line for line in status if line.startswith(field + ":")).split()[1])


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


def _worker(rank: int, world_size: int, shapes: list, cfg: dict) -> list[dict]:
    device = torch.device("cpu")
    if cfg["device"] == "cuda":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    names = cfg.get("methods")
    out = [{"samples": _time({name: fn for name, fn in _methods(tuple(shape), device, rank).items()
                              if names is None or name in names}, device, cfg)} for shape in shapes]
    if not cfg.get("memory", True):
        return out
    # Only after timing (it slows allocation): glibc unmaps every freed tensor, so peak RSS sees
    # each allocation instead of reused heap pages.
    if device.type == "cpu":
        return_freed_memory_above(128 * 1024)
    for result, shape in zip(out, shapes):
        methods = _methods(tuple(shape), device, rank)
        for fn in methods.values():  # lazy initialisation is not the layer's memory
            fn()
        result["peak_bytes"] = {}
        for name, fn in methods.items():
            dist.barrier()
            result["peak_bytes"][name] = _peak_bytes(fn, device)
    return out


def analyse(shape: tuple[int, ...], per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """One shape's row: medians, ratios of custom over every other method (CIs), peak memory."""
    samples = {name: slowest_rank([rank["samples"][name] for rank in per_rank]) for name in per_rank[0]["samples"]}
    return {
        "shape": list(shape),
        "median_s": {name: asdict(median_ci(values)) for name, values in samples.items()},
        "ratios": {f"custom/{name}": asdict(ratio_ci(samples["custom"], samples[name]))
                   for name in samples if name != "custom"},
        "peak_bytes": {name: max(rank["peak_bytes"][name] for rank in per_rank)
                       for name in per_rank[0].get("peak_bytes", {})},
        "samples_s": samples,
    }


def shape_name(shape: list[int]) -> str:
    return "x".join(map(str, shape))


def headline(rows: list[dict], baseline: str, one_rank_rows: list[dict] | None = None) -> dict[str, Any]:
    """Flat README-ready numbers: custom over the baseline and over local BN, per shape, and the worst;
    on one rank custom over native BN per shape, and the worst of the conv and of the (N, C) shapes."""
    out: dict[str, Any] = {}
    one_rank_rows = one_rank_rows or []
    for row in one_rank_rows:
        out[f"custom_vs_native_1rank_{shape_name(row['shape'])}"] = row["ratios"]["custom/local"]
    for kind in ONE_RANK_TARGETS:
        ratios = [row["ratios"]["custom/local"] for row in one_rank_rows if shape_kind(row["shape"]) == kind]
        if ratios:
            out[f"custom_vs_native_1rank_worst_{kind}"] = max(ratios, key=lambda e: e["value"])
    for key in (f"custom/{baseline}", "custom/local"):
        name = key.replace("/", "_vs_")
        for row in rows:
            out[f"{name}_{shape_name(row['shape'])}"] = row["ratios"][key]
        out[f"{name}_worst"] = max((row["ratios"][key] for row in rows), key=lambda e: e["value"])
        out[f"{name}_shapes_ci_includes_1"] = sum(syncbn_report.includes_one(row["ratios"][key]) for row in rows)
    return out


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.syncbn", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/syncbn"))
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--rounds", type=int, help=f"interleaved rounds (default {FULL['rounds']})")
    parser.add_argument("--iters", type=int, help=f"iterations per method per round (default {FULL['iters']})")
    parser.add_argument("--shapes", nargs="+", type=lambda s: tuple(map(int, s.split("x"))),
                        help="per-rank shapes such as 32x128 32x64x16x16 (default: the 12 above)")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    parser.add_argument("--max-wait-s", type=float, help="wait this long for a quiet machine (300; --quick: 0)")
    parser.add_argument("--quick", action="store_true", help="smoke run: 3 shapes, 3 rounds of 5 iterations")
    args = parser.parse_args(argv)
    if args.world_size < 2:
        parser.error(f"--world-size must be >= 2 to synchronise anything, got {args.world_size}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs a CUDA device; none is visible (torch.cuda.is_available())")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = _parse_args(argv)
    cfg = {**(QUICK if args.quick else FULL), "device": args.device}
    cfg.update({k: v for k, v in (("rounds", args.rounds), ("iters", args.iters)) if v is not None})
    shapes = args.shapes or (QUICK_SHAPES if args.quick else ASSIGNMENT_SHAPES + CONV_SHAPES)
    gpus = torch.cuda.device_count() if args.device == "cuda" else 0
    backend = "nccl" if gpus >= args.world_size else "gloo"
    quiet = wait_for_quiet(max_wait_s=args.max_wait_s if args.max_wait_s is not None else 0 if args.quick else 300)
    start = time.monotonic()
    per_rank = run_workers(_worker, args.world_size, args=(shapes, cfg), backend=backend,
                           timeout_s=1800.0, threads=args.threads)
    rows = [analyse(shape, [rank[i] for rank in per_rank]) for i, shape in enumerate(shapes)]
    # The kernel alone: a 1-rank group (no collective), custom against native BN, timing only.
    one_rank_cfg = {**cfg, "methods": ONE_RANK_METHODS, "memory": False}
    (one_rank,) = run_workers(_worker, 1, args=(shapes, one_rank_cfg), backend=backend, timeout_s=1800.0,
                              threads=args.threads)
    one_rank_rows = [analyse(shape, [one_rank[i]]) for i, shape in enumerate(shapes)]
    baseline, target = TARGETS[args.device]
    config = {**cfg, "world_size": args.world_size, "backend": backend, "threads": args.threads,
              "shapes": [list(s) for s in shapes], "baseline": baseline, "target": target,
              "one_rank_targets": ONE_RANK_TARGETS}
    record = make_record("syncbn", config, quiet.finish(), argv=argv, headline=headline(rows, baseline, one_rank_rows),
                         rows=rows, one_rank_rows=one_rank_rows, wall_s=time.monotonic() - start)
    syncbn_report.write(record, args.out)
    print((args.out / "results.md").read_text())
    return record


if __name__ == "__main__":
    main()
