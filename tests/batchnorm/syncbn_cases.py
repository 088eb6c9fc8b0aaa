"""SyncBatchNorm test cases shared by test_syncbn_distributed.py and test_syncbn_compiled.py: a case
(local batch sizes, feature shape, offset, ...), its training run on some rows of every global batch,
the one-process torch reference and the comparison; the compiled variant of a case and its helpers."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, replace

import pytest
import torch
from torch import nn

import parallel.batchnorm.syncbn
from parallel.batchnorm.syncbn import SyncBatchNorm
from parallel.batchnorm.syncbn_kernels import compiled_kernels

_TORCH_BATCH_NORM = {1: nn.BatchNorm1d, 2: nn.BatchNorm1d, 3: nn.BatchNorm2d, 4: nn.BatchNorm3d}


@dataclass(frozen=True)
class Case:
    sizes: tuple[int, ...]  # local batch size of each rank
    feature_shape: tuple[int, ...] = (6,)  # (C,), (C, L), (C, H, W) or (C, D, H, W)
    offset: float = 0.0
    momentum: float | None = 0.1
    channels_last: bool = False
    steps: int = 2
    compile: bool = False  # SyncBatchNorm(compile=True), every input shape compiled (see make_layer)

    @property
    def num_features(self) -> int:
        return self.feature_shape[0]

    def batch(self, step: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
        """Global input, upstream gradient and eval input of training step ``step``."""
        generator = torch.Generator().manual_seed(100 + step)
        shape = (sum(self.sizes), *self.feature_shape)
        x = self.offset + 2.0 * torch.randn(shape, generator=generator, dtype=torch.float64)
        grad = torch.randn(shape, generator=generator, dtype=torch.float64)
        eval_x = self.offset + torch.randn((5, *self.feature_shape), generator=generator).double()
        return x.to(dtype), grad.to(dtype), eval_x.to(dtype)

    def shard(self, rank: int) -> slice:
        first = sum(self.sizes[:rank])
        return slice(first, first + self.sizes[rank])


def forward_backward(layer: nn.Module, x: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``layer(x)`` and the input's gradient for the output gradient ``grad``."""
    x = x.clone().requires_grad_()
    out = layer(x)
    out.backward(grad)
    return out.detach(), x.grad


def init_affine(layer: nn.Module, num_features: int) -> None:
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        layer.weight.copy_(0.5 + torch.rand(num_features, generator=generator))
        layer.bias.copy_(torch.randn(num_features, generator=generator))


def train_and_eval(layer: nn.Module, case: Case, rows: slice, dtype: torch.dtype, device: str = "cpu") -> dict:
    """Run ``case`` through ``layer`` (on ``device``) on the given rows of every global batch; results on the CPU."""
    init_affine(layer, case.num_features)
    outputs, input_grads = [], []
    for step in range(case.steps):
        x, grad, _ = (t.to(device) for t in case.batch(step, dtype))
        x = x[rows].clone()
        if case.channels_last:
            x = x.to(memory_format=torch.channels_last)
        x.requires_grad_()
        out = layer(x)
        out.backward(grad[rows])
        outputs.append(out.detach().cpu())
        input_grads.append(x.grad.cpu())
    layer.eval()
    eval_out = layer(case.batch(case.steps - 1, dtype)[2].to(device))
    return {
        "outputs": outputs,
        "input_grads": input_grads,
        "weight_grad": layer.weight.grad.cpu(),
        "bias_grad": layer.bias.grad.cpu(),
        "running_mean": layer.running_mean.cpu(),
        "running_var": layer.running_var.cpu(),
        "num_batches_tracked": layer.num_batches_tracked.cpu(),
        "eval_output": eval_out.detach().cpu(),
    }


# A worker that compiles (~20 s cold, several times that on a loaded machine) gets this long.
COMPILE_TIMEOUT_S = 600.0


def timeout_s(case: Case) -> float:
    """The launcher's deadline for ``case``'s workers: the default unless they compile."""
    return COMPILE_TIMEOUT_S if case.compile else 60.0


# The compiled set of SyncBatchNorm(compile=True) leaves small and (N, C) inputs to the eager
# kernel; this one compiles every shape, so small test shapes run the compiled passes.
COMPILE_EVERY_SHAPE = compiled_kernels(min_elements=0, spatial_only=False)


def make_layer(case: Case) -> SyncBatchNorm:
    """The layer under test (in a worker process: it may swap the compiled set for that process)."""
    if case.compile:
        parallel.batchnorm.syncbn.COMPILED_KERNELS = COMPILE_EVERY_SHAPE
        no_silent_fallback()
    # force_sync: a one-rank case runs the hand-written kernel too, not torch's native batch norm.
    return SyncBatchNorm(case.num_features, momentum=case.momentum, compile=case.compile, force_sync=True)


def no_silent_fallback() -> None:
    """In this (worker) process, a compile failure fails the test instead of falling back to eager."""
    warnings.filterwarnings("error", message=r"SyncBatchNorm\(compile=True\): torch.compile failed")


def sync_worker(rank: int, world_size: int, case: Case) -> dict:
    return train_and_eval(make_layer(case), case, case.shard(rank), torch.float32)


def reference(case: Case, dtype: torch.dtype = torch.float32) -> dict:
    batch_norm = _TORCH_BATCH_NORM[len(case.feature_shape)]
    layer = batch_norm(case.num_features, momentum=case.momentum).to(dtype)
    return train_and_eval(layer, case, slice(None), dtype)


def assert_matches(results: list[dict], expected: dict, **tolerance) -> None:
    for step, want in enumerate(expected["outputs"]):
        got = torch.cat([r["outputs"][step] for r in results])
        torch.testing.assert_close(got, want.float(), **tolerance)
        got = torch.cat([r["input_grads"][step] for r in results])
        torch.testing.assert_close(got, expected["input_grads"][step].float(), **tolerance)
    # Parameter gradients stay local sums (the data-parallel sync averages them later).
    for name in ("weight_grad", "bias_grad"):
        torch.testing.assert_close(sum(r[name] for r in results), expected[name].float(), **tolerance)
    for result in results:  # every rank holds the same, global running statistics
        for name in ("running_mean", "running_var", "eval_output"):
            torch.testing.assert_close(result[name], expected[name].float(), **tolerance)
        assert result["num_batches_tracked"] == expected["num_batches_tracked"]


CASES = {
    "2d-even": Case(sizes=(4, 4)),
    "2d-uneven": Case(sizes=(3, 7)),
    "3d-3ranks": Case(sizes=(2, 3, 4), feature_shape=(5, 3)),
    "4d-conv": Case(sizes=(3, 5), feature_shape=(8, 4, 5)),
    "4d-channels-last": Case(sizes=(4, 2), feature_shape=(8, 3, 3), channels_last=True),
    "5d": Case(sizes=(2, 2), feature_shape=(3, 2, 3, 2)),
    "empty-rank": Case(sizes=(0, 6), feature_shape=(4, 3, 3)),
    "empty-middle-3ranks": Case(sizes=(3, 0, 5)),
    "cumulative-momentum": Case(sizes=(3, 4), momentum=None, steps=3),
}


def with_compiled(cases: dict[str, Case]) -> list:
    """``cases`` as they are, then compiled (``slow``: a first compile takes ~20 s)."""
    return [
        *(pytest.param(case, id=name) for name, case in cases.items()),
        *(
            pytest.param(replace(case, compile=True), id=f"{name}-compiled", marks=pytest.mark.slow)
            for name, case in cases.items()
        ),
    ]
