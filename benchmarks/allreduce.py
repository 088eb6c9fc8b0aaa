"""All-reduce benchmark: hand-written ring and butterfly vs ``dist.all_reduce``, and its bandwidth.

Run from the repository root:
    python -m benchmarks.allreduce --out benchmarks/results/allreduce           # full (~10-20 min)
    python -m benchmarks.allreduce --out /tmp/allreduce --quick                 # smoke run (~1 min)

Part 1 (``compare``): ``collectives.allreduce.ring_all_reduce``, ``butterfly_all_reduce`` and
``dist.all_reduce`` + divide average float32 vectors of 1,000-100,000 elements on 1-32 gloo
ranks. Per call: median time (each repeat's time is the slowest rank's, after a barrier; the
methods are interleaved within a repeat so machine noise hits them alike), torch-allocated bytes
(profiler, rank 0), extra peak RSS (``VmHWM`` reset through ``/proc/self/clear_refs``, rank 0),
and max abs / relative error against the fp64 mean. Target: ring <= 1.5x ``dist.all_reduce`` at
100k elements on 2-8 ranks, relative error <= 1e-6.

Part 2 (``bandwidth``): ``dist.all_reduce`` on float32 tensors of 1 MiB-1 GiB on 2, 4, 6
processes (gloo on CPU; ``--device cuda`` uses NCCL on as many GPUs as there are). Latency,
algorithm bandwidth ``bytes / time`` and bus bandwidth ``algbw * 2 (N-1) / N`` (nccl-tests'
definition). Configurations whose tensors do not fit in available memory are skipped and
recorded; each configuration runs in its own process group under a 5-minute limit.

Every process uses one intra-op thread. With more processes than cores the figures include OS
scheduling: the tables record the oversubscription factor (processes / cores) next to each row.
Writes ``results.json``, ``README.md`` and ``time_vs_size.png`` / ``time_vs_world_size.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import psutil
import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from benchmarks import allreduce_report
from callbacks.run_info import environment
from collectives.allreduce import butterfly_all_reduce, ring_all_reduce
from collectives.launcher import run_workers

MiB = 1 << 20
CONFIG_LIMIT_S = 300.0  # the assignment's per-configuration limit
FULL = {
    "compare_world_sizes": [1, 2, 4, 8, 16, 32],
    "compare_numels": [1_000, 10_000, 100_000],
    "compare_warmup": 5,
    "compare_repeats": 50,
    "bandwidth_world_sizes": [2, 4, 6],
    "bandwidth_bytes": [1 * MiB, 10 * MiB, 100 * MiB, 1024 * MiB],
}
QUICK = {
    **FULL,
    "compare_world_sizes": [1, 2, 4],
    "compare_numels": [1_000, 100_000],
    "compare_repeats": 10,
    "bandwidth_world_sizes": [2],
    "bandwidth_bytes": [1 * MiB, 10 * MiB],
}


def _torch_average(tensor: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(tensor)
    return tensor.div_(dist.get_world_size())


METHODS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "ring": ring_all_reduce,
    "butterfly": butterfly_all_reduce,
    "all_reduce": _torch_average,
}


def _rank_data(seed: int, rank: int, numel: int) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(seed * 1_000_003 + rank))


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _reset_peak_rss() -> bool:
    try:  # Linux >= 4.0: writing 5 resets VmHWM (the peak RSS) to the current RSS.
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
        return True
    except OSError:
        return False


def _time_methods(data: torch.Tensor, warmup: int, repeats: int) -> dict[str, list[float]]:
    """Per-call seconds on this rank; the method order rotates each repeat to spread bias."""
    names, work = list(METHODS), torch.empty_like(data)
    times: dict[str, list[float]] = {name: [] for name in names}
    for repeat in range(warmup + repeats):
        for name in names[repeat % 3 :] + names[: repeat % 3]:
            work.copy_(data)
            dist.barrier()
            start = time.perf_counter()
            METHODS[name](work)
            elapsed = time.perf_counter() - start
            if repeat >= warmup:
                times[name].append(elapsed)
    return times


def _accuracy(rank: int, world_size: int, data: torch.Tensor, seed: int) -> dict[str, dict]:
    """Errors vs the fp64 mean (rank 0) and whether every rank got rank 0's exact bits."""
    out = {}
    if rank == 0:
        inputs = [_rank_data(seed, r, data.numel()).double() for r in range(world_size)]
        mean = torch.stack(inputs).mean(dim=0)
    for name, method in METHODS.items():
        result = method(data.clone())
        from_rank0 = result.clone()
        dist.broadcast(from_rank0, src=0)
        out[name] = {"identical": torch.equal(result, from_rank0)}
        if rank == 0:
            max_abs = (result.double() - mean).abs().max().item()
            out[name] |= {"max_abs_err": max_abs, "rel_err": max_abs / mean.abs().max().item()}
    return out


