"""Gradient synchronisation benchmark: SyncedDataParallel's modes against torch DDP, plus ZeRO-1.

Usage (from the repository root)::

    python -m benchmarks.grad_sync --out benchmarks/results/grad_sync          # full run
    python -m benchmarks.grad_sync --out /tmp/grad_sync --quick                # smoke run

Two ranks (gloo on CPU), one intra-op thread each, train a deep MLP and a CIFAR-sized ResNet-18
(SGD with momentum, one fixed batch per rank). For every variant (``none`` = no communication,
the four SyncedDataParallel modes with bucketed at several caps, torch DDP) and every step:
step time (the slower rank's, after a barrier) and time waiting in ``finish()``; peak memory
(RSS high-water mark above the built model) comes from a separate, untimed run.
"Communication alone" is the variant's bucket layout all-reduced with nothing else running.
Share hidden behind backward, two ways, each clipped to [0, 1]: ``1 - finish() wait / comm
alone`` (what backward did not cover) and ``1 - (step - step of none) / comm alone`` (which
also charges the slowdown of compute sharing the cores with communication). Variants run
interleaved for ``--rounds`` rounds so that load drifts hit all of them alike. The ZeRO-1 table
counts AdamW state bytes per rank, sharded vs unsharded. Results: ``results.json``,
``README.md`` and plots in ``--out`` (see :mod:`benchmarks.grad_sync_report`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torchvision
from torch import nn

from benchmarks import grad_sync_report
from callbacks.memory import PeakMemory, return_freed_memory_above
from callbacks.run_info import environment
from parallel.buckets import assign_buckets
from parallel.grad_sync import SyncedDataParallel
from parallel.sync_config import DEFAULT_BUCKET_CAP_MB, DEFAULT_FIRST_BUCKET_CAP_MB
from collectives.launcher import run_workers
from parallel.zero import ShardedOptimizer

WORLD_SIZE = 2
_MiB = 2**20
# The anchor is torch DDP as users get it (no options); its effective settings are read back
# from the wrapper and recorded next to the numbers. "ddp_tuned" turns on what saves memory/time.
DDP_TUNED = {"gradient_as_bucket_view": True, "forward_sync_buffers": False}
_DDP_SETTINGS = ("bucket_bytes_cap", "gradient_as_bucket_view", "forward_sync_buffers")
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "none": ("none", {}),
    "per_param": ("sdp", {"mode": "per_param"}),
    "flat": ("sdp", {"mode": "flat"}),
    "per_param_overlap": ("sdp", {"mode": "per_param_overlap"}),
    **{
        f"bucketed_{cap}mb": ("sdp", {"mode": "bucketed", "bucket_cap_mb": cap})
        for cap in (1, 10, 25, 100, 1000)
    },
    "bucketed_25mb_bf16": ("sdp", {"mode": "bucketed", "grad_compression": "bf16"}),
    "bucketed_25mb_zero1": ("sdp", {"mode": "bucketed", "zero1": True}),
    "ddp": ("ddp", {}),
    "ddp_tuned": ("ddp", DDP_TUNED),
}
FULL = {"mlp_width": 1024, "mlp_depth": 16, "mlp_batch": 64, "resnet_batch": 32,
        "warmup": 3, "steps": 10, "rounds": 2, "comm_repeats": 5, "memory_steps": 3}
QUICK = {"mlp_width": 256, "mlp_depth": 8, "mlp_batch": 16, "resnet_batch": 4,
         "warmup": 1, "steps": 3, "rounds": 1, "comm_repeats": 2, "memory_steps": 2}


def build_model(name: str, cfg: dict) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """The network and one fixed (input, target) batch for this rank."""
    if name == "mlp":
        width, depth = cfg["mlp_width"], cfg["mlp_depth"]
        layers = [m for _ in range(depth) for m in (nn.Linear(width, width), nn.ReLU())]
        net, x = nn.Sequential(*layers, nn.Linear(width, 100)), torch.randn(cfg["mlp_batch"], width)
    elif name == "resnet18":
        net = torchvision.models.resnet18(num_classes=100)
        x = torch.randn(cfg["resnet_batch"], 3, 32, 32)
    else:
        raise ValueError(f"unknown model {name!r}; choose 'mlp' or 'resnet18'")
    return net, x, torch.randint(0, 100, (x.shape[0],))


def _wrap(net: nn.Module, kind: str, options: dict) -> tuple[nn.Module, torch.optim.Optimizer]:
    options = dict(options)
    zero1 = options.pop("zero1", False)
    if kind == "sdp":
        model: nn.Module = SyncedDataParallel(net, **options)
    elif kind == "ddp":
        model = nn.parallel.DistributedDataParallel(net, **options)
    else:
        model = net
    sgd = {"lr": 0.01, "momentum": 0.9}
    if zero1:
        return model, ShardedOptimizer(net.parameters(), torch.optim.SGD, **sgd)
    return model, torch.optim.SGD(net.parameters(), **sgd)


def _train_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
) -> tuple[float, float]:
    """One step: its seconds, and the clock when backward and finish() ended.

    ``time.perf_counter`` is CLOCK_MONOTONIC on Linux, shared by all processes of the machine,
    so the ranks' stamps compare directly.
    """
    start = time.perf_counter()
    nn.functional.cross_entropy(model(x), y).backward()
    backward_done = time.perf_counter()
    if isinstance(model, SyncedDataParallel):
        model.finish()
    finished = time.perf_counter()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - start, backward_done, finished


def _comm_alone(model: nn.Module, net: nn.Module, repeats: int) -> list[float]:
    """Seconds to all-reduce this variant's bucket layout with nothing else running."""
    if isinstance(model, SyncedDataParallel):
        buffers, blocking = [b.buffer for b in model.buckets], model.mode == "per_param"
    else:  # DDP's layout: 25 MiB buckets, 1 MiB first, in reverse registration order
        params = [p for p in net.parameters() if p.requires_grad][::-1]
        groups = assign_buckets(params, DEFAULT_BUCKET_CAP_MB, DEFAULT_FIRST_BUCKET_CAP_MB)
        buffers, blocking = [torch.zeros(sum(params[i].numel() for i in g)) for g in groups], False
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        works = []
        for buffer in buffers:
            works.append(dist.all_reduce(buffer, async_op=True))
            if blocking:
                works.pop().wait()
        for work in works:
            work.wait()
        times.append(time.perf_counter() - start)
    return times


