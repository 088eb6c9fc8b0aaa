"""The base of the training patterns (:mod:`conformance.training.patterns`): a regression every pattern
changes one thing of, and its data.

Each pattern is a small :class:`TrainingPattern` (a LightningModule) trained on 32 fixed samples.
The data is sharded by hand (run with ``use_distributed_sampler=False``): rank r of W trains on
samples r, r+W, ... in batches of 4, and one process trains on batches of 4 * W, so global batch t
of the ranks is batch t of one process. ``truth`` names what a pattern's result is defined by: one
process on the global batch, or Lightning's ``ddp`` where the per-rank state is part of the
semantics (buffers updated from each rank's own data, local BatchNorm), or, for a pattern that is
interrupted after ``resume_after_steps`` optimizer steps and resumed from the checkpoint written
there, the same strategy's uninterrupted fit. ``ddp_options`` / ``custom_options`` are strategy
arguments; ``ddp_options = None``: ``ddp`` cannot run the pattern. The modules know nothing about the
strategy.
"""

from __future__ import annotations

from typing import Any, ClassVar

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

__all__ = ["BATCH_SIZE", "FEATURES", "NUM_SAMPLES", "OUTPUTS", "TrainingPattern", "WORLD_SIZE", "mlp"]

WORLD_SIZE = 2
NUM_SAMPLES, BATCH_SIZE, FEATURES, OUTPUTS = 32, 4, 6, 3


def mlp(batchnorm: bool = False) -> nn.Sequential:
    norm = nn.BatchNorm1d(8) if batchnorm else nn.Identity()
    return nn.Sequential(nn.Linear(FEATURES, 8), norm, nn.Tanh(), nn.Linear(8, OUTPUTS))


class TrainingPattern(pl.LightningModule):
    """Regression with an MLP and momentum SGD; subclasses change one thing each."""

    label: ClassVar[str] = "plain MLP, SGD"
    truth: ClassVar[str] = "one_process"
    max_epochs: ClassVar[int] = 1
    trainer_options: ClassVar[dict[str, Any]] = {}
    ddp_options: ClassVar[dict[str, Any] | None] = {}
    custom_options: ClassVar[dict[str, Any]] = {}
    timeout_s: ClassVar[float] = 60.0  # the strategies' collective timeout: how long a hang lasts
    # Runs torch.compile: kept out of the default test run (a rank's first compile takes 10-60 s), and its
    # one-process fit runs in a forked child too (conformance.training.runs).
    compiles: ClassVar[bool] = False
    resume_after_steps: ClassVar[int | None] = (
        None  # interrupted there, resumed from its checkpoint (truth: uninterrupted)
    )

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = self.build()
        generator = torch.Generator().manual_seed(1)
        self.inputs = torch.randn(NUM_SAMPLES, FEATURES, generator=generator)
        self.targets = torch.randn(NUM_SAMPLES, OUTPUTS, generator=generator)
        self.records: dict[str, list[Any]] = {}  # saved with the final state, per rank

    def build(self) -> nn.Module:
        return mlp()

    def callbacks(self) -> list[pl.Callback]:
        return []

    def fit_argument(self) -> nn.Module:
        """What ``trainer.fit`` is given: this module, or a wrapper of it (``torch.compile(self)``)."""
        return self

    def loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.net(inputs), targets)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.loss(*batch)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    def train_dataloader(self) -> DataLoader:
        rank, world_size = self.trainer.global_rank, self.trainer.world_size
        samples = list(zip(self.inputs, self.targets, strict=True))[rank::world_size]
        return DataLoader(samples, batch_size=BATCH_SIZE * WORLD_SIZE // world_size)
