"""SyncBatchNorm benchmark: does ``parallel.batchnorm.syncbn.SyncBatchNorm`` cost more than local BN plus its
all-reduces?

    python -m benchmarks.batchnorm.syncbn                             # CPU, 2 gloo ranks, 12 shapes: ~6 minutes
    python -m benchmarks.batchnorm.syncbn --quick --out /tmp/syncbn   # smoke run: 3 shapes, few rounds
    python -m benchmarks.batchnorm.syncbn --device cuda --out benchmarks/results/syncbn_gpu
    python -m benchmarks.batchnorm.syncbn --device cuda --world-size 1 --dtype bfloat16   # one GPU: a 1-rank NCCL group

Per shape (PER RANK: the assignment's 8 (N, C) and 4 (N, C, H, W) shapes), one forward+backward of
``custom`` (``parallel.batchnorm.syncbn.SyncBatchNorm``, its collectives through gloo), ``shared`` (the same layer
with its statistics through shared memory, as ``custom_ddp`` runs it on one CPU host:
``parallel.host.host_exchange``; target shared <= 1.0x floor), ``compiled`` (the same with ``compile=True``: its
passes ``torch.compile``'d; (N, C) and small inputs take the layer's default path by design -- eager on CPU, the
Triton kernels on CUDA --, see ``parallel/batchnorm/syncbn_kernels.py``), ``local`` (torch's BatchNorm), ``floor``
(local BN, then two ``all_reduce`` of 2C+1 floats, timed as ONE call: the least any synchronised BN does) and
on CUDA ``torch_syncbn`` (torch's SyncBatchNorm autograd Function, called even on one rank, where its
module would run cuDNN's BN) and ``eager`` (the eager reference kernel; ``custom`` is then the layer's CUDA
path, its Triton kernels: ``parallel/batchnorm/syncbn_fused.py``); targets custom <= 1.2x floor (CPU),
<= 1.0x torch_syncbn (CUDA). The kernel alone, on ONE rank: custom vs torch's BatchNorm, targets <= 1.10
(conv) and <= 1.5 (N, C), where a Python kernel's ~30 torch calls cost more than the arithmetic
(``python_floor``, an autograd.Function copying x and the gradient: what any Python kernel pays). Interleaved rounds of
barrier-aligned iterations, each sample the slowest rank's (``torch.utils.benchmark`` would put
the ranks' collectives out of step). Peak memory of one forward+backward: the most bytes of tensors
held at once (CPU: the profiler's allocator events, ``measure.memory.allocated_peak``; CUDA: the
allocator's peak). First-compile time: the first call of ``compiled`` per shape, in the 2-rank run
with an EMPTY inductor cache (the first shape pays the fixed ~20 s) and in the 1-rank run after it
(warm cache: what a second run pays). Compiled targets (issue 24): <= 1.00x torch's BatchNorm on conv
shapes, <= 1.5x on (N, C), on one rank. Analysis, headline, report: :mod:`benchmarks.batchnorm.syncbn_report`.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules._functions import SyncBatchNorm as _torch_sync_batch_norm  # private: torch's SyncBN kernels

import parallel.batchnorm.syncbn
from benchmarks.batchnorm.syncbn_report import TITLE, headline, parse_shape, write
from benchmarks.harness import parse, parser, run_benchmark, slowest_ranks, timed_rounds
from collectives.launcher import run_workers
from measure.memory import allocated_peak, measure_peak
from measure.timing import aligned_seconds
from parallel.batchnorm.syncbn import SyncBatchNorm
from parallel.batchnorm.syncbn_function import sync_batch_norm
from parallel.host.host_exchange import open_shared_memory_exchange
from parallel.host.host_reduce import open_shared_memory_all_reduce

# The record's module: rederive and the results blocks load TITLE, headline and write from here.
__all__ = ["TITLE", "headline", "layer_calls", "main", "write"]

ASSIGNMENT_SHAPES = [(batch, hid) for hid in (128, 256, 512, 1024) for batch in (32, 64)]
CONV_SHAPES = [(32, 64, 16, 16), (32, 128, 32, 32), (64, 256, 16, 16), (128, 64, 32, 32)]
QUICK_SHAPES = [(32, 128), (64, 1024), (32, 64, 16, 16)]
FULL = {"rounds": 10, "iters": 20, "warmup": 5}
QUICK = {"rounds": 3, "iters": 5, "warmup": 2}
TARGETS = {"cpu": ("floor", 1.2), "cuda": ("torch_syncbn", 1.0)}  # baseline, max custom/baseline
ONE_RANK_TARGETS = {"conv": 1.10, "nc": 1.5}  # max custom/native BN on one rank, by shape kind
COMPILED_TARGETS = {"conv": 1.00, "nc": 1.5}  # max compiled/native BN on one rank, by shape kind


class _TorchSyncFunction(nn.BatchNorm2d):
    """torch's SyncBatchNorm Function (CUDA only) on the world group whatever its size: on one GPU its module
    would run cuDNN's BN instead, which is not what ``custom`` (``force_sync``) is compared with."""

    def _check_input_dim(self, input: torch.Tensor) -> None:
        pass  # (N, C) and (N, C, H, W) alike, as the Function takes them

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        world = dist.group.WORLD
        stats = (self.running_mean, self.running_var, self.eps, self.momentum)
        return _torch_sync_batch_norm.apply(x, self.weight, self.bias, *stats, world, dist.get_world_size(world))


