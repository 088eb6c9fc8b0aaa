"""Uneven training data per rank for :class:`strategies.custom_ddp.CustomDDPStrategy`: the loader joins, each
step is weighed by the ranks that trained in it.

:class:`UnevenTraining` is a strategy mixin (placed before :class:`~strategies.training.SyncedTraining`)
that owns every strategy hook the join needs; the loader and the step shares are the pure torch of
:mod:`parallel.uneven.joined_loader`.

- **Loader** (``process_dataloader`` of the training stage): :func:`~parallel.uneven.joined_loader.join_uneven`
  (one all-gather of the lengths): returned as it is where every rank's length is known and equal;
  otherwise a rank whose data ended runs empty batches until every rank's has, so every rank runs the
  same steps and the epoch ends on every rank at once. ``uneven_data="refuse"`` (or manual
  optimization, whose ``training_step`` may issue collectives no empty batch can be trusted to repeat)
  raises instead, on every rank, naming each rank's batch count.
- **A step** (``on_train_batch_start``): its :class:`~parallel.uneven.joined_loader.StepShare`. A rank on an
  empty batch backpropagates ``loss * 0`` (its loss over 0 samples is NaN; the gradients stay exactly
  0); the module's ``self.log`` calls of that step log neutral values (0, batch size 0; -inf/+inf for
  max/min) so epoch aggregates count only trained samples; ``reduce`` leaves its value out.
- **The gradient** of an optimizer step (``pre_backward`` of the synced micro-batch): the sum over the
  ranks divided by the trained (rank, micro-batch) pairs of its accumulation window over the window's
  micro-batches. Without a joined step that is the world size: ``ddp``'s mean, bit for bit. With one, it
  is the mean of the per-rank mean losses' gradients over the ranks that trained: one process on the
  union of the step's batches when those batches are the same size (as ``ddp`` weighs an uneven last
  batch: per rank, not per sample).
- **Buffers** (``broadcast_buffers``): taken from the lowest rank that trained in the last step.
"""

from __future__ import annotations

import functools
import logging
import math
from typing import Any

import torch
from lightning.pytorch.trainer.states import RunningStage
from typing_extensions import override

from parallel.gradients.grad_sync import SyncedDataParallel
from parallel.uneven.joined_loader import JoinedLoader, StepShare, join_uneven
from strategies.options import CustomDDPOptions, is_mean_op

__all__ = ["UnevenTraining"]

log = logging.getLogger(__name__)

_REFUSED = (
    "Give every rank the same number of batches per epoch, or let custom_ddp train through it: "
    "CustomDDPStrategy(uneven_data='join')."
)
_MANUAL = (
    "custom_ddp joins uneven data under automatic optimization only (a manual training_step may issue "
    "collectives an empty batch cannot be trusted to repeat): give every rank the same number of batches."
)
_SEVERAL = (
    "custom_ddp joins uneven data for one training loader, and this fit has several whose lengths differ or are "
    "unknown per rank (an IterableDataset): give them known, equal lengths per rank, or pass "
    "CustomDDPStrategy(uneven_data='refuse') to train them as they are (an error names the counts if they differ)."
)
# The hooks of one training batch that may log: there a rank on an empty batch logs neutral values.
_STEP_HOOKS = frozenset(
    {
        "training_step",
        "on_train_batch_start",
        "on_train_batch_end",
        "on_before_backward",
        "on_after_backward",
        "on_before_optimizer_step",
        "on_before_zero_grad",
    }
)


def _neutral(value: Any, reduce_fx: Any) -> Any:
    """What a rank that trained nothing logs: the reduction's identity (a Metric object is left as it is:
    an empty batch updated it by nothing)."""
    fill = {"max": -math.inf, "min": math.inf}.get(getattr(reduce_fx, "__name__", reduce_fx), 0.0)
    if isinstance(value, torch.Tensor):
        return torch.full_like(
            value, fill, dtype=value.dtype if value.is_floating_point() else torch.get_default_dtype()
        )
    if isinstance(value, (int, float)):
        return fill
    return value


