"""Count every collective a training run issues, per micro-batch and by source. Observation only.

``count_collectives`` (a context manager, no Trainer needed; this module never imports Lightning)
and ``callbacks.CollectiveCounter`` (the Lightning callback, :mod:`callbacks.collective_counter`) run
``torch.profiler`` (CPU activity, ``record_shapes=True``) and read the ``c10d::`` dispatcher ops:
every ``torch.distributed`` collective passes through one, whatever import path or backend issued it.
The profiler's event tree (``experimental_event_tree``, marked experimental by torch; tested with
2.14) gives each op's callers (its enclosing profiler events) and its tensor arguments' shape and
dtype, also for ``Tensor[]`` arguments, which the flat ``FunctionEvent`` list leaves empty.

Window of micro-batch k (the callback): from the end of ``on_train_batch_end`` of batch k-1 (of
``on_train_epoch_start`` for the first) to the end of ``on_train_batch_end`` of batch k. A marker
event at ``on_train_batch_start`` splits it: collectives before it (``before_batch``) belong to
Lightning's loop between batches (the SIGTERM broadcast; validation or checkpointing run after
the previous batch), the rest to the batch itself (forward, backward, optimizer step). What runs
after the last batch of an epoch lands in a window with ``batch_idx=None``.

Attribution, first rule that matches:

1. ``syncbn_forward`` / ``syncbn_backward``: issued inside the forward / backward of the SyncBN
   autograd function (``parallel.batchnorm.syncbn_function._SyncBatchNormFunction`` or torch's
   ``SyncBatchNorm``): an all_gather and an all_reduce per layer call; through shared memory
   (:mod:`parallel.host.host_exchange`, ops ``shared_memory_all_gather`` / ``shared_memory_all_reduce``) they
   count once each, at their profiler label.
2. ``ddp_bucket_rebuild`` / ``ddp_buffers``: a broadcast inside ``DistributedDataParallel.forward``.
   The reducer's bucket rebuild sends int32 tensors (bucket sizes, then parameter indices; once,
   on the first forward after the first synced backward); any other dtype is the buffer sync
   (``broadcast_buffers``: one coalesced broadcast per buffer dtype, e.g. float32 running stats
   and int64 ``num_batches_tracked``), which DDP runs on the first forward after a synced one.
3. ``buffer_broadcast``: the broadcast of :class:`parallel.gradients.buffer_sync.BufferBroadcast` (inside its
   ``SyncedDataParallel.broadcast_buffers`` profiler label): rank 0's buffers, all packed in one
   uint8 tensor, before each training forward (``broadcast_buffers=True``; none when every buffer
   is a SyncBN statistic), and once before validation / at the end of fit.
   ``uneven_join``: the all_reduce of one "I have a batch" flag per rank (inside the
   ``JoinedLoader.who_trains`` profiler label) before each batch of a training loader whose length
   is unknown per rank (:mod:`parallel.uneven.joined_loader`).
4. ``grad_buckets``: an all_reduce of one tensor whose size equals a gradient bucket of the
   strategy's ``SyncedDataParallel`` (``model.buckets``, flags included). A bucket summed in shared
   memory (:mod:`parallel.host.host_reduce`) counts once, at its launch (a profiler label naming the
   buffer, op ``shared_memory_all_reduce``); the barriers its worker thread runs are not counted. Another all_reduce of
   exactly a bucket's size would be counted here too; none in this project has one.
5. ``ddp_grad_buckets``: with a torch DDP model, a floating-point all_reduce issued during
   backward (inside the autograd engine: DDP's reducer hooks).
6. ``lightning_sigterm``: the LAST broadcast from rank 0 of one 1-element integer tensor before
   the batch's ``on_train_batch_start``: Lightning's ``_broadcast_sigterm_tensor``
   (loops/training_epoch_loop.py), run before every training batch (micro-batches included) when
   world size > 1. The last, because ``broadcast_object_list`` (a checkpoint callback between
   batches) also starts with one, and no collective runs between the flag and the batch's hooks.
7. ``other``: everything else (``self.log(sync_dist=True)``, metric syncs, ZeRO-1 parameter
   broadcasts, barriers, evaluation).

``bytes`` is this rank's payload: the tensor it contributes (all_reduce, broadcast, the local
input of all_gather / reduce_scatter / gather / all_to_all) or receives (scatter, recv).
Profiling every op costs CPU time: use ``max_batches`` on long runs. Pure observation: nothing
is wrapped or patched, and no collective is added.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

from parallel.gradients.buffer_sync import BUFFER_BROADCAST
from parallel.gradients.grad_sync import SyncedDataParallel
from parallel.host.host_exchange import parse_exchange_label
from parallel.host.host_reduce import WORKER_LABEL, parse_launch_label
from parallel.uneven.joined_loader import JOIN_EXCHANGE

__all__ = ["MARKER", "SOURCES", "Collective", "Window", "classify", "count_collectives", "profiler"]

SOURCES = (
    "lightning_sigterm",
    "syncbn_forward",
    "syncbn_backward",
    "buffer_broadcast",
    "uneven_join",
    "grad_buckets",
    "ddp_grad_buckets",
    "ddp_buffers",
    "ddp_bucket_rebuild",
    "other",
)
MARKER = "collective_count::on_train_batch_start"  # recorded by the callback at on_train_batch_start
# c10d op (without "c10d::") -> (kind, index of the argument holding this rank's payload).
_OPS = {
    "allreduce_": ("all_reduce", 0),
    "allreduce_coalesced_": ("all_reduce", 0),
    "broadcast_": ("broadcast", 0),
    "reduce_": ("reduce", 0),
    "_allgather_base_": ("all_gather", 1),
    "allgather_": ("all_gather", 1),
    "allgather_coalesced_": ("all_gather", 1),
    "allgather_into_tensor_coalesced_": ("all_gather", 1),
    "_reduce_scatter_base_": ("reduce_scatter", 1),
    "reduce_scatter_": ("reduce_scatter", 1),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1),
    "alltoall_": ("all_to_all", 1),
    "alltoall_base_": ("all_to_all", 1),
    "gather_": ("gather", 1),
    "gather_into_tensor_": ("gather", 1),
    "scatter_": ("scatter", 0),
    "send": ("send", 0),
    "recv_": ("recv", 0),
    "recv_any_source_": ("recv", 0),
    "barrier": ("barrier", None),
    "monitored_barrier_": ("barrier", None),
}
_SYNCBN_FORWARD = {"_SyncBatchNormFunction", "SyncBatchNorm"}
_SYNCBN_BACKWARD = {"_SyncBatchNormFunctionBackward", "SyncBatchNormBackward"}


@dataclass(frozen=True)
class Collective:
    """One collective op: ``kind`` (all_reduce, all_gather, broadcast, ...), its attributed
    ``source`` (one of ``SOURCES``), this rank's payload, the root rank of a broadcast, and
    whether it ran before the batch's ``on_train_batch_start``."""

    op: str
    kind: str
    source: str
    bytes: int
    shapes: tuple[tuple[int, ...], ...]
    dtype: str
    root: int | None
    before_batch: bool


