"""Data-parallel gradient averaging: bucketed, overlapped with backward, accumulation-aware.

:class:`SyncedDataParallel` wraps a module, broadcasts rank 0's parameters and buffers, and
averages gradients over a process group. The training step is::

    model = SyncedDataParallel(net)                # mode="bucketed" by default
    for i, batch in enumerate(micro_batches):      # k micro-batches per optimizer step
        last = i == len(micro_batches) - 1
        with contextlib.nullcontext() if last else model.no_sync():
            loss_fn(model(batch)).backward()       # no gradient communication inside no_sync
    optimizer.step(); optimizer.zero_grad()        # p.grad held the rank average when backward returned

Gradients live as views into flat bucket buffers (:mod:`parallel.buckets`), so micro-batches
accumulate in place into the memory that is all-reduced. Modes: ``bucketed`` (a bucket's async
all-reduce starts from the post-accumulate-grad hooks once its gradients are in, overlapping the
rest of backward), ``per_param_overlap`` (the same, one parameter per bucket), ``flat`` (one
all-reduce per dtype at the end of backward), ``per_param`` (blocking, one per parameter).

Gradients are final when backward returns, as with torch DDP: the first gradient hook of a synced
backward queues :meth:`~SyncedDataParallel.finish` as an autograd-engine callback (run once the
graph is done, before ``backward()`` returns), so ``on_after_backward``, clipping and code after
``manual_backward`` read the rank average, never a buffer an all-reduce is still writing. Calling
``finish()`` again is a no-op; it still joins a rank whose backward produced no gradient. Two
synced backward passes in one step are each averaged and add up, as in one process.

Every rank launches buckets in one fixed order; a gradient missing at the end of backward travels
as zeros with a "used" flag, so ranks never desynchronise and one no rank used keeps ``grad=None``.

A change of ``requires_grad`` (unfreezing, freezing again; the same on every rank) is noticed at the
next forward with gradients enabled (one tuple of flags compared) and rebuilds the buckets and
hooks (within a step: averaged at its end); torch DDP leaves such parameters out for good. Sparse
gradients stay out of the buckets (:mod:`parallel.sparse_grads`); ``broadcast_buffers`` gives
every rank rank 0's buffers before each forward with gradients enabled (:mod:`parallel.buffer_sync`).
CPU ranks on one host keep their buckets in shared memory and sum them there (:mod:`parallel.host_reduce`).

Rank status (``carry_rank_status=True``): a small integer per rank (:meth:`~SyncedDataParallel.
set_rank_status`, e.g. "a SIGTERM arrived") rides in the last bucket; after the step every rank reads
every rank's value (:attr:`~SyncedDataParallel.rank_status`) without a collective of its own. Pure torch.
"""

from __future__ import annotations

import logging
import math
import time
import weakref
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable

from parallel.buckets import Bucket, assign_buckets, build_buckets, describe_buckets, is_view_of
from parallel.buffer_sync import BufferBroadcast
from parallel.dist_utils import broadcast_module_state, group_world_size
from parallel.host_reduce import open_shared_memory_all_reduce
from parallel.sparse_grads import SparseGradSync, sparse_gradient_params
from parallel.sync_config import DEFAULT_BUCKET_CAP_MB, WIRE_DTYPES, GradSyncConfig

__all__ = ["SyncedDataParallel"]

log = logging.getLogger(__name__)