class _LocalKernel(nn.Module):
    """``layer``'s hand-written kernel with no group: the kernel alone, its arithmetic and dispatch without a
    collective (a one-rank group would add its own collectives' cost: that is the one-GPU run's question)."""

    def __init__(self, layer: SyncBatchNorm) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        layer = self.layer
        kernels = parallel.batchnorm.syncbn.COMPILED_KERNELS if layer.compile_kernel else None
        stats = (layer.running_mean, layer.running_var, layer.momentum, layer.eps)
        return sync_batch_norm(x, layer.weight, layer.bias, *stats, None, 1, kernels)


class _EagerKernel(_LocalKernel):
    """``layer``'s eager reference kernel on its group (on CUDA the layer itself takes its Triton kernels)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        layer, world = self.layer, dist.group.WORLD
        stats = (layer.running_mean, layer.running_var, layer.momentum, layer.eps)
        return sync_batch_norm(x, layer.weight, layer.bias, *stats, world, dist.get_world_size(world))


class _PythonFloor(nn.Module):
    """A layer whose autograd.Function copies x and the gradient: the overhead of any Python kernel."""

    class _Copy(torch.autograd.Function):
        forward = staticmethod(lambda ctx, x: x.clone())
        backward = staticmethod(lambda ctx, grad: grad.clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._Copy.apply(x)


def layer_calls(
    shape: Sequence[int], device: torch.device, rank: int, cfg: dict[str, Any], exchange: Any = None
) -> dict[str, Callable[[], None]]:
    """One forward+backward per method of ``cfg["methods"]`` on this rank's fixed input of ``cfg["dtype"]`` (the
    layers' parameters stay fp32, as under autocast; ``shared``: with ``exchange``)."""
    generator, names = torch.Generator().manual_seed(rank), cfg["methods"]
    dtype = getattr(torch, cfg.get("dtype", "float32"))
    x, grad = (torch.randn(shape, generator=generator).to(device, dtype) for _ in range(2))
    stats, local = torch.zeros(2 * shape[1] + 1, device=device), nn.BatchNorm1d if len(shape) < 4 else nn.BatchNorm2d
    layers = {  # force_sync: on one rank too, the hand-written kernel and its collectives (not torch's native BN)
        "custom": SyncBatchNorm(shape[1], force_sync=True),
        "shared": SyncBatchNorm(shape[1], force_sync=True),
        "compiled": SyncBatchNorm(shape[1], compile=True, force_sync=True),
        "local": local(shape[1]),
        "floor": local(shape[1]),
        "python_floor": _PythonFloor(),
    }
    if device.type == "cuda":  # torch's SyncBN Function; the eager kernel (custom: the layer's Triton kernels)
        layers |= {"torch_syncbn": _TorchSyncFunction(shape[1]), "eager": _EagerKernel(SyncBatchNorm(shape[1]))}

    def fwd_bwd(name: str, layer: nn.Module) -> Callable[[], None]:
        def run() -> None:
            layer(x.detach().requires_grad_()).backward(grad)
            if name == "floor":  # the two all-reduces a synchronised BN cannot avoid
                dist.all_reduce(stats)
                dist.all_reduce(stats)

        return run

    if cfg.get("local_kernel"):
        layers |= {name: _LocalKernel(layers[name]) for name in ("custom", "compiled")}
    SyncBatchNorm.use_exchange(layers["shared"], exchange, None)
    names = [name for name in names if name != "shared" or exchange is not None]
    return {name: fwd_bwd(name, layer.to(device)) for name, layer in layers.items() if name in names}


def _worker(rank: int, world_size: int, shapes: list, cfg: dict) -> dict[str, Any]:
    device = torch.device("cuda", rank % torch.cuda.device_count()) if cfg["device"] == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cfg["inductor_cache"]  # this process only (a fork)
    exchange = _shared_memory_exchange(shapes, world_size) if "shared" in cfg["methods"] else None
    out = []
    for shape in shapes:
        fns = layer_calls(shape, device, rank, cfg, exchange)
        compile_s = aligned_seconds(fns["compiled"], device) if "compiled" in fns else None  # the first call
        out.append({"samples": timed_rounds(fns, cfg, device), "compile_s": compile_s})
    if cfg.get("memory", True):  # after timing: the profiler's memory events slow every call
        for result, shape in zip(out, shapes, strict=True):
            result["peak_bytes"] = _peak_bytes(layer_calls(shape, device, rank, cfg, exchange), device)
    return {"shapes": out, "threads": torch.get_num_threads()}


