"""Opt-in collective desync check for ``custom_ddp``: a mismatch is an error naming both sides.

Every rank must issue the same collectives in the same order. When one does not (a collective
under ``if self.global_rank == 0``, a step one rank skips, a ``self.log(..., sync_dist=True)`` only
some ranks reach), gloo and NCCL pair the wrong operations: the run waits for the process-group
timeout (30 minutes by default), aborts (gloo, on a size mismatch) or computes garbage.

``desync_check=True`` turns on torch's collective fingerprint check (what
``TORCH_DISTRIBUTED_DEBUG=DETAIL`` does): torch wraps the process group in its
``ProcessGroupWrapper``, which before every collective exchanges a fingerprint (sequence number,
operation, shapes, dtypes) over a helper gloo group and raises on every rank at the first
difference, within milliseconds instead of the timeout. torch's message is not enough to find the
bug: it names operations and shapes only, and the peer's side is often its own internal barrier
or gather rather than the user's collective. :func:`report_desync` therefore describes each rank's
side from its own traceback (the ``torch.distributed`` call with its tensor's dtype and shape, and
the source: SyncBN forward/backward, a gradient bucket, the evaluation reductions, Lightning's loop,
or user code with file and line), and the ranks exchange these lines through the job's TCP store
(not a collective, bounded wait), so rank 0 prints both sides in one message.

Cost: a barrier and an all_gather on the helper group before every collective, and asynchronous
collectives (gradient buckets) wait for the peer at launch, losing overlap with backward: a few ms
per collective of a step on 2 CPU ranks, tens of percent of a small step
(``benchmarks/results/desync_cost``, also in docs/benchmarks.md). Turn it on to debug a hang, in CI and after changing
anything that issues collectives; leave it off for long production runs. It must be on before the
process group exists: the strategy sets torch's debug level in ``setup_environment`` of every rank.
"""

from __future__ import annotations

import logging
import re
import time
import traceback
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

import torch
import torch.distributed as dist

from measure.run_info import display_path
from strategies.fault_tolerance.exit_causes import chained_text
from strategies.fault_tolerance.job_store import CONNECT_S, connect_store

__all__ = ["enable_desync_check", "is_desync_error", "log_desync", "own_side", "report_desync"]

log = logging.getLogger(__name__)

_MARKERS = ("Detected mismatch between collectives", "failed to pass monitoredBarrier")
_COLLECTIVES = {
    "all_reduce",
    "broadcast",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "all_gather_object",
    "broadcast_object_list",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "gather",
    "gather_object",
    "scatter",
    "scatter_object_list",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "monitored_barrier",
}
_TENSOR_ARGS = ("tensor", "input_tensor", "input", "tensor_list", "object_list", "obj", "scatter_list")
_STRATEGIES_DIR = Path(__file__).resolve().parents[1].as_posix() + "/"  # this project's strategies/ package
# Project files whose collectives have a name, by (path part, function) -> source; "" matches any function.
_SOURCES = (
    ("parallel/batchnorm/syncbn_function.py", "backward", "SyncBN backward"),
    ("parallel/batchnorm/syncbn_function.py", "", "SyncBN forward"),
    ("parallel/gradients/grad_sync.py", "", "gradient bucket (SyncedDataParallel)"),
    ("parallel/gradients/reducer.py", "", "gradient bucket (SyncedDataParallel)"),
    ("parallel/gradients/buckets.py", "", "gradient bucket (SyncedDataParallel)"),
    ("parallel/evaluation/metric_sync.py", "", "evaluation metric reduction"),
    ("parallel/evaluation/eval_sharding.py", "", "evaluation scatter"),
    ("parallel/evaluation/uneven_gather.py", "", "custom_ddp all_gather"),
    ("parallel/gradients/zero.py", "", "ZeRO-1 optimizer"),
)
# torch's mismatch text: "Rank <own> is running collective: CollectiveFingerPrint(SequenceNumber=<n>, OpType=...),
# but Rank <peer> is running collective: CollectiveFingerPrint(SequenceNumber=<m>, OpType=<op>, TensorShape=[...],
# TensorDtypes=<dtype>...)"; a barrier's has no tensor (and no comma before OpType).
_FINGERPRINTS = re.compile(
    r"Rank \d+ is running collective: CollectiveFingerPrint\(SequenceNumber=(\d+).*?"
    r"but Rank (\d+) is running collective: CollectiveFingerPrint\(SequenceNumber=(\d+),?\s*"
    r"OpType=(\w+)(?:, TensorShape=\[([^\]]*)\], TensorDtypes=(\w+))?",
    re.DOTALL,
)
_FINGERPRINT_DTYPES = {
    "Float": "float32",
    "Double": "float64",
    "Half": "float16",
    "BFloat16": "bfloat16",
    "Long": "int64",
    "Int": "int32",
    "Short": "int16",
    "Char": "int8",
    "Byte": "uint8",
}
_STORE_WAIT_S = 3.0
_CONNECT_WAIT_S = CONNECT_S  # a healthy store can take name lookups' timeouts to accept (job_store)