def _memory(rank: int, data: torch.Tensor) -> dict[str, dict]:
    """Torch-allocated bytes per call (profiler) and extra peak RSS over a call (rank 0)."""
    out = {}
    for name, method in METHODS.items():
        work = data.clone()
        reset, before = _reset_peak_rss(), _status_kib("VmRSS")
        method(work)
        peak = _status_kib("VmHWM")
        # Every rank profiles (all must make the same calls); only rank 0's record is reported.
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            method(work)
        events = [e for e in prof.events() if e.name != "[memory]"]
        allocated = sum(max(e.self_cpu_memory_usage, 0) for e in events)
        extra_kib = peak - before if reset and peak is not None and before is not None else None
        out[name] = {"torch_alloc_bytes": allocated, "extra_peak_rss_kib": extra_kib}
    return out


def compare_worker(rank: int, world_size: int, numels: list[int], cfg: dict, seed: int) -> dict:
    """One process of part 1: every size and method inside one process group."""
    out = {}
    for numel in numels:
        data = _rank_data(seed, rank, numel)
        out[numel] = {
            "times": _time_methods(data, cfg["compare_warmup"], cfg["compare_repeats"]),
            "accuracy": _accuracy(rank, world_size, data, seed),
            "memory": _memory(rank, data),
        }
    out["peak_rss_kib"] = _status_kib("VmHWM")
    return out


def bandwidth_worker(rank: int, world_size: int, numel: int, warmup: int, repeats: int) -> dict:
    """One process of part 2: time ``dist.all_reduce`` of ``numel`` float32 values."""
    device = torch.device("cpu")
    if dist.get_backend() == "nccl":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    tensor = torch.zeros(numel, dtype=torch.float32, device=device)  # zeros: no overflow/denormals
    times = []
    for repeat in range(warmup + repeats):
        sync()
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(tensor)
        sync()
        if repeat >= warmup:
            times.append(time.perf_counter() - start)
    return {"times": times, "peak_rss_kib": _status_kib("VmHWM")}


def _slowest_rank_median(per_rank_times: list[list[float]]) -> float:
    return statistics.median(max(call) for call in zip(*per_rank_times))


def _compare_rows(per_rank: list[dict], world_size: int, numel: int, wall_s: float) -> list[dict]:
    rows = []
    for name in METHODS:
        accuracy = per_rank[0][numel]["accuracy"][name]
        rows.append({
            "world_size": world_size, "numel": numel, "method": name,
            "median_s": _slowest_rank_median([r[numel]["times"][name] for r in per_rank]),
            "identical_on_all_ranks": all(
                r[numel]["accuracy"][name]["identical"] for r in per_rank
            ),
            "max_abs_err": accuracy["max_abs_err"], "rel_err": accuracy["rel_err"],
            **per_rank[0][numel]["memory"][name],
            "max_peak_rss_kib": max(r["peak_rss_kib"] or 0 for r in per_rank),
            "group_wall_s": wall_s,
        })
    return rows


def run_compare(cfg: dict, seed: int, tmp: Path) -> list[dict]:
    """Part 1: one process group per world size, every size and method inside it."""
    rows = []
    for world_size in cfg["compare_world_sizes"]:
        print(f"[compare] world_size={world_size}", flush=True)
        started = time.monotonic()
        per_rank = run_workers(
            compare_worker, world_size, args=(cfg["compare_numels"], cfg, seed),
            init_file=tmp / f"compare_{world_size}", timeout_s=CONFIG_LIMIT_S,
        )
        for numel in cfg["compare_numels"]:
            rows += _compare_rows(per_rank, world_size, numel, time.monotonic() - started)
    return rows


