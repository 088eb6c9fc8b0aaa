"""Data-parallel gradient averaging: bucketed, overlapped with backward, accumulation-aware.

:class:`SyncedDataParallel` wraps a module, broadcasts rank 0's parameters and buffers, and
averages gradients over a process group. The training step is::

    model = SyncedDataParallel(net)                # mode="bucketed" by default
    for i, batch in enumerate(micro_batches):      # k micro-batches per optimizer step
        last = i == len(micro_batches) - 1
        with contextlib.nullcontext() if last else model.no_sync():
            loss_fn(model(batch)).backward()       # no gradient communication inside no_sync
    optimizer.step(); optimizer.zero_grad()        # p.grad held the rank average when backward returned

Gradients live as views into flat bucket buffers (:mod:`parallel.gradients.buckets`), so micro-batches
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

Buckets, hooks, launches and that wait are :class:`parallel.gradients.reducer.GradReducer` (torch DDP's
``Reducer``): every rank launches buckets in one fixed order, and a gradient missing at the end of
backward travels as zeros with a "used" flag, so ranks never desynchronise and a parameter no rank
used keeps ``grad=None``.

A change of ``requires_grad`` (unfreezing, freezing again; the same on every rank) is noticed at the
next forward with gradients enabled (one tuple of flags compared) and rebuilds the buckets and
hooks (within a step: averaged at its end); torch DDP leaves such parameters out for good. Sparse
gradients stay out of the buckets (:mod:`parallel.gradients.sparse_grads`); ``broadcast_buffers`` gives
every rank rank 0's buffers before each forward with gradients enabled (:mod:`parallel.gradients.buffer_sync`).
CPU ranks on one host keep their buckets in shared memory and sum them there (:mod:`parallel.host.host_reduce`).

A group of one rank (one GPU, ``devices=1``) has nothing to average: no bucket, no hook, no copy; gradients stay
where autograd puts them, as torch's SyncBatchNorm runs plain batch norm there.

Rank status (``carry_rank_status=True``): a small integer per rank (:meth:`~SyncedDataParallel.
set_rank_status`, e.g. "a SIGTERM arrived") rides in the last bucket; after the step every rank reads
every rank's value (:attr:`~SyncedDataParallel.rank_status`) without a collective of its own. Pure torch.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from parallel.dist_utils import broadcast_module_state, check_same_layout, group_world_size
from parallel.gradients.buckets import Bucket
from parallel.gradients.buffer_sync import BufferBroadcast
from parallel.gradients.reducer import GradReducer
from parallel.host.host_reduce import SharedMemoryAllReduce, open_shared_memory_all_reduce
from parallel.sync_config import DEFAULT_BUCKET_CAP_MB, GradSyncConfig

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
            no compression) live in shared memory and are summed there (:mod:`parallel.host.host_reduce`),
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
        _refuse_uninitialized(module)
        self._config = GradSyncConfig(mode, bucket_cap_mb, first_bucket_cap_mb, grad_compression, grad_transport)
        self.module = module
        self._world_size = group_world_size(process_group)
        self._backend = dist.get_backend(process_group) if self._world_size > 1 else "gloo"
        if self._world_size > 1:
            check_same_layout(module, process_group)
        if broadcast_init and self._world_size > 1:
            broadcast_module_state(module, process_group)
        self._buffer_sync = (
            BufferBroadcast(module, process_group) if broadcast_buffers and self._world_size > 1 else None
        )
        self._host = (
            None
            if self._world_size == 1
            else open_shared_memory_all_reduce(
                grad_transport, process_group, [p.device for p in module.parameters()], grad_compression, timeout
            )
        )
        rank = dist.get_rank(process_group) if self._world_size > 1 else 0
        self._reducer = GradReducer(
            module,
            self._config,
            process_group,
            self._world_size,
            rank,
            self._backend,
            self._host,
            status_slots=self._world_size if carry_rank_status else 0,
        )

    @property
    def config(self) -> GradSyncConfig:
        """The validated gradient-sync settings (mode, bucket caps, compression, transport); frozen."""
        return self._config

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
    def shared_memory(self) -> SharedMemoryAllReduce | None:
        """The shared-memory transport the buckets are summed with (``None``: the process group's all-reduce);
        :mod:`parallel.host.host_exchange` sends SyncBatchNorm's statistics through it too."""
        return self._host

    @property
    def rank_status(self) -> tuple[int, ...] | None:
        """Every rank's status as of the last synced step (the same tuple on every rank).

        ``None`` before the first synced step, without ``carry_rank_status`` or without buckets.
        """
        return self._reducer.rank_status

    def set_rank_status(self, value: int) -> None:
        """This rank's status for the coming synced steps (it stays until changed).

        ``value`` is read when the last bucket is launched, so a value set during a step's
        backward may only travel with the next step. Values are small integers, ``0 <= value < 128``
        (they ride in the gradients' dtype, bfloat16 included).
        """
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 128:
            raise ValueError(f"rank status {value!r} must be an int in [0, 128)")
        self._reducer.local_status = value

    @property
    def buckets(self) -> tuple[Bucket, ...]:
        """The gradient buckets in launch order (read-only use: sizes, parameter grouping)."""
        return self._reducer.buckets

    @property
    def last_finish_s(self) -> float:
        """Diagnostic: seconds the last synced backward waited for its all-reduces at its end."""
        return self._reducer.last_finish_s

    @property
    def syncing(self) -> bool:
        """Whether a backward now would average gradients (outside :meth:`no_sync`)."""
        return self._reducer.sync_enabled

    def weight_next_sync(self, *, contributes: bool, divisor: float) -> None:
        """For the coming synced backward only (uneven data, :mod:`parallel.uneven`): this rank's
        gradients count or are sent as zeros, and the sum is divided by ``divisor`` instead of the world
        size. Every rank passes the same ``divisor``; :meth:`finish` restores the plain rank mean."""
        self._reducer.weight_next_sync(contributes=contributes, divisor=divisor)

    @property
    def buffer_source(self) -> int:
        """The group rank whose buffers ``broadcast_buffers`` copies to every rank (0, as torch DDP's)."""
        return 0 if self._buffer_sync is None else self._buffer_sync.source

    @buffer_source.setter
    def buffer_source(self, rank: int) -> None:
        # A rank that trained nothing in the last step holds no newer buffers than before it: the
        # joined step's buffers are those of a rank that trained (the same on every rank).
        if self._buffer_sync is not None:
            self._buffer_sync.source = rank

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if torch.is_grad_enabled():
            if self._reducer.stale:
                log.info("SyncedDataParallel: the parameters requiring gradients changed; rebuilding the buckets")
                self._reducer.rebuild()
            if self._buffer_sync is not None:
                self._buffer_sync.before_forward()
            self._reducer.arm()
        return self.module(*args, **kwargs)

    def sync_buffers(self) -> None:
        """Every rank, at the same point (before evaluation, at the end of fit): rank 0's buffers if a
        training forward may have changed them since the last broadcast."""
        if self._buffer_sync is not None:
            self._buffer_sync.broadcast_if_stale()

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally with no communication at all."""
        previous, self._reducer.sync_enabled = self._reducer.sync_enabled, False
        try:
            yield
        finally:
            self._reducer.sync_enabled = previous

    def finish(self) -> None:
        """Complete this backward's all-reduce: afterwards every ``p.grad`` holds the rank average.

        Runs by itself at the end of every synced backward (:meth:`parallel.gradients.reducer.GradReducer.finish`);
        calling it again is a no-op, and it still joins a rank whose backward produced no gradient.
        """
        self._reducer.finish()

    def remove_hooks(self) -> None:
        """Detach the gradient hooks from the wrapped module's parameters (before unwrapping it)."""
        self._reducer.remove_hooks()

    def close(self) -> None:
        """Unwrapping for good: the hooks go, and the shared-memory worker thread stops (if any)."""
        self.remove_hooks()
        if self._host is not None:
            self._host.close()


def _refuse_uninitialized(module: nn.Module) -> None:
    # A lazy module's shapes exist only after a forward: there is nothing to broadcast or bucket yet
    # (torch DDP refuses such a module too). Every rank holds the same module, so every rank raises.
    lazy = [
        name for name, tensor in [*module.named_parameters(), *module.named_buffers()] if nn.parameter.is_lazy(tensor)
    ]
    if lazy:
        raise ValueError(
            f"SyncedDataParallel: {', '.join(lazy)} not initialised yet (lazy module). Run one forward pass "
            f"on a sample batch before wrapping the module (under Lightning: at the end of the "
            f"LightningModule's __init__ or in configure_model)."
        )
