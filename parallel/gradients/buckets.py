"""Gradient buckets: which parameters share one flat all-reduce buffer, and the buffers themselves.

A bucket is one flat tensor holding the gradients of several parameters back to back, followed by
one "used" flag per parameter. Each parameter's ``.grad`` is a view into that buffer (DDP's
``gradient_as_bucket_view``), so autograd accumulates straight into the memory that is reduced
and no second gradient-sized copy exists. The flags travel in the same all-reduce: after it, a
flag > 0 means some rank produced a gradient for that parameter, which lets a parameter that no
rank used keep ``grad=None`` exactly as in single-process training, at the cost of one element
per parameter instead of an extra collective. The last bucket may also carry ``status_slots``
elements after its flags: one small integer per rank (see ``SyncedDataParallel.set_rank_status``),
so every rank learns every rank's status in the gradient all-reduce it already runs.

Assignment follows DDP: parameters in the order given (reverse registration order, roughly the
order backward produces them), split by (device, dtype), a bucket closes once it reaches its
byte cap, and the first bucket of each kind has its own, smaller cap so the first all-reduce
starts early in backward. Pure torch; no Lightning import.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from parallel.host.host_reduce import SharedMemoryAllReduce

__all__ = ["Bucket", "assign_buckets", "build_buckets", "describe_buckets", "is_view_of"]

_MB = 1024 * 1024


def is_view_of(grad: torch.Tensor, view: torch.Tensor) -> bool:
    """Whether ``grad`` is the bucket slice ``view`` itself (same memory, same shape)."""
    return grad.data_ptr() == view.data_ptr() and grad.shape == view.shape


@dataclass(eq=False)
class Bucket:
    """One flat gradient buffer and the per-step bookkeeping of its all-reduce.

    Attributes:
        index: Position in the launch order; every rank launches buckets in this order.
        params: Parameters whose gradients live in ``buffer``.
        buffer: ``[grads of params..., one used-flag per param, status slots...]``.
        views: ``views[i]`` is ``params[i]``'s gradient slice, shaped like the parameter.
        ready: ``ready[i]`` is whether ``params[i]``'s gradient arrived in this backward.
        pending: How many entries of ``ready`` are still False.
        launched: Whether this step's all-reduce has been started.
        all_used: Whether every parameter had a gradient on this rank when it was launched.
        work: The in-flight all-reduce, if launched and not yet waited on.
        wire: The (possibly compressed) tensor being reduced; ``buffer`` itself when uncompressed.
        status_slots: Elements after the flags that carry one status value per rank (0: none).
        shared: Every rank's ``buffer`` (this rank's is ``buffer`` itself) when the buffers live in
            shared memory (:mod:`parallel.host.host_reduce`); ``None`` otherwise.
    """

    index: int
    params: list[torch.nn.Parameter]
    buffer: torch.Tensor
    views: list[torch.Tensor]
    ready: list[bool] = field(default_factory=list)
    pending: int = 0
    launched: bool = False
    all_used: bool = True
    work: dist.Work | torch.futures.Future | None = None
    wire: torch.Tensor | None = None
    status_slots: int = 0
    shared: list[torch.Tensor] | None = None

    @property
    def flags(self) -> torch.Tensor:
        """One used-flag per parameter, right after the gradients."""
        end = self.buffer.numel() - self.status_slots
        return self.buffer[end - len(self.params) : end]

    @property
    def status(self) -> torch.Tensor:
        """The status slots at the tail of ``buffer`` (empty unless ``status_slots``)."""
        return self.buffer[self.buffer.numel() - self.status_slots :]

    def write_status(self, rank: int, value: int) -> None:
        """Put this rank's status in its slot, zeros in the others' (the all-reduce adds them up)."""
        self.status.zero_()
        self.status[rank] = value

    def read_status(self) -> tuple[int, ...]:
        """Every rank's status after the all-reduce."""
        # Slot r held rank r's value, zeros elsewhere, and the slots are not divided like the
        # gradients: the sum is the value itself, an integer below 128, exact even in bfloat16.
        return tuple(int(v) for v in self.status.float().round().tolist())

    def start_all_reduce(
        self,
        group: dist.ProcessGroup | None,
        divisor: float,
        wire_dtype: torch.dtype | None = None,
        host: SharedMemoryAllReduce | None = None,
    ) -> None:
        """Start the async sum of the gradients / ``divisor`` (the world size, or the ranks that trained
        in a joined step) over ``group``, in ``wire_dtype`` if given; through ``host`` when the buffer is
        shared (``wire_dtype`` is then ``None``: see host_reduce). The status slots are summed undivided."""
        # Gloo has no AVG reduction: pre-divide (as DDP does), which also keeps bf16 in range.
        self.buffer[: self.buffer.numel() - self.status_slots].div_(divisor)
        if self.shared is not None:
            assert host is not None and wire_dtype is None, "shared buckets are summed by their SharedMemoryAllReduce"
            self.work = host.all_reduce(self.shared)
            return
        wire = self.buffer
        if wire_dtype is not None and wire.dtype in (torch.float32, torch.float64):
            wire = wire.to(wire_dtype)
        self.wire = wire
        self.work = dist.all_reduce(wire, group=group, async_op=True)

    def wait(self) -> None:
        """Wait for the all-reduce started by :meth:`start_all_reduce` (if any) and copy the result back."""
        if self.work is None:
            return
        self.work.wait()
        if self.wire is not None and self.wire is not self.buffer:
            self.buffer.copy_(self.wire)
        self.work, self.wire = None, None

    def reset(self) -> None:
        """Forget the last step's all-reduce; the gradients stay in ``buffer``."""
        self.ready = [False] * len(self.params)
        self.pending = len(self.params)
        self.launched = False
        self.all_used = True
        self.work = None
        self.wire = None


