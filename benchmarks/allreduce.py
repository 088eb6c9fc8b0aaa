"""All-reduce benchmark: hand-written ring and butterfly vs ``dist.all_reduce``, and gloo's bandwidth.

Run from the repository root::

    python -m benchmarks.allreduce                                # full (~10-20 min)
    python -m benchmarks.allreduce --quick --out /tmp/allreduce   # smoke run

Part 1 (``compare``): ``collectives.allreduce.ring_all_reduce``, ``butterfly_all_reduce`` and
``dist.all_reduce`` + divide average float32 vectors of 1,000-100,000 elements on 1-32 gloo
ranks. Timing goes through ``benchmarks.harness``: the methods run in interleaved rounds, each
iteration starts after a barrier and its sample is the slowest rank's time; reported are medians
and ring / all_reduce, butterfly / all_reduce as ratios of medians with bootstrap 95 % CIs.
Also per call: max abs / relative error against the fp64 mean (target <= 1e-6) and whether all
ranks got identical bits, torch-allocated bytes (profiler) and extra peak RSS (rank 0).
Target: ring <= 1.5x ``dist.all_reduce`` at 100k elements on 2-8 ranks.

Part 2 (``bandwidth``): ``dist.all_reduce`` of 1 MiB-1 GiB float32 on 2, 4, 6 processes (gloo;
``--device cuda``: NCCL, one GPU per rank). Median latency with its CI, algorithm bandwidth
bytes / time and bus bandwidth algbw * 2(N-1)/N (nccl-tests' definition). Configurations that
do not fit in available memory are skipped and recorded; each runs in its own process group
under a 5-minute limit.

One intra-op thread per process. World sizes above the machine's core count run time-shared:
their rows say so and the plots shade them. ``torch.utils.benchmark`` is not used: its per-process
block sizes and warm-up calls would put the ranks' collectives out of step.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable

import psutil
import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from benchmarks import allreduce_report
from benchmarks.harness import (
    aligned_seconds, interleave, make_record, median_ci, ratio_ci, slowest_rank, wait_for_quiet,
)
from collectives.allreduce import butterfly_all_reduce, ring_all_reduce
from collectives.launcher import run_workers

MiB = 1 << 20
CONFIG_LIMIT_S = 300.0  # the assignment's per-configuration limit
FULL = {
    "compare_world_sizes": [1, 2, 4, 8, 16, 32], "compare_numels": [1_000, 10_000, 100_000],
    "warmup": 5, "rounds": 10, "iters": 10,
    "bandwidth_world_sizes": [2, 4, 6], "bandwidth_bytes": [1 * MiB, 10 * MiB, 100 * MiB, 1024 * MiB],
}
QUICK = {**FULL, "compare_world_sizes": [1, 2, 4], "compare_numels": [1_000, 100_000], "warmup": 2,
         "rounds": 3, "iters": 4, "bandwidth_world_sizes": [2], "bandwidth_bytes": [1 * MiB, 10 * MiB]}


def _torch_average(tensor: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(tensor)
    return tensor.div_(dist.get_world_size())


METHODS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "ring": ring_all_reduce, "butterfly": butterfly_all_reduce, "all_reduce": _torch_average,
}


def _rank_data(seed: int, rank: int, numel: int) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(seed * 1_000_003 + rank))


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as status:
            return next((int(line.split()[1]) for line in status if line.startswith(field + ":")), None)
    except OSError:
        return None


def _time_methods(data: torch.Tensor, cfg: dict) -> dict[str, list[float]]:
    """Per-iteration seconds of every method on this rank: warm-up, then interleaved rounds."""
    work = torch.empty_like(data)

    def once(name: str) -> float:
        work.copy_(data)  # every call averages the same input; the copy is outside the timing
        return aligned_seconds(lambda: METHODS[name](work))

    for _ in range(cfg["warmup"]):
        for name in METHODS:
            once(name)
    rounds = interleave(list(METHODS), cfg["rounds"], lambda name, _: [once(name) for _ in range(cfg["iters"])])
    return {name: [s for block in blocks for s in block] for name, blocks in rounds.items()}


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
    """Torch-allocated bytes per call (profiler) and extra peak RSS over one call."""
    out = {}
    for name, method in METHODS.items():
        work = data.clone()
        with open("/proc/self/clear_refs", "w") as clear_refs:  # reset VmHWM (peak RSS) to the RSS
            clear_refs.write("5")
        before = _status_kib("VmRSS")
        method(work)
        peak = _status_kib("VmHWM")
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:  # every rank: same calls
            method(work)
        allocated = sum(max(e.self_cpu_memory_usage, 0) for e in prof.events() if e.name != "[memory]")
        out[name] = {"torch_alloc_bytes": allocated,
                     "extra_peak_rss_kib": None if peak is None or before is None else peak - before}
    return out


def compare_worker(rank: int, world_size: int, numels: list[int], cfg: dict, seed: int) -> dict:
    """One process of part 1: every size and method inside one process group."""
    out = {}
    for numel in numels:
        data = _rank_data(seed, rank, numel)
        out[numel] = {"samples": _time_methods(data, cfg), "accuracy": _accuracy(rank, world_size, data, seed),
                      "memory": _memory(data)}
    return out


def compare_row(world_size: int, numel: int, per_rank: list[dict], cores: int) -> dict[str, Any]:
    """One (world size, size) row: medians and ratios to dist.all_reduce with CIs, accuracy, memory."""
    samples = {name: slowest_rank([r[numel]["samples"][name] for r in per_rank]) for name in METHODS}
    accuracy = {name: {**per_rank[0][numel]["accuracy"][name],
                       "identical": all(r[numel]["accuracy"][name]["identical"] for r in per_rank)}
                for name in METHODS}
    return {
        "world_size": world_size, "numel": numel, "oversubscribed": world_size > cores,
        "median_s": {name: asdict(median_ci(values)) for name, values in samples.items()},
        "ratios": {f"{name}/all_reduce": asdict(ratio_ci(samples[name], samples["all_reduce"]))
                   for name in ("ring", "butterfly")},
        "accuracy": accuracy, "memory": per_rank[0][numel]["memory"], "samples_s": samples,
    }


def run_compare(cfg: dict, seed: int, tmp: Path, cores: int) -> list[dict]:
    """Part 1: one process group per world size, every size and method inside it."""
    rows = []
    for world_size in cfg["compare_world_sizes"]:
        print(f"[compare] world_size={world_size}", flush=True)
        per_rank = run_workers(compare_worker, world_size, args=(cfg["compare_numels"], cfg, seed),
                               init_file=tmp / f"compare_{world_size}", timeout_s=CONFIG_LIMIT_S)
        rows += [compare_row(world_size, numel, per_rank, cores) for numel in cfg["compare_numels"]]
    return rows


def bandwidth_worker(rank: int, world_size: int, numel: int, warmup: int, repeats: int) -> list[float]:
    """One process of part 2: per-iteration seconds of ``dist.all_reduce`` of ``numel`` float32 values."""
    device = torch.device("cpu")
    if dist.get_backend() == "nccl":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    tensor = torch.zeros(numel, dtype=torch.float32, device=device)  # zeros: no overflow or denormals

    def call() -> None:
        dist.all_reduce(tensor)
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    return [aligned_seconds(call) for _ in range(warmup + repeats)][warmup:]


def _bandwidth_one(world_size: int, nbytes: int, backend: str, tmp: Path, cores: int) -> dict:
    row: dict[str, Any] = {"world_size": world_size, "bytes": nbytes, "backend": backend,
                           "oversubscribed": backend == "gloo" and world_size > cores}
    # Each rank holds the tensor; gloo's ring scratch is segment-sized (measured: +7 MiB peak RSS
    # at 100 MiB), so 1.25x the tensors plus 1 GiB for the processes themselves is ample.
    needed, available = 1.25 * world_size * nbytes + 2**30, psutil.virtual_memory().available
    if backend == "gloo" and needed > 0.8 * available:
        return row | {"status": f"skipped: needs ~{needed / 2**30:.1f} GiB, {available / 2**30:.1f} GiB available"}
    warmup, repeats = (1, 5) if nbytes >= 512 * MiB else (2, 10) if nbytes >= 64 * MiB else (3, 30)
    try:
        per_rank = run_workers(bandwidth_worker, world_size, args=(nbytes // 4, warmup, repeats), backend=backend,
                               init_file=tmp / f"bw_{backend}_{world_size}_{nbytes}", timeout_s=CONFIG_LIMIT_S,
                               start_method="spawn" if backend == "nccl" else "fork")
    except TimeoutError as err:
        return row | {"status": f"failed: over the {CONFIG_LIMIT_S:.0f} s limit ({err})"}
    latency = median_ci(slowest_rank(per_rank))
    # Bandwidth falls as time rises: the CI bounds swap.
    algbw = {"value": nbytes / latency.value / 1e9, "low": nbytes / latency.high / 1e9,
             "high": nbytes / latency.low / 1e9, "n": latency.n}
    bus = 2 * (world_size - 1) / world_size
    return row | {"status": "ok", "median_s": asdict(latency), "algbw_GBps": algbw,
                  "busbw_GBps": {k: v * bus if k != "n" else v for k, v in algbw.items()}}


def run_bandwidth(cfg: dict, device: str, tmp: Path, cores: int) -> list[dict]:
    backend, world_sizes = "gloo", cfg["bandwidth_world_sizes"]
    if device == "cuda":  # one GPU per rank: a machine with a single GPU can only run world size 1
        backend = "nccl"
        world_sizes = sorted({min(ws, torch.cuda.device_count()) for ws in world_sizes})
    rows = []
    for world_size in world_sizes:
        for nbytes in cfg["bandwidth_bytes"]:
            print(f"[bandwidth] {backend} world_size={world_size} bytes={nbytes}", flush=True)
            rows.append(_bandwidth_one(world_size, nbytes, backend, tmp, cores))
    return rows


def _numel_name(numel: int) -> str:
    return f"{numel // 1000}k" if numel % 1000 == 0 else str(numel)


def headline(compare: list[dict], bandwidth: list[dict]) -> dict[str, Any]:
    """Flat README-ready numbers: ratios to dist.all_reduce at the largest size, worst error, peak busbw."""
    out: dict[str, Any] = {}
    numel = max((r["numel"] for r in compare), default=0)
    for row in (r for r in compare if r["numel"] == numel and r["world_size"] > 1):
        for name in ("ring", "butterfly"):
            out[f"{name}_vs_torch_{row['world_size']}ranks_{_numel_name(numel)}"] = row["ratios"][f"{name}/all_reduce"]
    for name in ("ring", "butterfly"):
        out[f"{name}_max_rel_err"] = max((r["accuracy"][name]["rel_err"] for r in compare), default=None)
    ok = [r for r in bandwidth if r["status"] == "ok"]
    if ok:
        out["allreduce_peak_busbw_GBps"] = max((r["busbw_GBps"] for r in ok), key=lambda e: e["value"])
    return out


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.allreduce", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/allreduce"))
    parser.add_argument("--quick", action="store_true", help="smoke run: 1-4 ranks, 2 sizes, 3 short rounds")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="bandwidth part: cpu = gloo, cuda = NCCL on the visible GPUs")
    parser.add_argument("--parts", nargs="+", choices=("compare", "bandwidth"), default=["compare", "bandwidth"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-wait-s", type=float, help="wait this long for a quiet machine (300; --quick: 0)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs a CUDA GPU; none is visible (use --device cpu)")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = _parse_args(argv)
    cfg = QUICK if args.quick else FULL
    cores = os.cpu_count() or 1  # the count the record's environment reports
    tmp = Path(tempfile.mkdtemp(prefix="allreduce_bench_"))
    quiet = wait_for_quiet(max_wait_s=args.max_wait_s if args.max_wait_s is not None else 0 if args.quick else 300)
    started = time.monotonic()
    try:
        compare = run_compare(cfg, args.seed, tmp, cores) if "compare" in args.parts else []
        bandwidth = run_bandwidth(cfg, args.device, tmp, cores) if "bandwidth" in args.parts else []
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    config = cfg | {"seed": args.seed, "device": args.device, "threads_per_process": 1, "cores": cores}
    record = make_record("allreduce", config, quiet.finish(), argv=argv, headline=headline(compare, bandwidth),
                         compare=compare, bandwidth=bandwidth, wall_s=time.monotonic() - started)
    allreduce_report.write(record, args.out)
    print(f"wrote {args.out}/results.json, results.md and plots", flush=True)
    return record


if __name__ == "__main__":
    main()
