"""The gradient side of :class:`parallel.gradients.grad_sync.SyncedDataParallel`: buckets, hooks, launches, the wait.

:class:`GradReducer` plays torch DDP's ``Reducer``: it lays the trainable parameters' gradients out
in buckets (:mod:`parallel.gradients.buckets`), registers a post-accumulate-grad hook per parameter, starts a
bucket's all-reduce once its gradients are in (in bucket order only, the same on every rank) and,
from an autograd-engine callback queued by the first hook of a synced backward, launches what
backward did not and waits for everything before ``backward()`` returns. A gradient missing at the
end of backward travels as zeros with a "used" flag, so ranks never desynchronise and a parameter no
rank used keeps ``grad=None``. Sparse gradients go to :mod:`parallel.gradients.sparse_grads`.

A change of ``requires_grad`` is the wrapper's to notice (:attr:`GradReducer.stale`) and this class's
to apply (:meth:`GradReducer.rebuild`); a parameter unfrozen inside a step, after its forward, is
averaged in extra buckets at that step's end. Rank status (``status_slots``): a small integer per rank
rides in the last bucket (or the sparse counts), read back after the step. Pure torch; no Lightning.
"""

from __future__ import annotations

import logging
import math
import time
import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable

from parallel.gradients.buckets import Bucket, assign_buckets, build_buckets, describe_buckets, is_view_of
from parallel.gradients.sparse_grads import SparseGradSync, sparse_gradient_params
from parallel.host.host_reduce import SharedMemoryAllReduce
from parallel.sync_config import WIRE_DTYPES, GradSyncConfig

__all__ = ["GradReducer"]

log = logging.getLogger(__name__)


