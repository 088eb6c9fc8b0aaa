"""An evaluation pattern with uneven data per rank, for the evaluation conformance table.

Rank 0 evaluates 7 samples and rank 1 the other 4, from loaders the module shards itself (run with
``use_distributed_sampler=False``): a map-style ``DataLoader`` per rank, or an ``IterableDataset`` per
rank. One process evaluates the 11. Each validation step updates a torchmetrics accuracy and logs the
loss with ``sync_dist=True`` on step and epoch: under ``ddp`` the per-step sync of a rank with more
batches pairs with nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
import torchmetrics
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

__all__ = ["RANK_SAMPLES", "UnevenShards"]

RANK_SAMPLES = (7, 4)  # samples of rank 0, rank 1; one process evaluates all of them
CLASSES = 4


class _Samples(IterableDataset):
    def __init__(self, samples: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.samples = samples

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return iter(self.samples)


class UnevenShards(pl.LightningModule):
    """A linear classifier evaluated on 7 + 4 samples (``iterable``: through an ``IterableDataset``)."""

    def __init__(self, iterable: bool = False) -> None:
        super().__init__()
        self.iterable = iterable
        torch.manual_seed(0)
        self.net = torch.nn.Linear(3, CLASSES)
        generator = torch.Generator().manual_seed(1)
        self.inputs = torch.randn(sum(RANK_SAMPLES), 3, generator=generator)
        self.labels = torch.randint(0, CLASSES, (sum(RANK_SAMPLES),), generator=generator)
        self.accuracy = torchmetrics.Accuracy(task="multiclass", num_classes=CLASSES)

    def val_dataloader(self) -> DataLoader:
        if self.trainer.world_size == 1:
            rows = slice(None)
        else:
            start = sum(RANK_SAMPLES[: self.trainer.global_rank])
            rows = slice(start, start + RANK_SAMPLES[self.trainer.global_rank])
        inputs, labels = self.inputs[rows], self.labels[rows]
        data = _Samples(list(zip(inputs, labels, strict=True))) if self.iterable else TensorDataset(inputs, labels)
        return DataLoader(data, batch_size=2)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        inputs, labels = batch
        logits = self.net(inputs)
        self.accuracy(logits, labels)
        self.log("loss", F.cross_entropy(logits, labels), on_step=True, on_epoch=True, sync_dist=True)
        self.log("accuracy", self.accuracy)
