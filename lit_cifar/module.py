"""The LightningModule: cross-entropy classification with SGD/AdamW and a per-step LR schedule.

Metrics are torchmetrics objects (top-1/top-5 accuracy and a batch-size-weighted mean loss), so
under any data-parallel strategy they reduce *sums and counts* across processes at epoch end; a
per-rank mean averaged with ``sync_dist`` would be wrong for uneven shards. Logged names:
``{train,val,test}/{loss,acc1,acc5}`` (train also per step).

``predict_step`` returns, per batch, a dict of tensors: ``pred`` (top-1 class, (N,)),
``top5`` (classes by decreasing probability, (N, 5)), ``probs`` (softmax, (N, num_classes)) and
``target`` (the dataset's label, (N,)); :class:`callbacks.PredictionWriter` saves them.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor, nn
from torchmetrics import MeanMetric
from torchmetrics.classification import MulticlassAccuracy

from lit_cifar.errors import OptionError
from lit_cifar.nets import NETS, build_net

__all__ = ["LitClassifier"]

_OPTIMIZERS = ("sgd", "adamw")
_SCHEDULES = ("cosine", "onecycle", "none")
_SCHEDULE_STEPS_KEY = "lit_cifar_schedule_steps"  # in a checkpoint: the optimizer steps its LR schedule was built for


def _warmup_cosine(warmup_steps: int, total_steps: int):
    """LR factor: linear 0->1 over ``warmup_steps``, then cosine 1->0 at ``total_steps``."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def _onecycle_pct_start(hp: Any, total_steps: int) -> float:
    """OneCycleLR's rise fraction; a rise of exactly one step becomes two (or none below 3 steps)."""
    pct_start = hp.warmup_fraction or 0.25
    # torch's OneCycleLR divides by zero when pct_start * total_steps == 1 (e.g. 5 steps with 0.2).
    if math.isclose(pct_start * total_steps, 1.0):
        return 2.0 / total_steps if total_steps > 2 else 0.0
    return pct_start


