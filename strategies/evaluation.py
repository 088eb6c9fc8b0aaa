"""Lightning-side glue of scatter-based evaluation, used by :class:`strategies.custom_ddp.CustomDDPStrategy`.

Two jobs, both driven from strategy hooks:

- :meth:`ScatteredEvaluation.loader` turns an evaluation ``DataLoader`` into one over this rank's
  shard from :func:`parallel.eval_sharding.scatter_shards` (rank 0 materialises the samples in
  the loader's sampler order). Same batch size and collate function; nothing is dropped.
- :meth:`~ScatteredEvaluation.begin` / :meth:`~ScatteredEvaluation.after_step` /
  :meth:`~ScatteredEvaluation.end` run :class:`parallel.metric_reduction.EpochMetricReducer`
  over the LightningModule's torchmetrics: compute-time sync off for the run, one all-reduce
  after the rank's last step of each loader. The step count comes from the Trainer's own
  per-rank batch counts (``num_val_batches`` etc.), so a rank with fewer batches reduces
  earlier but exactly as often as its peers.

Limitations: metrics must be updated in ``validation_step``/``test_step`` (not in batch-end
hooks), steps that take ``dataloader_iter`` are not supported, and every rank needs at least
one batch of every loader (guaranteed when the dataset has at least ``world_size`` samples
and no ``limit_*_batches`` fraction rounds a shard down to zero).
"""

from __future__ import annotations

import itertools

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from parallel.metric_reduction import EpochMetricReducer, stateful_metrics
from parallel.eval_sharding import materialize, scatter_shards

__all__ = ["ScatteredEvaluation"]

_FALLBACK = "pass CustomDDPStrategy(scatter_eval=False) to keep Lightning's DistributedSampler"


class ScatteredEvaluation:
    """Per-rank evaluation loaders and once-per-epoch exact metric reduction."""

    def __init__(self) -> None:
        self._reducer = EpochMetricReducer()
        self._loader_ends: list[int] = []  # cumulative step counts at which this rank's loaders end
        self._steps = 0

    def loader(self, dataloader: object, *, is_source: bool, world_size: int, device: torch.device) -> DataLoader:
        """This rank's shard of ``dataloader``'s samples, batched like ``dataloader``. A collective."""
        if not isinstance(dataloader, DataLoader) or isinstance(dataloader.dataset, IterableDataset):
            raise TypeError(f"scatter evaluation needs a map-style torch DataLoader, got {type(dataloader).__name__}; "
                            f"use one or {_FALLBACK}")
        if dataloader.batch_size is None:
            raise ValueError("scatter evaluation re-batches the shard and needs DataLoader(batch_size=...), not a "
                             f"batch_sampler; or {_FALLBACK}")
        fields = None
        if is_source:
            fields = materialize(dataloader.dataset, list(dataloader.sampler), num_workers=dataloader.num_workers)
        shard = scatter_shards(fields, device=device)
        if shard.num_samples < world_size:  # every rank knows num_samples: all raise together
            raise ValueError(f"the evaluation set has {shard.num_samples} samples for {world_size} ranks; scatter "
                             f"evaluation needs at least one per rank: use fewer devices or {_FALLBACK}")
        return DataLoader(
            TensorDataset(*(field.cpu() for field in shard.fields)),
            batch_size=dataloader.batch_size,
            collate_fn=dataloader.collate_fn,
            pin_memory=dataloader.pin_memory,
        )

    def begin(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        """Evaluation run starts (after its loaders are set up): track the module's metrics."""
        if trainer.sanity_checking:
            batches = trainer.num_sanity_val_batches
        else:
            batches = trainer.num_test_batches if trainer.testing else trainer.num_val_batches
        self._loader_ends = list(itertools.accumulate(int(n) for n in batches))
        self._steps = 0
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
