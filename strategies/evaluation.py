"""Lightning-side owner of scatter-based evaluation, used by :class:`strategies.custom_ddp.CustomDDPStrategy`.

:class:`ScatteredEvaluation` is the one object that decides and holds everything about it; the
strategy's hooks each delegate to it in one line:

- **Loaders** (:meth:`~ScatteredEvaluation.loader`, when Lightning sets loaders up): rank 0 reads
  the sample order from the loader's sampler, and the indices (never the samples) are scattered
  by :mod:`parallel.eval_sharding`. Each rank then reads its own dataset object through a
  :class:`~parallel.eval_sharding.ShardSampler`, with the user's batch size, ``collate_fn``,
  workers, pinning and transforms untouched: a step receives exactly the batch the user's loader
  would give it. Loaders that cannot be re-sharded by index (an ``IterableDataset``, a sampler of
  the user's own, a custom batch sampler, an iterable that is no ``DataLoader``) are used as they
  are, with a warning, as Lightning's ``ddp`` uses them.
- **Runs** (:meth:`~ScatteredEvaluation.start` ... :meth:`~ScatteredEvaluation.end`, one per
  validation/test/sanity run): decided once, at the run's start. The run counts this rank's
  steps against the Trainer's own per-rank batch counts (``num_val_batches``, ...) and hands the
  torchmetrics of the module and of the callbacks to :class:`parallel.metric_sync.MetricSync`:
  exact dataset values, merged in a few collectives after the rank's last step of each loader.
  ``in_step`` tells the strategy's ``reduce`` to keep per-step ``sync_dist`` values local.

Every rank must run at least one batch of a loader or none does: a rank with no batch skips the
loop and its collectives. When contiguous shards cannot promise that (fewer samples than ranks,
or a ``limit_*_batches`` fraction that rounds one rank down to zero batches), the loader falls
back to ``DistributedSampler``'s layout (equal shards padded with repeats, as Lightning's ``ddp``
does) with a warning. A run with a loader of unknown length leaves the metrics' own sync alone.
"""

from __future__ import annotations

import itertools
import math
from typing import Any, Callable

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, IterableDataset
from torchmetrics import Metric

from parallel.eval_sharding import Layout, ShardSampler, broadcast_count, make_shards, scatter_shard_indices, \
    shard_lengths
from parallel.metric_sync import MetricSync

__all__ = ["ScatteredEvaluation"]

_FALLBACK = "pass CustomDDPStrategy(scatter_eval=False) to keep Lightning's DistributedSampler"
_EVAL_STAGES = (RunningStage.VALIDATING, RunningStage.TESTING, RunningStage.SANITY_CHECKING)
# DataLoader settings carried over to the shard loader unchanged (all but dataset/batching/sampling).
_KEPT_LOADER_ARGS = ("num_workers", "collate_fn", "pin_memory", "timeout", "worker_init_fn",
                     "multiprocessing_context", "generator", "prefetch_factor", "persistent_workers",
                     "pin_memory_device", "in_order")


def _limited_batches(num_batches: int, limit: int | float) -> int:
    """What Lightning makes of ``limit_{val,test}_batches`` for one rank's batch count."""
    return min(num_batches, limit) if isinstance(limit, int) else int(num_batches * limit)


def _choose_layout(num_samples: int, world_size: int, batching: tuple[int, bool], limit: int | float) -> Layout:
    """``contiguous`` unless some rank would run no batch while another runs some (then ``strided_padded``)."""
    batch_size, drop_last = batching
    rounding = math.floor if drop_last else math.ceil
    lengths = shard_lengths(num_samples, world_size)
    batches = [_limited_batches(rounding(n / batch_size), limit) for n in lengths]
    if all(b > 0 for b in batches) or not any(batches):
        return "contiguous"
    rank_zero_warn(f"custom_ddp: {num_samples} evaluation samples in batches of {batch_size} with limit "
                   f"{limit!r} give per-rank batch counts {batches}; a rank without a batch would skip the "
                   "collectives of the others, so this loader uses DistributedSampler's padded layout (some "
                   "samples count twice, as with Lightning's ddp). Use more samples, a smaller batch size or an "
                   "int limit to keep each sample once.")
    return "strided_padded"


def _batching(dataloader: object) -> tuple[int, bool] | str:
    """``(batch_size, drop_last)`` of a loader that can be re-sharded by index, else why not."""
    if not isinstance(dataloader, DataLoader):
        return f"a {type(dataloader).__name__}, not a torch DataLoader"
    if isinstance(dataloader.dataset, IterableDataset):
        return "over an IterableDataset"
    if isinstance(dataloader.sampler, DistributedSampler) and dataloader.sampler.num_replicas != 1:
        return "sharded by a DistributedSampler of your own"
    if dataloader.batch_size is not None:
        return dataloader.batch_size, dataloader.drop_last
    if type(dataloader.batch_sampler) is BatchSampler:  # torch's own: its batches are re-made from the shard
        return dataloader.batch_sampler.batch_size, dataloader.batch_sampler.drop_last
    return f"batched by a {type(dataloader.batch_sampler).__name__} of your own"


