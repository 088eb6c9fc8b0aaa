"""Training patterns Lightning users write every day, for the training conformance table and its tests.

Each pattern is a small :class:`TrainingPattern` (a LightningModule) trained on 32 fixed samples.
The data is sharded by hand (run with ``use_distributed_sampler=False``): rank r of W trains on
samples r, r+W, ... in batches of 4, and one process trains on batches of 4 * W, so global batch t
of the ranks is batch t of one process. ``truth`` names what a pattern's result is defined by: one
process on the global batch, or Lightning's ``ddp`` where the per-rank state is part of the
semantics (buffers updated from each rank's own data, local BatchNorm), or, for a pattern that is
interrupted after ``resume_after_steps`` optimizer steps and resumed from the checkpoint written
there, the same strategy's uninterrupted fit. ``ddp_options`` /
``custom_options`` are strategy arguments; ``ddp_options = None``: ``ddp`` cannot run the pattern.
The modules know nothing about the strategy.
"""

from __future__ import annotations

from typing import Any, ClassVar

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import BackboneFinetuning, GradientAccumulationScheduler, StochasticWeightAveraging
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Dataset

__all__ = ["PATTERNS", "TrainingPattern", "WORLD_SIZE"]

WORLD_SIZE = 2
NUM_SAMPLES, BATCH_SIZE, FEATURES, OUTPUTS = 32, 4, 6, 3


def _mlp(batchnorm: bool = False) -> nn.Sequential:
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
    slow: ClassVar[bool] = False  # kept out of the default test run (compiling takes long)
    resume_after_steps: ClassVar[int | None] = None  # interrupted there, resumed from its checkpoint (truth: uninterrupted)

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = self.build()
        generator = torch.Generator().manual_seed(1)
        self.inputs = torch.randn(NUM_SAMPLES, FEATURES, generator=generator)
        self.targets = torch.randn(NUM_SAMPLES, OUTPUTS, generator=generator)
        self.records: dict[str, list[Any]] = {}  # saved with the final state, per rank

    def build(self) -> nn.Module:
        return _mlp()

    def callbacks(self) -> list[pl.Callback]:
        return []

    def loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.net(inputs), targets)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.loss(*batch)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    def train_dataloader(self) -> DataLoader:
        rank, world_size = self.trainer.global_rank, self.trainer.world_size
        samples = list(zip(self.inputs, self.targets))[rank::world_size]
        return DataLoader(samples, batch_size=BATCH_SIZE * WORLD_SIZE // world_size)


class AfterBackwardClamp(TrainingPattern):
    label = "on_after_backward reads and clamps gradients"

    def on_after_backward(self) -> None:
        self.records.setdefault("after_backward_grads", []).append(
            {name: p.grad.detach().clone() for name, p in self.named_parameters() if p.grad is not None})
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
        return nn.Sequential(RunningScale(), _mlp())

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        # What this step's forward reads: rank 0's value under ddp and custom_ddp.
        self.records.setdefault("buffer_at_forward", []).append(self.net[0].running_scale.clone())
        return super().training_step(batch, batch_idx)


class LocalBatchNorm(TrainingPattern):
    label = "BatchNorm1d with sync_batchnorm=False (running stats broadcast as ddp)"
    truth = "ddp"
    custom_options = {"sync_batchnorm": False}

    def build(self) -> nn.Module:
        return _mlp(batchnorm=True)


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


class UnfreezeInHook(TrainingPattern):
    label = "first layer frozen, requires_grad_(True) in on_train_epoch_start of epoch 1"
    max_epochs = 2

    def build(self) -> nn.Module:
        net = _mlp()
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
        return _mlp().double()

    def loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.net(inputs.double()), targets.double())


class DoubleBackward(TrainingPattern):
    label = "double backward (input-gradient penalty, create_graph=True)"

    def loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        inputs = inputs.clone().requires_grad_(True)
        outputs = self.net(inputs)
        (input_grad,) = torch.autograd.grad(outputs.sum(), inputs, create_graph=True)
        return F.mse_loss(outputs, targets) + 0.1 * input_grad.pow(2).mean()


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


PATTERNS: dict[str, type[TrainingPattern]] = {
    "after_backward": AfterBackwardClamp, "after_manual_backward": ManualBackwardRescale,
    "non_bn_buffer": NonBatchNormBuffer, "local_batchnorm": LocalBatchNorm,
    "sparse_embedding_sgd": SparseEmbeddingSGD, "sparse_embedding_bag_adam": SparseEmbeddingBagAdam,
    "unfreeze_in_hook": UnfreezeInHook, "unfreeze_in_training_step": UnfreezeInTrainingStep, "freeze_again": FreezeAgain, "backbone_finetuning": BackboneUnfreeze,
    "clip_with_accumulation": ClipWithAccumulation, "manual_optimization": ManualOptimization,
    "unused_parameters": UnusedParameters, "accumulation_schedule": AccumulationSchedule, "swa": SWA,
    "activation_checkpointing": ActivationCheckpointing, "reentrant_checkpointing": ReentrantCheckpointing,
    "float64": Float64Parameters,
    "double_backward": DoubleBackward,
    "dropout_resumed_mid_epoch": DropoutResumedMidEpoch, "dropout_resumed_at_epoch_end": DropoutResumedAtEpochEnd,
    "worker_noise_resumed_at_epoch_end": WorkerNoiseResumedAtEpochEnd,
}


class CompiledSyncBatchNorm(TrainingPattern):
    label = "torch.compile(net) with BatchNorm1d, sync_batchnorm=True"
    ddp_options = None  # torch's SyncBatchNorm is CUDA-only: ddp cannot run it on CPU
    slow = True

    def build(self) -> nn.Module:
        # Inductor's pool of compile workers hangs in ranks started with fork (seen with custom_ddp; ddp
        # errors out): compile in the rank's own process (TORCHINDUCTOR_COMPILE_THREADS=1 does the same).
        torch._inductor.config.compile_threads = 1
        return torch.compile(_mlp(batchnorm=True))


class CompiledLocalBatchNorm(CompiledSyncBatchNorm):
    label = "torch.compile(net) with BatchNorm1d, sync_batchnorm=False"
    truth = "ddp"
    ddp_options = {}
    custom_options = {"sync_batchnorm": False}


PATTERNS.update({"compiled_syncbn": CompiledSyncBatchNorm, "compiled_local_bn": CompiledLocalBatchNorm})
