"""Data-parallel gradient averaging: bucketed, overlapped with backward, accumulation-aware.

:class:`SyncedDataParallel` wraps a module, broadcasts rank 0's parameters and buffers, and
averages gradients over a process group. The training step is::

    model = SyncedDataParallel(net)                # mode="bucketed" by default
    for i, batch in enumerate(micro_batches):      # k micro-batches per optimizer step
        last = i == len(micro_batches) - 1
        with contextlib.nullcontext() if last else model.no_sync():
            loss_fn(model(batch)).backward()       # no communication inside no_sync
    model.finish()                                  # p.grad now holds the average over ranks
    optimizer.step(); optimizer.zero_grad()

Gradients live as views into flat bucket buffers (:mod:`parallel.buckets`), so micro-batches
accumulate in place into the memory that is all-reduced. Modes, for comparison:

- ``bucketed``: a bucket's async all-reduce starts from the parameters' post-accumulate-grad
  hooks as soon as all its gradients are in, so communication overlaps the rest of backward.
- ``per_param_overlap``: the same with one parameter per bucket.
- ``flat``: one all-reduce of all gradients (one bucket per dtype), started by :meth:`finish`.
- ``per_param``: one blocking all-reduce per parameter, run by :meth:`finish`.

Gradients are final when backward returns, as with torch DDP: the first gradient hook of a
synced backward queues :meth:`finish` as an autograd-engine callback (run once the whole graph is
done, before ``backward()`` returns), so code right after ``backward()`` (Lightning's
``on_after_backward``, clipping, code after ``manual_backward``) reads the rank average, never a
buffer an all-reduce is still writing. Calling :meth:`finish` again is a no-op; it remains the way
to join when this rank's backward produced no gradient at all. Two synced backward passes in one
step (without ``no_sync``) are each averaged and add up, as in one process.

Every rank launches buckets in the same fixed order: a bucket whose gradients are ready waits
for the buckets before it, because collectives are matched by issue order. Buckets that are not
complete at :meth:`finish` (parameters unused in this backward) are launched there, with zeros
for the missing gradients, so ranks never desynchronise; a parameter that no rank produced a
gradient for keeps ``grad=None``.

Rank status (``carry_rank_status=True``): each rank may set a small integer
(:meth:`~SyncedDataParallel.set_rank_status`, e.g. "a SIGTERM arrived here"); it travels in the
last bucket of the step's all-reduce, one slot per rank, and after :meth:`finish` every rank reads
the same tuple of every rank's value (:attr:`~SyncedDataParallel.rank_status`). Every rank thereby
takes the same decision at the same optimizer step, without a collective of its own. Pure torch;
no Lightning import.
"""

from __future__ import annotations

import functools
import logging
from contextlib import contextmanager
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable

from parallel.buckets import Bucket, assign_buckets, build_buckets, describe_buckets
from parallel.dist_utils import broadcast_module_state, group_world_size
from parallel.sync_config import (
    DEFAULT_BUCKET_CAP_MB,
    DEFAULT_FIRST_BUCKET_CAP_MB,
    GRAD_COMPRESSIONS,
    MODES_LAUNCHED_FROM_HOOKS,
    SYNC_MODES,
    WIRE_DTYPES,
    caps_for_mode,
)

__all__ = ["SyncedDataParallel"]

log = logging.getLogger(__name__)

_COMPRESSIONS = (None, *GRAD_COMPRESSIONS)


def _check_options(
    mode: str, bucket_cap_mb: float, first_bucket_cap_mb: float, grad_compression: str | None
) -> None:
    if mode not in SYNC_MODES:
        raise ValueError(f"mode={mode!r} is not supported; choose one of {SYNC_MODES}")
    caps = {"bucket_cap_mb": bucket_cap_mb, "first_bucket_cap_mb": first_bucket_cap_mb}
    for name, cap in caps.items():
        if not cap > 0:
            raise ValueError(
                f"{name}={cap} must be > 0 MiB (mode='per_param' puts each parameter alone)"
            )
    if grad_compression not in _COMPRESSIONS:
        raise ValueError(f"grad_compression={grad_compression!r} is not one of {_COMPRESSIONS}")


def _is_view_of(grad: torch.Tensor, view: torch.Tensor) -> bool:
    return grad.data_ptr() == view.data_ptr() and grad.shape == view.shape


