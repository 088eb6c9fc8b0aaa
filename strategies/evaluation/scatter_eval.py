"""Scatter-based evaluation for :class:`strategies.custom_ddp.CustomDDPStrategy`: the one component.

:class:`ScatterEvaluation` is a strategy mixin (placed before ``DDPStrategy``) that owns every
strategy hook scatter evaluation needs; the shard arithmetic and the collectives are the pure
torch of :mod:`parallel.evaluation.eval_sharding` and :mod:`parallel.evaluation.metric_sync`.

- **Loaders** (``distributed_sampler_kwargs``, ``process_dataloader``, when Lightning sets loaders
  up): Lightning's injected sampler is made the identity, then rank 0 reads the sample order from
  it; the count is broadcast, every rank computes the same :class:`~parallel.evaluation.eval_sharding.ShardPlan`
  once, and rank 0 scatters the indices (never the samples). Each rank reads its own dataset object
  through a :class:`~parallel.evaluation.eval_sharding.ShardSampler`, with the user's batch size,
  ``collate_fn``, workers, pinning and transforms untouched: a step receives exactly the batch the
  user's loader would give it (a ``batch_size=None`` loader's items are its batches: the items are sharded).
  Loaders that cannot be re-sharded by index (an ``IterableDataset``, a sampler of the user's own or none
  injected (``use_distributed_sampler=False``: the user shards), a custom batch sampler, an iterable that is no
  ``DataLoader``) are used as Lightning's ``ddp`` uses them, with a warning: the identity sampler injected into
  them shards as ``ddp``'s (strided, padded); their lengths may differ per rank (see **Runs**).
- **Runs** (``on_validation_start``/``on_test_start`` ... ``on_*_end`` and ``teardown``): one
  :class:`_EvaluationRun` per validation/test/sanity run counts this rank's steps against the
  Trainer's own per-rank batch counts and hands the torchmetrics of the module and of the callbacks
  to :class:`parallel.evaluation.metric_sync.MetricSync`: exact dataset values, merged after the rank's last
  step of each loader.
- **reduce**: inside a step a ``self.log(..., on_step=True, sync_dist=True)`` value stays this
  rank's own (ranks run different numbers of steps: a per-step collective would pair with another
  rank's epoch-end one); epoch values are reduced as usual, integer means as floats.

A plan whose contiguous split leaves some rank without a batch (fewer samples than ranks, a
``limit_*_batches`` fraction rounding a shard to zero batches) falls back to
``DistributedSampler``'s padded layout with a warning. A run with a loader of unknown length (an
iterable whose length differs per rank) keeps its step values local the same way and leaves the
metrics' own sync alone (at ``compute()``, where every rank meets): every rank evaluates what it has,
and epoch values and metrics are those of one process over the union.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.utils.data import DistributedSampler
from torchmetrics import Metric
from typing_extensions import override

from parallel.evaluation.eval_sharding import ShardPlan, ShardSampler, broadcast_count, scatter_shard_indices
from parallel.evaluation.metric_sync import MetricSync
from strategies.loaders import index_batching, loader_samplers, with_sampler
from strategies.options import is_mean_op

__all__ = ["ScatterEvaluation", "shard_loader"]

_FALLBACK = "pass CustomDDPStrategy(scatter_eval=False) to keep Lightning's DistributedSampler"
_EVAL_STAGES = (RunningStage.VALIDATING, RunningStage.TESTING, RunningStage.SANITY_CHECKING)


def _batching(dataloader: object) -> tuple[int | None, bool] | str:
    """``(batch_size, drop_last)`` of a loader that can be re-sharded by index, else why not; ``batch_size`` is
    ``None`` for a ``batch_size=None`` loader (its items are the steps' batches: they are sharded as they are)."""
    sampler = getattr(dataloader, "sampler", None)
    if isinstance(sampler, DistributedSampler) and sampler.num_replicas != 1:
        return "sharded by a DistributedSampler of your own"
    batching = index_batching(dataloader, unbatched=True)
    if not isinstance(batching, str) and not isinstance(sampler, DistributedSampler):
        # Lightning injects one (the identity) unless told not to
        return f"sampled by a {type(sampler).__name__} of your own (use_distributed_sampler=False)"
    return batching


def _shard_as_ddp(dataloader: object) -> bool:
    """Make the identity sampler Lightning injected into a loader that is not scattered shard it as under ``ddp``
    (strided, padded to equal lengths; in place, whoever holds it: the loader or a batch sampler of the user's own).
    Without this every rank would evaluate the whole set. Whether there was one."""
    injected = [
        sampler
        for sampler in loader_samplers(dataloader)
        if isinstance(sampler, DistributedSampler) and sampler.num_replicas == 1
    ]
    world_size, rank = (dist.get_world_size(), dist.get_rank()) if injected else (1, 0)
    for sampler in injected:  # DistributedSampler.__init__'s arithmetic for these replicas
        length = len(sampler.dataset)  # type: ignore[arg-type]
        per_rank = length // world_size if sampler.drop_last else math.ceil(length / world_size)
        sampler.num_replicas, sampler.rank = world_size, rank
        sampler.num_samples, sampler.total_size = per_rank, per_rank * world_size
    return bool(injected)


def _warn_fallback(plan: ShardPlan, batch_size: int, limit: int | float) -> None:
    rank_zero_warn(
        f"custom_ddp: {plan.num_samples} evaluation samples in batches of {batch_size} with limit "
        f"{limit!r} give per-rank batch counts {list(plan.contiguous_batches)}; a rank without a batch "
        "would skip the collectives of the others, so this loader uses DistributedSampler's padded "
        "layout (some samples count twice, as with Lightning's ddp). Use more samples, a smaller batch "
        "size or an int limit to keep each sample once."
    )


def shard_loader(dataloader: object, trainer: pl.Trainer, *, device: torch.device) -> object:
    """This rank's shard of an evaluation ``dataloader`` (see the module docstring). Two collectives."""
    batching = _batching(dataloader)
    if isinstance(batching, str):
        how = (
            "sharded by Lightning's DistributedSampler, padded with repeats, as under ddp"
            if _shard_as_ddp(dataloader)
            else "used as it is, as Lightning's ddp uses it"
        )
        rank_zero_warn(
            f"custom_ddp: an evaluation loader is {batching}: it is {how}, without scatter evaluation; "
            "metrics are exact only if it covers each sample once over all ranks."
        )
        return dataloader
    order = list(dataloader.sampler) if dist.get_rank() == 0 else None  # the identity sampler: the full order
    num_samples = broadcast_count(None if order is None else len(order), device=device)
    limit = trainer.limit_test_batches if trainer.testing else trainer.limit_val_batches
    batch_size, drop_last = batching[0] or 1, batching[1]  # unbatched: one item per step
    plan = ShardPlan.decide(num_samples, dist.get_world_size(), batch_size=batch_size, drop_last=drop_last, limit=limit)
    if plan.layout != "contiguous":
        _warn_fallback(plan, batch_size, limit)
    indices = scatter_shard_indices(None if order is None else plan.shards(order), plan.lengths, device=device)
    return with_sampler(dataloader, ShardSampler(indices), batching, "evaluation loader", _FALLBACK)


def _metrics(trainer: pl.Trainer, module: pl.LightningModule) -> list[Metric]:
    """The torchmetrics of the module, then of the callbacks (their attributes), in a rank-independent order."""
    owners = [module] + [
        value
        for callback in trainer.callbacks
        for value in getattr(callback, "__dict__", {}).values()
        if isinstance(value, torch.nn.Module)
    ]
    return [metric for owner in owners for metric in owner.modules() if isinstance(metric, Metric)]


class _EvaluationRun:
    """One validation/test/sanity run: its step count and, when every loader's length is known, its metrics'
    deferred sync. ``loader_ends`` ``None``: some loader's length is unknown (an iterable), so no step is known
    to be a rank's last; the metrics keep their own sync at ``compute()``, where every rank meets."""

    def __init__(self, loader_ends: list[int] | None, metrics: list[Metric], device: torch.device) -> None:
        self._loader_ends = loader_ends  # cumulative step counts at which this rank's loaders end
        self._steps = 0
        self.in_step = False
        self._metric_sync = None if loader_ends is None else MetricSync(device=device)
        if self._metric_sync is not None:
            self._metric_sync.begin(metrics)
            self._metric_sync.set_ready(0 in loader_ends)  # a loader with no batch on any rank

    def step(self, step: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run one step; the metrics may merge only after a loader's last one."""
        if self._metric_sync is not None:
            self._metric_sync.set_ready(False)
        self.in_step = True
        try:
            output = step(*args, **kwargs)
            self._steps += 1  # not on StopIteration: a ``dataloader_iter`` step that found no batch
            return output
        finally:
            self.in_step = False
            if self._metric_sync is not None:
                self._metric_sync.set_ready(self._steps in self._loader_ends)

    def end(self) -> None:
        """Give the metrics their own sync back."""
        if self._metric_sync is not None:
            self._metric_sync.end()


class ScatterEvaluation:
    """Strategy hooks of scatter evaluation; mix in before ``DDPStrategy``.

    Reads the strategy's ``options.scatter_eval``.
    """

    options: Any  # the strategy's CustomDDPOptions
    _collective_device: torch.device  # the strategy's: CPU for gloo, the rank's device for NCCL
    _evaluation_run: _EvaluationRun | None = None  # between on_*_start and on_*_end of a scattered run

    @property
    def _trainer(self) -> pl.Trainer | None:
        module = self.lightning_module
        return None if module is None else module._trainer

    def _scatters(self) -> bool:
        """Whether the evaluation loaders being set up now, and their run, are scattered."""
        trainer = self._trainer
        return (
            self.options.scatter_eval
            and trainer is not None
            and trainer.world_size > 1
            and trainer.state.stage in _EVAL_STAGES
        )

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Evaluation loaders are sharded by the scatter: let the sampler Lightning injects be the
        # identity (full dataset, no padding duplicates, no "use devices=1" warning).
        if self._scatters():
            return {"num_replicas": 1, "rank": 0}
        return super().distributed_sampler_kwargs

    @override
    def process_dataloader(self, dataloader: object) -> object:
        if not self._scatters():
            return dataloader
        return shard_loader(dataloader, self._trainer, device=self._collective_device)

    def _start_run(self) -> None:
        self._end_run()
        trainer = self._trainer
        if not self._scatters():
            return
        if trainer.sanity_checking:
            batches = trainer.num_sanity_val_batches
        else:
            batches = trainer.num_test_batches if trainer.testing else trainer.num_val_batches
        known = all(math.isfinite(n) for n in batches)  # else no step is known to be a rank's last
        loader_ends = list(itertools.accumulate(int(n) for n in batches)) if known else None
        self._evaluation_run = _EvaluationRun(
            loader_ends, _metrics(trainer, self.lightning_module), self._collective_device
        )

    def _end_run(self) -> None:
        if self._evaluation_run is not None:
            self._evaluation_run.end()
        self._evaluation_run = None

    def _step(self, step: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        run = self._evaluation_run
        return step(*args, **kwargs) if run is None else run.step(step, *args, **kwargs)

    @override
    def on_validation_start(self) -> None:
        self._start_run()

    @override
    def on_test_start(self) -> None:
        self._start_run()

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._step(super().validation_step, *args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._step(super().test_step, *args, **kwargs)

    @override
    def on_validation_end(self) -> None:
        self._end_run()

    @override
    def on_test_end(self) -> None:
        self._end_run()

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any | None = "mean") -> Any:
        if self._evaluation_run is not None and self._evaluation_run.in_step:
            return tensor  # a step value stays this rank's own; see the module docstring
        # Lightning averages an integer tensor in its own dtype, truncating: ``self.log(...,
        # sync_dist=True)`` divides the synced value sum by the synced (int) ``cumulated_batch_size``,
        # so 6 + 5 samples on 2 ranks give a mean count of 5, not 5.5, and a 10% wrong epoch value.
        # ddp's equal padded shards never show it; uneven evaluation shards do. Average as floats.
        if (
            isinstance(tensor, torch.Tensor)
            and is_mean_op(reduce_op)
            and not (tensor.is_floating_point() or tensor.is_complex())
        ):
            tensor = tensor.to(torch.get_default_dtype())
        return super().reduce(tensor, group, reduce_op)

    @override
    def teardown(self) -> None:
        self._end_run()
        super().teardown()
