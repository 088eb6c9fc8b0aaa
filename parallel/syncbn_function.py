"""The autograd function behind :class:`parallel.syncbn.SyncBatchNorm`: one collective per pass.

Notation, per channel, over the ``n`` elements of ALL ranks (batch and spatial positions)::

    mu = sum(x) / n          var = sum((x - mu)^2) / n        r = 1 / sqrt(var + eps)
    x_hat = (x - mu) * r     y = gamma * x_hat + beta         g = dL/dy

Forward: each rank reduces its shard to ``(count, mean, M2)`` per channel; ONE ``all_gather`` of
those ``2C + 1`` floats lets every rank merge them exactly (Chan et al.)::

    n = sum_k n_k    mu = sum_k n_k mu_k / n    M2 = sum_k M2_k + sum_k n_k (mu_k - mu)^2

(``mu`` is summed as deviations from one rank's mean, see ``_merge_moments``.)

Why a gather and not one ``all_reduce`` of ``[n, sum x, sum x^2]``: ``E[x^2] - E[x]^2`` cancels
catastrophically when ``|mu| >> sigma`` (1e4 + N(0, 1) in fp32 loses every digit of the variance),
and an all-reduce of sums shifted by a common ``K`` needs that ``K`` on every rank BEFORE the
collective (the running mean is stale at step 0 and absent without running stats). Centred
``(mean, M2)`` pairs are exact at any offset; the gather moves ``world_size * (2C + 1)`` floats,
a few KB, so it costs one latency like the all-reduce would.

Backward, by hand. With ``d mu / d x_i = 1/n``, ``d var / d x_i = 2 (x_i - mu) / n`` (the term
``sum(x - mu)`` is zero) and ``d r / d var = -r^3 / 2``::

    dL/dx_i = gamma * r * (g_i - sum(g) / n - (x_i - mu) * r^2 * sum(g * (x - mu)) / n)
    dL/dgamma = sum(g * x_hat)        dL/dbeta = sum(g)

The two sums in ``dL/dx`` run over every rank's elements: ONE ``all_reduce`` of
``[sum(g), sum(g * (x - mu))]`` (``2C`` floats). ``dL/dgamma`` and ``dL/dbeta`` stay LOCAL sums,
as in ``torch.nn.SyncBatchNorm``: the data-parallel gradient sync averages them like every other
parameter gradient; summing them over ranks here as well would scale them by the world size.

The collective runs even on a rank whose local batch is empty (it sends zeros) and on
accumulation micro-batches: the input gradient needs the global sums either way.

Pure torch; no Lightning import.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.autograd.function import once_differentiable

__all__ = ["sync_batch_norm"]

# torch 2.14 renamed all_gather_into_tensor (now deprecated) to all_gather_single.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def sync_batch_norm(
    x: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    running_mean: Tensor | None,
    running_var: Tensor | None,
    momentum: float,
    eps: float,
    group: dist.ProcessGroup | None,
    world_size: int,
) -> Tensor:
    """Batch-normalise ``x`` (N, C, *) with statistics over the batches of every rank in ``group``.

    Args:
        x: Input of shape (N, C, *); N may be 0 on some ranks.
        weight: Per-channel scale ``gamma`` or ``None``.
        bias: Per-channel shift ``beta`` or ``None``.
        running_mean: Buffer updated in place with the global batch mean, or ``None``.
        running_var: Buffer updated in place with the global unbiased variance, or ``None``.
        momentum: Weight of the new statistics in the running average.
        eps: Added to the variance before the inverse square root.
        group: Process group to synchronise over; ``None`` for purely local statistics.
        world_size: Size of ``group`` (ignored when ``group`` is ``None``).

    Returns:
        The normalised tensor, in ``x``'s dtype and memory format.
    """
    # Statistics and reductions run in (at least) fp32 whatever the autocast context says;
    # only the output goes back to the input dtype.
    autocast = torch.is_autocast_enabled(x.device.type)
    with torch.autocast(x.device.type, enabled=False) if autocast else contextlib.nullcontext():
        return _SyncBatchNormFunction.apply(
            x, weight, bias, running_mean, running_var, momentum, eps, group, world_size
        )


class _SyncBatchNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: Tensor,
        weight: Tensor | None,
        bias: Tensor | None,
        running_mean: Tensor | None,
        running_var: Tensor | None,
        momentum: float,
        eps: float,
        group: dist.ProcessGroup | None,
        world_size: int,
    ) -> Tensor:
        num_channels = x.shape[1]
        local_count = x.numel() // num_channels
        channel_shape = (1, num_channels) + (1,) * (x.dim() - 2)
        # `buf` (x minus an approximate mean) is the forward's only x-sized allocation: it
        # feeds M2 and then becomes the output (fresh large buffers cost page faults on CPU).
        stats, buf, approx_mean = _local_moments(x, local_count, channel_shape)
        if group is not None:
            # Flat output: gloo accepts only the concatenated form, not a (world_size, K) stack.
            gathered = stats.new_empty(world_size * stats.numel())
            _all_gather_single(gathered, stats, group=group)
            count, mean, m2 = _merge_moments(gathered.view(world_size, -1))
        else:
            count, mean, m2 = stats[:1], stats[1 : num_channels + 1], stats[num_channels + 1 :]
        has_values = _check_global_count(count, local_count, x.shape)
        inv_count = count.clamp(min=1).reciprocal_()
        invstd = (m2 * inv_count).add_(eps).rsqrt_()
        if running_mean is not None and running_var is not None and has_values:
            running_mean.lerp_(mean.to(running_mean.dtype), momentum)
            unbiased_var = m2 / (count - 1).clamp_(min=1)
            running_var.lerp_(unbiased_var.to(running_var.dtype), momentum)

        # Save the input itself (alive anyway for the caller) and C-sized vectors, never x_hat.
        ctx.save_for_backward(x, weight, mean, invstd, inv_count)
        ctx.group, ctx.channel_shape = group, channel_shape
        ctx.bias_dtype = None if bias is None else bias.dtype
        # y = (x - mu) * scale + beta = buf * scale + (beta - (mu - approx_mean) * scale):
        # buf is already centred, so |mu| >> sigma costs no precision.
        scale = invstd if weight is None else invstd * weight
        shift = (approx_mean - mean).mul_(scale)
        if bias is not None:
            shift.add_(bias)
        # In-place mul_ + add_ measure ~2x faster on CPU than one out= addcmul here.
        return buf.mul_(scale.view(channel_shape)).add_(shift.view(channel_shape)).to(x.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        x, weight, mean, invstd, inv_count = ctx.saved_tensors
        channel_shape, num_channels = ctx.channel_shape, mean.numel()
        dims = _reduce_dims(x)
        # One x-sized (fp32) buffer: x - mu, then dL/dx in place.
        buf = x - mean.view(channel_shape)
        sums = torch.cat([grad_out.sum(dims, dtype=mean.dtype), _sum_of_products(buf, grad_out)])
        sum_dy, sum_dy_xmu = sums[:num_channels], sums[num_channels:]
        # Parameter gradients are the LOCAL sums: taken before the all-reduce overwrites them.
        grad_weight = (sum_dy_xmu * invstd).to(weight.dtype) if ctx.needs_input_grad[1] else None
        grad_bias = sum_dy.to(ctx.bias_dtype, copy=True) if ctx.needs_input_grad[2] else None
        if ctx.group is not None:
            dist.all_reduce(sums, group=ctx.group)
        if not ctx.needs_input_grad[0]:
            return None, grad_weight, grad_bias, None, None, None, None, None, None

        # dL/dx = scale * g + coef_xmu * (x - mu) + coef_const, with scale = gamma * r and
        # coef_const = -scale * sum(g) / n, coef_xmu = -scale * r^2 * sum(g * (x - mu)) / n.
        scale = invstd if weight is None else invstd * weight
        minus_scale_over_n = scale * inv_count.neg()
        coef_const = minus_scale_over_n * sum_dy
        coef_xmu = minus_scale_over_n.mul_(invstd).mul_(invstd).mul_(sum_dy_xmu)
        buf.mul_(coef_xmu.view(channel_shape)).add_(coef_const.view(channel_shape))
        grad_input = buf.addcmul_(grad_out, scale.view(channel_shape)).to(x.dtype)
        return grad_input, grad_weight, grad_bias, None, None, None, None, None, None


def _reduce_dims(x: Tensor) -> list[int]:
    """Every dimension but the channel dimension 1."""
    return [0, *range(2, x.dim())]


def _local_moments(
    x: Tensor, local_count: int, channel_shape: tuple[int, ...]
) -> tuple[Tensor, Tensor, Tensor]:
    """This rank's ``[count, mean (C), M2 (C)]``, ``buf = x - approx_mean`` and ``approx_mean``.

    All in fp32 (fp64 for fp64 input). Corrected two-pass algorithm (Chan, Golub & LeVeque):
    the deviations from a first, roughly rounded mean give both the correction of that mean
    and M2 = sum(d^2) - n * correction^2, where the correction is tiny, so nothing cancels
    even for 1e4 + N(0, 1) (E[x^2] - E[x]^2 would lose every digit there).
    """
    acc_dtype = torch.promote_types(x.dtype, torch.float32)
    num_channels = x.shape[1]
    stats = torch.full((2 * num_channels + 1,), float(local_count), dtype=acc_dtype, device=x.device)
    mean, m2 = stats[1 : num_channels + 1], stats[num_channels + 1 :]
    approx_mean = x.sum(_reduce_dims(x), dtype=acc_dtype).div_(max(local_count, 1))
    buf = torch.sub(x, approx_mean.view(channel_shape), out=torch.empty_like(x, dtype=acc_dtype))
    if local_count == 0:
        stats[1:] = 0.0
        return stats, buf, approx_mean
    correction = buf.sum(_reduce_dims(x)).div_(local_count)
    torch.add(approx_mean, correction, out=mean)
    torch.sub(_sum_of_products(buf, buf), correction.square_().mul_(local_count), out=m2).clamp_(min=0)
    return stats, buf, approx_mean


def _sum_of_products(a: Tensor, b: Tensor) -> Tensor:
    """Per-channel ``sum(a * b)`` over all other dims, without an ``a``-sized temporary.

    Row blocks of ~1 MiB (CPU: stays in L2) or ~16 MiB (GPU: few launches) are multiplied
    and reduced one at a time; a full-size product would cost as much as the reduction in
    fresh-memory page faults and would add a tensor to the peak memory.
    """
    dims = _reduce_dims(a)
    block_bytes = (1 << 20) if a.device.type == "cpu" else (16 << 20)
    rows = max(block_bytes * a.shape[0] // max(a.numel() * a.element_size(), 1), 1)
    if rows >= a.shape[0]:
        return torch.sum(a * b, dims)
    total = torch.sum(a[:rows] * b[:rows], dims)
    for start in range(rows, a.shape[0], rows):
        total.add_(torch.sum(a[start : start + rows] * b[start : start + rows], dims))
    return total


def _check_global_count(count: Tensor, local_count: int, shape: torch.Size) -> bool:
    """Raise if the global batch has 1 value per channel; return whether it has any.

    Only a rank that holds fewer than 2 values can see a global count below 2, so only such a
    rank pays for the device-to-host copy. Every rank of a 1-value batch raises, so no peer is
    left waiting in the backward collective.
    """
    if local_count >= 2:
        return True
    global_count = int(count.item())
    if global_count == 1:
        raise ValueError(
            f"Expected more than 1 value per channel when training, got input of shape "
            f"{tuple(shape)} and 1 value per channel over all ranks; use a larger batch."
        )
    return global_count > 0


def _merge_moments(gathered: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Merge per-rank rows ``[count, mean, M2]`` into the global (count, mean, M2) (Chan et al.)."""
    num_channels = (gathered.shape[1] - 1) // 2
    counts = gathered[:, :1]
    means = gathered[:, 1 : num_channels + 1]
    m2s = gathered[:, num_channels + 1 :]
    count = counts.sum()
    # Weighted sums of the deviations from one rank's mean, not of the means: n_k * mu_k is
    # large when |mu| >> sigma and its fp32 rounding would shift the merged mean.
    reference = means[counts.argmax()]
    deviations = means - reference
    mean_shift = (counts * deviations).sum(0) / count.clamp(min=1)
    m2 = m2s.sum(0) + (counts * (deviations - mean_shift).square()).sum(0)
    return count, reference + mean_shift, m2