class LitClassifier(LightningModule):
    """Image classifier over one of :data:`lit_cifar.nets.NETS`.

    Args:
        net: Net name: ``template`` (the assignment's net) or ``resnet18`` (CIFAR ResNet-18).
        net_kwargs: Extra constructor arguments of the net, e.g. ``{"width": 0.25}`` for ``resnet18``.
        num_classes: Number of classes (100 for CIFAR-100).
        optimizer: ``sgd`` (momentum, optional Nesterov) or ``adamw``.
        lr: Peak learning rate.
        momentum: SGD momentum (AdamW ignores it).
        nesterov: Nesterov momentum for SGD.
        weight_decay: Decoupled for AdamW, L2 for SGD; never applied to biases and norm parameters.
        schedule: ``cosine`` (optional linear warm-up, then cosine to 0), ``onecycle`` or ``none``.
        warmup_fraction: Fraction of all optimizer steps used to warm up (``onecycle``: its rise).
        label_smoothing: Cross-entropy label smoothing in [0, 1).
    """

    def __init__(
        self,
        net: str = "resnet18",
        net_kwargs: dict[str, Any] | None = None,
        num_classes: int = 100,
        optimizer: Literal["sgd", "adamw"] = "sgd",
        lr: float = 0.1,
        momentum: float = 0.9,
        nesterov: bool = True,
        weight_decay: float = 5e-4,
        schedule: Literal["cosine", "onecycle", "none"] = "cosine",
        warmup_fraction: float = 0.0,
        label_smoothing: float = 0.0,
    ) -> None:
        super().__init__()
        if net not in NETS:
            raise OptionError(f"unknown net {net!r}; choose one of {sorted(NETS)}.")
        if optimizer not in _OPTIMIZERS or schedule not in _SCHEDULES:
            raise OptionError(
                f"optimizer must be one of {_OPTIMIZERS} (got {optimizer!r}) and schedule one of "
                f"{_SCHEDULES} (got {schedule!r})."
            )
        if optimizer == "sgd" and nesterov and momentum <= 0:
            raise OptionError(f"nesterov=True needs momentum > 0, got momentum={momentum}; set nesterov=false.")
        if not 0.0 <= warmup_fraction < 1.0 or not 0.0 <= label_smoothing < 1.0:
            raise OptionError(
                f"warmup_fraction ({warmup_fraction}) and label_smoothing ({label_smoothing}) must lie in [0, 1)."
            )
        self.save_hyperparameters()
        # Optimizer steps the LR schedule was built for: this fit's, and the resumed checkpoint's.
        self._schedule_steps: int | None = None
        self._resumed_schedule_steps: int | None = None
        self.net = build_net(net, num_classes, **(net_kwargs or {}))
        # One normalised 32x32 RGB image: Lightning's model summary runs it to fill in the FLOPs
        # (per image) and the in/out sizes (without it the FLOPs column reads 0 for every layer).
        self.example_input_array = torch.zeros(1, 3, 32, 32)
        self.criterion = nn.CrossEntropyLoss(label_smoothing=label_smoothing)
        # One metric set per stage ("train" cannot be a ModuleDict key: it is nn.Module.train).
        for stage in ("train", "val", "test"):
            setattr(
                self,
                f"{stage}_metrics",
                nn.ModuleDict(
                    {
                        "loss": MeanMetric(),
                        "acc1": MulticlassAccuracy(num_classes, top_k=1, average="micro"),
                        "acc5": MulticlassAccuracy(num_classes, top_k=5, average="micro"),
                    }
                ),
            )

    def forward(self, images: Tensor) -> Tensor:
        return self.net(images)

    def _step(self, batch: tuple[Tensor, Tensor], stage: str) -> Tensor:
        images, labels = batch
        logits = self(images)
        loss = self.criterion(logits, labels)
        metrics = getattr(self, f"{stage}_metrics")
        metrics["loss"](loss.detach(), weight=labels.numel())
        metrics["acc1"](logits.detach(), labels)
        metrics["acc5"](logits.detach(), labels)
        for name, metric in metrics.items():
            self.log(
                f"{stage}/{name}",
                metric,
                on_step=stage == "train",
                on_epoch=True,
                prog_bar=name != "acc5",
                batch_size=labels.numel(),
            )
        return loss

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return self._step(batch, "train")

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self._step(batch, "val")

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self._step(batch, "test")

    def predict_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> dict[str, Tensor]:
        """Top-1 class, top-5 classes, class probabilities and the dataset's label of each image."""
        images, labels = batch
        probs = self(images).float().softmax(dim=-1)  # float: bf16/fp16 logits would round the probabilities
        top5 = probs.topk(min(5, probs.shape[-1]), dim=-1).indices
        return {"pred": top5[:, 0], "top5": top5, "probs": probs, "target": labels}

    def param_groups(self) -> list[dict[str, Any]]:
        """Two groups: weights with weight decay, biases and norm affine parameters without."""
        decay = [p for p in self.net.parameters() if p.ndim > 1]
        no_decay = [p for p in self.net.parameters() if p.ndim <= 1]
        return [{"params": decay, "weight_decay": self.hparams.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]

    def configure_optimizers(self) -> Any:
        hp = self.hparams
        if hp.optimizer == "sgd":
            optimizer = torch.optim.SGD(self.param_groups(), lr=hp.lr, momentum=hp.momentum, nesterov=hp.nesterov)
        else:
            optimizer = torch.optim.AdamW(self.param_groups(), lr=hp.lr)
        if hp.schedule == "none":
            return optimizer
        total_steps = self._schedule_steps = int(self.trainer.estimated_stepping_batches)
        if hp.schedule == "onecycle":
            scheduler = torch.optim.lr_scheduler.OneCycleLR(
                optimizer, max_lr=hp.lr, total_steps=total_steps, pct_start=_onecycle_pct_start(hp, total_steps)
            )
        else:
            warmup_steps = round(hp.warmup_fraction * total_steps)
            scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _warmup_cosine(warmup_steps, total_steps))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self._schedule_steps is not None:
            checkpoint[_SCHEDULE_STEPS_KEY] = self._schedule_steps

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self._resumed_schedule_steps = checkpoint.get(_SCHEDULE_STEPS_KEY)

    def on_train_start(self) -> None:
        # A fit resumed with a larger max_epochs / max_steps than the interrupted one: OneCycleLR keeps the
        # checkpoint's total_steps and torch fails at the first step past it; a cosine schedule is rebuilt
        # for the new length, so its learning rate does not continue the interrupted curve.
        resumed, steps = self._resumed_schedule_steps, self._schedule_steps
        if resumed is None or steps is None or resumed == steps:
            return
        what = (
            f"--ckpt_path resumes a {self.hparams.schedule} schedule built for {resumed} optimizer steps into a "
            f"fit of {steps} (its max_epochs or max_steps differ from the interrupted fit's)"
        )
        if self.hparams.schedule == "onecycle":
            raise OptionError(
                f"{what}: torch's OneCycleLR cannot change its length. Resume with the interrupted "
                "fit's --trainer.max_epochs / --trainer.max_steps, or start a new fit without --ckpt_path."
            )
        rank_zero_warn(
            f"{what}: the schedule is rebuilt for {steps} steps, so from step {self.global_step} on its "
            "learning rate does not continue the interrupted fit's curve."
        )
