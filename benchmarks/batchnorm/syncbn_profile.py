"""Where one SyncBatchNorm call's time goes: the host's time to issue it against the whole call's.

    python -m benchmarks.batchnorm.syncbn_profile --device cuda --out /tmp/g/syncbn_profile   # one GPU: ~30 s
    python -m benchmarks.batchnorm.syncbn_profile --quick --out /tmp/syncbn_profile            # the CPU dry run

On a 1-rank group (NCCL on a GPU, gloo on CPU), per shape, one forward+backward of each layer of
:func:`benchmarks.batchnorm.syncbn.layer_calls`: ``custom`` (the layer, its synchronising path forced: on CUDA its
Triton kernels), on CUDA ``eager`` (its eager reference kernel: the fallback where Triton is missing or fails its
self-check) and ``torch_syncbn`` (torch's SyncBatchNorm Function), and ``local`` (torch's BatchNorm), in interleaved
rounds, each call timed two ways: ``host``, the seconds until the call returns to Python (its Python, dispatch,
kernel launches and the collectives' enqueueing; the device may still be running), and ``call``, until the device
has finished (CUDA events around it, after a synchronize; on CPU the two are the same). ``host / call`` near 1: the
host bounds the call, and fewer launches or less Python would pay; well under 1: the device does, and the kernels'
memory traffic would. Then ``torch.profiler`` over a few calls of ``custom`` and ``eager``: their ops and kernels by
self host time, by the memory each op allocated (the SyncBN record's peak memory, op by op) and, on CUDA, by device
time. No target: this tells the SyncBN benchmark's ratios (:mod:`benchmarks.batchnorm.syncbn`) where to look.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.batchnorm.syncbn import layer_calls
from benchmarks.batchnorm.syncbn_report import parse_shape, shape_label
from benchmarks.harness import interleave, parse, parser, round_estimates, run_benchmark, settings
from benchmarks.report import fmt_value, headline_row, publish, table
from collectives.launcher import run_workers

__all__ = ["TITLE", "main", "write"]

TITLE = "SyncBatchNorm: the host's share of one call"
FULL, QUICK = settings({"rounds": (5, 2), "iters": (20, 3), "warmup": (5, 1), "profiled": (10, 2)})
SHAPES = [(32, 128), (1024, 2048), (32, 64, 16, 16), (128, 64, 32, 32), (256, 64, 56, 56), (256, 256, 14, 14)]
QUICK_SHAPES = [(32, 128), (8, 16, 8, 8)]
METHODS = ("custom", "eager", "torch_syncbn", "local")  # eager and torch_syncbn exist on CUDA only
PROFILED = ("custom", "eager")
PROFILE_ROWS = 15


def _host_and_call(fn: Callable[[], None], device: torch.device) -> tuple[float, float]:
    """Seconds until ``fn()`` returns, and until the device has finished it (the same on CPU)."""
    if device.type != "cuda":
        start_s = time.perf_counter()
        fn()
        elapsed = time.perf_counter() - start_s
        return elapsed, elapsed
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize(device)
    start.record()
    start_s = time.perf_counter()
    fn()
    host_s = time.perf_counter() - start_s
    end.record()
    end.synchronize()
    return host_s, start.elapsed_time(end) / 1e3


def _round(fns: dict[str, Callable[[], None]], device: torch.device, calls: int, name: str, _: int) -> list:
    """One round of ``calls`` timed calls of method ``name``: ``(host, call)`` seconds each."""
    return [_host_and_call(fns[name], device) for _ in range(calls)]


def _profile(name: str, fn: Callable[[], None], device: torch.device, calls: int) -> dict[str, str]:
    """``torch.profiler``'s tables of ``calls`` calls of method ``name`` (``fn``): by self host time, by the memory
    each op allocated (on the device, or on CPU there) and on CUDA by device time."""
    on_cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU, *[ProfilerActivity.CUDA] * on_cuda]
    with profile(activities=activities, profile_memory=True) as prof:
        for _ in range(calls):
            fn()
        if on_cuda:
            torch.cuda.synchronize(device)
    averages = prof.key_averages()
    sort_by = {"self host time": "self_cpu_time_total"}
    sort_by |= {"device time": "self_device_time_total"} if on_cuda else {}
    sort_by |= {"memory allocated": "self_device_memory_usage" if on_cuda else "self_cpu_memory_usage"}
    return {f"{name}, by {what}": averages.table(sort_by=key, row_limit=PROFILE_ROWS) for what, key in sort_by.items()}


def _worker(rank: int, world_size: int, shapes: list, cfg: dict) -> dict[str, Any]:
    device = torch.device("cuda", 0) if cfg["device"] == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    rows = []
    for shape in shapes:
        fns = layer_calls(shape, device, rank, cfg)
        for fn in [fn for _ in range(cfg["warmup"]) for fn in fns.values()]:  # warm-up: compiles, caches
            fn()
        timed = interleave(list(fns), cfg["rounds"], functools.partial(_round, fns, device, cfg["iters"]))
        samples = {
            f"{name} {kind}": [pair[i] for block in blocks for pair in block]
            for name, blocks in timed.items()
            for i, kind in enumerate(("host", "call"))
        }
        profiled = {}
        for name in [name for name in PROFILED if name in fns]:
            profiled |= _profile(name, fns[name], device, cfg["profiled"])
        rows.append({"shape": list(shape), "samples_s": samples, "profile": profiled})
    return {"rows": rows, "threads": torch.get_num_threads()}


def _methods(row: dict[str, Any]) -> list[str]:
    return [name for name in METHODS if f"{name} call" in row["samples_s"]]


def write(record: dict[str, Any], out: Path) -> None:
    """Medians (CIs) and ``host / call`` per method and shape from the record's samples; the profiles; the report."""
    run_length = record["config"]["iters"]
    for row in record["rows"]:
        samples = row["samples_s"]
        # host / call of each call (paired: the same call timed both ways), not a ratio of two medians.
        pairs = {name: zip(samples[f"{name} host"], samples[f"{name} call"], strict=True) for name in _methods(row)}
        shares = {f"{name} share": [host / call for host, call in calls] for name, calls in pairs.items()}
        row["median_s"] = round_estimates(samples | shares, run_length, [])["median_s"]
    rows = record["rows"]
    share = lambda row: row["median_s"]["custom share"]  # noqa: E731
    lowest = min(rows, key=lambda row: share(row)["value"])
    record["headline"] = [
        headline_row(f"custom: host / call, the most device-bound shape ({shape_label(lowest)})", share(lowest), "x"),
        headline_row(f"custom: host / call, shapes above 0.8 (host-bound) of {len(rows)}",
                     sum(share(row)["value"] > 0.8 for row in rows)),
    ]  # fmt: skip
    cells = [
        [shape_label(row), name, *(fmt_value(row["median_s"][f"{name} {kind}"], "s") for kind in ("host", "call")),
         fmt_value(row["median_s"][f"{name} share"])]
        for row in rows
        for name in _methods(row)
    ]  # fmt: skip
    body = ["## Host and call time per method", "", *table("shape | method | host | call | host / call", cells)]
    for row in rows:
        for what, text in row["profile"].items():
            body += ["", f"## {shape_label(row)}: torch.profiler, {what}", "", "```", text.rstrip(), "```"]
    publish(out, record, TITLE, body)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = parser("batchnorm.syncbn_profile", __doc__)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="the input's dtype")
    p.add_argument("--rounds", type=int, help=f"interleaved rounds (default {FULL['rounds']})")
    p.add_argument("--iters", type=int, help=f"calls per method per round (default {FULL['iters']})")
    p.add_argument("--shapes", nargs="+", type=parse_shape, help="e.g. 32x128 8x16x8x8")
    args = parse(p, argv, FULL, QUICK)
    shapes = args.shapes or (QUICK_SHAPES if args.quick else SHAPES)
    backend = "nccl" if args.device == "cuda" else "gloo"
    config = args.cfg | {"device": args.device, "dtype": args.dtype, "backend": backend, "methods": METHODS}
    config |= {"shapes": [list(s) for s in shapes], "threads": None}
    # CUDA workers are spawned: a fork after this process touched CUDA dies in the child.
    start_method = "spawn" if args.device == "cuda" else "fork"
    launch = {"backend": backend, "timeout_s": 900.0, "threads": 1, "start_method": start_method}

    def measure() -> dict[str, Any]:
        (result,) = run_workers(_worker, 1, args=(shapes, config), **launch)
        config["threads"] = result["threads"]
        return {"rows": result["rows"]}

    return run_benchmark("batchnorm.syncbn_profile", config, argv, write, measure, args.out, args.max_wait_s)


if __name__ == "__main__":
    main()