class SyncedDataParallel(nn.Module):
    """Average gradients of ``module`` over ``process_group`` (see the module docstring).

    Args:
        module: The network; its trainable parameters get gradient hooks.
        process_group: Group to average over; the default group when ``None``. Without an
            initialised ``torch.distributed`` the wrapper runs as world size 1.
        mode: ``"bucketed"``, ``"flat"``, ``"per_param"`` or ``"per_param_overlap"``.
        bucket_cap_mb: Bucket size cap in MiB for ``"bucketed"``.
        first_bucket_cap_mb: Cap of the first (last-layer) bucket in ``"bucketed"``, small so
            the first all-reduce starts early in backward.
        grad_compression: ``None``, ``"bf16"`` or ``"fp16"``: reduce fp32/fp64 buckets in that
            dtype (half the bytes on the wire; precision and range in
            :data:`parallel.sync_config.GradCompression`).
        broadcast_init: Broadcast rank 0's parameters and buffers at construction.
        carry_rank_status: Reserve one slot per rank in the last bucket for :meth:`set_rank_status`.
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        process_group: dist.ProcessGroup | None = None,
        mode: str = "bucketed",
        bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
        first_bucket_cap_mb: float = DEFAULT_FIRST_BUCKET_CAP_MB,
        grad_compression: str | None = None,
        broadcast_init: bool = True,
        carry_rank_status: bool = False,
    ) -> None:
        super().__init__()
        _check_options(mode, bucket_cap_mb, first_bucket_cap_mb, grad_compression)
        self.module = module
        self._process_group = process_group
        self._world_size = group_world_size(process_group)
        self._mode = mode
        self._compression = grad_compression
        if broadcast_init and self._world_size > 1:
            broadcast_module_state(module, process_group)
        # Reverse registration order approximates the order backward produces gradients in.
        params = [p for p in module.parameters() if p.requires_grad][::-1]
        cap_mb, first_cap_mb = caps_for_mode(mode, bucket_cap_mb, first_bucket_cap_mb)
        slots = self._world_size if carry_rank_status else 0
        self._buckets = build_buckets(params, assign_buckets(params, cap_mb, first_cap_mb), slots)
        self._rank = dist.get_rank(process_group) if self._world_size > 1 else 0
        self._local_status = 0
        self._rank_status: tuple[int, ...] | None = None
        log.debug("SyncedDataParallel(mode=%s, world_size=%d): %s", mode, self._world_size,
                  describe_buckets(self._buckets, module))
        self._hook_handles = [
            param.register_post_accumulate_grad_hook(
                functools.partial(self._on_grad_ready, bucket, slot)
            )
            for bucket in self._buckets
            for slot, param in enumerate(bucket.params)
        ]
        self._sync_enabled = True
        self._armed = False  # a synced forward/backward ran since the last finish()
        self._finish_queued = False  # finish() waits as a callback at the end of this backward
        self._next_launch = 0  # index of the first bucket not launched yet

    @property
    def mode(self) -> str:
        return self._mode

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def grad_compression(self) -> str | None:
        return self._compression

    @property
    def rank_status(self) -> tuple[int, ...] | None:
        """Every rank's status as of the last synced step (the same tuple on every rank).

        ``None`` before the first synced step, without ``carry_rank_status`` or without buckets.
        """
        return self._rank_status

    def set_rank_status(self, value: int) -> None:
        """This rank's status for the coming synced steps (it stays until changed).

        ``value`` is read when the last bucket is launched, so a value set during a step's
        backward may only travel with the next step. Values are small integers, ``0 <= value < 128``
        (they ride in the gradients' dtype, bfloat16 included).
        """
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 128:
            raise ValueError(f"rank status {value!r} must be an int in [0, 128)")
        self._local_status = value

    @property
    def buckets(self) -> tuple[Bucket, ...]:
        """The gradient buckets in launch order (read-only use: sizes, parameter grouping)."""
        return tuple(self._buckets)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._sync_enabled and torch.is_grad_enabled():
            self._armed = True
        return self.module(*args, **kwargs)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally with no communication at all."""
        previous, self._sync_enabled = self._sync_enabled, False
        try:
            yield
        finally:
            self._sync_enabled = previous

    def finish(self) -> None:
        """Complete this backward's all-reduce: afterwards every ``p.grad`` holds the rank average.

        Launches, in bucket order, what backward did not (every bucket in ``flat`` and
        ``per_param``; buckets with unused parameters otherwise), then waits for all of them.
        A no-op inside :meth:`no_sync` or when nothing ran since the last call.
        """
        if not self._sync_enabled or not self._armed:
            return
        blocking = self._mode == "per_param"
        for bucket in self._buckets[self._next_launch :]:
            self._launch(bucket)
            if blocking:
                self._complete(bucket)
        if not blocking:
            for bucket in self._buckets:
                self._complete(bucket)
        for bucket in self._buckets:
            bucket.reset()
        self._next_launch = 0
        self._armed = False
        self._finish_queued = False

    def remove_hooks(self) -> None:
        """Detach the gradient hooks from the wrapped module's parameters (before unwrapping it)."""
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles.clear()

    def _on_grad_ready(self, bucket: Bucket, slot: int, param: torch.Tensor) -> None:
        view = bucket.views[slot]
        if param.grad is not None and not _is_view_of(param.grad, view):
            # Grads were set to None (zero_grad default): autograd allocated a fresh gradient.
            # Move it into the bucket once; later micro-batches accumulate into the view itself.
            view.copy_(param.grad)
            param.grad = view
        if not self._sync_enabled:
            return
        self._armed = True
        if not self._finish_queued:
            # Runs once autograd has executed the whole graph, before backward() returns (torch DDP's
            # reducer queues its finalizer the same way).
            self._finish_queued = True
            Variable._execution_engine.queue_callback(self.finish)
        if self._mode not in MODES_LAUNCHED_FROM_HOOKS:
            return
        if bucket.launched:  # the all-reduce is reading this buffer right now
            raise RuntimeError(
                f"A gradient arrived for a bucket whose all-reduce already started (bucket "
                f"{bucket.index}): a parameter produced its gradient twice in one backward "
                "(a nested backward, e.g. reentrant activation checkpointing around it); use "
                "torch.utils.checkpoint(..., use_reentrant=False)."
            )
        if bucket.ready[slot]:
            return
        bucket.ready[slot] = True
        bucket.pending -= 1
        # Launch in bucket order only: a ready bucket waits for the ones before it.
        buckets = self._buckets
        while self._next_launch < len(buckets) and buckets[self._next_launch].pending == 0:
            self._launch(buckets[self._next_launch])

    def _launch(self, bucket: Bucket) -> None:
        """Put every gradient of ``bucket`` into its buffer and start the all-reduce."""
        bucket.flags.fill_(1)
        for slot, (param, view) in enumerate(zip(bucket.params, bucket.views)):
            if param.grad is None:  # no gradient on this rank: contribute zeros, flag unused
                view.zero_()
                bucket.flags[slot] = 0
                bucket.all_used = False
            elif not _is_view_of(param.grad, view):
                view.copy_(param.grad)
                param.grad = view
        if bucket.status_slots:
            bucket.status.zero_()
            bucket.status[self._rank] = self._local_status
        bucket.launched = True
        self._next_launch = bucket.index + 1
        if self._world_size == 1:
            return
        # Gloo has no AVG reduction: pre-divide (as DDP does), which also keeps bf16 in range.
        bucket.buffer.div_(self._world_size)
        wire = bucket.buffer
        if self._compression is not None and wire.dtype in (torch.float32, torch.float64):
            wire = wire.to(WIRE_DTYPES[self._compression])
        bucket.wire = wire
        bucket.work = dist.all_reduce(wire, group=self._process_group, async_op=True)

    def _complete(self, bucket: Bucket) -> None:
        """Wait for ``bucket``'s all-reduce and point each parameter's grad at its average."""
        if bucket.work is not None:
            bucket.work.wait()
            if bucket.wire is not bucket.buffer:
                bucket.buffer.copy_(bucket.wire)
            bucket.work, bucket.wire = None, None
        if bucket.status_slots:
            # Slot r held rank r's value, zeros elsewhere, pre-divided by the world size like the
            # gradients: the sum is value / world_size, within 0.25 of it after rescaling even in
            # bfloat16 (8 significant bits) for values < 128, so rounding recovers it exactly.
            scaled = bucket.status.float() * self._world_size
            self._rank_status = tuple(int(v) for v in scaled.round().tolist())
        if bucket.all_used:
            return
        # Some local gradient was missing: a parameter no rank used keeps grad=None, one that
        # another rank used takes the average like every other parameter.
        for param, view, used in zip(bucket.params, bucket.views, bucket.flags.tolist()):
            param.grad = view if used > 0 else None
