"""``torch.compile`` patterns (:mod:`conformance.training.patterns`): the net compiled inside the LightningModule
(``self.net = torch.compile(net)``), and the whole LightningModule compiled and handed to ``trainer.fit``, the way
Lightning's docs compile a model (Lightning then compiles its ``training_step``: ``from_compiled``). Each rank
compiles on its first step (10-60 s on 2 cores), so these rows are left to ``pytest -m slow``.
"""

from __future__ import annotations

import torch
from torch import nn

from conformance.training.base import TrainingPattern, mlp

__all__ = ["COMPILE_PATTERNS"]


class _Compiling(TrainingPattern):
    compiles = True

    def __init__(self) -> None:
        # Inductor's pool of compile workers hangs in ranks started with fork (seen with custom_ddp; ddp errors out):
        # compile in the rank's own process (TORCHINDUCTOR_COMPILE_THREADS=1 does the same). Set before the ranks fork.
        torch._inductor.config.compile_threads = 1
        super().__init__()


class CompiledSyncBatchNorm(_Compiling):
    label = "torch.compile(net) with BatchNorm1d, sync_batchnorm=True"
    ddp_options = None  # torch's SyncBatchNorm is CUDA-only: ddp cannot run it on CPU

    def build(self) -> nn.Module:
        return torch.compile(mlp(batchnorm=True))


class CompiledLocalBatchNorm(CompiledSyncBatchNorm):
    label = "torch.compile(net) with BatchNorm1d, sync_batchnorm=False"
    truth = "ddp"
    ddp_options = {}
    custom_options = {"sync_batchnorm": False}


class CompiledLightningModule(_Compiling):
    label = "trainer.fit(torch.compile(module)): training_step compiled by Lightning"

    def fit_argument(self) -> nn.Module:
        return torch.compile(self)


class CompiledLightningModuleSyncBatchNorm(CompiledLightningModule):
    label = "trainer.fit(torch.compile(module)) with BatchNorm1d, sync_batchnorm=True"
    ddp_options = None  # torch's SyncBatchNorm is CUDA-only: ddp cannot run it on CPU

    def build(self) -> nn.Module:
        return mlp(batchnorm=True)


COMPILE_PATTERNS: dict[str, type[TrainingPattern]] = {
    "compiled_syncbn": CompiledSyncBatchNorm,
    "compiled_local_bn": CompiledLocalBatchNorm,
    "compiled_module": CompiledLightningModule,
    "compiled_module_syncbn": CompiledLightningModuleSyncBatchNorm,
}
