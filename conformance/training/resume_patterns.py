"""Training patterns interrupted and resumed from a checkpoint (:mod:`conformance.training.patterns`):
their truth is the same strategy's uninterrupted fit, which a resume repeats only if it repeats every
rank's random draws.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from conformance.training.base import FEATURES, OUTPUTS, TrainingPattern

__all__ = ["DropoutResumedAtEpochEnd", "DropoutResumedMidEpoch", "WorkerNoiseResumedAtEpochEnd"]


class DropoutResumedMidEpoch(TrainingPattern):
    """Dropout, each rank its own stream: a resume repeats the fit only if it repeats every rank's draws."""

    label = "Dropout, interrupted mid-epoch (step 3 of 4) and resumed from that checkpoint"
    truth = "uninterrupted"
    max_epochs = 2
    resume_after_steps = 3

    def build(self) -> nn.Module:
        return nn.Sequential(nn.Linear(FEATURES, 8), nn.Tanh(), nn.Dropout(0.3), nn.Linear(8, OUTPUTS))

    def setup(self, stage: str) -> None:
        torch.manual_seed(10 + self.global_rank)


class DropoutResumedAtEpochEnd(DropoutResumedMidEpoch):
    label = "Dropout, interrupted after epoch 0's last step and resumed from that checkpoint"
    resume_after_steps = 4


class _NoisyReads(Dataset):
    """``samples`` with fresh noise from torch's generator at every read (a random augmentation)."""

    def __init__(self, samples: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.samples = samples

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        inputs, targets = self.samples[index]
        return inputs + 0.1 * torch.randn(inputs.shape), targets


class WorkerNoiseResumedAtEpochEnd(DropoutResumedAtEpochEnd):
    """Noise drawn in a DataLoader worker, seeded from the base seed its iterator drew from the rank's
    generator: a resume repeats it only if it makes that iterator from the interrupted fit's generator
    (which dropout has moved on from the restart's)."""

    label = "Dropout and noise drawn in a DataLoader worker, interrupted after epoch 0's last step and resumed"

    def train_dataloader(self) -> DataLoader:
        loader = super().train_dataloader()
        return DataLoader(_NoisyReads(loader.dataset), batch_size=loader.batch_size, num_workers=1)