def _shard_loader(dataloader: DataLoader, indices: list[int], batching: tuple[int, bool]) -> DataLoader:
    """``dataloader`` reading only ``indices`` of its dataset, every other setting kept."""
    kept = {name: getattr(dataloader, name) for name in _KEPT_LOADER_ARGS if hasattr(dataloader, name)}
    if type(dataloader) is not DataLoader:
        rank_zero_warn(f"custom_ddp: the evaluation loader of class {type(dataloader).__name__} is rebuilt as a "
                       f"torch DataLoader over this rank's shard (same settings); {_FALLBACK} if the subclass "
                       "changes iteration.")
    batch_size, drop_last = batching
    return DataLoader(dataloader.dataset, batch_size=batch_size, drop_last=drop_last,
                      sampler=ShardSampler(indices), **kept)


def _metrics(trainer: pl.Trainer, module: pl.LightningModule) -> list[Metric]:
    """The torchmetrics of the module, then of the callbacks (their attributes), in a rank-independent order."""
    owners = [module] + [value for callback in trainer.callbacks for value in getattr(callback, "__dict__", {}).values()
                         if isinstance(value, torch.nn.Module)]
    return [metric for owner in owners for metric in owner.modules() if isinstance(metric, Metric)]


class ScatteredEvaluation:
    """The owner of scatter evaluation: which loaders are sharded, and each evaluation run's state.

    Args:
        enabled: ``CustomDDPStrategy(scatter_eval=...)``; when ``False`` nothing here acts.
    """

    def __init__(self, enabled: bool = True) -> None:
        self._enabled = enabled
        self._metric_sync: MetricSync | None = None  # set for the length of a scattered run
        self._loader_ends: list[int] = []  # cumulative step counts at which this rank's loaders end
        self._steps = 0
        self._in_step = False

    @property
    def in_step(self) -> bool:
        """Inside a validation/test step of a scattered run (where nothing may communicate)."""
        return self._in_step

    def applies(self, trainer: pl.Trainer | None) -> bool:
        """Whether the evaluation loaders set up now are scattered."""
        return (self._enabled and trainer is not None and trainer.world_size > 1
                and trainer.state.stage in _EVAL_STAGES)

    def loader(self, dataloader: object, trainer: pl.Trainer, *, device: torch.device) -> object:
        """This rank's shard of ``dataloader`` (see the module docstring). Two collectives."""
        batching = _batching(dataloader)
        if isinstance(batching, str):
            rank_zero_warn(f"custom_ddp: an evaluation loader is {batching}: it is used as it is, without scatter "
                           "evaluation (as Lightning's ddp uses it); metrics are exact only if it covers each "
                           "sample once over all ranks.")
            return dataloader
        rank, world_size = dist.get_rank(), dist.get_world_size()
        order = list(dataloader.sampler) if rank == 0 else None  # Lightning's 1-replica sampler: the full order
        num_samples = broadcast_count(None if order is None else len(order), device=device)
        limit = trainer.limit_test_batches if trainer.testing else trainer.limit_val_batches
        layout = _choose_layout(num_samples, world_size, batching, limit)
        lengths = shard_lengths(num_samples, world_size, layout)
        shards = None if order is None else make_shards(order, world_size, layout)
        return _shard_loader(dataloader, scatter_shard_indices(shards, lengths, device=device), batching)

    def start(self, trainer: pl.Trainer, module: pl.LightningModule, *, device: torch.device) -> None:
        """An evaluation run starts (its loaders are set up): decide, once, whether it is scattered."""
        self.end()
        if not self.applies(trainer):
            return
        if trainer.sanity_checking:
            batches = trainer.num_sanity_val_batches
        else:
            batches = trainer.num_test_batches if trainer.testing else trainer.num_val_batches
        if not all(math.isfinite(n) for n in batches):
            # A loader of unknown length: no step is known to be a rank's last, so the metrics keep
            # their own compute-time sync (as under Lightning's ddp).
            return
        self._loader_ends = list(itertools.accumulate(int(n) for n in batches))
        self._steps = 0
        self._metric_sync = MetricSync(device=device)
        self._metric_sync.begin(_metrics(trainer, module))
        self._metric_sync.set_ready(0 in self._loader_ends)  # a loader with no batch on any rank

    def step(self, step: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run one validation/test step of the run; the metrics merge only after a loader's last one."""
        if self._metric_sync is None:
            return step(*args, **kwargs)
        self._metric_sync.set_ready(False)
        self._in_step = True
        try:
            output = step(*args, **kwargs)
            self._steps += 1  # not on StopIteration: a ``dataloader_iter`` step that found no batch
            return output
        finally:
            self._in_step = False
            self._metric_sync.set_ready(self._steps in self._loader_ends)

    def end(self) -> None:
        """The run ends: give the metrics their own sync back."""
        if self._metric_sync is not None:
            self._metric_sync.end()
        self._metric_sync = None
