"""Training patterns Lightning users write every day, for the training conformance table and its tests.

Each is a :class:`~conformance.training.base.TrainingPattern` that changes one thing of a small
regression (:mod:`conformance.training.base` says how the data is sharded and what ``truth`` means);
the resumed ones are in :mod:`conformance.training.resume_patterns`, the fine-tuning recipes that freeze and
unfreeze layers mid-fit in :mod:`conformance.training.freeze_patterns`, those around the optimizer step in
:mod:`conformance.training.optimizer_patterns`, those with uneven data per rank in
:mod:`conformance.training.uneven_patterns`, the ``torch.compile`` ones in
:mod:`conformance.training.compile_patterns`. :data:`PATTERNS` names them all.
"""

from __future__ import annotations

from typing import Any, ClassVar

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import (
    GradientAccumulationScheduler,
    StochasticWeightAveraging,
    WeightAveraging,
)
from torch import nn
from torch.optim.swa_utils import get_ema_avg_fn
from torch.utils.checkpoint import checkpoint

from conformance.training.base import OUTPUTS, TrainingPattern, mlp
from conformance.training.compile_patterns import COMPILE_PATTERNS
from conformance.training.freeze_patterns import (
    BackboneUnfreeze,
    BatchNormBackboneInEval,
    BatchNormBackboneUnfreeze,
    BatchNormFoundByClass,
    FreezeAgain,
    UnfreezeInHook,
    UnfreezeInTrainingStep,
)
from conformance.training.optimizer_patterns import GradNormLoggedClipByValue, LBFGSClosure
from conformance.training.resume_patterns import (
    DropoutResumedAtEpochEnd,
    DropoutResumedMidEpoch,
    WorkerNoiseResumedAtEpochEnd,
)
from conformance.training.uneven_patterns import UNEVEN_PATTERNS

__all__ = ["PATTERNS"]


class AfterBackwardClamp(TrainingPattern):
    label = "on_after_backward reads and clamps gradients"

    def on_after_backward(self) -> None:
        self.records.setdefault("after_backward_grads", []).append(
            {name: p.grad.detach().clone() for name, p in self.named_parameters() if p.grad is not None}
        )
        for p in self.parameters():
            if p.grad is not None:
                p.grad.clamp_(-0.05, 0.05)


class ManualBackwardRescale(TrainingPattern):
    label = "manual optimization: gradients rescaled right after manual_backward"

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> None:
        optimizer = self.optimizers()
        optimizer.zero_grad()
        self.manual_backward(self.loss(*batch))
        norm = torch.sqrt(sum(p.grad.pow(2).sum() for p in self.parameters()))
        for p in self.parameters():
            p.grad.div_(norm.clamp(min=1.0) * 0.5)  # what a user's own normalisation reads


