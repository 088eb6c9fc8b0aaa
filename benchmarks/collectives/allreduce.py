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
process. Analysis, headline and report: this module.
"""

from __future__ import annotations

import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

import psutil
import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from benchmarks.harness import parse, parser, round_estimates, run_benchmark, settings, slowest_ranks, timed_rounds
from benchmarks.report import Panel, fmt_bytes, fmt_value, headline_row, publish, table
from collectives.allreduce import butterfly_all_reduce, ring_all_reduce
from collectives.launcher import run_workers
from measure.memory import measure_peak
from measure.stats import median_ci
from measure.timing import aligned_seconds

MiB = 1 << 20
CONFIG_LIMIT_S = 300.0  # the assignment's per-configuration limit
TITLE = "All-reduce: ring vs butterfly vs dist.all_reduce, and bandwidth"
RING_TARGET_RATIO, RING_TARGET_WORLD_SIZES, REL_ERR_TARGET = 1.5, (2, 4, 8), 1e-6
SLOW_CALL_S = 2e-3  # between the fast mode (~0.3-0.5 ms at 2 ranks) and the ~3.5 ms stall mode
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
RATIOS = ("ring/all_reduce", "butterfly/all_reduce")
_PAIRS = [key.split("/") for key in RATIOS]


def _torch_average(tensor: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(tensor)
    return tensor.div_(dist.get_world_size())


METHODS = {"ring": ring_all_reduce, "butterfly": butterfly_all_reduce, "all_reduce": _torch_average}


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
        **round_estimates(samples, run_length, _PAIRS),
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


def headline(record: dict[str, Any]) -> list[dict[str, Any]]:
    """Ring (with its target) and butterfly over dist.all_reduce at the largest size, worst error, peak busbw."""
    compare, rows = record["compare"], []
    numel = max((r["numel"] for r in compare), default=0)
    for row in (r for r in compare if r["numel"] == numel and r["world_size"] in RING_TARGET_WORLD_SIZES):
        at = f"{numel:,} float32, {row['world_size']} ranks" + (" (time-shared cores)" if row["oversubscribed"] else "")
        for key, target in zip(RATIOS, (RING_TARGET_RATIO, None), strict=True):
            what = f"{key.split('/')[0]} / dist.all_reduce: time per call, {at}"
            rows.append(headline_row(what, row["ratios"][key], "x", target))
    if compare:
        worst = max(r["accuracy"][m]["rel_err"] for r in compare for m in ("ring", "butterfly"))
        what = "ring and butterfly: worst relative error vs the fp64 mean, every configuration"
        rows.append(headline_row(what, worst, "", REL_ERR_TARGET))
    ok = [r for r in record["bandwidth"] if r["status"] == "ok"]
    if ok:
        best = max(ok, key=lambda r: r["busbw_GBps"]["value"])
        at = f"{best['backend']}, {fmt_bytes(best['bytes'])}, {best['world_size']} ranks"
        rows.append(headline_row(f"dist.all_reduce peak bus bandwidth ({at})", best["busbw_GBps"], "GB/s"))
    return rows


def slow_call_share(samples_s: list[float]) -> float:
    """The share of calls slower than ``SLOW_CALL_S``: how much of a bimodal time sits in the slow mode."""
    return sum(t > SLOW_CALL_S for t in samples_s) / max(len(samples_s), 1)


def _tables(record: dict[str, Any]) -> list[str]:
    compare, cfg = record["compare"], record["config"]
    times = [
        [r["world_size"], r["oversubscribed"], f"{r['numel']:,}", *(fmt_value(r["median_s"][m], "s") for m in METHODS)]
        + [fmt_value(r["ratios"][key]) for key in RATIOS]
        + [" / ".join(f"{slow_call_share(r['samples_s'][m]):.0%}" for m in METHODS)]
        for r in compare
    ]
    accuracy = [
        [r["world_size"], f"{r['numel']:,}", m, f"{a['max_abs_err']:.1e}", f"{a['rel_err']:.1e}", a["identical"]]
        + [fmt_bytes(r["memory"][m][key]) for key in ("torch_alloc_bytes", "extra_peak_bytes")]
        for r in compare
        for m, a in r["accuracy"].items()
    ]
    measured = {"median_s": "s", "algbw_GBps": "", "busbw_GBps": ""}  # key: unit
    bandwidth = [
        [fmt_bytes(r["bytes"]), r["world_size"], r["oversubscribed"], r["backend"]]
        + [fmt_value(r[key], unit) if r["status"] == "ok" else "-" for key, unit in measured.items()]
        + [r["status"]]
        for r in record["bandwidth"]
    ]
    methods = " / ".join(METHODS)
    return [
        f"{cfg['rounds']} interleaved rounds x {cfg['iters']} iterations per method after {cfg['warmup']} "
        f"warm-up; wall time {record['wall_s']:.0f} s.",
        "",
        "## Time per call (float32 average)",
        "",
        *table(
            f"ranks | time-shared | elements | {methods.replace('/', '|')} | ring / all_reduce | "
            f"butterfly / all_reduce | calls > {SLOW_CALL_S * 1e3:g} ms ({methods})",
            times,
        ),
        "",
        "## Accuracy and memory (rank 0)",
        "",
        "`extra peak memory` grows only when a call cannot reuse freed heap pages; `torch alloc/call` is the "
        "allocator-independent figure.",
        "",
        *table(
            "ranks | elements | method | max abs err | rel err | same bits all ranks | torch alloc/call | "
            "extra peak memory",
            accuracy,
        ),
        "",
        "## dist.all_reduce bandwidth",
        "",
        *table("size | ranks | time-shared | backend | latency | algbw GB/s | busbw GB/s | status", bandwidth),
        "",
    ]


def _compare_panels(compare: list[dict[str, Any]], cores: int) -> list[Panel]:
    """Time per call at the largest size per world size, and its ratio to dist.all_reduce."""
    numel = max(r["numel"] for r in compare)
    rows = sorted((r for r in compare if r["numel"] == numel), key=lambda r: r["world_size"])
    groups = [f"{r['world_size']}{'*' * r['oversubscribed']} rank{'s' * (r['world_size'] > 1)}" for r in rows]
    title = f"float32 average, {numel:,} elements (* time-shared: more ranks than {cores} cores)"
    times = {m: [r["median_s"][m] for r in rows] for m in METHODS}
    ratio = {
        key.replace("/", " / "): [r["ratios"][key] if r["world_size"] > 1 else None for r in rows] for key in RATIOS
    }
    lines = {"1": 1.0, f"ring target {RING_TARGET_RATIO}x": RING_TARGET_RATIO}
    return [
        Panel(title, "median ms per call", groups, times, scale=1e3, log=True),
        Panel("time relative to dist.all_reduce", "ratio of medians", groups, ratio, lines=lines),
    ]


def _bandwidth_panels(ok: list[dict[str, Any]]) -> list[Panel]:
    """dist.all_reduce's latency and bus bandwidth per size, a series per world size."""
    sizes, world_sizes = sorted({r["bytes"] for r in ok}), sorted({r["world_size"] for r in ok})
    at = {(r["world_size"], r["bytes"]): r for r in ok}
    shown = {"latency": ("median_s", "median ms", 1e3), "bus bandwidth": ("busbw_GBps", "GB/s", 1.0)}
    return [
        Panel(f"dist.all_reduce {name}", unit, [fmt_bytes(b) for b in sizes], series, scale, log=True)
        for name, (key, unit, scale) in shown.items()
        for series in [{f"{ws} ranks": [at.get((ws, b), {}).get(key) for b in sizes] for ws in world_sizes}]
    ]


def write(record: dict[str, Any], out_dir: Path) -> None:
    """Write results.json, results.md and allreduce.png for ``record`` into ``out_dir``."""
    # compare_row's estimates again, from the kept samples, so a stored record re-derives the same way
    for row in record["compare"]:
        row.update(round_estimates(row["samples_s"], record["config"]["iters"], _PAIRS))
    record["headline"] = headline(record)
    ok = [r for r in record["bandwidth"] if r["status"] == "ok"]
    panels = (_compare_panels(record["compare"], record["config"]["cores"]) if record["compare"] else []) + (
        _bandwidth_panels(ok) if ok else []
    )
    publish(out_dir, record, TITLE, _tables(record), {"allreduce.png": (TITLE, panels)})


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
