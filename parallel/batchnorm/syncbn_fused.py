"""SyncBatchNorm's CUDA path: the same math as :mod:`parallel.batchnorm.syncbn_function`, in five Triton kernels.

On a GPU a ResNet-18 CIFAR step is bound by kernel launches (issue 45: ~20 ms of launches for ~1 ms of math on
an H200), and the eager reference launches one kernel per torch op: four x-sized passes plus ~30 C-sized ops per
layer and step. Here each pass is one kernel and the C-sized math between the collectives is fused into them::

    forward:   moments -> all_gather -> merge (+ running stats) -> normalise          3 kernels, 1 collective
    backward:  grad_sums (+ local dgamma, dbeta) -> all_reduce -> grad_input          2 kernels, 1 collective

the launches of torch's own CUDA SyncBatchNorm (``batch_norm_stats``, ``batch_norm_gather_stats_with_counts``,
``batch_norm_elemt``; ``batch_norm_backward_reduce``, ``batch_norm_backward_elemt``). Memory, as torch: backward
keeps x, the weight, the mean, invstd and a count (``2C + 1`` values); each direction allocates one x-sized tensor
(the output, ``dL/dx``) and C-sized ones.

Why Triton and not ``torch.compile`` of the whole forward and backward: the compiled set
(:func:`parallel.batchnorm.syncbn_kernels.compiled_kernels`) still runs the C-sized math eagerly between its
graphs, and graphs with collectives inside need functional collectives and a graph per world size and layer
shape; five hand-written kernels are the readable form of the fused passes, run without a warm-up compile, and
Triton's interpreter (``TRITON_INTERPRET=1``) runs them on CPU, so the tests check them without a GPU.

Used by :class:`parallel.batchnorm.syncbn.SyncBatchNorm` for CUDA inputs when Triton imports (:func:`handles`);
the eager reference stays the CPU path. Pure torch + Triton; no Lightning import.
"""

from __future__ import annotations

import functools
import importlib.util
import warnings
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.autograd.function import once_differentiable

from parallel.batchnorm.syncbn_function import check_global_count, sync_batch_norm
from parallel.batchnorm.syncbn_kernels import one_line
from parallel.torch_compat import all_gather_single

__all__ = ["FusedSyncBatchNorm", "handles"]

_BLOCK = 1024  # positions per program step: 4 KiB of fp32 per load, Triton's usual elementwise block
_BLOCK_C = 128  # channels per program of the merge
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_MAX_CHANNELS = 65_535  # CUDA's limit on a grid's second axis


@functools.cache
def _triton_kernels() -> ModuleType | None:
    """The kernels module, imported on first use (``TRITON_INTERPRET`` is read then); ``None`` without Triton."""
    if importlib.util.find_spec("triton") is None:
        return None
    from parallel.batchnorm import triton_kernels

    return triton_kernels


def handles(x: Tensor) -> bool:
    """Whether :class:`FusedSyncBatchNorm` runs ``x``: a CUDA floating-point input of at most 65,535 channels (the
    elementwise grid's second axis), with Triton installed and the kernels passing :func:`self_check` there."""
    if x.device.type != "cuda" or x.dtype not in _DTYPES or x.shape[1] > _MAX_CHANNELS:
        return False
    return _triton_kernels() is not None and self_check(x.device)


@functools.cache
def self_check(device: torch.device) -> bool:
    """Whether the kernels compile and match the eager reference on ``device``: checked once per device, before any
    collective (a kernel failing in the middle of a layer's collectives would leave its peers waiting). If not,
    warns ONCE and the layers run the eager reference there: the same math, slower."""
    try:
        problem = _mismatch(device)
    except Exception as error:  # noqa: BLE001 -- any Triton, compiler or driver failure: the eager path is the same math
        problem = f"failed: {one_line(error)}"
    if problem is not None:
        warnings.warn(
            f"SyncBatchNorm's Triton kernels {problem} (on {device}); running the eager kernel there (same math, "
            "slower). Please report it with your torch, Triton and GPU versions.",
            RuntimeWarning,
            stacklevel=2,
        )
    return problem is None


def _mismatch(device: torch.device) -> str | None:
    """What differs between the kernels and the eager reference in one small forward and backward on ``device``."""
    generator = torch.Generator().manual_seed(0)
    x, grad, weight, bias = (
        torch.randn(shape, generator=generator).to(device) for shape in [(6, 3, 4, 4)] * 2 + [3] * 2
    )
    results = []
    with torch.inference_mode(False), torch.enable_grad(), torch.autocast(device.type, enabled=False):
        for run in (FusedSyncBatchNorm.apply, lambda *args: sync_batch_norm(*args, None, None)):
            leaves = [t.clone().requires_grad_() for t in (x, weight, bias)]
            out = run(*leaves, None, None, 0.1, 1e-5, None, 1)
            out.backward(grad)
            results.append([out.detach(), *(leaf.grad for leaf in leaves)])
    wrong = [
        name for name, a, b in zip(("y", "dx", "dw", "db"), *results, strict=True) if not a.allclose(b, 1e-4, 1e-5)
    ]
    return f"differ from the eager reference in {', '.join(wrong)}" if wrong else None


def _dense(tensor: Tensor) -> Tensor:
    """``tensor`` itself if contiguous in torch's or a channels_last format (its spatial dims then merge into one,
    and ``empty_like`` gives its strides), else a contiguous copy."""
    channels_last = {4: torch.channels_last, 5: torch.channels_last_3d}.get(tensor.dim())
    if tensor.is_contiguous() or (channels_last is not None and tensor.is_contiguous(memory_format=channels_last)):
        return tensor
    return tensor.contiguous()