class UnevenTraining:
    """Strategy hooks of the join (module docstring); mix in before ``SyncedTraining``."""

    _options: CustomDDPOptions  # the strategy's
    _collective_device: torch.device  # the strategy's
    model: Any  # the strategy's wrapped module
    lightning_module: Any
    global_rank: int
    _joined: JoinedLoader | None = None  # this fit's training loader, when it joins
    _joined_at = -1  # the epoch its loaders were set up at (they are again with reload_dataloaders_every_n_epochs)
    _share: StepShare | None = None  # the step running now, when it is joined
    _window: tuple[StepShare, ...] = ()  # the joined accumulation window so far
    _window_closed = False  # the last step synced: the next batch opens a new window
    _last_first = 0  # the lowest rank that trained in the last step: its buffers are the newest
    _step_log: StepShare | None = None  # inside a joined step's self.log call

    @override
    def process_dataloader(self, dataloader: object) -> object:
        dataloader = super().process_dataloader(dataloader)  # type: ignore[misc]
        module = self.lightning_module
        trainer = None if module is None else module._trainer
        if trainer is None or trainer.state.stage != RunningStage.TRAINING or trainer.world_size == 1:
            return dataloader
        refuse = _REFUSED if self._options.uneven_data == "refuse" else None
        if not module.automatic_optimization:
            refuse = _MANUAL
        loader = join_uneven(
            dataloader,  # type: ignore[arg-type]
            device=self._collective_device,
            refuse=refuse,
            epoch=lambda: trainer.current_epoch,
        )
        if isinstance(loader, JoinedLoader) and refuse is None:
            if self._joined is not None and self._joined_at == trainer.current_epoch:
                raise ValueError(_SEVERAL)
            log.info("custom_ddp: the training loader's length differs or is unknown per rank: it joins")
            self._joined, self._joined_at = loader, trainer.current_epoch
        return loader

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)  # type: ignore[misc]
        if self._joined is None:
            return
        share = self._joined.take_share() or StepShare((True,) * self.lightning_module.trainer.world_size)
        if isinstance(self.model, SyncedDataParallel):  # before this step's forward: last step's trained buffers
            self.model.buffer_source = self._last_first
        self._last_first = share.first
        self._window = (share,) if self._window_closed else (*self._window, share)
        self._window_closed = False
        self._share = share if share.joined else None
        self._weigh_logs(self._share)

    def _weigh_logs(self, share: StepShare | None) -> None:
        """In a joined step's hooks, ``self.log`` of a rank on an empty batch logs the reduction's identity with
        batch size 0, and a synced value is the mean over the ranks that trained (:meth:`reduce`)."""
        module = self.lightning_module
        if share is None:
            module.__dict__.pop("log", None)
            return
        trained = share.trained[self.global_rank]

        @functools.wraps(type(module).log)
        def step_log(name: str, value: Any, *args: Any, **kwargs: Any) -> None:
            if getattr(module, "_current_fx_name", None) not in _STEP_HOOKS:
                return type(module).log(module, name, value, *args, **kwargs)
            if not trained:
                value, kwargs["batch_size"] = _neutral(value, kwargs.get("reduce_fx", "mean")), 0
            self._step_log = share
            try:
                return type(module).log(module, name, value, *args, **kwargs)
            finally:
                self._step_log = None

        module.log = step_log

    @override
    def backward(self, closure_loss: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self._share is not None and not self._share.trained[self.global_rank]:
            closure_loss = closure_loss * 0.0  # NaN over 0 samples; the gradient of x * 0 is 0
        return super().backward(closure_loss, *args, **kwargs)  # type: ignore[misc]

    @override
    def pre_backward(self, closure_loss: torch.Tensor) -> None:
        super().pre_backward(closure_loss)  # type: ignore[misc]
        window = self._window
        if any(share.joined for share in window) and isinstance(self.model, SyncedDataParallel) and self.model.syncing:
            self.model.weight_next_sync(
                contributes=any(share.trained[self.global_rank] for share in window),
                divisor=sum(share.count for share in window) / len(window),
            )

    @override
    def post_backward(self, closure_loss: torch.Tensor) -> None:
        super().post_backward(closure_loss)  # type: ignore[misc]
        if isinstance(self.model, SyncedDataParallel) and self.model.syncing:
            self._window_closed = True

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any | None = "mean") -> Any:
        share = self._step_log
        if share is None or not isinstance(tensor, torch.Tensor) or not is_mean_op(reduce_op):
            return super().reduce(tensor, group, reduce_op)  # type: ignore[misc]
        # A value logged in a joined step: the empty ranks sent 0; the mean is over the ranks that trained.
        if not tensor.is_floating_point():
            tensor = tensor.to(torch.get_default_dtype())
        total = super().reduce(tensor, group, "sum")  # type: ignore[misc]
        return total / share.count

    @override
    def on_validation_start(self) -> None:
        self._buffers_of_last_step()
        super().on_validation_start()  # type: ignore[misc]

    @override
    def on_train_end(self) -> None:
        self._buffers_of_last_step()
        super().on_train_end()  # type: ignore[misc]

    def _buffers_of_last_step(self) -> None:
        if self._joined is not None:
            self._weigh_logs(None)
            self._share = None
            if isinstance(self.model, SyncedDataParallel):
                self.model.buffer_source = self._last_first

    @override
    def teardown(self) -> None:
        if self._joined is not None and self.lightning_module is not None:
            self._weigh_logs(None)
        self._joined, self._joined_at, self._share, self._window = None, -1, None, ()
        self._window_closed, self._last_first = False, 0
        super().teardown()  # type: ignore[misc]