class RunningScale(nn.Module):
    """Divides its input by a running mean of |x| kept in a buffer (an EMA, not BatchNorm)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("running_scale", torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.running_scale.mul_(0.5).add_(0.5 * x.detach().abs().mean())
        return x / self.running_scale


class NonBatchNormBuffer(TrainingPattern):
    label = "a buffer that is not BatchNorm (an EMA of abs(x) as input scale)"
    truth = "ddp"

    def build(self) -> nn.Module:
        return nn.Sequential(RunningScale(), mlp())

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        # What this step's forward reads: rank 0's value under ddp and custom_ddp.
        self.records.setdefault("buffer_at_forward", []).append(self.net[0].running_scale.clone())
        return super().training_step(batch, batch_idx)


class LocalBatchNorm(TrainingPattern):
    label = "BatchNorm1d with sync_batchnorm=False (running stats broadcast as ddp)"
    truth = "ddp"
    custom_options = {"sync_batchnorm": False}

    def build(self) -> nn.Module:
        return mlp(batchnorm=True)


class SparseEmbeddingSGD(TrainingPattern):
    label = "nn.Embedding(sparse=True) + Linear, SGD"

    def build(self) -> nn.Module:
        return nn.ModuleDict({"embedding": nn.Embedding(10, 4, sparse=True), "head": nn.Linear(4, OUTPUTS)})

    def loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        ids = (inputs.abs() * 3).long().clamp(max=9)  # 6 ids per sample, repeats included
        return F.mse_loss(self.net["head"](self.net["embedding"](ids).mean(1)), targets)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.5)


class SparseEmbeddingBagAdam(SparseEmbeddingSGD):
    label = "nn.EmbeddingBag(sparse=True), SparseAdam"

    def build(self) -> nn.Module:
        return nn.ModuleDict({"bag": nn.EmbeddingBag(10, OUTPUTS, mode="sum", sparse=True)})

    def loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.net["bag"]((inputs.abs() * 3).long().clamp(max=9)), targets)

    def configure_optimizers(self) -> Any:
        return torch.optim.SparseAdam(list(self.parameters()), lr=0.05)


class ClipWithAccumulation(TrainingPattern):
    label = "gradient clipping (norm 0.05) with accumulate_grad_batches=2"
    trainer_options = {"gradient_clip_val": 0.05, "accumulate_grad_batches": 2}


class ManualOptimization(ManualBackwardRescale):
    label = "manual optimization, one optimizer"

    def training_step(self, batch: Any, batch_idx: int) -> None:
        optimizer = self.optimizers()
        optimizer.zero_grad()
        self.manual_backward(self.loss(*batch))
        optimizer.step()


class UnusedParameters(TrainingPattern):
    label = "a parameter no rank uses"
    ddp_options = {"find_unused_parameters": True}

    def __init__(self) -> None:
        super().__init__()
        self.never_used = nn.Parameter(torch.ones(OUTPUTS))


class AccumulationSchedule(TrainingPattern):
    label = "GradientAccumulationScheduler({0: 2, 1: 1})"
    max_epochs = 2

    def callbacks(self) -> list[pl.Callback]:
        return [GradientAccumulationScheduler({0: 2, 1: 1})]


class SWA(TrainingPattern):
    label = "StochasticWeightAveraging from epoch 1"
    max_epochs = 3

    def callbacks(self) -> list[pl.Callback]:
        return [StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=1)]


class EMA(TrainingPattern):
    label = "WeightAveraging as an EMA (decay 0.9, every step)"
    max_epochs = 2

    def callbacks(self) -> list[pl.Callback]:
        return [WeightAveraging(avg_fn=get_ema_avg_fn(0.9))]


class EMAOverSyncBatchNorm(EMA):
    label = "WeightAveraging EMA of a BatchNorm1d net (running statistics averaged too), sync_batchnorm=True"
    ddp_options = None  # torch's SyncBatchNorm is CUDA-only: ddp cannot run it on CPU

    def build(self) -> nn.Module:
        return mlp(batchnorm=True)


class ActivationCheckpointing(TrainingPattern):
    label = "activation checkpointing (torch.utils.checkpoint, use_reentrant=False)"
    reentrant: ClassVar[bool] = False

    def loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        hidden = checkpoint(self.net[:3], inputs, use_reentrant=self.reentrant)
        return F.mse_loss(self.net[3](hidden), targets)


class ReentrantCheckpointing(ActivationCheckpointing):
    label = "activation checkpointing, use_reentrant=True (a nested backward)"
    reentrant = True


class Float64Parameters(TrainingPattern):
    label = "float64 parameters"

    def build(self) -> nn.Module:
        return mlp().double()

    def loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.net(inputs.double()), targets.double())


class DoubleBackward(TrainingPattern):
    label = "double backward (input-gradient penalty, create_graph=True)"

    def loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        inputs = inputs.clone().requires_grad_(True)
        outputs = self.net(inputs)
        (input_grad,) = torch.autograd.grad(outputs.sum(), inputs, create_graph=True)
        return F.mse_loss(outputs, targets) + 0.1 * input_grad.pow(2).mean()


class BuiltInConfigureModel(TrainingPattern):
    label = "layers built in configure_model, each rank seeded by its rank (rank 0's initial weights are kept)"

    def build(self) -> nn.Module | None:
        return None  # Lightning calls configure_model before the strategy wraps the module

    def configure_model(self) -> None:
        if self.net is None:  # called again by a later trainer.fit / validate
            torch.manual_seed(self.global_rank)  # one process: rank 0, the truth's initial weights
            self.net = mlp()


PATTERNS: dict[str, type[TrainingPattern]] = {
    "after_backward": AfterBackwardClamp,
    "after_manual_backward": ManualBackwardRescale,
    "non_bn_buffer": NonBatchNormBuffer,
    "local_batchnorm": LocalBatchNorm,
    "sparse_embedding_sgd": SparseEmbeddingSGD,
    "sparse_embedding_bag_adam": SparseEmbeddingBagAdam,
    "unfreeze_in_hook": UnfreezeInHook,
    "unfreeze_in_training_step": UnfreezeInTrainingStep,
    "freeze_again": FreezeAgain,
    "backbone_finetuning": BackboneUnfreeze,
    "batchnorm_backbone_finetuning": BatchNormBackboneUnfreeze,
    "batchnorm_backbone_in_eval": BatchNormBackboneInEval,
    "batchnorm_found_by_class": BatchNormFoundByClass,
    "clip_with_accumulation": ClipWithAccumulation,
    "manual_optimization": ManualOptimization,
    "unused_parameters": UnusedParameters,
    "accumulation_schedule": AccumulationSchedule,
    "swa": SWA,
    "ema": EMA,
    "ema_syncbn": EMAOverSyncBatchNorm,
    "activation_checkpointing": ActivationCheckpointing,
    "reentrant_checkpointing": ReentrantCheckpointing,
    "float64": Float64Parameters,
    "double_backward": DoubleBackward,
    "configure_model": BuiltInConfigureModel,
    "lbfgs_closure": LBFGSClosure,
    "grad_norm_clip_by_value": GradNormLoggedClipByValue,
    "dropout_resumed_mid_epoch": DropoutResumedMidEpoch,
    "dropout_resumed_at_epoch_end": DropoutResumedAtEpochEnd,
    "worker_noise_resumed_at_epoch_end": WorkerNoiseResumedAtEpochEnd,
    **UNEVEN_PATTERNS,
    **COMPILE_PATTERNS,
}