def _geometry(tensor: Tensor) -> tuple[int, int, int, int, int]:
    """``(N * S, S, stride_n, stride_c, stride_s)`` of a :func:`_dense` tensor seen as (N, C, S)."""
    spatial = [(size, stride) for size, stride in zip(tensor.shape[2:], tensor.stride()[2:], strict=True) if size != 1]
    positions = 1
    for size, _ in spatial:
        positions *= size
    stride_s = spatial[-1][1] if spatial else 1
    return tensor.shape[0] * positions, positions, tensor.stride(0), tensor.stride(1), stride_s


def _grid(channels: int, positions: int) -> tuple[int, int]:
    """The elementwise kernels' grid: blocks of positions on the first axis (up to 2^31 - 1), channels on the
    second (up to 65,535)."""
    return -(-positions // _BLOCK), channels


class FusedSyncBatchNorm(torch.autograd.Function):
    """``FusedSyncBatchNorm.apply(x, weight, bias, running_mean, running_var, momentum, eps, group, world_size)``:
    :func:`parallel.batchnorm.syncbn_function.sync_batch_norm` (the arguments it documents, but the kernels and the
    exchange) in the Triton kernels, one all_gather forward and one all_reduce backward on ``group`` (``None``:
    local statistics). Where :func:`handles` says no, Triton is missing or the input is not on a GPU."""

    @staticmethod
    def forward(ctx: Any, *args: Any) -> Tensor:  # type: ignore[override]
        x, weight, bias, running_mean, running_var, momentum, eps, group, world_size = args
        kernels, x = _triton_kernels(), _dense(x)
        channels, geometry = x.shape[1], _geometry(x)
        # [count, mean, M2 | m0]: the first 2C + 1 values are this rank's row of the all_gather.
        stats = x.new_empty(3 * channels + 1, dtype=torch.promote_types(x.dtype, torch.float32))
        kernels.moments_kernel[(channels,)](x, stats, *geometry, channels, BLOCK=_BLOCK)
        row = stats[: 2 * channels + 1]
        if group is None:
            gathered, world_size = row, 1
        else:
            gathered = stats.new_empty(world_size * row.numel())
            all_gather_single(gathered, row, group=group)
        local_count = geometry[0]
        # Only a rank with fewer than 2 values per channel reads the global count back (a device sync).
        if local_count >= 2:
            has_values = True
        else:
            has_values = check_global_count(gathered.view(world_size, -1)[:, 0].sum(), local_count, x.shape)
        update_running = running_mean is not None and running_var is not None and has_values
        # Backward reads keep (mean, invstd, count) and the weight; scale and shift live for this forward only.
        keep, params = stats.new_empty(2 * channels + 1), stats.new_empty(2 * channels)
        kernels.merge_kernel[(-(-channels // _BLOCK_C),)](
            gathered, stats, _or(weight, stats), _or(bias, stats), _or(running_mean, stats), _or(running_var, stats),
            keep, params, world_size, channels, momentum, eps,
            HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None, UPDATE_RUNNING=update_running, BLOCK_C=_BLOCK_C,
        )  # fmt: skip
        output = torch.empty_like(x)
        if local_count:
            kernels.normalise_kernel[_grid(channels, local_count)](
                x, output, stats[2 * channels + 1 :], params, *geometry, channels, BLOCK=_BLOCK
            )
        ctx.save_for_backward(x, keep, weight)
        ctx.group, ctx.geometry = group, geometry
        ctx.bias_dtype = None if bias is None else bias.dtype
        return output

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        kernels, (x, keep, weight), geometry = _triton_kernels(), ctx.saved_tensors, ctx.geometry
        grad_out, channels = _dense(grad_out), x.shape[1]
        grad_strides = (grad_out.stride(0), grad_out.stride(1), _geometry(grad_out)[4])
        sums = keep.new_empty(2 * channels)
        need_weight = ctx.needs_input_grad[1] and weight is not None
        need_bias = ctx.needs_input_grad[2] and ctx.bias_dtype is not None
        grad_weight = x.new_empty(channels, dtype=weight.dtype) if need_weight else None
        grad_bias = x.new_empty(channels, dtype=ctx.bias_dtype) if need_bias else None
        kernels.grad_sums_kernel[(channels,)](
            x, grad_out, keep, sums, _or(grad_weight, sums), _or(grad_bias, sums), *geometry, *grad_strides,
            channels, WEIGHT_GRAD=need_weight, BIAS_GRAD=need_bias, BLOCK=_BLOCK,
        )  # fmt: skip
        if ctx.group is not None:
            dist.all_reduce(sums, group=ctx.group)
        grad_input = None
        if ctx.needs_input_grad[0]:
            grad_input = torch.empty_like(x)
            if geometry[0]:
                kernels.grad_input_kernel[_grid(channels, geometry[0])](
                    x, grad_out, grad_input, keep, _or(weight, keep), sums, *geometry, *grad_strides, channels,
                    HAS_WEIGHT=weight is not None, BLOCK=_BLOCK,
                )  # fmt: skip
        return grad_input, grad_weight, grad_bias, None, None, None, None, None, None


def _or(tensor: Tensor | None, stand_in: Tensor) -> Tensor:
    """A kernel argument for an optional tensor: a pointer its ``HAS_*`` flag keeps the kernel from touching."""
    return stand_in if tensor is None else tensor
