"""Fine-tuning recipes (:mod:`conformance.training.patterns`): layers frozen at setup and unfrozen mid-fit, in a
hook, inside ``training_step`` or by Lightning's ``BackboneFinetuning``, and frozen again. A parameter that
starts training after setup must be averaged from its first step, as under ``ddp``.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import BackboneFinetuning
from torch import nn

from conformance.training.base import TrainingPattern, mlp

__all__ = ["BackboneUnfreeze", "FreezeAgain", "UnfreezeInHook", "UnfreezeInTrainingStep"]


class UnfreezeInHook(TrainingPattern):
    label = "first layer frozen, requires_grad_(True) in on_train_epoch_start of epoch 1"
    max_epochs = 2

    def build(self) -> nn.Module:
        net = mlp()
        net[0].requires_grad_(False)
        return net

    def on_train_epoch_start(self) -> None:
        if self.current_epoch == 1:
            self.net[0].requires_grad_(True)


class UnfreezeInTrainingStep(UnfreezeInHook):
    label = "first layer unfrozen inside training_step (epoch 1, first batch)"

    def on_train_epoch_start(self) -> None:
        pass

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.current_epoch == 1 and batch_idx == 0:
            self.net[0].requires_grad_(True)
        return super().training_step(batch, batch_idx)


class FreezeAgain(UnfreezeInHook):
    label = "unfrozen at epoch 1, frozen again at epoch 2"
    max_epochs = 3

    def on_train_epoch_start(self) -> None:
        self.net[0].requires_grad_(self.current_epoch == 1)


class BackboneUnfreeze(TrainingPattern):
    label = "BackboneFinetuning (backbone unfrozen at epoch 1, new param group)"
    max_epochs = 2

    def __init__(self) -> None:
        super().__init__()
        self.backbone, self.head = self.net[0], self.net[3]

    def callbacks(self) -> list[pl.Callback]:
        return [BackboneFinetuning(unfreeze_backbone_at_epoch=1, backbone_initial_ratio_lr=0.5)]

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(filter(lambda p: p.requires_grad, self.parameters()), lr=0.1, momentum=0.9)
