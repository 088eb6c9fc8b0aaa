"""Training patterns with uneven data per rank (:mod:`conformance.training.patterns`): each rank's
``IterableDataset`` yields its own number of batches, as streaming data does (or each rank's own
map-style ``DataLoader``, whose lengths are known).

Batch ``t`` of rank ``r`` is the ``(t * WORLD_SIZE + r)``-th run of ``BATCH_SIZE`` samples; one process
trains, at step ``t``, on the union of the batches ``t`` of the ranks that have one (in rank order). The
truth is that process: every step's gradient is the mean over the samples trained in it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, ClassVar

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset

from conformance.training.base import BATCH_SIZE, WORLD_SIZE, TrainingPattern, mlp

__all__ = ["UNEVEN_PATTERNS", "UnevenTraining"]


class _Batches(IterableDataset):
    """Pre-made batches, yielded as they are (``DataLoader(batch_size=None)``)."""

    def __init__(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.batches = batches

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return iter(self.batches)


def _logged(trainer: pl.Trainer, name: str) -> torch.Tensor:
    """The value logged as ``name``; NaN where nothing was (a rank that ran no step under ddp, a manual step)."""
    return trainer.callback_metrics.get(name, torch.tensor(float("nan"))).clone()


class UnevenTraining(TrainingPattern):
    """Rank ``r`` trains ``lengths[r]`` batches per epoch; the weights after every step are recorded."""

    label = "uneven iterable data: 4 + 2 batches per rank"
    lengths: ClassVar[tuple[int, ...]] = (4, 2)
    iterable: ClassVar[bool] = True  # else a map-style DataLoader per rank: lengths known, no per-step exchange
    timeout_s = 10.0  # ddp waits in a collective no peer joins: the timeout ends it

    def _batch(self, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = (step * WORLD_SIZE + rank) * BATCH_SIZE
        return self.inputs[start : start + BATCH_SIZE], self.targets[start : start + BATCH_SIZE]

    def train_dataloader(self) -> DataLoader:
        if self.trainer.world_size == 1:  # the truth: the union of the ranks' batches of each step
            batches = [
                tuple(torch.cat(part) for part in zip(*parts, strict=True))
                for step in range(max(self.lengths))
                if (parts := [self._batch(step, r) for r, n in enumerate(self.lengths) if step < n])
            ]
        else:
            rank = self.trainer.global_rank
            batches = [self._batch(step, rank) for step in range(self.lengths[rank])]
        return DataLoader(_Batches(batches) if self.iterable else batches, batch_size=None)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.loss(*batch)
        self.log("train_loss", loss, on_step=False, on_epoch=True, sync_dist=True)
        self.log("step_loss", loss, on_step=True, on_epoch=False, sync_dist=True)
        return loss

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.records.setdefault("weights", []).append(
            {name: p.detach().clone() for name, p in self.net.named_parameters()}
        )
        self.records.setdefault("step_loss", []).append(_logged(self.trainer, "step_loss"))

    def on_train_epoch_end(self) -> None:
        self.records.setdefault("train_loss", []).append(_logged(self.trainer, "train_loss"))


class UnevenRankZeroEndsFirst(UnevenTraining):
    label = "uneven iterable data: 2 + 4 batches per rank, BatchNorm1d (synced by custom_ddp)"
    lengths = (2, 4)

    def build(self) -> nn.Module:
        return mlp(batchnorm=True)


class UnevenMapStyle(UnevenTraining):
    label = "uneven map-style data (a DataLoader per rank, use_distributed_sampler=False): 4 + 2 batches"
    iterable = False


class UnevenRankWithoutData(UnevenTraining):
    label = "uneven iterable data: 3 + 0 batches per rank, accumulate_grad_batches=2"
    lengths = (3, 0)
    trainer_options = {"accumulate_grad_batches": 2}


UNEVEN_PATTERNS: dict[str, type[TrainingPattern]] = {
    "uneven_4_2": UnevenTraining,
    "uneven_map_style_4_2": UnevenMapStyle,
    "uneven_2_4_batchnorm": UnevenRankZeroEndsFirst,
    "uneven_3_0_accumulate": UnevenRankWithoutData,
}
