"""The training side of :class:`strategies.custom_ddp.CustomDDPStrategy`: the one gradient-sync component.

:class:`SyncedTraining` is a strategy mixin (placed before ``DDPStrategy``) that owns every strategy
hook the gradient sync needs; the buckets, hooks and collectives are the pure torch of
:class:`parallel.gradients.grad_sync.SyncedDataParallel`.

- **Wrapping** (``_setup_model``/``configure_ddp``, ``teardown``): the module is wrapped in
  ``SyncedDataParallel`` instead of torch DDP (so none of ``DDPStrategy``'s comm hooks apply) and
  unwrapped, its gradient hooks removed, at teardown.
- **Accumulation** (``block_backward_sync``): Lightning runs non-stepping micro-batches of
  ``accumulate_grad_batches`` inside it -> ``no_sync()``: no gradient collective at all.
- **A synced backward** waits for its buckets in an autograd-engine callback before it returns, so
  ``on_after_backward``, code after ``manual_backward``, clipping and ``on_before_optimizer_step``
  read rank-averaged gradients. ``pre_backward`` hands this rank's preemption status to the sync
  (it rides in the last bucket); ``post_backward`` calls ``finish()`` (then a no-op, or the join of
  a rank whose backward made no gradient) and hands every rank's status back to
  :class:`strategies.stopping.preemption.Preemption`.
- **SyncBatchNorm's statistics** go where the buckets go: through shared memory when they are summed there.
- **Buffers**: rank 0's before each training forward (``broadcast_buffers``, as torch DDP), and
  once more before validation and at the end of fit, points every rank reaches.
"""

from __future__ import annotations

import logging
from collections.abc import Generator
from contextlib import contextmanager
from dataclasses import asdict
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.nn import Module
from typing_extensions import override

from parallel.batchnorm.syncbn import SyncBatchNorm
from parallel.gradients.grad_sync import SyncedDataParallel
from parallel.host.host_exchange import open_shared_memory_exchange
from strategies.options import CustomDDPOptions
from strategies.stopping import Preemption
from strategies.training.layer_sync import CustomSyncBatchNorm

__all__ = ["SyncedTraining"]

log = logging.getLogger(__name__)


class SyncedTraining:
    """Strategy mixin: gradients averaged by :class:`~parallel.gradients.grad_sync.SyncedDataParallel` (module
    docstring)."""

    _options: CustomDDPOptions  # the strategy's
    _preemption: Preemption  # the strategy's: owns the stop state the sync carries
    _timeout: timedelta | None  # DDPStrategy's collective timeout
    model: Any  # the strategy's (Lightning's) wrapped module
    lightning_module: Any
    _layer_sync: Any  # the strategy's LayerSync plugin, applied before configure_ddp (DDPStrategy.setup)

    @override
    def _setup_model(self, model: Module) -> SyncedDataParallel:
        return SyncedDataParallel(
            model,
            **asdict(self._options.grad_sync),
            carry_rank_status=True,
            broadcast_buffers=self._options.broadcast_buffers,
            timeout=self._timeout,
        )

    @override
    def configure_ddp(self) -> None:
        self.model = self._setup_model(self.model)
        log.debug("%s: module wrapped in SyncedDataParallel (%s)", self.__class__.__name__, self._options.grad_sync)
        self._exchange_statistics_as_the_buckets()

    def _exchange_statistics_as_the_buckets(self) -> None:
        """SyncBatchNorm's two collectives per layer go where the gradient buckets go: through shared memory when
        they are summed there (:mod:`parallel.host.host_exchange`, slots reserved now for the largest layer), else
        through the process group. Collective: every rank converted the same layers."""
        plugin, capacity = self._layer_sync, SyncBatchNorm.largest_statistics(self.model)
        if not isinstance(plugin, CustomSyncBatchNorm) or capacity == 0:
            return
        group = plugin.process_group
        members = dist.get_process_group_ranks(dist.group.WORLD if group is None else group)
        exchange = open_shared_memory_exchange(self.model.shared_memory, members, capacity)
        if exchange is not None:
            layers = SyncBatchNorm.use_exchange(self.model, exchange, group)
            log.info("SyncBatchNorm statistics of %d layer(s) go through shared memory", layers)

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Accumulating micro-batch: backward with no gradient communication at all."""
        if isinstance(self.model, SyncedDataParallel):
            with self.model.no_sync():
                yield
        else:
            yield

    @override
    def pre_backward(self, closure_loss: torch.Tensor) -> None:
        super().pre_backward(closure_loss)  # type: ignore[misc]
        if isinstance(self.model, SyncedDataParallel):
            self.model.set_rank_status(self._preemption.local_status)  # a signal this rank got rides along

    @override
    def post_backward(self, closure_loss: torch.Tensor) -> None:
        # Runs inside the optimizer closure: before unscaling, clipping and on_before_optimizer_step.
        if isinstance(self.model, SyncedDataParallel):
            self.model.finish()  # already done at the end of backward, unless this rank made no gradient
            self._preemption.agree(self.model.rank_status)  # every rank's status, the same on every rank

    def _sync_buffers(self) -> None:
        if isinstance(self.model, SyncedDataParallel):
            self.model.sync_buffers()

    @override
    def on_validation_start(self) -> None:
        self._sync_buffers()  # every rank evaluates with rank 0's buffers
        super().on_validation_start()  # type: ignore[misc]

    @override
    def on_train_end(self) -> None:
        self._sync_buffers()  # the checkpoint and the returned module hold rank 0's buffers
        super().on_train_end()  # type: ignore[misc]

    @override
    def teardown(self) -> None:
        if isinstance(self.model, SyncedDataParallel):
            self.model.close()
            self.model = self.lightning_module
        super().teardown()  # type: ignore[misc]
