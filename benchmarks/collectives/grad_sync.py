"""Gradient synchronisation benchmark: SyncedDataParallel's modes against torch DDP, plus ZeRO-1.

    python -m benchmarks.collectives.grad_sync                                # about 12 minutes on 2 cores
    python -m benchmarks.collectives.grad_sync --quick --out /tmp/grad_sync   # smoke run

Two ranks (gloo, one thread each) train a deep MLP and a torchvision ResNet-18 (SGD, momentum, a
fixed batch per rank): SyncedDataParallel's four modes, ``bucketed`` at 1-1000 MiB caps, its buckets
summed by gloo instead of in shared memory (``_gloo``: ``grad_transport="process_group"``) or in
shared memory behind gloo barriers instead of futex ones (``_gloo_barriers``), bf16 wire
compression (summed by gloo, compared with ``_gloo``) and ZeRO-1, against ``ddp_default`` (buffers broadcast every
forward) and ``ddp_tuned`` (``gradient_as_bucket_view=True, forward_sync_buffers=False``); SyncedDataParallel runs with
``broadcast_buffers=False`` like ``ddp_tuned``. Exposed communication = step -
``no_comm`` step (same wrapper and ranks inside ``no_sync()``: thread-matched; it also charges the
compute gloo's reductions slow down); speed-up = 2 x ``single_all_cores`` step (one process, every
core, one rank's batch: what a user would run instead) / step. Fresh processes per variant and
round, interleaved; a step starts after a barrier and takes the slower rank's time. Untimed: peak
memory, one step's collectives by source, ZeRO-1's AdamW state per rank at 2 and 4 ranks.
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
from typing import Any

import torch
import torch.distributed as dist
import torchvision
from torch import nn

# TITLE and headline are what benchmarks.readme_results reads from each benchmark's entry module.
from benchmarks.collectives.grad_sync_report import ANCHORS, NO_COMM, SINGLE, TITLE, headline, write
from benchmarks.harness import interleave, parse, parser, run_benchmark, settings, slowest_ranks
from collectives.launcher import run_workers
from measure.collective_count import Window, count_collectives
from measure.memory import measure_peak, return_freed_memory_above
from parallel.gradients.grad_sync import SyncedDataParallel
from parallel.gradients.zero import ShardedOptimizer
from parallel.host import host_reduce
from parallel.torch_compat import DDP_SYNC_BUFFERS

__all__ = ["TITLE", "VARIANTS", "headline", "main", "measure_model"]

WORLD_SIZE = 2
_DDP_SETTINGS = ("bucket_bytes_cap", "gradient_as_bucket_view", DDP_SYNC_BUFFERS)
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {  # (wrapper, its options; "zero1": the sharded optimizer)
    NO_COMM: ("sdp", {"mode": "bucketed"}),
    SINGLE: ("single", {}),
    **{mode: ("sdp", {"mode": mode}) for mode in ("per_param", "flat", "per_param_overlap")},
    **{f"bucketed_{cap}mb": ("sdp", {"mode": "bucketed", "bucket_cap_mb": cap}) for cap in (1, 10, 25, 100, 1000)},
    # The first bucket by backend (gloo: as large as the others) against torch DDP's 1 MiB first bucket.
    "bucketed_25mb_first1mb": ("sdp", {"mode": "bucketed", "first_bucket_cap_mb": 1.0}),
    # Buckets summed by gloo (TCP loopback) instead of in shared memory (grad_transport="auto" here).
    "bucketed_25mb_gloo": ("sdp", {"mode": "bucketed", "grad_transport": "process_group"}),
    # Shared-memory sums whose barriers are gloo's (as on CPUs other than x86-64) instead of futex waits.
    "bucketed_25mb_gloo_barriers": ("sdp", {"mode": "bucketed", "barriers": "gloo"}),
    "bucketed_25mb_bf16": ("sdp", {"mode": "bucketed", "grad_compression": "bf16"}),
    "bucketed_25mb_zero1": ("sdp", {"mode": "bucketed", "zero1": True}),
    "ddp_default": ("ddp", {"gradient_as_bucket_view": False}),  # everything else: torch's defaults
    "ddp_tuned": ("ddp", {"gradient_as_bucket_view": True, DDP_SYNC_BUFFERS: False}),
}
REQUIRED = [NO_COMM, SINGLE, *ANCHORS]  # every exposure, speed-up and ratio needs them
# Several rounds (fresh processes each) put run-to-run spread into the intervals.
FULL, QUICK = settings(
    {
        "mlp_width": (1024, 128),
        "mlp_depth": (16, 4),
        "mlp_batch": (64, 8),
        "resnet_batch": (32, 2),
        "warmup": (2, 1),
        "steps": (8, 2),
        "rounds": (5, 2),
        "probe_steps": (3, 2),
    }
)


def build_model(name: str, cfg: dict[str, Any]) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """The network (``mlp`` or ``resnet18``) and one fixed (input, target) batch."""
    width = cfg["mlp_width"]
    if name == "mlp":
        layers = [m for _ in range(cfg["mlp_depth"]) for m in (nn.Linear(width, width), nn.ReLU())]
        net, x = nn.Sequential(*layers, nn.Linear(width, 100)), torch.randn(cfg["mlp_batch"], width)
    else:
        net, x = torchvision.models.resnet18(num_classes=100), torch.randn(cfg["resnet_batch"], 3, 32, 32)
    return net, x, torch.randint(0, 100, (x.shape[0],))


def _setup(rank: int, model_name: str, variant: str, cfg: dict[str, Any]) -> tuple[Any, ...]:
    """Identical weights on every rank, different data per rank, the variant's wrapper and optimizer."""
    torch.manual_seed(0)
    net, x, y = build_model(model_name, cfg)
    torch.manual_seed(rank)
    kind, options = VARIANTS[variant]
    # SyncedDataParallel without buffer broadcasts, as ddp_tuned (forward_sync_buffers=False): this benchmark
    # times the gradient sync (ddp_default's broadcast of ResNet-18's BatchNorm buffers is its own cost).
    sdp = functools.partial(SyncedDataParallel, broadcast_buffers=False)
    wrap = {"sdp": sdp, "ddp": nn.parallel.DistributedDataParallel, "single": lambda m: m}[kind]
    sgd = {"lr": 0.01, "momentum": 0.9}
    sharded = options.get("zero1")
    optimizer = (
        ShardedOptimizer(net.parameters(), torch.optim.SGD, **sgd)
        if sharded
        else torch.optim.SGD(net.parameters(), **sgd)
    )
    if options.get("barriers") == "gloo":  # each variant runs in fresh processes: nothing else sees this
        host_reduce.local_problem = lambda peers: "gloo barriers forced by the benchmark variant"
    model = wrap(net, **{k: v for k, v in options.items() if k not in ("zero1", "barriers")})
    return model, optimizer, torch.randn_like(x), torch.randint(0, 100, y.shape)