@dataclass
class Window:
    """The collectives of one micro-batch window (``batch_idx=None``: after an epoch's last batch)."""

    epoch: int
    batch_idx: int | None
    collectives: list[Collective] = field(default_factory=list)

    def counts(self) -> dict[str, int]:
        """Number of collectives by source (sources with none are left out)."""
        return dict(Counter(c.source for c in self.collectives))

    def bytes(self) -> dict[str, int]:
        """Payload bytes by source."""
        totals = dict.fromkeys(self.counts(), 0)  # same keys as counts(), barriers' 0 bytes too
        for c in self.collectives:
            totals[c.source] += c.bytes
        return totals

    def to_dict(self) -> dict[str, Any]:  # JSON-ready
        return {
            "epoch": self.epoch,
            "batch_idx": self.batch_idx,
            "counts": self.counts(),
            "bytes": self.bytes(),
            "collectives": [asdict(c) for c in self.collectives],
        }


@dataclass(frozen=True)
class _Hints:
    """What the wrapped model tells about its own collectives."""

    bucket_numels: frozenset[int] = frozenset()
    torch_ddp: bool = False

    @classmethod
    def from_model(cls, model: nn.Module | None) -> _Hints:
        if isinstance(model, SyncedDataParallel):
            return cls(bucket_numels=frozenset(b.buffer.numel() for b in model.buckets))
        return cls(torch_ddp=isinstance(model, nn.parallel.DistributedDataParallel))


def _tensors(argument: Any) -> list[Any]:
    """Tensor metadata in a profiled argument: a tensor, a Tensor[] or a Tensor[][]."""
    if isinstance(argument, (list, tuple)):
        return [t for item in argument for t in _tensors(item)]
    return [argument] if hasattr(argument, "sizes") and hasattr(argument, "dtype") else []


def _payload(event: Any, op: str) -> tuple[list[Any], Any]:
    """Metadata of this rank's payload tensors, and the root rank of a broadcast (else None)."""
    inputs = list(getattr(event.extra_fields, "inputs", []))
    index = _OPS[op][1]
    payload = _tensors(inputs[index]) if index is not None and index < len(inputs) else []
    return payload, inputs[2] if op == "broadcast_" and len(inputs) > 2 else None


def _source(kind: str, ancestors: list[str], shapes: tuple, dtype: str, hints: _Hints) -> str:
    """Rules 1-5 and 7 of the module docstring (rule 6 needs the whole window)."""
    if _SYNCBN_FORWARD.intersection(ancestors):
        return "syncbn_forward"
    if _SYNCBN_BACKWARD.intersection(ancestors):
        return "syncbn_backward"
    if BUFFER_BROADCAST in ancestors:
        return "buffer_broadcast"
    if JOIN_EXCHANGE in ancestors:
        return "uneven_join"
    if "DistributedDataParallel.forward" in ancestors and kind == "broadcast":
        return "ddp_bucket_rebuild" if dtype == "int32" else "ddp_buffers"
    if kind == "all_reduce" and len(shapes) == 1 and torch.Size(shapes[0]).numel() in hints.bucket_numels:
        return "grad_buckets"
    floating = dtype.startswith(("float", "bfloat", "complex"))
    in_backward = any(name.startswith("autograd::engine::evaluate_function") for name in ancestors)
    if hints.torch_ddp and kind == "all_reduce" and floating and in_backward:
        return "ddp_grad_buckets"
    return "other"