def _setup(rank: int, model_name: str, variant: str, cfg: dict) -> tuple[Any, ...]:
    torch.manual_seed(0)
    net, x, y = build_model(model_name, cfg)  # identical weights; DDP/SDP broadcast anyway
    torch.manual_seed(rank)
    x, y = torch.randn_like(x), torch.randint(0, 100, y.shape)  # different data per rank
    kind, options = VARIANTS[variant]
    return net, x, y, kind, options


def step_worker(rank: int, world_size: int, model_name: str, variant: str, cfg: dict) -> dict:
    """Per-step times on this rank, and the variant's communication timed alone."""
    net, x, y, kind, options = _setup(rank, model_name, variant, cfg)
    model, optimizer = _wrap(net, kind, options)
    steps, stamps = [], []
    for i in range(cfg["warmup"] + cfg["steps"]):
        dist.barrier()
        step_s, backward_done, finished = _train_step(model, optimizer, x, y)
        if i >= cfg["warmup"]:
            steps.append(step_s)
            stamps.append((backward_done, finished))
    comm = [] if kind == "none" else _comm_alone(model, net, cfg["comm_repeats"])
    buckets = len(model.buckets) if isinstance(model, SyncedDataParallel) else None
    settings = {k: getattr(model, k, None) for k in _DDP_SETTINGS} if kind == "ddp" else None
    return {"step_s": steps, "stamps": stamps, "comm_alone_s": comm, "buckets": buckets,
            "ddp_settings": settings}


def memory_worker(rank: int, world_size: int, model_name: str, variant: str, cfg: dict) -> int:
    """Peak RSS over wrapping and a few steps, above the built model (untimed run)."""
    # Only in this untimed run: freed transients must leave the RSS (see the helper).
    return_freed_memory_above(_MiB)
    net, x, y, kind, options = _setup(rank, model_name, variant, cfg)
    memory = PeakMemory(torch.device("cpu"))
    memory.start()
    baseline = memory.stop()["peak_bytes"]
    memory.start()
    model, optimizer = _wrap(net, kind, options)
    for _ in range(cfg["memory_steps"]):
        _train_step(model, optimizer, x, y)
    return int(memory.stop()["peak_bytes"] - baseline)


def zero_worker(rank: int, world_size: int, model_name: str, cfg: dict) -> dict:
    """AdamW state bytes on this rank after one step, sharded and unsharded."""
    torch.manual_seed(0)
    net, x, y = build_model(model_name, cfg)
    out = {}
    for name, optimizer in (
        ("unsharded", torch.optim.AdamW(net.parameters(), lr=1e-3)),
        ("sharded", ShardedOptimizer(net.parameters(), torch.optim.AdamW, lr=1e-3)),
    ):
        nn.functional.cross_entropy(net(x), y).backward()
        optimizer.step()
        net.zero_grad(set_to_none=True)
        state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
        out[name] = sum(v.numel() * v.element_size() for v in state)
    out["param_bytes"] = sum(p.numel() * p.element_size() for p in net.parameters())
    return out


