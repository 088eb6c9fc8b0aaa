"""Lightning-side glue of scatter-based evaluation, used by :class:`strategies.custom_ddp.CustomDDPStrategy`.

Two jobs, both driven from strategy hooks:

- :meth:`ScatteredEvaluation.loader` gives an evaluation ``DataLoader`` this rank's shard: rank
  0 reads the sample order from the loader's sampler, and the indices (never the samples) are
  scattered by :mod:`parallel.eval_sharding`. Each rank then reads its own dataset object through
  a :class:`~parallel.eval_sharding.ShardSampler`, with the user's batch size, ``collate_fn``,
  workers, pinning and transforms untouched: a step receives exactly the batch the user's loader
  would give it.
- :meth:`~ScatteredEvaluation.begin` / :meth:`~ScatteredEvaluation.after_step` /
  :meth:`~ScatteredEvaluation.end` run :class:`parallel.metric_reduction.EpochMetricReducer`
  over the LightningModule's torchmetrics: compute-time sync off for the run, one all-reduce
  after the rank's last step of each loader. The step count comes from the Trainer's own
  per-rank batch counts (``num_val_batches`` etc.), so a rank with fewer batches reduces
  earlier but exactly as often as its peers.

Every rank must run at least one batch of a loader or none does: a rank with no batch skips the
loop and its collectives. When contiguous shards cannot promise that (fewer samples than ranks,
or a ``limit_*_batches`` fraction that rounds one rank down to zero batches), the loader falls
back to ``DistributedSampler``'s layout (equal shards padded with repeats, as Lightning's ``ddp``
does) with a warning. ``IterableDataset`` loaders are left as Lightning made them (it does not
shard them either). Metrics must be updated in ``validation_step``/``test_step``, and steps that
take ``dataloader_iter`` are not supported.
"""

from __future__ import annotations

import itertools
import math

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset

from parallel.eval_sharding import Layout, ShardSampler, broadcast_count, make_shards, scatter_shard_indices, \
    shard_lengths
from parallel.metric_reduction import EpochMetricReducer, stateful_metrics

__all__ = ["ScatteredEvaluation"]

_FALLBACK = "pass CustomDDPStrategy(scatter_eval=False) to keep Lightning's DistributedSampler"
# DataLoader settings carried over to the shard loader unchanged (all but dataset/batching/sampling).
_KEPT_LOADER_ARGS = ("num_workers", "collate_fn", "pin_memory", "drop_last", "timeout", "worker_init_fn",
                     "multiprocessing_context", "generator", "prefetch_factor", "persistent_workers",
                     "pin_memory_device", "in_order")


def _limited_batches(num_batches: int, limit: int | float) -> int:
    """What Lightning makes of ``limit_{val,test}_batches`` for one rank's batch count."""
    return min(num_batches, limit) if isinstance(limit, int) else int(num_batches * limit)


def _choose_layout(num_samples: int, world_size: int, loader: DataLoader, limit: int | float) -> Layout:
    """``contiguous`` unless some rank would run no batch while another runs some (then ``strided_padded``)."""
    rounding = math.floor if loader.drop_last else math.ceil
    lengths = shard_lengths(num_samples, world_size)
    batches = [_limited_batches(rounding(n / loader.batch_size), limit) for n in lengths]
    if all(b > 0 for b in batches) or not any(batches):
        return "contiguous"
    rank_zero_warn(f"custom_ddp: {num_samples} evaluation samples in batches of {loader.batch_size} with limit "
                   f"{limit!r} give per-rank batch counts {batches}; a rank without a batch would skip the "
                   "collectives of the others, so this loader uses DistributedSampler's padded layout (some "
                   "samples count twice, as with Lightning's ddp). Use more samples, a smaller batch size or an "
                   "int limit to keep each sample once.")
    return "strided_padded"


