"""Training patterns around the optimizer step (:mod:`conformance.training.patterns`): an optimizer that
runs its closure several times per step, and Lightning's documented gradient-norm logging with
clipping by value.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from lightning.pytorch.utilities import grad_norm
from torch import nn

from conformance.training.base import TrainingPattern, mlp

__all__ = ["GradNormLoggedClipByValue", "LBFGSClosure"]


class LBFGSClosure(TrainingPattern):
    """Each optimizer step calls Lightning's closure (forward, zero_grad, backward) up to 3 times:
    every one of those backward passes is a synced one, averaged before LBFGS reads the gradient."""

    label = "LBFGS (max_iter=3, float64): up to 3 closure calls, each a synced backward, per step"

    # float64: LBFGS's curvature estimate amplifies float32 rounding of the averaged gradient (the
    # global batch summed in a different order) to 1e-6..4e-6 in weights, in ddp and custom_ddp alike.
    def build(self) -> nn.Module:
        return mlp().double()

    def loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.net(inputs.double()), targets.double())

    def configure_optimizers(self) -> Any:
        # No line search: "strong_wolfe" picks step sizes from the closure's loss, which is each
        # rank's own loss under ddp and custom_ddp alike, so the ranks would pick different steps.
        return torch.optim.LBFGS(self.parameters(), lr=0.2, max_iter=3)


class GradNormLoggedClipByValue(TrainingPattern):
    """Lightning's docs: log ``grad_norm`` in ``on_before_optimizer_step``; clip by value, accumulate 2."""

    label = "grad_norm logged in on_before_optimizer_step, clipped by value (0.02), accumulate_grad_batches=2"
    trainer_options = {"gradient_clip_val": 0.02, "gradient_clip_algorithm": "value", "accumulate_grad_batches": 2}

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        norms = grad_norm(self, norm_type=2)
        self.log_dict(norms)
        self.records.setdefault("grad_norms", []).append({name: value.clone() for name, value in norms.items()})