def _merge(per_rank: list[dict]) -> dict:
    """Per step the slower rank's time (ranks start each step together after a barrier)."""
    slowest = [max(times) for times in zip(*(r["step_s"] for r in per_rank))]
    # Exposed communication: from the LAST rank's end of backward to the last finish(). A fast
    # rank's own wait also covers the slow rank's remaining backward, which is not communication.
    waits = [
        max(0.0, max(f for _, f in step) - max(b for b, _ in step))
        for step in zip(*(r["stamps"] for r in per_rank))
    ]
    comm = [max(times) for times in zip(*(r["comm_alone_s"] for r in per_rank))]
    return {"step_s": slowest, "wait_s": waits, "comm_alone_s": comm,
            "buckets": per_rank[0]["buckets"], "ddp_settings": per_rank[0]["ddp_settings"]}


def run_steps(cfg: dict, models: list[str], variants: list[str], tmp: Path) -> dict:
    samples: dict[str, dict[str, dict]] = {m: {} for m in models}
    for round_index in range(cfg["rounds"]):
        for model_name in models:
            for variant in variants:
                store = tmp / f"store_{round_index}_{model_name}_{variant}"
                args = (model_name, variant, cfg)
                merged = _merge(run_workers(step_worker, WORLD_SIZE, args=args, init_file=store,
                                            timeout_s=600))
                print(f"round {round_index} {model_name:8s} {variant:22s} step "
                      f"{statistics.median(merged['step_s']) * 1e3:8.1f} ms", flush=True)
                previous = samples[model_name].get(variant)
                for key in ("step_s", "wait_s", "comm_alone_s") if previous else ():
                    merged[key] = previous[key] + merged[key]
                samples[model_name][variant] = merged
    for model_name in models:
        for variant in variants:
            peaks = run_workers(memory_worker, WORLD_SIZE, args=(model_name, variant, cfg),
                                init_file=tmp / f"memory_{model_name}_{variant}", timeout_s=600)
            samples[model_name][variant]["peak_bytes"] = max(peaks)
    return samples


def run_zero(cfg: dict, models: list[str], tmp: Path) -> list[dict]:
    rows = []
    for model_name in models:
        for world_size in (2, 4):
            per_rank = run_workers(zero_worker, world_size, args=(model_name, cfg),
                                   init_file=tmp / f"zero_{model_name}_{world_size}", timeout_s=600)
            rows.append({"model": model_name, "world_size": world_size,
                         "param_bytes": per_rank[0]["param_bytes"],
                         "unsharded_bytes": per_rank[0]["unsharded"],
                         "sharded_bytes_per_rank": [r["sharded"] for r in per_rank]})
    return rows


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.grad_sync",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/grad_sync"))
    parser.add_argument("--quick", action="store_true", help="small smoke configuration")
    parser.add_argument("--models", nargs="+", choices=("mlp", "resnet18"),
                        default=["mlp", "resnet18"])
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--rounds", type=int, help="override the number of interleaved rounds")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = _parse_args(argv)
    cfg = dict(QUICK if args.quick else FULL)
    if args.rounds is not None:
        cfg["rounds"] = args.rounds
    # "none", the compute-only baseline, is always measured: the overlap figures need it.
    variants = ["none", *[v for v in args.variants if v != "none"]]
    args.out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="grad_sync_bench_"))
    env = environment() | {"load_avg_start": os.getloadavg()}
    command = ["python -m benchmarks.grad_sync", *(sys.argv[1:] if argv is None else argv)]
    record: dict[str, Any] = {
        "command": " ".join(command),
        "config": cfg | {"world_size": WORLD_SIZE, "backend": "gloo", "device": "cpu",
                         "threads_per_process": 1, "optimizer": "SGD(lr=0.01, momentum=0.9)",
                         "ddp_tuned_options": DDP_TUNED,
                         "variants": {v: VARIANTS[v] for v in variants}},
        "environment": env,
    }
    started = time.monotonic()
    record["steps"] = run_steps(cfg, args.models, variants, tmp)
    record["zero1"] = run_zero(cfg, args.models, tmp)
    env |= {"load_avg_end": os.getloadavg(), "total_wall_s": time.monotonic() - started}
    (args.out / "results.json").write_text(json.dumps(record, indent=2, default=str) + "\n")
    grad_sync_report.write(record, args.out)
    print(f"wrote {args.out}/results.json, README.md and plots", flush=True)


if __name__ == "__main__":
    main()