def _collective(event: Any, ancestors: list[str], hints: _Hints, before_batch: bool) -> Collective:
    op = event.name.removeprefix("c10d::")
    kind = _OPS[op][0]
    payload, root = _payload(event, op)
    shapes = tuple(tuple(t.sizes) for t in payload)
    dtype = str(payload[0].dtype).removeprefix("torch.") if payload else ""
    size = sum(torch.Size(t.sizes).numel() * t.dtype.itemsize for t in payload)
    source = _source(kind, ancestors, shapes, dtype, hints)
    return Collective(op, kind, source, size, shapes, dtype, root, before_batch)


def _shared_memory_label(name: str) -> tuple[str, str, int] | None:
    """``(kind, dtype, numel)`` of a collective through shared memory that the profiler label ``name`` marks: a
    gradient bucket's launch (:func:`parallel.host.host_reduce.parse_launch_label`) or a SyncBatchNorm statistics
    exchange (:func:`parallel.host.host_exchange.parse_exchange_label`); ``None`` for any other event."""
    bucket = parse_launch_label(name)
    return ("all_reduce", *bucket) if bucket else parse_exchange_label(name)


def _shared_memory_collective(
    label: tuple[str, str, int], ancestors: list[str], hints: _Hints, before_batch: bool
) -> Collective:
    """One collective through shared memory, of the kind and tensor its ``label`` names (op
    ``shared_memory_<kind>``); its barriers are not counted."""
    kind, dtype, numel = label
    size = numel * getattr(torch, dtype).itemsize
    source = _source(kind, ancestors, ((numel,),), dtype, hints)
    return Collective(f"shared_memory_{kind}", kind, source, size, ((numel,),), dtype, None, before_batch)


def _is_sigterm_candidate(c: Collective) -> bool:
    one_int = c.shapes in (((1,),), ((),)) and c.dtype.startswith(("int", "uint", "bool"))
    return c.before_batch and c.kind == "broadcast" and c.source == "other" and one_int and c.root == 0


def classify(prof: profile, model: nn.Module | None = None) -> list[Collective]:
    """The collectives recorded by ``prof`` (``record_shapes=True``) in issue order, attributed."""
    tree = getattr(prof.profiler.kineto_results, "experimental_event_tree", None)
    if tree is None:
        raise RuntimeError(
            f"torch {torch.__version__} has no profiler event tree; collective counting "
            "needs torch >= 2.1 (tested with 2.11 and 2.15)."
        )
    hints, found, marker_ns = _Hints.from_model(model), [], None
    stack = [(root, []) for root in reversed(tree())]
    while stack:  # depth-first, children in order; a collective's own children are not visited
        event, ancestors = stack.pop()
        name = event.name
        if name == MARKER:
            marker_ns = event.start_time_ns
        elif name == WORKER_LABEL:  # its barriers are the shared-memory all-reduce counted at launch
            continue
        elif (label := _shared_memory_label(name)) or (
            name.startswith("c10d::") and name.removeprefix("c10d::") in _OPS
        ):
            found.append((event.start_time_ns, event, ancestors, label))
            continue
        stack.extend((child, [*ancestors, name]) for child in reversed(event.children))
    found.sort(key=lambda item: item[0])
    collectives = []
    for start, event, ancestors, label in found:
        before = marker_ns is not None and start < marker_ns
        collectives.append(
            _shared_memory_collective(label, ancestors, hints, before)
            if label
            else _collective(event, ancestors, hints, before)
        )
    sigterm = [i for i, c in enumerate(collectives) if _is_sigterm_candidate(c)]
    if sigterm:  # rule 6: the last candidate
        collectives[sigterm[-1]] = replace(collectives[sigterm[-1]], source="lightning_sigterm")
    return collectives


def profiler() -> profile:
    """A CPU profiler with ``record_shapes``: the tensor metadata of every op's arguments."""
    return profile(activities=[ProfilerActivity.CPU], record_shapes=True)


@contextmanager
def count_collectives(model: nn.Module | None = None) -> Iterator[list[Collective]]:
    """Record the collectives issued inside the block; the list is filled when the block ends.

    Args:
        model: The data-parallel wrapper in use (``SyncedDataParallel`` or torch DDP), whose
            buckets tell gradient all-reduces apart; ``None`` if there is none.

    Example:
        >>> with count_collectives(model) as collectives:  # doctest: +SKIP
        ...     model(x).sum().backward()
        >>> Counter(c.source for c in collectives)  # doctest: +SKIP
    """
    collectives: list[Collective] = []
    with profiler() as prof:
        yield collectives
    collectives.extend(classify(prof, model))