def _bandwidth_repeats(nbytes: int) -> tuple[int, int]:
    return (1, 3) if nbytes >= 512 * MiB else (1, 5) if nbytes >= 64 * MiB else (2, 15)


def _bandwidth_one(world_size: int, nbytes: int, backend: str, tmp: Path) -> dict:
    row: dict[str, Any] = {"world_size": world_size, "bytes": nbytes, "backend": backend}
    # Each rank holds the tensor; gloo's ring scratch is segment-sized (measured: +7 MiB peak RSS
    # at 100 MiB), so 1.25x the tensors plus 1 GiB for the processes themselves is ample.
    needed = 1.25 * world_size * nbytes + 2**30
    available = psutil.virtual_memory().available
    if backend == "gloo" and needed > 0.8 * available:
        return row | {"status": f"skipped: needs ~{needed / 2**30:.1f} GiB, "
                                f"{available / 2**30:.1f} GiB available"}
    warmup, repeats = _bandwidth_repeats(nbytes)
    started = time.monotonic()
    try:
        per_rank = run_workers(
            bandwidth_worker, world_size, args=(nbytes // 4, warmup, repeats), backend=backend,
            init_file=tmp / f"bw_{backend}_{world_size}_{nbytes}", timeout_s=CONFIG_LIMIT_S,
            start_method="spawn" if backend == "nccl" else "fork",
        )
    except TimeoutError as err:
        return row | {"status": f"failed: over the {CONFIG_LIMIT_S:.0f} s limit ({err})"}
    median_s = _slowest_rank_median([r["times"] for r in per_rank])
    algbw = nbytes / median_s / 1e9
    return row | {
        "status": "ok", "median_s": median_s, "repeats": repeats,
        "algbw_GBps": algbw, "busbw_GBps": algbw * 2 * (world_size - 1) / world_size,
        "max_peak_rss_kib": max(r["peak_rss_kib"] or 0 for r in per_rank),
        "config_wall_s": time.monotonic() - started,
    }


def run_bandwidth(cfg: dict, device: str, tmp: Path) -> list[dict]:
    backend, world_sizes = "gloo", cfg["bandwidth_world_sizes"]
    if device == "cuda":
        # One GPU per rank: a machine with a single GPU can only run world size 1.
        backend, gpus = "nccl", torch.cuda.device_count()
        world_sizes = sorted({min(ws, gpus) for ws in world_sizes})
    rows = []
    for world_size in world_sizes:
        for nbytes in cfg["bandwidth_bytes"]:
            print(f"[bandwidth] {backend} world_size={world_size} bytes={nbytes}", flush=True)
            rows.append(_bandwidth_one(world_size, nbytes, backend, tmp))
    return rows


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.allreduce", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/allreduce"))
    parser.add_argument("--quick", action="store_true", help="small smoke configuration")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="bandwidth part: cpu = gloo, cuda = NCCL on the visible GPUs")
    parser.add_argument("--parts", nargs="+", choices=("compare", "bandwidth"),
                        default=["compare", "bandwidth"])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs a CUDA GPU; none is visible (use --device cpu)")
    return args


def main(argv: list[str] | None = None) -> None:
    args = _parse_args(argv)
    cfg = QUICK if args.quick else FULL
    args.out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="allreduce_bench_"))
    env = environment() | {"load_avg_start": os.getloadavg(),
                           "mem_available_gib": psutil.virtual_memory().available / 2**30}
    record = {
        "command": " ".join(
            ["python -m benchmarks.allreduce", *(sys.argv[1:] if argv is None else argv)]
        ),
        "config": cfg | {"seed": args.seed, "device": args.device, "threads_per_process": 1},
        "environment": env,
    }
    started = time.monotonic()
    record["compare"] = run_compare(cfg, args.seed, tmp) if "compare" in args.parts else []
    record["bandwidth"] = run_bandwidth(cfg, args.device, tmp) if "bandwidth" in args.parts else []
    env |= {"load_avg_end": os.getloadavg(), "total_wall_s": time.monotonic() - started}
    (args.out / "results.json").write_text(json.dumps(record, indent=2, default=str) + "\n")
    allreduce_report.write(record, args.out)
    shutil.rmtree(tmp, ignore_errors=True)
    print(f"wrote {args.out}/results.json, README.md and plots", flush=True)


if __name__ == "__main__":
    main()
