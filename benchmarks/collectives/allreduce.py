"""All-reduce benchmark: hand-written ring and butterfly vs ``dist.all_reduce``, and gloo's bandwidth.

    python -m benchmarks.collectives.allreduce                                # about 8 minutes on 2 cores
    python -m benchmarks.collectives.allreduce --quick --out /tmp/allreduce   # smoke run

Part 1: ``collectives.allreduce.ring_all_reduce``, ``butterfly_all_reduce`` and ``dist.all_reduce``
+ divide average float32 vectors of 1,000-100,000 elements on 1-32 gloo ranks (interleaved rounds
of barrier-aligned calls, the slowest rank's time); ratios to ``dist.all_reduce`` with bootstrap
95 % CIs, target ring <= 1.5x at 100k elements on 2-8 ranks; per call also the error against the
fp64 mean (target <= 1e-6), identical bits on all ranks, torch-allocated bytes, extra peak memory.
The ring runs 2(N-1) dependent steps from Python, each done only when the neighbour's gloo I/O
thread and this rank's main thread get a core; gloo's own all-reduce runs its steps in one C++
call. The butterfly needs fewer steps but N-1 peers at once and an N-chunk receive buffer. Both are
bit-identical on all ranks: one owner rank computes each chunk. World sizes above the core count
run time-shared (``*``): they measure OS scheduling as much as communication. Per-call times are
bimodal even on 2 quiet cores: a ~3.5-4 ms (and ~8 ms) mode hits every method, ``dist.all_reduce``
included and at 1,000 elements as at 100,000 (a wake-up delay, not bandwidth), so a median lands in
the slow mode once more than half the calls do; the table gives each method's share of calls over
``SLOW_CALL_S`` next to the medians.
Part 2: ``dist.all_reduce`` of 1 MiB-1 GiB float32 on 2, 4, 6 processes (gloo; ``--device cuda``:
NCCL, one GPU per rank): latency, algorithm bandwidth bytes / time and bus bandwidth algbw *
2(N-1)/N (nccl-tests' definition); what does not fit in memory is skipped and recorded; each
configuration runs in its own process group under a 5-minute limit. One intra-op thread per
process. Analysis, headline and report: :mod:`benchmarks.collectives.allreduce_report`.
"""

from __future__ import annotations

import os
from dataclasses import asdict
from typing import Any

import psutil
import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from benchmarks.collectives.allreduce_report import METHOD_NAMES, PAIRS, TITLE, headline, write
from benchmarks.harness import parse, parser, round_estimates, run_benchmark, settings, slowest_ranks, timed_rounds
from collectives.allreduce import butterfly_all_reduce, ring_all_reduce
from collectives.launcher import run_workers
from measure.memory import measure_peak
from measure.stats import median_ci
from measure.timing import aligned_seconds

# The record's module: rederive and the results blocks load TITLE, headline and write from here.
__all__ = [
    "FULL",
    "METHODS",
    "QUICK",
    "TITLE",
    "bandwidth_row",
    "compare_row",
    "headline",
    "main",
    "run_compare",
    "write",
]

MiB = 1 << 20
CONFIG_LIMIT_S = 300.0  # the assignment's per-configuration limit
FULL, QUICK = settings(
    {
        "compare_world_sizes": ([1, 2, 4, 8, 16, 32], [1, 2, 4]),
        "compare_numels": ([1_000, 10_000, 100_000], [1_000, 100_000]),
        "warmup": (5, 2),
        "rounds": (10, 3),
        "iters": (10, 4),
        "bandwidth_world_sizes": ([2, 4, 6], [2]),
        "bandwidth_bytes": ([1 * MiB, 10 * MiB, 100 * MiB, 1024 * MiB], [1 * MiB, 10 * MiB]),
    }
)


def _torch_average(tensor: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(tensor)
    return tensor.div_(dist.get_world_size())


METHODS = dict(zip(METHOD_NAMES, (ring_all_reduce, butterfly_all_reduce, _torch_average), strict=True))


def _rank_data(seed: int, rank: int, numel: int) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(seed * 1_000_003 + rank))