def _unsupported(dataloader: object) -> str | None:
    """Why ``dataloader`` cannot be re-sharded by index (``None`` if it can)."""
    if not isinstance(dataloader, DataLoader):
        return f"scatter evaluation needs a torch DataLoader, got {type(dataloader).__name__}"
    if isinstance(dataloader.dataset, IterableDataset):
        return "iterable"
    if dataloader.batch_size is None:
        return ("scatter evaluation re-batches each rank's shard and needs DataLoader(batch_size=...), not a "
                "custom batch_sampler")
    sampler = dataloader.sampler
    if isinstance(sampler, DistributedSampler) and sampler.num_replicas != 1:
        return "user-sharded"
    return None


def _shard_loader(dataloader: DataLoader, indices: list[int]) -> DataLoader:
    """``dataloader`` reading only ``indices`` of its dataset, every other setting kept."""
    kept = {name: getattr(dataloader, name) for name in _KEPT_LOADER_ARGS if hasattr(dataloader, name)}
    if type(dataloader) is not DataLoader:
        rank_zero_warn(f"custom_ddp: the evaluation loader of class {type(dataloader).__name__} is rebuilt as a "
                       f"torch DataLoader over this rank's shard (same settings); {_FALLBACK} if the subclass "
                       "changes iteration.")
    return DataLoader(dataloader.dataset, batch_size=dataloader.batch_size, sampler=ShardSampler(indices), **kept)


class ScatteredEvaluation:
    """Per-rank evaluation loaders and once-per-epoch exact metric reduction."""

    def __init__(self) -> None:
        self._reducer = EpochMetricReducer()
        self._loader_ends: list[int] = []  # cumulative step counts at which this rank's loaders end
        self._steps = 0

    def loader(self, dataloader: object, trainer: pl.Trainer, *, device: torch.device) -> object:
        """This rank's shard of ``dataloader`` (see the module docstring). Two collectives."""
        reason = _unsupported(dataloader)
        if reason in ("iterable", "user-sharded"):
            rank_zero_warn(f"custom_ddp: an evaluation loader is {reason} (an IterableDataset, or a DistributedSampler "
                           "of your own): it is used as it is, without scatter evaluation; metrics are exact only "
                           "if your sharding covers each sample once.")
            return dataloader
        if reason is not None:
            raise TypeError(f"{reason}; {_FALLBACK}")
        rank, world_size = dist.get_rank(), dist.get_world_size()
        order = list(dataloader.sampler) if rank == 0 else None  # Lightning's 1-replica sampler: the full order
        num_samples = broadcast_count(None if order is None else len(order), device=device)
        limit = trainer.limit_test_batches if trainer.testing else trainer.limit_val_batches
        layout = _choose_layout(num_samples, world_size, dataloader, limit)
        lengths = shard_lengths(num_samples, world_size, layout)
        shards = None if order is None else make_shards(order, world_size, layout)
        return _shard_loader(dataloader, scatter_shard_indices(shards, lengths, device=device))

    def begin(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        """Evaluation run starts (after its loaders are set up): track the module's metrics."""
        if trainer.sanity_checking:
            batches = trainer.num_sanity_val_batches
        else:
            batches = trainer.num_test_batches if trainer.testing else trainer.num_val_batches
        self._steps = 0
        if not all(math.isfinite(n) for n in batches):
            # An IterableDataset loader of unknown length: no step is known to be a rank's last,
            # so the metrics keep their own compute-time sync (as under Lightning's ddp).
            self._loader_ends = []
            return
        self._loader_ends = list(itertools.accumulate(int(n) for n in batches))
        self._reducer.begin(stateful_metrics(module))

    def after_step(self) -> None:
        """After every evaluation step: reduce the metrics once this rank's loader is done."""
        if not self._reducer.active:
            return
        self._steps += 1
        if self._steps in self._loader_ends:
            self._reducer.reduce()

    def end(self) -> None:
        """Evaluation run ends: give the metrics their own sync back."""
        self._reducer.end()