def assign_buckets(params: Sequence[torch.Tensor], cap_mb: float, first_cap_mb: float) -> list[list[int]]:
    """Group parameter indices into buckets of at most about ``cap_mb`` each.

    Args:
        params: Parameters in the order their gradients are expected (reverse registration).
        cap_mb: A bucket closes once its gradients reach this many MiB; ``0`` gives one
            parameter per bucket, ``math.inf`` one bucket per (device, dtype).
        first_cap_mb: Cap of the first bucket of each (device, dtype).

    Returns:
        Lists of indices into ``params``, ordered by their first parameter.
    """
    open_buckets: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    open_bytes: dict[tuple[torch.device, torch.dtype], int] = {}
    closed: list[list[int]] = []
    kinds_closed: set[tuple[torch.device, torch.dtype]] = set()
    for index, param in enumerate(params):
        kind = (param.device, param.dtype)
        open_buckets.setdefault(kind, []).append(index)
        open_bytes[kind] = open_bytes.get(kind, 0) + param.numel() * param.element_size()
        cap = cap_mb if kind in kinds_closed else min(cap_mb, first_cap_mb)
        if open_bytes[kind] >= cap * _MB:
            closed.append(open_buckets.pop(kind))
            open_bytes.pop(kind)
            kinds_closed.add(kind)
    closed.extend(open_buckets.values())
    return sorted(closed, key=lambda bucket: bucket[0])


def build_buckets(
    params: Sequence[torch.nn.Parameter],
    groups: list[list[int]],
    status_slots: int = 0,
    host: SharedMemoryAllReduce | None = None,
) -> list[Bucket]:
    """Allocate one zeroed flat buffer per group; carve the parameters' gradient views from it.

    ``status_slots`` extra elements go to the LAST bucket, the one launched last in every step.
    With ``host``, the buffers live in shared memory (collective: every rank builds the same layout).
    """
    members_of = [[params[i] for i in group] for group in groups]
    slots_of = [status_slots if index == len(groups) - 1 else 0 for index in range(len(groups))]
    sizes = [
        (sum(p.numel() for p in members) + len(members) + slots, members[0].dtype)
        for members, slots in zip(members_of, slots_of, strict=True)
    ]
    shared = host.allocate(sizes) if host is not None and groups else [None] * len(groups)
    buckets = []
    for bucket_index, (members, slots, (size, dtype), every_rank) in enumerate(
        zip(members_of, slots_of, sizes, shared, strict=True)
    ):
        buffer = (
            every_rank[host.rank]
            if every_rank is not None  # only with a host
            else torch.zeros(size, dtype=dtype, device=members[0].device)
        )
        views, offset = [], 0
        for p in members:
            views.append(_grad_view(buffer[offset : offset + p.numel()], p))
            offset += p.numel()
        bucket = Bucket(bucket_index, members, buffer, views, status_slots=slots, shared=every_rank)
        bucket.reset()
        buckets.append(bucket)
    return buckets


def _grad_view(flat: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``flat`` shaped like ``param``, with ``param``'s strides when it is dense (a channels_last convolution weight
    too): the layout autograd gives its gradient (torch DDP's bucket views keep it too), so moving a gradient into
    the bucket, the all-reduce and the optimizer's update all walk memory in order."""
    return flat.as_strided(param.shape, param.stride()) if _dense(param) else flat.view_as(param)


def _dense(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s elements fill ``numel()`` consecutive slots of memory in some order of its dimensions."""
    expected = 1
    for size, stride in sorted(zip(tensor.shape, tensor.stride(), strict=True), key=lambda dim: dim[1]):
        if size == 1:
            continue
        if stride != expected:
            return False
        expected *= size
    return True


def describe_buckets(buckets: Sequence[Bucket], module: torch.nn.Module | None = None) -> str:
    """One line per bucket (index, MiB, dtype, parameter count and names) for debug logs."""
    names = {id(p): n for n, p in module.named_parameters()} if module is not None else {}
    total_mb = sum(b.buffer.numel() * b.buffer.element_size() for b in buckets) / _MB
    lines = [f"{len(buckets)} bucket(s), {total_mb:.2f} MiB in all"]
    for b in buckets:
        mb = b.buffer.numel() * b.buffer.element_size() / _MB
        members = ", ".join(names.get(id(p), "?") for p in b.params)
        lines.append(
            f"  bucket {b.index}: {mb:.3f} MiB {b.buffer.dtype} on {b.buffer.device}, "
            f"{len(b.params)} param(s): {members}"
        )
    return "\n".join(lines)
