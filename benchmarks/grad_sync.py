"""Gradient synchronisation benchmark: SyncedDataParallel's modes against torch DDP, plus ZeRO-1.

Usage (from the repository root)::

    python -m benchmarks.grad_sync --out benchmarks/results/grad_sync          # full run
    python -m benchmarks.grad_sync --out /tmp/grad_sync --quick                # smoke run

Two ranks (gloo on CPU, one intra-op thread each) train a deep MLP and a CIFAR-sized ResNet-18
(SGD with momentum, one fixed batch per rank). Variants: the four SyncedDataParallel modes,
``bucketed`` at caps of 1-1000 MiB, bf16 wire compression and ZeRO-1, against two torch DDP
anchors that every ratio names:

- ``ddp_default``: DDP as users get it (``gradient_as_bucket_view=False``, buffers broadcast
  before every forward).
- ``ddp_tuned``: ``gradient_as_bucket_view=True, forward_sync_buffers=False`` (torch >= 2.13's
  name for ``broadcast_buffers=False``). SyncedDataParallel broadcasts buffers only at
  construction, so this is the like-for-like anchor.

Timing (:mod:`benchmarks.harness`): every round starts each variant in fresh processes, in the
order the harness's ``interleave`` alternates, so load drift hits all variants alike. Before each
step the ranks meet at a barrier; the step's time is the slower rank's. Medians carry bootstrap
95 % intervals, ratios to an anchor carry the interval of the ratio of medians.

Exposed communication = step time minus the ``no_comm`` step time. ``no_comm`` runs the same
model, batch and SyncedDataParallel (``bucketed``) on the same two ranks, with every backward
inside ``no_sync()``: no collective at all. Two ranks rather than one, because the two processes
share the machine's cores and memory bandwidth; one rank alone would get a quieter machine and
overstate what communication costs. The difference is not clipped: a value below zero is noise.
It also charges communication for the compute it slows down (gloo reduces on the same cores that
run backward), which ``finish()`` wait time cannot see; that wait is kept only as a diagnostic.

Untimed, per variant: peak RSS above the built model (callbacks/memory.py PeakMemory, with freed
memory returned to the kernel) over a few steps, then one step under torch.profiler counting
``c10d::`` collectives and the bytes gloo moved (exact, hardware-independent). ZeRO-1: AdamW state
bytes per rank, sharded vs unsharded, at 2 and 4 ranks. Output: ``results.json`` (with a flat
``headline`` dict), ``results.md`` and ``grad_sync.png`` (see :mod:`benchmarks.grad_sync_report`).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torchvision
from torch import nn

from benchmarks import grad_sync_report
from benchmarks.harness import interleave, make_record, slowest_rank, wait_for_quiet
from callbacks.memory import PeakMemory, return_freed_memory_above
from collectives.launcher import run_workers
from parallel.grad_sync import SyncedDataParallel
from parallel.zero import ShardedOptimizer

WORLD_SIZE = 2
_MiB = 2**20
NO_COMM = "no_comm"
DDP_DEFAULT = {"gradient_as_bucket_view": False}  # everything else: torch's defaults
DDP_TUNED = {"gradient_as_bucket_view": True, "forward_sync_buffers": False}
_DDP_SETTINGS = ("bucket_bytes_cap", "gradient_as_bucket_view", "forward_sync_buffers")
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    NO_COMM: ("sdp", {"mode": "bucketed"}),  # trained inside no_sync(): see the docstring
    "per_param": ("sdp", {"mode": "per_param"}),
    "flat": ("sdp", {"mode": "flat"}),
    "per_param_overlap": ("sdp", {"mode": "per_param_overlap"}),
    **{f"bucketed_{cap}mb": ("sdp", {"mode": "bucketed", "bucket_cap_mb": cap})
       for cap in (1, 10, 25, 100, 1000)},
    "bucketed_25mb_bf16": ("sdp", {"mode": "bucketed", "grad_compression": "bf16"}),
    "bucketed_25mb_zero1": ("sdp", {"mode": "bucketed", "zero1": True}),
    "ddp_default": ("ddp", DDP_DEFAULT),
    "ddp_tuned": ("ddp", DDP_TUNED),
}
# Per-step samples pool over rounds; several rounds (fresh processes each) put run-to-run
# spread into the intervals, which matters more here than more steps per run.
FULL = {"mlp_width": 1024, "mlp_depth": 16, "mlp_batch": 64, "resnet_batch": 32,
        "warmup": 2, "steps": 8, "rounds": 5, "probe_steps": 3}
QUICK = {"mlp_width": 128, "mlp_depth": 4, "mlp_batch": 8, "resnet_batch": 2,
         "warmup": 1, "steps": 2, "rounds": 2, "probe_steps": 2}
# --quick: every mode, both anchors, compression, ZeRO-1 and two caps (the other caps add no code path).
QUICK_VARIANTS = [NO_COMM, "ddp_tuned", "ddp_default", "per_param", "flat", "per_param_overlap",
                  "bucketed_1mb", "bucketed_25mb", "bucketed_25mb_bf16", "bucketed_25mb_zero1"]
_DTYPE_BYTES = {"float": 4, "double": 8, "c10::BFloat16": 2, "c10::Half": 2, "long int": 8,
                "int": 4, "unsigned char": 1, "bool": 1}


def build_model(name: str, cfg: dict[str, Any]) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """The network and one fixed (input, target) batch."""
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


def _setup(rank: int, model_name: str, variant: str, cfg: dict[str, Any]) -> tuple[Any, ...]:
    """Identical weights on every rank, different data per rank, the variant's wrapper."""
    torch.manual_seed(0)
    net, x, y = build_model(model_name, cfg)
    torch.manual_seed(rank)
    x, y = torch.randn_like(x), torch.randint(0, 100, y.shape)
    kind, options = VARIANTS[variant]
    options = dict(options)
    zero1 = options.pop("zero1", False)
    model = SyncedDataParallel(net, **options) if kind == "sdp" else \
        nn.parallel.DistributedDataParallel(net, **options)
    sgd = {"lr": 0.01, "momentum": 0.9}
    optimizer = ShardedOptimizer(net.parameters(), torch.optim.SGD, **sgd) if zero1 else \
        torch.optim.SGD(net.parameters(), **sgd)
    return model, optimizer, x, y