def _accuracy(rank: int, world_size: int, data: torch.Tensor, seed: int) -> dict[str, dict]:
    """Errors vs the fp64 mean (rank 0) and whether every rank got rank 0's exact bits."""
    out = {}
    if rank == 0:
        mean = torch.stack([_rank_data(seed, r, data.numel()).double() for r in range(world_size)]).mean(dim=0)
    for name, method in METHODS.items():
        result = method(data.clone())
        from_rank0 = result.clone()
        dist.broadcast(from_rank0, src=0)
        out[name] = {"identical": torch.equal(result, from_rank0)}
        if rank == 0:
            max_abs = (result.double() - mean).abs().max().item()
            out[name] |= {"max_abs_err": max_abs, "rel_err": max_abs / mean.abs().max().item()}
    return out


def _memory(data: torch.Tensor) -> dict[str, dict]:
    """Torch-allocated bytes per call (profiler) and the extra peak memory of one call."""
    out = {}
    for name, method in METHODS.items():
        work = data.clone()
        _, peak = measure_peak(lambda m=method, w=work: m(w))
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:  # every rank: same calls
            method(work)
        allocated = sum(max(e.self_cpu_memory_usage, 0) for e in prof.events() if e.name != "[memory]")
        out[name] = {"torch_alloc_bytes": allocated, "extra_peak_bytes": peak}
    return out


def compare_worker(rank: int, world_size: int, numels: list[int], cfg: dict, seed: int) -> dict:
    """One process of part 1: every size and method inside one process group."""
    out: dict[Any, Any] = {"threads": torch.get_num_threads()}
    for numel in numels:
        data = _rank_data(seed, rank, numel)
        work = torch.empty_like(data)  # every call averages the same input; the copy is outside the timing
        calls = {name: lambda m=method, w=work: m(w) for name, method in METHODS.items()}
        samples = timed_rounds(calls, cfg, prepare=lambda _, w=work, d=data: w.copy_(d))
        out[numel] = {"samples": samples, "accuracy": _accuracy(rank, world_size, data, seed), "memory": _memory(data)}
    return out


def run_compare(cfg: dict, seed: int, cores: int) -> list[dict]:
    """Part 1: one process group per world size, every size and method inside it."""
    rows, numels = [], cfg["compare_numels"]
    for world_size in cfg["compare_world_sizes"]:
        print(f"[compare] world_size={world_size}", flush=True)
        per_rank = run_workers(compare_worker, world_size, args=(numels, cfg, seed), timeout_s=CONFIG_LIMIT_S)
        rows += [compare_row(world_size, numel, per_rank, cores, cfg["iters"]) for numel in numels]
    return rows


def bandwidth_worker(rank: int, world_size: int, numel: int, warmup: int, repeats: int) -> dict[str, Any]:
    """One process of part 2: per-iteration seconds of ``dist.all_reduce`` of ``numel`` float32 values."""
    device = torch.device("cuda", rank) if dist.get_backend() == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    tensor = torch.zeros(numel, dtype=torch.float32, device=device)  # zeros: no overflow or denormals
    samples = [aligned_seconds(lambda: dist.all_reduce(tensor), device) for _ in range(warmup + repeats)]
    return {"samples": samples[warmup:], "threads": torch.get_num_threads()}