def _train_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor, variant: str
) -> tuple[float, float]:
    """One step's seconds, and the seconds ``finish()`` spent at the end of backward (SyncedDataParallel only)."""
    start = time.perf_counter()
    with model.no_sync() if variant == NO_COMM else contextlib.nullcontext():
        nn.functional.cross_entropy(model(x), y).backward()  # the bucket wait runs inside, at its end
    finish_s = model.last_finish_s if isinstance(model, SyncedDataParallel) and variant != NO_COMM else 0.0
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - start, finish_s


def step_worker(rank: int, world_size: int, model_name: str, variant: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """This rank's per-step and ``finish()`` seconds after the warm-up, and its intra-op threads."""
    model, optimizer, x, y = _setup(rank, model_name, variant, cfg)
    times = []
    for _ in range(cfg["warmup"] + cfg["steps"]):
        dist.barrier()  # every step starts together, so the slower rank's time is the step's
        times.append(_train_step(model, optimizer, x, y, variant))
    steps, finishes = zip(*times[cfg["warmup"] :], strict=True)
    return {"step_s": list(steps), "finish_s": list(finishes), "threads": torch.get_num_threads()}


def probe_worker(rank: int, world_size: int, model_name: str, variant: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """Untimed: peak memory over wrapping and a few steps, then one step's collectives by source."""
    os.environ.setdefault("KINETO_LOG_LEVEL", "5")  # silence kineto's "no GPU" error lines
    return_freed_memory_above(2**20)  # freed transients must leave the RSS (see the helper)

    def build_and_train() -> tuple[Any, ...]:
        built = _setup(rank, model_name, variant, cfg)
        for _ in range(cfg["probe_steps"]):  # DDP rebuilds its buckets after the first step
            _train_step(*built, variant)
        return built

    (model, optimizer, x, y), peak = measure_peak(build_and_train)
    with count_collectives(None if VARIANTS[variant][0] == "single" else model) as collectives:
        _train_step(model, optimizer, x, y, variant)
    window, ddp = Window(0, 0, collectives), isinstance(model, nn.parallel.DistributedDataParallel)
    return {
        "peak_bytes": peak,
        "collectives": {"counts": window.counts(), "bytes": window.bytes()},
        "buckets": len(model.buckets) if isinstance(model, SyncedDataParallel) else None,
        "ddp_settings": {k: getattr(model, k, None) for k in _DDP_SETTINGS} if ddp else None,
    }


def zero_worker(rank: int, world_size: int, model_name: str, cfg: dict[str, Any]) -> dict[str, int]:
    """AdamW state bytes on this rank after one step, sharded and unsharded."""
    torch.manual_seed(0)
    net, x, y = build_model(model_name, cfg)
    out = {"param_bytes": sum(p.numel() * p.element_size() for p in net.parameters())}
    unsharded, sharded = (
        torch.optim.AdamW(net.parameters(), lr=1e-3),
        ShardedOptimizer(net.parameters(), torch.optim.AdamW, lr=1e-3),
    )
    for name, optimizer in (("unsharded", unsharded), ("sharded", sharded)):
        nn.functional.cross_entropy(net(x), y).backward()
        optimizer.step()
        net.zero_grad(set_to_none=True)
        state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
        out[name] = sum(v.numel() * v.element_size() for v in state)
    return out


def _run(fn: Any, variant: str | None, *args: Any, world_size: int = WORLD_SIZE) -> list[Any]:
    """One fresh process group per call: ``single_all_cores`` is one rank on every core, the rest 2
    ranks of one intra-op thread each."""
    single = variant is not None and VARIANTS[variant][0] == "single"
    args = args if variant is None else (args[0], variant, *args[1:])
    return run_workers(
        fn, 1 if single else world_size, args=args, timeout_s=600, threads=(os.cpu_count() or 1) if single else 1
    )


def measure_model(model_name: str, variants: list[str], cfg: dict[str, Any]) -> dict[str, Any]:
    """Interleaved timed rounds, then one untimed probe, for every variant of one model."""

    def timed(variant: str, round_index: int) -> dict[str, Any]:
        per_rank = _run(step_worker, variant, model_name, cfg)
        merged = slowest_ranks(per_rank, ("step_s", "finish_s"))
        print(f"round {round_index} {model_name:8s} {variant:22s} {1e3 * min(merged['step_s']):8.1f} ms", flush=True)
        return merged | {"threads": per_rank[0]["threads"]}

    rounds = interleave(variants, cfg["rounds"], timed)
    out = {}
    for variant in variants:
        probes = _run(probe_worker, variant, model_name, cfg)
        out[variant] = {
            **probes[0],
            "peak_bytes": max(p["peak_bytes"] for p in probes),
            "ranks": len(probes),
            "threads": rounds[variant][0]["threads"],
            **{f"{key}_by_round": [r[key] for r in rounds[variant]] for key in ("step_s", "finish_s")},
        }
    return out


def _zero1(model: str, world_size: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """ZeRO-1's AdamW state per rank against the unsharded state, on ``world_size`` ranks."""
    per_rank = _run(zero_worker, None, model, cfg, world_size=world_size)
    return {
        "model": model,
        "world_size": world_size,
        "param_bytes": per_rank[0]["param_bytes"],
        "unsharded_bytes": per_rank[0]["unsharded"],
        "sharded_bytes_per_rank": [r["sharded"] for r in per_rank],
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = parser("collectives.grad_sync", __doc__)
    p.add_argument("--models", nargs="+", choices=("mlp", "resnet18"), default=["mlp", "resnet18"])
    p.add_argument("--variants", nargs="+", choices=list(VARIANTS), help="default: all")
    p.add_argument("--rounds", type=int, help="override the number of interleaved rounds")
    args = parse(p, argv, FULL, QUICK)
    cfg, variants = args.cfg, REQUIRED + [v for v in args.variants or VARIANTS if v not in REQUIRED]
    optimizer = "SGD(lr=0.01, momentum=0.9)"
    config = cfg | {"world_size": WORLD_SIZE, "backend": "gloo", "device": "cpu", "optimizer": optimizer}
    config["variants"] = {v: VARIANTS[v] for v in variants}

    def measure() -> dict[str, Any]:
        steps = {m: measure_model(m, variants, cfg) for m in args.models}
        return {"steps": steps, "zero1": [_zero1(m, n, cfg) for m in args.models for n in (2, 4)]}

    return run_benchmark("collectives.grad_sync", config, argv, write, measure, args.out, args.max_wait_s)


if __name__ == "__main__":
    main()