def _train_step(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor,
                y: torch.Tensor, variant: str) -> tuple[float, float]:
    """One step's seconds, and the seconds spent in ``finish()`` (SyncedDataParallel only)."""
    local: contextlib.AbstractContextManager[Any] = (
        model.no_sync() if variant == NO_COMM else contextlib.nullcontext())
    start = time.perf_counter()
    with local:
        nn.functional.cross_entropy(model(x), y).backward()
    backward_done = time.perf_counter()
    if isinstance(model, SyncedDataParallel):
        model.finish()
    finish_s = time.perf_counter() - backward_done
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - start, finish_s


def step_worker(rank: int, world_size: int, model_name: str, variant: str,
                cfg: dict[str, Any]) -> dict[str, list[float]]:
    """This rank's per-step seconds and ``finish()`` seconds after the warm-up steps."""
    model, optimizer, x, y = _setup(rank, model_name, variant, cfg)
    steps, finishes = [], []
    for i in range(cfg["warmup"] + cfg["steps"]):
        dist.barrier()  # every step starts together, so the slower rank's time is the step's
        step_s, finish_s = _train_step(model, optimizer, x, y, variant)
        if i >= cfg["warmup"]:
            steps.append(step_s)
            finishes.append(finish_s)
    return {"step_s": steps, "finish_s": finishes}


def count_collectives(events: Any) -> dict[str, dict[str, float]]:
    """Per collective (``allreduce``, ``broadcast``...): calls and bytes, from raw profiler events.

    Calls are the dispatcher's ``c10d::<op>_`` events (whoever issued them: our engine or DDP's
    C++ reducer); bytes come from gloo's own ``gloo:<op>`` events, which carry shape and dtype.
    ``events`` are kineto's raw events (``name()``, ``shapes()``, ``dtypes()``): the public
    ``profile.events()`` first builds the whole op tree, about a second per ResNet-18 step.
    """
    counts: dict[str, dict[str, float]] = {}
    for event in events:
        prefix, _, op = event.name().rpartition(":")
        if prefix not in ("c10d:", "gloo"):
            continue
        entry = counts.setdefault(op.replace("_", ""), {"count": 0, "bytes": 0})
        if prefix == "c10d:":
            entry["count"] += 1
            continue
        for shape, dtype in zip(event.shapes(), event.dtypes()):
            entry["bytes"] += _DTYPE_BYTES.get(dtype, float("nan")) * math.prod(shape)
    return counts


def probe_worker(rank: int, world_size: int, model_name: str, variant: str,
                 cfg: dict[str, Any]) -> dict[str, Any]:
    """Untimed: peak RSS over wrapping and a few steps, then one profiled step's collectives."""
    from torch.profiler import ProfilerActivity, profile

    os.environ.setdefault("KINETO_LOG_LEVEL", "5")  # silence kineto's "no GPU" error lines
    return_freed_memory_above(_MiB)  # freed transients must leave the RSS (see the helper)
    memory = PeakMemory(torch.device("cpu"))
    memory.start()
    baseline = memory.stop()["peak_bytes"]
    memory.start()
    model, optimizer, x, y = _setup(rank, model_name, variant, cfg)
    for _ in range(cfg["probe_steps"]):  # DDP rebuilds its buckets after the first step
        _train_step(model, optimizer, x, y, variant)
    peak = memory.stop()["peak_bytes"] - baseline
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        _train_step(model, optimizer, x, y, variant)
    ddp = isinstance(model, nn.parallel.DistributedDataParallel)
    collectives = count_collectives(prof.profiler.kineto_results.events())
    return {"peak_bytes": int(peak), "collectives": collectives,
            "buckets": len(model.buckets) if isinstance(model, SyncedDataParallel) else None,
            "ddp_settings": {k: getattr(model, k, None) for k in _DDP_SETTINGS} if ddp else None}