def _shared_memory_exchange(shapes: list, world_size: int) -> Any:
    """The statistics' shared-memory exchange of every rank (None where it cannot apply: then no ``shared`` rows),
    sized for the widest shape, on a shared-memory all-reduce of its own as the strategy's buckets would have."""
    if world_size < 2:
        return None
    host = open_shared_memory_all_reduce("auto", None, [torch.device("cpu")], None)
    return open_shared_memory_exchange(host, list(range(world_size)), (2 * max(s[1] for s in shapes) + 1) * 8)


def _peak_bytes(fns: dict[str, Callable[[], None]], device: torch.device) -> dict[str, int]:
    """Each method's peak memory of one forward+backward, after a first call of each."""
    for fn in fns.values():  # lazy initialisation is not the layer's memory
        fn()
    peaks = {}
    for name, fn in fns.items():
        dist.barrier()
        peaks[name] = allocated_peak(fn)[1] if device.type == "cpu" else measure_peak(fn, device)[1]
    return peaks


def analyse_row(shape: tuple[int, ...], per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """One shape: the slowest rank's samples, peak memory (max over ranks); :func:`write` derives the estimates."""
    compile_s = [r["compile_s"] for r in per_rank if r.get("compile_s") is not None]
    return {
        "shape": list(shape),
        "peak_bytes": {n: max(r["peak_bytes"][n] for r in per_rank) for n in per_rank[0].get("peak_bytes", {})},
        "samples_s": slowest_ranks([rank["samples"] for rank in per_rank]),
    } | ({"compile_s": max(compile_s)} if compile_s else {})


def _measure(shapes: list[tuple[int, ...]], cfg: dict[str, Any], launch: dict[str, Any]) -> dict[str, Any]:
    """The synchronised layers on ``cfg["world_size"]`` ranks, then the kernels alone on one rank (timing only);
    the first compile from an empty inductor cache. Completes ``cfg`` with the ranks' threads."""
    one_rank_run = cfg["world_size"] == 1  # one GPU: the synchronised run is the one-rank run
    with tempfile.TemporaryDirectory(prefix="syncbn-inductor-") as cache:  # a first compile from nothing
        methods = ("custom", "shared", "compiled", "eager", "local", "floor", "torch_syncbn")
        methods += one_rank_run * ("python_floor",)
        synchronised = {"methods": methods, "inductor_cache": cache}
        per_rank = run_workers(_worker, cfg["world_size"], args=(shapes, cfg | synchronised), **launch)
        # The kernel alone (no collective), custom against native BN, timing only.
        alone = {"methods": ("custom", "compiled", "local", "python_floor"), "memory": False, "inductor_cache": cache}
        alone |= {"local_kernel": True}
        one_rank = per_rank if one_rank_run else run_workers(_worker, 1, args=(shapes, cfg | alone), **launch)
    cfg["threads"] = per_rank[0]["threads"]
    return {
        "rows": [analyse_row(s, [r["shapes"][i] for r in per_rank]) for i, s in enumerate(shapes)],
        "one_rank_rows": [analyse_row(s, [one_rank[0]["shapes"][i]]) for i, s in enumerate(shapes)],
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = parser("batchnorm.syncbn", __doc__)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--rounds", type=int, help=f"interleaved rounds (default {FULL['rounds']})")
    p.add_argument("--iters", type=int, help=f"iterations per method per round (default {FULL['iters']})")
    p.add_argument(
        "--shapes",
        nargs="+",
        type=parse_shape,
        help="per-rank shapes such as 32x128 32x64x16x16 (default: the 12 above)",
    )
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="the input's dtype")
    args = parse(p, argv, FULL, QUICK)
    if args.world_size < 1:
        p.error(
            f"--world-size must be >= 1 (1: the synchronising path forced on a 1-rank group), got {args.world_size}"
        )
    shapes = args.shapes or (QUICK_SHAPES if args.quick else ASSIGNMENT_SHAPES + CONV_SHAPES)
    backend = "nccl" if args.device == "cuda" and torch.cuda.device_count() >= args.world_size else "gloo"
    baseline, target = TARGETS[args.device]
    config = args.cfg | {"device": args.device, "world_size": args.world_size, "backend": backend, "threads": None}
    config |= {"dtype": args.dtype}
    config |= {"shapes": [list(s) for s in shapes], "baseline": baseline, "target": target}
    config |= {"one_rank_targets": ONE_RANK_TARGETS, "compiled_targets": COMPILED_TARGETS}
    # CUDA workers are spawned: a fork after this process touched CUDA dies in the child.
    start_method = "spawn" if args.device == "cuda" else "fork"
    launch = {"backend": backend, "timeout_s": 1800.0, "threads": args.threads, "start_method": start_method}
    measure = lambda: _measure(shapes, config, launch)  # noqa: E731
    return run_benchmark("batchnorm.syncbn", config, argv, write, measure, args.out, args.max_wait_s)


if __name__ == "__main__":
    main()