def enable_desync_check() -> None:
    """Make every process group created from now on check collective fingerprints (this process)."""
    if dist.is_available() and dist.is_initialized():
        raise RuntimeError(
            "custom_ddp: desync_check=True must be set before the process group exists, but torch.distributed is "
            "already initialised (by init_process_group in user code?). Set TORCH_DISTRIBUTED_DEBUG=DETAIL in the "
            "environment instead, or let the strategy create the process group."
        )
    dist.set_debug_level(dist.DebugLevel.DETAIL)


def is_desync_error(error: BaseException) -> bool:
    """Whether ``error`` (or an exception it chains) is torch's collective mismatch report."""
    text = chained_text(error)
    return any(marker in text for marker in _MARKERS)


def _torch_view(error: BaseException) -> str:
    """What torch's check adds to a rank's own line: the peer's collective as its fingerprint names it
    (the rank that found the mismatch; only at the same sequence number, else torch names an internal
    collective of its check, seen as "SequenceNumber=0OpType=GATHER"), or that this rank's collective is where it
    found a peer gone (a rank whose own check passed and that went on until the peer that raised had exited)."""
    text = chained_text(error)
    match = _FINGERPRINTS.search(text)
    if match is not None:
        own_sequence, peer, peer_sequence, op, shape, dtype = match.groups()
        if own_sequence != peer_sequence:  # the peer's side is torch's own helper collective, not the user's
            return ""
        tensor = "" if shape is None else f"{_FINGERPRINT_DTYPES.get(dtype, dtype.lower())}[{shape}]"
        return f"; torch saw rank {peer} issue {op.lower()}({tensor})"
    if _MARKERS[1] in text:
        return " (where it found a peer gone; the mismatch is in the peer's line)"
    return ""