def _bandwidth_config(row: dict[str, Any]) -> dict[str, Any]:
    """One (world size, size) of part 2 in its own process group; skipped when it does not fit in memory."""
    world_size, nbytes, backend = row["world_size"], row["bytes"], row["backend"]
    # Each rank holds the tensor; gloo's ring scratch is segment-sized (measured: +7 MiB peak RSS
    # at 100 MiB), so 1.25x the tensors plus 1 GiB for the processes themselves is ample.
    needed, available = 1.25 * world_size * nbytes + 2**30, psutil.virtual_memory().available
    if backend == "gloo" and needed > 0.8 * available:
        return row | {"status": f"skipped: needs ~{needed / 2**30:.1f} GiB, {available / 2**30:.1f} GiB available"}
    warmup, repeats = (1, 5) if nbytes >= 512 * MiB else (2, 10) if nbytes >= 64 * MiB else (3, 30)
    launch = {"backend": backend, "timeout_s": CONFIG_LIMIT_S, "start_method": "spawn" if backend == "nccl" else "fork"}
    try:
        return bandwidth_row(
            row, run_workers(bandwidth_worker, world_size, args=(nbytes // 4, warmup, repeats), **launch)
        )
    except TimeoutError as err:
        return row | {"status": f"failed: over the {CONFIG_LIMIT_S:.0f} s limit ({err})"}


def run_bandwidth(cfg: dict, device: str, cores: int) -> list[dict]:
    """Part 2: one process group per (world size, size); what does not fit in memory is skipped."""
    backend, world_sizes, rows = "gloo", cfg["bandwidth_world_sizes"], []
    if device == "cuda":  # one GPU per rank: a machine with a single GPU can only run world size 1
        backend, world_sizes = "nccl", sorted({min(ws, torch.cuda.device_count()) for ws in world_sizes})
    for world_size, nbytes in ((ws, b) for ws in world_sizes for b in cfg["bandwidth_bytes"]):
        print(f"[bandwidth] {backend} world_size={world_size} bytes={nbytes}", flush=True)
        row = {"world_size": world_size, "bytes": nbytes, "backend": backend}
        rows.append(_bandwidth_config(row | {"oversubscribed": backend == "gloo" and world_size > cores}))
    return rows


def compare_row(world_size: int, numel: int, per_rank: list[dict], cores: int, run_length: int) -> dict[str, Any]:
    """One (world size, size) row: medians and ratios to dist.all_reduce (CIs) of the slowest rank's samples,
    accuracy, memory."""
    samples, first = slowest_ranks([r[numel]["samples"] for r in per_rank]), per_rank[0][numel]
    identical = {name: all(r[numel]["accuracy"][name]["identical"] for r in per_rank) for name in METHODS}
    return {
        "world_size": world_size,
        "numel": numel,
        "oversubscribed": world_size > cores,
        "threads": per_rank[0]["threads"],
        **round_estimates(samples, run_length, PAIRS),
        "accuracy": {name: first["accuracy"][name] | {"identical": identical[name]} for name in METHODS},
        "memory": first["memory"],
        "samples_s": samples,
    }


def bandwidth_row(row: dict[str, Any], per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """Latency (median, CI) of the slowest rank, algorithm and bus bandwidth (nccl-tests' definition)."""
    samples = slowest_ranks(per_rank, ["samples"])["samples"]
    latency = median_ci(samples)
    # Bandwidth falls as time rises: the CI bounds swap.
    seconds = {"value": latency.value, "low": latency.high, "high": latency.low}
    algbw = {k: row["bytes"] / s / 1e9 for k, s in seconds.items()} | {"n": latency.n}
    bus = 2 * (row["world_size"] - 1) / row["world_size"]
    return row | {
        "status": "ok",
        "threads": per_rank[0]["threads"],
        "median_s": asdict(latency),
        "algbw_GBps": algbw,
        "busbw_GBps": {k: v * bus if k != "n" else v for k, v in algbw.items()},
        "samples_s": samples,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = parser("collectives.allreduce", __doc__)
    help_device = "bandwidth part: cpu = gloo, cuda = NCCL on the visible GPUs"
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help=help_device)
    p.add_argument("--parts", nargs="+", choices=("compare", "bandwidth"), default=["compare", "bandwidth"])
    p.add_argument("--seed", type=int, default=0)
    args = parse(p, argv, FULL, QUICK)
    cfg, cores, parts = args.cfg, os.cpu_count() or 1, args.parts  # cores: the count the record's environment reports
    config = cfg | {"seed": args.seed, "device": args.device, "threads_per_process": 1, "cores": cores}

    def measure() -> dict[str, Any]:
        compare = run_compare(cfg, args.seed, cores) if "compare" in parts else []
        return {"compare": compare, "bandwidth": run_bandwidth(cfg, args.device, cores) if "bandwidth" in parts else []}

    return run_benchmark("collectives.allreduce", config, argv, write, measure, args.out, args.max_wait_s)


if __name__ == "__main__":
    main()
