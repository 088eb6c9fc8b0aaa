"""All-reduce benchmark: hand-written ring and butterfly vs ``dist.all_reduce``, and gloo's bandwidth.

    python -m benchmarks.allreduce                                # about 8 minutes on 2 cores
    python -m benchmarks.allreduce --quick --out /tmp/allreduce   # smoke run

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
process. Analysis, headline and report: this module.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import psutil
import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from benchmarks.harness import (
    aligned_seconds,
    finish_run,
    fmt_bytes,
    fmt_value,
    headline_row,
    in_runs,
    measure_peak,
    median_ci,
    parse,
    parser,
    plot_estimates,
    ratio_ci,
    report,
    slowest_rank,
    table,
    timed_rounds,
    wait_for_quiet,
    write_record,
)
from benchmarks.launcher import run_workers
from collectives.allreduce import butterfly_all_reduce, ring_all_reduce

MiB = 1 << 20
CONFIG_LIMIT_S = 300.0  # the assignment's per-configuration limit
TITLE = "All-reduce: ring vs butterfly vs dist.all_reduce, and bandwidth"
RING_TARGET_RATIO, RING_TARGET_WORLD_SIZES, REL_ERR_TARGET = 1.5, (2, 4, 8), 1e-6
SLOW_CALL_S = 2e-3  # between the fast mode (~0.3-0.5 ms at 2 ranks) and the ~3.5 ms stall mode
FULL = {
    "compare_world_sizes": [1, 2, 4, 8, 16, 32],
    "compare_numels": [1_000, 10_000, 100_000],
    "warmup": 5,
    "rounds": 10,
    "iters": 10,
    "bandwidth_world_sizes": [2, 4, 6],
    "bandwidth_bytes": [1 * MiB, 10 * MiB, 100 * MiB, 1024 * MiB],
}
QUICK = {
    **FULL,
    "compare_world_sizes": [1, 2, 4],
    "compare_numels": [1_000, 100_000],
    "warmup": 2,
    "rounds": 3,
    "iters": 4,
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
        samples = timed_rounds(
            {name: lambda m=method, w=work: m(w) for name, method in METHODS.items()},
            cfg,
            prepare=lambda _, w=work, d=data: w.copy_(d),
        )
        out[numel] = {"samples": samples, "accuracy": _accuracy(rank, world_size, data, seed), "memory": _memory(data)}
    return out


def run_compare(cfg: dict, seed: int, cores: int) -> list[dict]:
    """Part 1: one process group per world size, every size and method inside it."""
    rows = []
    for world_size in cfg["compare_world_sizes"]:
        print(f"[compare] world_size={world_size}", flush=True)
        per_rank = run_workers(
            compare_worker, world_size, args=(cfg["compare_numels"], cfg, seed), timeout_s=CONFIG_LIMIT_S
        )
        rows += [compare_row(world_size, numel, per_rank, cores, cfg["iters"]) for numel in cfg["compare_numels"]]
    return rows


def bandwidth_worker(rank: int, world_size: int, numel: int, warmup: int, repeats: int) -> dict[str, Any]:
    """One process of part 2: per-iteration seconds of ``dist.all_reduce`` of ``numel`` float32 values."""
    device = torch.device("cuda", rank) if dist.get_backend() == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    tensor = torch.zeros(numel, dtype=torch.float32, device=device)  # zeros: no overflow or denormals
    samples = [aligned_seconds(lambda: dist.all_reduce(tensor), device) for _ in range(warmup + repeats)]
    return {"samples": samples[warmup:], "threads": torch.get_num_threads()}


def run_bandwidth(cfg: dict, device: str, cores: int) -> list[dict]:
    """Part 2: one process group per (world size, size); what does not fit in memory is skipped."""
    backend, world_sizes, rows = "gloo", cfg["bandwidth_world_sizes"], []
    if device == "cuda":  # one GPU per rank: a machine with a single GPU can only run world size 1
        backend, world_sizes = "nccl", sorted({min(ws, torch.cuda.device_count()) for ws in world_sizes})
    for world_size, nbytes in ((ws, b) for ws in world_sizes for b in cfg["bandwidth_bytes"]):
        print(f"[bandwidth] {backend} world_size={world_size} bytes={nbytes}", flush=True)
        row = {
            "world_size": world_size,
            "bytes": nbytes,
            "backend": backend,
            "oversubscribed": backend == "gloo" and world_size > cores,
        }
        # Each rank holds the tensor; gloo's ring scratch is segment-sized (measured: +7 MiB peak RSS
        # at 100 MiB), so 1.25x the tensors plus 1 GiB for the processes themselves is ample.
        needed, available = 1.25 * world_size * nbytes + 2**30, psutil.virtual_memory().available
        if backend == "gloo" and needed > 0.8 * available:
            rows.append(
                row | {"status": f"skipped: needs ~{needed / 2**30:.1f} GiB, {available / 2**30:.1f} GiB available"}
            )
            continue
        warmup, repeats = (1, 5) if nbytes >= 512 * MiB else (2, 10) if nbytes >= 64 * MiB else (3, 30)
        try:
            rows.append(
                bandwidth_row(
                    row,
                    run_workers(
                        bandwidth_worker,
                        world_size,
                        args=(nbytes // 4, warmup, repeats),
                        backend=backend,
                        timeout_s=CONFIG_LIMIT_S,
                        start_method="spawn" if backend == "nccl" else "fork",
                    ),
                )
            )
        except TimeoutError as err:
            rows.append(row | {"status": f"failed: over the {CONFIG_LIMIT_S:.0f} s limit ({err})"})
    return rows


def compare_estimates(samples: dict[str, list[float]], run_length: int) -> dict[str, Any]:
    """Medians and ratios to dist.all_reduce (CIs) from a row's slowest-rank samples, kept flat in rounds of
    ``run_length`` calls (each round is resampled whole)."""
    runs = {name: in_runs(values, run_length) for name, values in samples.items()}
    return {
        "median_s": {name: asdict(median_ci(values)) for name, values in runs.items()},
        "ratios": {
            f"{name}/all_reduce": asdict(ratio_ci(runs[name], runs["all_reduce"])) for name in ("ring", "butterfly")
        },
    }


def compare_row(world_size: int, numel: int, per_rank: list[dict], cores: int, run_length: int) -> dict[str, Any]:
    """One (world size, size) row: :func:`compare_estimates`, accuracy, memory."""
    samples = {name: slowest_rank([r[numel]["samples"][name] for r in per_rank]) for name in METHODS}
    accuracy = {
        name: {
            **per_rank[0][numel]["accuracy"][name],
            "identical": all(r[numel]["accuracy"][name]["identical"] for r in per_rank),
        }
        for name in METHODS
    }
    return {
        "world_size": world_size,
        "numel": numel,
        "oversubscribed": world_size > cores,
        "threads": per_rank[0]["threads"],
        **compare_estimates(samples, run_length),
        "accuracy": accuracy,
        "memory": per_rank[0][numel]["memory"],
        "samples_s": samples,
    }


def bandwidth_row(row: dict[str, Any], per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """Latency (median, CI) of the slowest rank, algorithm and bus bandwidth (nccl-tests' definition)."""
    samples = slowest_rank([r["samples"] for r in per_rank])
    latency = median_ci(samples)
    # Bandwidth falls as time rises: the CI bounds swap.
    algbw = {
        "value": row["bytes"] / latency.value / 1e9,
        "low": row["bytes"] / latency.high / 1e9,
        "high": row["bytes"] / latency.low / 1e9,
        "n": latency.n,
    }
    bus = 2 * (row["world_size"] - 1) / row["world_size"]
    return row | {
        "status": "ok",
        "threads": per_rank[0]["threads"],
        "median_s": asdict(latency),
        "algbw_GBps": algbw,
        "busbw_GBps": {k: v * bus if k != "n" else v for k, v in algbw.items()},
        "samples_s": samples,
    }


def headline(record: dict[str, Any]) -> list[dict[str, Any]]:
    """Ring (with its target) and butterfly over dist.all_reduce at the largest size, worst error, peak busbw."""
    compare, rows = record["compare"], []
    numel = max((r["numel"] for r in compare), default=0)
    for row in (r for r in compare if r["numel"] == numel and r["world_size"] in RING_TARGET_WORLD_SIZES):
        at = f"{numel:,} float32, {row['world_size']} ranks" + (" (time-shared cores)" if row["oversubscribed"] else "")
        rows += [
            headline_row(
                f"{m} / dist.all_reduce: time per call, {at}",
                row["ratios"][f"{m}/all_reduce"],
                "x",
                RING_TARGET_RATIO if m == "ring" else None,
            )
            for m in ("ring", "butterfly")
        ]
    if compare:
        worst = max(r["accuracy"][m]["rel_err"] for r in compare for m in ("ring", "butterfly"))
        rows.append(
            headline_row(
                "ring and butterfly: worst relative error vs the fp64 mean, every configuration",
                worst,
                "",
                REL_ERR_TARGET,
            )
        )
    ok = [r for r in record["bandwidth"] if r["status"] == "ok"]
    if ok:
        best = max(ok, key=lambda r: r["busbw_GBps"]["value"])
        rows.append(
            headline_row(
                f"dist.all_reduce peak bus bandwidth ({best['backend']}, {fmt_bytes(best['bytes'])}, "
                f"{best['world_size']} ranks)",
                best["busbw_GBps"],
                "GB/s",
            )
        )
    return rows


def slow_call_share(samples_s: list[float]) -> float:
    """The share of calls slower than ``SLOW_CALL_S``: how much of a bimodal time sits in the slow mode."""
    return sum(t > SLOW_CALL_S for t in samples_s) / max(len(samples_s), 1)


def _tables(record: dict[str, Any]) -> list[str]:
    compare, bandwidth, cfg = record["compare"], record["bandwidth"], record["config"]
    times = [
        [
            r["world_size"],
            r["oversubscribed"],
            f"{r['numel']:,}",
            *(fmt_value(r["median_s"][m], "s") for m in METHODS),
            *(fmt_value(r["ratios"][f"{m}/all_reduce"]) for m in ("ring", "butterfly")),
            " / ".join(f"{slow_call_share(r['samples_s'][m]):.0%}" for m in METHODS),
        ]
        for r in compare
    ]
    accuracy = [
        [
            r["world_size"],
            f"{r['numel']:,}",
            m,
            f"{r['accuracy'][m]['max_abs_err']:.1e}",
            f"{r['accuracy'][m]['rel_err']:.1e}",
            r["accuracy"][m]["identical"],
            fmt_bytes(r["memory"][m]["torch_alloc_bytes"]),
            fmt_bytes(r["memory"][m]["extra_peak_bytes"]),
        ]
        for r in compare
        for m in METHODS
    ]
    bw = [
        [
            fmt_bytes(r["bytes"]),
            r["world_size"],
            r["oversubscribed"],
            r["backend"],
            *(
                (fmt_value(r["median_s"], "s"), fmt_value(r["algbw_GBps"]), fmt_value(r["busbw_GBps"]))
                if r["status"] == "ok"
                else ("-", "-", "-")
            ),
            r["status"],
        ]
        for r in bandwidth
    ]
    return [
        f"{cfg['rounds']} interleaved rounds x {cfg['iters']} iterations per method after {cfg['warmup']} "
        f"warm-up; wall time {record['wall_s']:.0f} s.",
        "",
        "## Time per call (float32 average)",
        "",
        *table(
            [
                "ranks",
                "time-shared",
                "elements",
                *METHODS,
                "ring / all_reduce",
                "butterfly / all_reduce",
                f"calls > {SLOW_CALL_S * 1e3:g} ms ({' / '.join(METHODS)})",
            ],
            times,
        ),
        "",
        "## Accuracy and memory (rank 0)",
        "",
        "`extra peak memory` grows only when a call cannot reuse freed heap pages; `torch alloc/call` is the "
        "allocator-independent figure.",
        "",
        *table(
            [
                "ranks",
                "elements",
                "method",
                "max abs err",
                "rel err",
                "same bits all ranks",
                "torch alloc/call",
                "extra peak memory",
            ],
            accuracy,
        ),
        "",
        "## dist.all_reduce bandwidth",
        "",
        *table(["size", "ranks", "time-shared", "backend", "latency", "algbw GB/s", "busbw GB/s", "status"], bw),
        "",
    ]


def write(record: dict[str, Any], out_dir: Path) -> None:
    """Write results.json, results.md and allreduce.png for ``record`` into ``out_dir``."""
    # compare_row's estimates again, from the kept samples, so a stored record re-derives the same way
    for row in record["compare"]:
        row.update(compare_estimates(row["samples_s"], record["config"]["iters"]))
    record["headline"] = headline(record)
    write_record(out_dir, record, report(record, TITLE, _tables(record)))
    panels, cores = [], record["config"]["cores"]
    if record["compare"]:
        numel = max(r["numel"] for r in record["compare"])
        rows = sorted((r for r in record["compare"] if r["numel"] == numel), key=lambda r: r["world_size"])
        groups = [f"{r['world_size']}{'*' * r['oversubscribed']} rank{'s' * (r['world_size'] > 1)}" for r in rows]
        panels += [
            {
                "title": f"float32 average, {numel:,} elements (* time-shared: more ranks than {cores} cores)",
                "ylabel": "median ms per call",
                "scale": 1e3,
                "log": True,
                "groups": groups,
                "series": {m: [r["median_s"][m] for r in rows] for m in METHODS},
            },
            {
                "title": "time relative to dist.all_reduce",
                "ylabel": "ratio of medians",
                "groups": groups,
                "series": {
                    f"{m} / all_reduce": [r["ratios"][f"{m}/all_reduce"] if r["world_size"] > 1 else None for r in rows]
                    for m in ("ring", "butterfly")
                },
                "lines": {"1": 1.0, f"ring target {RING_TARGET_RATIO}x": RING_TARGET_RATIO},
            },
        ]
    ok = [r for r in record["bandwidth"] if r["status"] == "ok"]
    if ok:
        sizes, world_sizes = sorted({r["bytes"] for r in ok}), sorted({r["world_size"] for r in ok})
        at = {(r["world_size"], r["bytes"]): r for r in ok}
        panels += [
            {
                "title": f"dist.all_reduce {name}",
                "ylabel": unit,
                "groups": [fmt_bytes(b) for b in sizes],
                "scale": scale,
                "log": True,
                "series": {f"{ws} ranks": [at.get((ws, b), {}).get(key) for b in sizes] for ws in world_sizes},
            }
            for name, key, unit, scale in (
                ("latency", "median_s", "median ms", 1e3),
                ("bus bandwidth", "busbw_GBps", "GB/s", 1.0),
            )
        ]
    plot_estimates(out_dir / "allreduce.png", panels, TITLE, record["quietness"]["comparable"])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = parser("allreduce", __doc__)
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="bandwidth part: cpu = gloo, cuda = NCCL on the visible GPUs",
    )
    p.add_argument("--parts", nargs="+", choices=("compare", "bandwidth"), default=["compare", "bandwidth"])
    p.add_argument("--seed", type=int, default=0)
    args = parse(p, argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda needs a CUDA GPU; none is visible (use --device cpu)")
    cfg = QUICK if args.quick else FULL
    cores = os.cpu_count() or 1  # the count the record's environment reports
    quiet = wait_for_quiet(max_wait_s=args.max_wait_s)
    started = time.monotonic()
    compare = run_compare(cfg, args.seed, cores) if "compare" in args.parts else []
    bandwidth = run_bandwidth(cfg, args.device, cores) if "bandwidth" in args.parts else []
    config = cfg | {"seed": args.seed, "device": args.device, "threads_per_process": 1, "cores": cores}
    return finish_run("allreduce", config, quiet, argv, write, args.out, started, compare=compare, bandwidth=bandwidth)


if __name__ == "__main__":
    main()