class GradReducer:
    """Bucketed, hook-driven gradient all-reduce for ``module``'s trainable parameters (module docstring).

    ``sync_enabled`` off (``no_sync``): gradients accumulate locally, nothing communicates.
    ``status_slots``: one slot per rank for :attr:`local_status` in the last bucket (0: none).
    """

    def __init__(
        self,
        module: nn.Module,
        config: GradSyncConfig,
        process_group: dist.ProcessGroup | None,
        world_size: int,
        rank: int,
        backend: str,
        host: SharedMemoryAllReduce | None,
        status_slots: int = 0,
    ) -> None:
        self._module, self._config, self._process_group = module, config, process_group
        self._world_size, self._rank, self._backend, self._host = world_size, rank, backend, host
        self._status_slots = status_slots
        self.local_status = 0  # this rank's value for the coming synced steps
        self.rank_status: tuple[int, ...] | None = None  # every rank's, as of the last synced step
        self.sync_enabled = True
        self.weight_next_sync(contributes=True, divisor=world_size)
        self.last_finish_s = 0.0  # diagnostic: the exposed wait at the end of the last synced backward
        self._armed = False  # a synced forward/backward ran since the last finish()
        self._finish_queued = False  # finish() waits as a callback at the end of this backward
        self._next_launch = 0  # index of the first bucket not launched yet
        self._hook_handles: list[Any] = []
        self.rebuild()

    @property
    def buckets(self) -> tuple[Bucket, ...]:
        return tuple(self._buckets)

    @property
    def stale(self) -> bool:
        """Whether ``requires_grad`` changed since the last :meth:`rebuild` while no bucket is in flight."""
        return self._trainable != tuple(p.requires_grad for p in self._params) and self._next_launch == 0

    def rebuild(self) -> None:
        """(Re)build the buckets and hooks for the parameters that require gradients now; none in a group of
        one rank, where the local gradients are the average (see :meth:`finish`)."""
        self.remove_hooks()
        self._params = list(self._module.parameters())
        self._trainable = tuple(p.requires_grad for p in self._params)
        if self._world_size == 1:
            # Nothing to average: no bucket, no copy, no Python hook per parameter (on one H200 ResNet-18's launch-
            # bound step went from 23.1 to 19.1 ms without its 62), as torch's SyncBatchNorm falls back to BatchNorm.
            self._sparse, self._buckets = SparseGradSync([], self._process_group, 1), []
            log.debug("GradReducer(mode=%s, world_size=1): nothing to average, no buckets", self._config.mode)
            return
        sparse = sparse_gradient_params(self._module)
        # Reverse registration order approximates the order backward produces gradients in.
        trainable = [p for p in self._params if p.requires_grad][::-1]
        dense = [p for p in trainable if p not in sparse]
        self._sparse = SparseGradSync([p for p in trainable if p in sparse], self._process_group, self._world_size)
        layout = assign_buckets(dense, *self._config.caps(self._backend))
        self._buckets = build_buckets(dense, layout, self._status_slots, self._host)
        log.debug(
            "GradReducer(mode=%s, world_size=%d): %s",
            self._config.mode,
            self._world_size,
            describe_buckets(self._buckets, self._module),
        )
        # The hooks hold this reducer weakly and name buckets by index: a strong reference from a
        # parameter's (C++) hook back to it is a cycle Python's collector cannot see.
        self._hook_handles = [
            param.register_post_accumulate_grad_hook(_weak_hook(self._on_grad_ready, bucket.index, slot))
            for bucket in self._buckets
            for slot, param in enumerate(bucket.params)
        ] + [
            param.register_post_accumulate_grad_hook(_weak_hook(self._on_sparse_grad_ready))
            for param in self._sparse.params
        ]

    def remove_hooks(self) -> None:
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles.clear()

    def weight_next_sync(self, *, contributes: bool, divisor: float) -> None:
        """How the coming synced backward averages (reset to the plain rank mean by :meth:`finish`):
        this rank's gradients are summed (``contributes``) or sent as zeros flagged unused, and the sum
        is divided by ``divisor`` (the world size; fewer in a step some ranks trained nothing in)."""
        if not divisor > 0:
            raise ValueError(f"divisor={divisor!r} must be > 0 (at least one rank trained in the step)")
        self.contributes, self.divisor = contributes, float(divisor)

    def arm(self) -> None:
        """A synced forward ran: the next :meth:`finish` joins the all-reduce even without a local gradient."""
        if self.sync_enabled:
            self._armed = True

    def finish(self) -> None:
        """Complete this backward's all-reduce: afterwards every ``p.grad`` holds the rank average.

        Launches, in bucket order, what backward did not (every bucket in ``flat`` and ``per_param``;
        buckets with unused parameters otherwise), averages the sparse gradients, then waits for all
        of them. A no-op inside ``no_sync`` or when nothing ran since the last call.
        """
        if not self.sync_enabled or not self._armed:
            return
        if self._world_size == 1:  # the local gradients are the average; the status needs no all-reduce
            self.rank_status = (self.local_status,) if self._status_slots else None
            self._armed = False
            return
        started = time.perf_counter()
        blocking = self._config.mode == "per_param"
        for bucket in self._buckets[self._next_launch :]:
            self._launch(bucket)
            if blocking:
                self._complete(bucket)
        self._average_params_unfrozen_in_step()
        statuses = self._sparse.average(self.local_status, divisor=self.divisor, contributes=self.contributes)
        if self._status_slots and not self._buckets and statuses is not None:
            self.rank_status = statuses  # every gradient is sparse: the status rode with the sparse counts
        for bucket in self._buckets:
            self._complete(bucket)
            bucket.reset()
        self._next_launch = 0
        self._armed = False
        self._finish_queued = False
        self.weight_next_sync(contributes=True, divisor=self._world_size)
        self.last_finish_s = time.perf_counter() - started

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

    def _arm_finish(self) -> None:
        self._armed = True
        if not self._finish_queued:
            # Runs once autograd has executed the whole graph, before backward() returns (torch DDP's
            # reducer queues its finalizer the same way).
            self._finish_queued = True
            Variable._execution_engine.queue_callback(self.finish)

    def _on_sparse_grad_ready(self, param: torch.Tensor) -> None:
        if self.sync_enabled:
            self._arm_finish()

    def _on_grad_ready(self, bucket_index: int, slot: int, param: torch.Tensor) -> None:
        bucket = self._buckets[bucket_index]
        view = bucket.views[slot]
        if param.grad is not None and not is_view_of(param.grad, view):
            # Grads were set to None (zero_grad default): autograd allocated a fresh gradient.
            # Move it into the bucket once; later micro-batches accumulate into the view itself.
            view.copy_(param.grad)
            param.grad = view
        if not self.sync_enabled:
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
        for slot, (param, view) in enumerate(zip(bucket.params, bucket.views, strict=True)):
            if param.grad is None or not self.contributes:  # contribute zeros, flag unused
                view.zero_()
                bucket.flags[slot] = 0
                bucket.all_used = False
                if param.grad is not None:  # a rank that trained nothing in a joined step
                    param.grad = view
            elif not is_view_of(param.grad, view):
                view.copy_(param.grad)
                param.grad = view
        if bucket.status_slots:
            bucket.write_status(self._rank, self.local_status)
        bucket.launched = True
        self._next_launch = bucket.index + 1
        if self._world_size > 1:
            wire_dtype = None if self._config.grad_compression is None else WIRE_DTYPES[self._config.grad_compression]
            bucket.start_all_reduce(self._process_group, self.divisor, wire_dtype, self._host)

    def _complete(self, bucket: Bucket) -> None:
        """Wait for ``bucket``'s all-reduce and point each parameter's grad at its average."""
        bucket.wait()
        if bucket.status_slots:
            self.rank_status = bucket.read_status()
        if bucket.all_used:
            return
        # Some local gradient was missing: a parameter no rank used keeps grad=None, one that
        # another rank used takes the average like every other parameter.
        for param, view, used in zip(bucket.params, bucket.views, bucket.flags.tolist(), strict=True):
            param.grad = view if used > 0 else None


def _weak_hook(method: Any, *args: Any) -> Any:
    """A gradient hook calling ``method(*args, param)`` while its object lives, and nothing after."""
    ref = weakref.WeakMethod(method)

    def hook(param: torch.Tensor) -> None:
        bound = ref()
        if bound is not None:
            bound(*args, param)

    return hook