class SyncedDataParallel(nn.Module):
    """Average gradients of ``module`` over ``process_group`` (see the module docstring).

    Args:
        module: The network; its trainable parameters get gradient hooks.
        process_group: Group to average over; the default group when ``None``. Without an
            initialised ``torch.distributed`` the wrapper runs as world size 1.
        mode: ``"bucketed"``, ``"flat"``, ``"per_param"`` or ``"per_param_overlap"``.
        bucket_cap_mb: Bucket size cap in MiB for ``"bucketed"``.
        first_bucket_cap_mb: Cap of the first (last-layer) bucket in ``"bucketed"``. ``None``: by
            the group's backend (:func:`parallel.sync_config.first_bucket_cap_for`): torch DDP's
            1 MiB on NCCL, so the first all-reduce starts early in backward; ``bucket_cap_mb`` on
            gloo, whose reduction shares the CPU cores with backward (one collective fewer).
        grad_compression: ``None``, ``"bf16"`` or ``"fp16"``: reduce fp32/fp64 buckets in that
            dtype (half the bytes on the wire; precision and range in
            :data:`parallel.sync_config.GradCompression`).
        broadcast_init: Broadcast rank 0's parameters and buffers at construction.
        carry_rank_status: Reserve one slot per rank in the last bucket for :meth:`set_rank_status`.
        broadcast_buffers: Give every rank rank 0's buffers before each forward with gradients
            enabled (torch DDP's ``broadcast_buffers``); SyncBN statistics are left out.
        grad_transport: ``"auto"`` (default): buckets of CPU ranks on one host (default gloo group,
            no compression) live in shared memory and are summed there (:mod:`parallel.host_reduce`),
            others by ``dist.all_reduce``; ``"process_group"``: always ``dist.all_reduce``;
            ``"shared_memory"``: shared memory or a ``ValueError`` naming why not.
        timeout: Timeout of the shared-memory sums' barriers (``None``: torch's default for a new group).
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        process_group: dist.ProcessGroup | None = None,
        mode: str = "bucketed",
        bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
        first_bucket_cap_mb: float | None = None,
        grad_compression: str | None = None,
        broadcast_init: bool = True,
        carry_rank_status: bool = False,
        broadcast_buffers: bool = True,
        grad_transport: str = "auto",
        timeout: timedelta | None = None,
    ) -> None:
        super().__init__()
        self._config = GradSyncConfig(mode, bucket_cap_mb, first_bucket_cap_mb, grad_compression, grad_transport)
        self.module = module
        self._process_group = process_group
        self._world_size = group_world_size(process_group)
        self._backend = dist.get_backend(process_group) if self._world_size > 1 else "gloo"
        if broadcast_init and self._world_size > 1:
            broadcast_module_state(module, process_group)
        self._status_slots = self._world_size if carry_rank_status else 0
        self._rank = dist.get_rank(process_group) if self._world_size > 1 else 0
        self._local_status = 0
        self._rank_status: tuple[int, ...] | None = None
        self._buffer_sync = (BufferBroadcast(module, process_group)
                             if broadcast_buffers and self._world_size > 1 else None)
        self._host = None if self._world_size == 1 else open_shared_memory_all_reduce(
            grad_transport, process_group, [p.device for p in module.parameters()], grad_compression, timeout)
        self._hook_handles: list[Any] = []
        self._build()
        self._sync_enabled = True
        self._armed = False  # a synced forward/backward ran since the last finish()
        self._finish_queued = False  # finish() waits as a callback at the end of this backward
        self._next_launch = 0  # index of the first bucket not launched yet
        self.last_finish_s = 0.0

    def _build(self) -> None:
        """(Re)build the buckets and hooks for the parameters that require gradients now."""
        self.remove_hooks()
        self._params = list(self.module.parameters())
        self._trainable = tuple(p.requires_grad for p in self._params)
        sparse = sparse_gradient_params(self.module)
        # Reverse registration order approximates the order backward produces gradients in.
        trainable = [p for p in self._params if p.requires_grad][::-1]
        dense = [p for p in trainable if p not in sparse]
        self._sparse = SparseGradSync([p for p in trainable if p in sparse], self._process_group, self._world_size)
        layout = assign_buckets(dense, *self._config.caps(self._backend))
        self._buckets = build_buckets(dense, layout, self._status_slots, self._host)
        log.debug("SyncedDataParallel(mode=%s, world_size=%d): %s", self._config.mode, self._world_size,
                  describe_buckets(self._buckets, self.module))
        # The hooks hold this wrapper weakly and name buckets by index: a strong reference from a
        # parameter's (C++) hook back to the wrapper is a cycle Python's collector cannot see.
        self._hook_handles = [
            param.register_post_accumulate_grad_hook(_weak_hook(self._on_grad_ready, bucket.index, slot))
            for bucket in self._buckets
            for slot, param in enumerate(bucket.params)
        ] + [param.register_post_accumulate_grad_hook(_weak_hook(self._on_sparse_grad_ready))
             for param in self._sparse.params]

    @property
    def mode(self) -> str:
        return self._config.mode

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def grad_compression(self) -> str | None:
        return self._config.grad_compression

    @property
    def grad_transport(self) -> str:
        """How the buckets are summed here: ``"shared_memory"`` or ``"process_group"`` (``"auto"`` resolved)."""
        return "process_group" if self._host is None else "shared_memory"

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
        if torch.is_grad_enabled():
            if self._trainable != tuple(p.requires_grad for p in self._params) and self._next_launch == 0:
                log.info("SyncedDataParallel: the parameters requiring gradients changed; rebuilding the buckets")
                self._build()
            if self._buffer_sync is not None:
                self._buffer_sync.before_forward()
            if self._sync_enabled:
                self._armed = True
        return self.module(*args, **kwargs)

    def sync_buffers(self) -> None:
        """Every rank, at the same point (before evaluation, at the end of fit): rank 0's buffers if a
        training forward may have changed them since the last broadcast."""
        if self._buffer_sync is not None:
            self._buffer_sync.broadcast_if_stale()

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

        Runs by itself at the end of every synced backward. Launches, in bucket order, what
        backward did not (every bucket in ``flat`` and ``per_param``; buckets with unused
        parameters otherwise), averages the sparse gradients, then waits for all of them.
        A no-op inside :meth:`no_sync` or when nothing ran since the last call.
        """
        if not self._sync_enabled or not self._armed:
            return
        started = time.perf_counter()
        blocking = self._config.mode == "per_param"
        for bucket in self._buckets[self._next_launch :]:
            self._launch(bucket)
            if blocking:
                self._complete(bucket)
        self._average_params_unfrozen_in_step()
        statuses = self._sparse.average(self._local_status)
        if self._status_slots and not self._buckets and statuses is not None:
            self._rank_status = statuses  # every gradient is sparse: the status rode with the sparse counts
        for bucket in self._buckets:
            self._complete(bucket)
            bucket.reset()
        self._next_launch = 0
        self._armed = False
        self._finish_queued = False
        self.last_finish_s = time.perf_counter() - started  # diagnostic: the exposed wait at the end of backward

    def _average_params_unfrozen_in_step(self) -> None:
        # requires_grad turned on after this step's forward began (inside training_step): those parameters
        # have no hook yet; average them in extra buckets now. The next forward rebuilds the layout.
        if self._trainable == tuple(p.requires_grad for p in self._params):
            return
        synced = {p for bucket in self._buckets for p in bucket.params} | set(self._sparse.params)
        extra = [p for p in self._params if p.requires_grad and p not in synced]
        for bucket in build_buckets(extra, assign_buckets(extra, math.inf, math.inf), host=self._host):
            self._launch(bucket)
            self._complete(bucket)

    def remove_hooks(self) -> None:
        """Detach the gradient hooks from the wrapped module's parameters (before unwrapping it)."""
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles.clear()

    def close(self) -> None:
        """Unwrapping for good: the hooks go, and the shared-memory worker thread stops (if any)."""
        self.remove_hooks()
        if self._host is not None:
            self._host.close()

    def _arm_finish(self) -> None:
        self._armed = True
        if not self._finish_queued:
            # Runs once autograd has executed the whole graph, before backward() returns (torch DDP's
            # reducer queues its finalizer the same way).
            self._finish_queued = True
            Variable._execution_engine.queue_callback(self.finish)

    def _on_sparse_grad_ready(self, param: torch.Tensor) -> None:
        if self._sync_enabled:
            self._arm_finish()

    def _on_grad_ready(self, bucket_index: int, slot: int, param: torch.Tensor) -> None:
        bucket = self._buckets[bucket_index]
        view = bucket.views[slot]
        if param.grad is not None and not is_view_of(param.grad, view):
            # Grads were set to None (zero_grad default): autograd allocated a fresh gradient.
            # Move it into the bucket once; later micro-batches accumulate into the view itself.
            view.copy_(param.grad)
            param.grad = view
        if not self._sync_enabled:
            return
        self._arm_finish()
        if not self._config.launched_from_hooks:
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
            elif not is_view_of(param.grad, view):
                view.copy_(param.grad)
                param.grad = view
        if bucket.status_slots:
            bucket.write_status(self._rank, self._local_status)
        bucket.launched = True
        self._next_launch = bucket.index + 1
        if self._world_size > 1:
            wire_dtype = None if self._config.grad_compression is None else WIRE_DTYPES[self._config.grad_compression]
            bucket.start_all_reduce(self._process_group, self._world_size, wire_dtype, self._host)

    def _complete(self, bucket: Bucket) -> None:
        """Wait for ``bucket``'s all-reduce and point each parameter's grad at its average."""
        bucket.wait()
        if bucket.status_slots:
            self._rank_status = bucket.read_status(self._world_size)
        if bucket.all_used:
            return
        # Some local gradient was missing: a parameter no rank used keeps grad=None, one that
        # another rank used takes the average like every other parameter.
        for param, view, used in zip(bucket.params, bucket.views, bucket.flags.tolist()):
            param.grad = view if used > 0 else None


def _weak_hook(method: Any, *args: Any) -> Any:
    """A gradient hook calling ``method(*args, param)`` while its object lives, and nothing after."""
    ref = weakref.WeakMethod(method)

    def hook(param: torch.Tensor) -> None:
        bound = ref()
        if bound is not None:
            bound(*args, param)

    return hook
