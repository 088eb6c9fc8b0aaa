"""Fine-tuning recipes (:mod:`conformance.training.patterns`): layers frozen at setup and unfrozen mid-fit, in a
hook, inside ``training_step`` or by Lightning's ``BackboneFinetuning``, and frozen again. A parameter that
starts training after setup must be averaged from its first step, as under ``ddp``. A BatchNorm backbone frozen
through its own name (``self.backbone``, also inside ``self.net``) must be frozen in the layer that runs.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import BackboneFinetuning, BaseFinetuning
from torch import nn

from conformance.training.base import TrainingPattern, mlp

__all__ = [
    "BackboneUnfreeze",
    "BatchNormBackboneInEval",
    "BatchNormBackboneUnfreeze",
    "BatchNormFoundByClass",
    "FreezeAgain",
    "UnfreezeInHook",
    "UnfreezeInTrainingStep",
]


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


class _FreezeBackboneWithItsBatchNorm(BaseFinetuning):
    """The ``BaseFinetuning`` recipe of Lightning's docs, with the backbone's BatchNorm statistics frozen too."""

    def freeze_before_training(self, pl_module: pl.LightningModule) -> None:
        self.freeze(pl_module.backbone, train_bn=False)  # also track_running_stats=False: batch statistics only

    def finetune_function(self, pl_module: pl.LightningModule, epoch: int, optimizer: torch.optim.Optimizer) -> None:
        if epoch == 1:
            self.unfreeze_and_add_param_group(pl_module.backbone, optimizer, lr=0.05, train_bn=True)


class BatchNormBackboneUnfreeze(BackboneUnfreeze):
    label = (
        "BaseFinetuning of a Linear + BatchNorm1d backbone (self.backbone = self.net[:2]): frozen with "
        "train_bn=False (no running statistics) in epoch 0, unfrozen from epoch 1"
    )
    ddp_options = None  # the batch statistics must be global: torch's SyncBatchNorm is CUDA-only

    def __init__(self) -> None:
        TrainingPattern.__init__(self)
        self.backbone, self.head = self.net[:2], self.net[3]

    def build(self) -> nn.Module:
        return mlp(batchnorm=True)

    def callbacks(self) -> list[pl.Callback]:
        return [_FreezeBackboneWithItsBatchNorm()]


class BatchNormBackboneInEval(TrainingPattern):
    label = (
        "a Linear + BatchNorm1d backbone (self.backbone = self.net[:2]) frozen: requires_grad_(False) at setup, "
        "self.backbone.eval() in on_train_epoch_start"
    )
    max_epochs = 2

    def __init__(self) -> None:
        super().__init__()
        self.backbone = self.net[:2]
        self.backbone.requires_grad_(False)

    def build(self) -> nn.Module:
        return mlp(batchnorm=True)

    def on_train_epoch_start(self) -> None:
        self.backbone.eval()  # running statistics, no batch statistics: ddp needs no SyncBatchNorm here

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(filter(lambda p: p.requires_grad, self.parameters()), lr=0.1, momentum=0.9)


class BatchNormFoundByClass(TrainingPattern):
    label = (
        "BatchNorm1d found by isinstance(m, nn.BatchNorm1d): left out of weight decay in configure_optimizers, "
        "put in eval mode in on_train_epoch_start"
    )
    max_epochs = 2

    def build(self) -> nn.Module:
        return mlp(batchnorm=True)

    def _batch_norms(self) -> list[nn.Module]:
        return [m for m in self.modules() if isinstance(m, nn.BatchNorm1d)]

    def on_train_epoch_start(self) -> None:
        for layer in self._batch_norms():  # running statistics only: ddp needs no SyncBatchNorm here
            layer.eval()

    def configure_optimizers(self) -> Any:
        no_decay = {id(p) for layer in self._batch_norms() for p in layer.parameters()}
        groups = [
            {"params": [p for p in self.parameters() if id(p) not in no_decay], "weight_decay": 0.1},
            {"params": [p for p in self.parameters() if id(p) in no_decay], "weight_decay": 0.0},
        ]
        return torch.optim.SGD(groups, lr=0.1, momentum=0.9)