def zero_worker(rank: int, world_size: int, model_name: str, cfg: dict[str, Any]) -> dict[str, int]:
    """AdamW state bytes on this rank after one step, sharded and unsharded."""
    torch.manual_seed(0)
    net, x, y = build_model(model_name, cfg)
    out = {"param_bytes": sum(p.numel() * p.element_size() for p in net.parameters())}
    for name, optimizer in (
        ("unsharded", torch.optim.AdamW(net.parameters(), lr=1e-3)),
        ("sharded", ShardedOptimizer(net.parameters(), torch.optim.AdamW, lr=1e-3)),
    ):
        nn.functional.cross_entropy(net(x), y).backward()
        optimizer.step()
        net.zero_grad(set_to_none=True)
        state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
        out[name] = sum(v.numel() * v.element_size() for v in state)
    return out


class _Runner:
    """Launches one fresh 2-rank group per call, each with its own rendezvous file."""

    def __init__(self, tmp: Path) -> None:
        self._tmp, self._calls = tmp, 0

    def __call__(self, fn: Any, args: tuple[Any, ...], world_size: int = WORLD_SIZE) -> list[Any]:
        self._calls += 1
        return run_workers(fn, world_size, args=args, init_file=self._tmp / f"store_{self._calls}",
                           timeout_s=600)


def measure_model(run: _Runner, model_name: str, variants: list[str],
                  cfg: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Interleaved timed rounds, then one untimed probe, for every variant of one model."""

    def timed(variant: str, round_index: int) -> dict[str, list[float]]:
        per_rank = run(step_worker, (model_name, variant, cfg))
        merged = {key: slowest_rank([r[key] for r in per_rank])
                  for key in ("step_s", "finish_s")}
        median_ms = sorted(merged["step_s"])[len(merged["step_s"]) // 2] * 1e3
        print(f"round {round_index} {model_name:8s} {variant:22s} {median_ms:8.1f} ms", flush=True)
        return merged

    rounds = interleave(variants, cfg["rounds"], timed)
    out = {}
    for variant in variants:
        probes = run(probe_worker, (model_name, variant, cfg))
        out[variant] = {**probes[0], "peak_bytes": max(p["peak_bytes"] for p in probes),
                        "step_s_by_round": [r["step_s"] for r in rounds[variant]],
                        "finish_s_by_round": [r["finish_s"] for r in rounds[variant]]}
    return out


def run_zero(run: _Runner, models: list[str], cfg: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for model_name in models:
        for world_size in (2, 4):
            per_rank = run(zero_worker, (model_name, cfg), world_size)
            rows.append({"model": model_name, "world_size": world_size,
                         "param_bytes": per_rank[0]["param_bytes"],
                         "unsharded_bytes": per_rank[0]["unsharded"],
                         "sharded_bytes_per_rank": [r["sharded"] for r in per_rank]})
    return rows


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.grad_sync",
                                     description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--out", type=Path, help="default: benchmarks/results/grad_sync; with --quick a "
                        "temporary folder, so that a smoke run never overwrites the committed results")
    parser.add_argument("--quick", action="store_true",
                        help="tiny smoke configuration; does not wait for a quiet machine")
    parser.add_argument("--models", nargs="+", choices=("mlp", "resnet18"), default=["mlp", "resnet18"])
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS),
                        help="default: all (with --quick: one cap per code path)")
    parser.add_argument("--rounds", type=int, help="override the number of interleaved rounds")
    parser.add_argument("--max-wait", type=float, help="seconds to wait for a quiet machine "
                        "(default 300, 0 with --quick)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = _parse_args(argv)
    out = args.out or (Path(tempfile.gettempdir()) / "grad_sync_quick" if args.quick
                       else Path("benchmarks/results/grad_sync"))
    cfg = dict(QUICK if args.quick else FULL)
    cfg["rounds"] = args.rounds if args.rounds is not None else cfg["rounds"]
    # The baseline and both anchors are always measured: exposure and every ratio need them.
    required = [NO_COMM, "ddp_tuned", "ddp_default"]
    chosen = args.variants or (QUICK_VARIANTS if args.quick else list(VARIANTS))
    variants = required + [v for v in chosen if v not in required]
    quiet = wait_for_quiet(max_wait_s=args.max_wait if args.max_wait is not None
                           else (0.0 if args.quick else 300.0))
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="grad_sync_bench_") as tmp:  # rendezvous files
        run = _Runner(Path(tmp))
        steps = {m: measure_model(run, m, variants, cfg) for m in args.models}
        zero1 = run_zero(run, args.models, cfg)
    config = cfg | {"world_size": WORLD_SIZE, "backend": "gloo", "device": "cpu",
                    "threads_per_process": 1, "optimizer": "SGD(lr=0.01, momentum=0.9)",
                    "variants": {v: VARIANTS[v] for v in variants}}
    record = make_record("grad_sync", config, quiet.finish(), argv=argv, wall_s=time.monotonic() - started,
                         steps=steps, zero1=zero1)
    grad_sync_report.write(grad_sync_report.analyse(record), out)
    print(f"wrote {out}/results.json, results.md and grad_sync.png", flush=True)


if __name__ == "__main__":
    main()