def _describe_tensor(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"{str(value.dtype).replace('torch.', '')}[{', '.join(map(str, value.shape))}]"
    if isinstance(value, (list, tuple)) and value:
        return f"{len(value)} x {_describe_tensor(value[0])}"
    return type(value).__name__


def _collective_call(frames: list[tuple[FrameType, int]]) -> str:
    """The innermost ``torch.distributed`` collective in ``frames``, with its tensor: 'all_reduce(float32[16])'."""
    for frame, _ in reversed(frames):
        code = frame.f_code
        if code.co_name in _COLLECTIVES and "torch/distributed" in code.co_filename.replace("\\", "/"):
            arg = next((frame.f_locals[name] for name in _TENSOR_ARGS if name in frame.f_locals), None)
            return f"{code.co_name}({_describe_tensor(arg)})" if arg is not None else f"{code.co_name}()"
    return "a collective"


def _is_library(path: str) -> bool:
    return "/site-packages/" in path or "/lib/python" in path or path.startswith("<")


def _source(frames: list[tuple[FrameType, int]]) -> str:
    """Who issued the collective: the innermost project frame names it; strategies/ frames pass it on."""
    via = ""
    for frame, lineno in reversed(frames):
        path, name = frame.f_code.co_filename.replace("\\", "/"), frame.f_code.co_name
        if _is_library(path):
            if name == "_broadcast_sigterm_tensor":
                return "Lightning's loop (per-batch SIGTERM broadcast)"
            continue
        for part, function, source in _SOURCES:
            if part in path and (not function or name == function):
                return f"{source} ({part}:{lineno})"
        if Path(path).resolve().as_posix().startswith(_STRATEGIES_DIR):
            # The innermost strategy frame names the method; the outer ones (a strategy method calling another) pass on.
            via = via or f"strategy.{name} ({path.rsplit('/', 2)[-2]}/{path.rsplit('/', 1)[-1]}:{lineno}) from "
            continue
        return f"{via}user code {display_path(path)}:{lineno} in {name}"
    inner = next((f for f, _ in reversed(frames) if "lightning" in f.f_code.co_filename), None)
    return f"Lightning ({inner.f_code.co_name})" if inner is not None else "unknown"


def own_side(tb: TracebackType | None, rank: int) -> str:
    """``rank R: <collective>(<tensor>) from <source>``, read from the failing collective's traceback."""
    frames = list(traceback.walk_tb(tb))
    return f"rank {rank}: {_collective_call(frames)} from {_source(frames)}"


def _exchange(line: str, rank: int, world_size: int, host: str, port: int) -> list[str] | None:
    """Every rank's line through the job's TCP store (rank 0 waits up to 3 s); ``None`` if unreachable.

    The store is the rendezvous server every rank already talks to; it is not a collective, so a
    desynchronised process group cannot hang it, and a stopped store host cannot either (the connection
    ends within 30 s, every store call within 3 s, :mod:`job_store`). Only rank 0 waits for the
    others' lines.
    """
    try:
        store = connect_store(host, port, "custom_ddp/desync/", _STORE_WAIT_S, _CONNECT_WAIT_S)
        store.set(str(rank), line)
        if rank != 0:
            return [line]
        keys = [str(r) for r in range(world_size)]
        deadline = time.monotonic() + _STORE_WAIT_S
        while not store.check(keys):
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.02)
        return [value.decode() for value in store.multi_get(keys)]
    except (RuntimeError, OSError, ValueError):  # unreachable store (StoreUnanswered is a RuntimeError)
        return None


def report_desync(error: BaseException, rank: int, world_size: int, host: str, port: int) -> str | None:
    """The message this rank logs for torch's desync error; ``None`` when ``error`` is something else."""
    if not is_desync_error(error):
        return None
    line = own_side(error.__traceback__, rank) + _torch_view(error)
    sides = _exchange(line, rank, world_size, host, port)
    head = (
        "custom_ddp desync check: the ranks issued different collectives (every rank must issue the same "
        "collectives in the same order):"
    )
    if sides is None:
        first = str(error).splitlines()[0][:400]
        return f"{head}\n  {line}\n  other ranks: see their own lines; torch says: {first}"
    tail = (
        "  Look for a collective only some ranks reach: a branch on the rank, a step one rank skips, "
        "self.log(..., sync_dist=True) in a rank-dependent branch."
    )
    return "\n".join([head, *(f"  {side}" for side in sides), tail])


def log_desync(error: BaseException, rank: int, world_size: int, environment: Any) -> None:
    """On an exception: log :func:`report_desync`'s message when ``error`` is torch's desync error
    (``environment``: the strategy's cluster environment, whose store the ranks exchange sides in)."""
    message = report_desync(error, rank, world_size, environment.main_address, environment.main_port)
    if message is not None:
        log.error(message)
