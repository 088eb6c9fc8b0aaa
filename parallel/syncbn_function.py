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

Cost. Large inputs are memory-bound: the forward makes 6 passes over x-sized memory (mean of x;
``buf = x - m0``; sum and sum of squares of ``buf``; scale and shift in place), the backward 6
(``x - mu``; sum of g; sum of g (x - mu); the folded ``dL/dx = a * g + b * (x - mu) + c`` in three
in-place passes), each direction allocating ONE x-sized buffer (the output, ``dL/dx``), as torch's
kernel does: fresh large buffers cost page faults on CPU. Small inputs are dispatch-bound (~1 us
per torch op called from Python, ~2 us when a Python number must become a tensor operand): 1/n
factors ride in ``alpha=`` / ``value=`` arguments, and 2-D inputs broadcast (C,) vectors without
views and scale-and-shift in one ``addcmul``.

Pure torch; no Lightning import.
"""

from __future__ import annotations

from typing import Any, NamedTuple

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
    args = (x, weight, bias, running_mean, running_var, momentum, eps, group, world_size)
    if not torch.is_autocast_enabled(x.device.type):
        return _SyncBatchNormFunction.apply(*args)
    # Statistics and reductions run in (at least) fp32 whatever the autocast context says;
    # only the output goes back to the input dtype.
    with torch.autocast(x.device.type, enabled=False):
        return _SyncBatchNormFunction.apply(*args)


class _SyncBatchNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: Tensor, weight: Tensor | None, bias: Tensor | None, running_mean: Tensor | None,
        running_var: Tensor | None, momentum: float, eps: float, group: dist.ProcessGroup | None, world_size: int,
    ) -> Tensor:
        # The arguments of sync_batch_norm, which documents them.
        local_count = x.numel() // x.shape[1]
        channel_shape = (1, x.shape[1]) + (1,) * (x.dim() - 2)
        buf, moments = _batch_moments(x, local_count, channel_shape, group, world_size)
        has_values = _check_global_count(moments.count, local_count, x.shape)
        if running_mean is not None and running_var is not None and has_values:
            _update_running_stats(running_mean, running_var, moments, momentum)
        invstd = moments.var.add_(eps).rsqrt_()
        scale = invstd if weight is None else invstd * weight
        # Save the input itself (alive anyway for the caller) and C-sized vectors, never x_hat.
        ctx.save_for_backward(x, moments.mean, invstd, scale)
        ctx.group, ctx.channel_shape, ctx.inv_count = group, channel_shape, moments.inv_count
        ctx.weight_dtype = None if weight is None else weight.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        # y = (x - mu) * scale + beta = buf * scale + (beta - (mu - m0) * scale): buf is already
        # centred, so |mu| >> sigma costs no precision (torch's x * scale + (beta - mu * scale)
        # rounds |mu| * scale).
        if bias is None:
            shift = torch.mul(moments.offset, scale).mul_(-moments.offset_scale)
        else:
            shift = torch.addcmul(bias, moments.offset, scale, value=-moments.offset_scale)
        out = _scale_shift_(buf, scale, shift, channel_shape)
        return out if out.dtype == x.dtype else out.to(x.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        x, mean, invstd, scale = ctx.saved_tensors
        channel_shape = ctx.channel_shape
        # The one x-sized buffer (fp32 at least, by type promotion): x - mu, then dL/dx in place.
        buf = x - _per_channel(mean, channel_shape)
        sum_dy = grad_out.sum(_reduce_dims(x), dtype=mean.dtype)
        sum_dy_xmu = _sum_of_products(buf, grad_out)
        # Parameter gradients are the LOCAL sums, as in torch.nn.SyncBatchNorm.
        grad_weight = sum_dy_xmu * invstd if ctx.needs_input_grad[1] else None
        grad_bias = sum_dy if ctx.needs_input_grad[2] else None
        if ctx.group is not None:
            sums = torch.cat([sum_dy, sum_dy_xmu])
            dist.all_reduce(sums, group=ctx.group)
            sum_dy, sum_dy_xmu = sums.view(2, -1).unbind()
        grad_input = None
        if ctx.needs_input_grad[0]:
            # dL/dx = scale * g + coef_xmu * (x - mu) + coef_const, with scale = gamma * r and
            # coef_const = -scale * sum(g) / n, coef_xmu = -scale * r^2 * sum(g * (x - mu)) / n.
            minus_scale_over_n = scale * -ctx.inv_count
            coef_const = minus_scale_over_n * sum_dy
            coef_xmu = minus_scale_over_n.mul_(invstd).mul_(invstd).mul_(sum_dy_xmu)
            grad_input = _scale_shift_(buf, coef_xmu, coef_const, channel_shape)
            grad_input.addcmul_(grad_out, _per_channel(scale, channel_shape))
            grad_input = grad_input if grad_input.dtype == x.dtype else grad_input.to(x.dtype)
        if grad_weight is not None and grad_weight.dtype != ctx.weight_dtype:
            grad_weight = grad_weight.to(ctx.weight_dtype)
        if grad_bias is not None and grad_bias.dtype != ctx.bias_dtype:
            grad_bias = grad_bias.to(ctx.bias_dtype)
        return grad_input, grad_weight, grad_bias, None, None, None, None, None, None


def _reduce_dims(x: Tensor) -> int | list[int]:
    """Every dimension but the channel dimension 1 (a plain int for 2-D input: a cheaper call)."""
    return 0 if x.dim() == 2 else [0, *range(2, x.dim())]


def _per_channel(vector: Tensor, channel_shape: tuple[int, ...]) -> Tensor:
    """A (C,) vector shaped to broadcast over (N, C, *); a 2-D input needs no view."""
    return vector if len(channel_shape) == 2 else vector.view(channel_shape)


def _as(value: Tensor, like: Tensor) -> Tensor:
    return value if value.dtype == like.dtype else value.to(like.dtype)


def _scale_shift_(buf: Tensor, scale: Tensor, shift: Tensor, channel_shape: tuple[int, ...]) -> Tensor:
    """``buf * scale + shift`` per channel, in place."""
    if len(channel_shape) == 2:
        # The vectors run along the contiguous dim: one vectorised pass.
        return torch.addcmul(shift, buf, scale, out=buf)
    # Two in-place passes: an addcmul with two per-channel (stride-0) operands runs
    # unvectorised on CPU, ~5x slower than both of these together.
    return buf.mul_(scale.view(channel_shape)).add_(shift.view(channel_shape))


class _Moments(NamedTuple):
    """The batch's statistics per channel (over every rank of the group, if any)."""

    count: int | Tensor  # an int without a group, the gathered 1-element total with one
    inv_count: float | Tensor
    mean: Tensor
    var: Tensor  # biased
    offset: Tensor  # mean - m0 == offset * offset_scale (offset_scale folds a 1/n into a later op)
    offset_scale: float


def _batch_moments(
    x: Tensor, local_count: int, channel_shape: tuple[int, ...], group: dist.ProcessGroup | None, world_size: int,
) -> tuple[Tensor, _Moments]:
    """``buf = x - m0`` (fp32 at least; the forward's only x-sized allocation, which becomes its output)
    and the batch's moments.

    Corrected two-pass algorithm (Chan, Golub & LeVeque): ``m0`` is a first, rounded mean; the
    deviations ``buf`` give both its correction, ``mean(buf)``, and ``M2 = sum(buf^2) -
    sum(buf)^2 / n``, where nothing cancels even for 1e4 + N(0, 1) (``E[x^2] - E[x]^2`` would
    lose every digit there).
    """
    dims = _reduce_dims(x)
    inv_local = 1.0 / max(local_count, 1)
    acc_dtype = torch.promote_types(x.dtype, torch.float32)
    if local_count:
        approx_mean = x.mean(dims, dtype=acc_dtype)
    else:  # an empty shard: mean() would be NaN, and the gather would spread it
        approx_mean = x.new_zeros(x.shape[1], dtype=acc_dtype)
    buf = x - _per_channel(approx_mean, channel_shape)  # type promotion: fp32 at least
    sum_buf = buf.sum(dims)
    m2 = torch.addcmul(_sum_of_products(buf, buf), sum_buf, sum_buf, value=-inv_local).clamp_min_(0)
    if group is None:
        mean = torch.add(approx_mean, sum_buf, alpha=inv_local)
        return buf, _Moments(local_count, inv_local, mean, m2.mul_(inv_local), sum_buf, inv_local)
    count, mean, offset, m2 = _gather_moments(approx_mean, sum_buf, m2, local_count, group, world_size)
    inv_count = count.clamp(min=1).reciprocal_()
    return buf, _Moments(count, inv_count, mean, m2.mul_(inv_count), offset, 1.0)


def _update_running_stats(running_mean: Tensor, running_var: Tensor, moments: _Moments, momentum: float) -> None:
    """Move the running mean and unbiased variance towards the batch's (count >= 2 here)."""
    running_mean.lerp_(_as(moments.mean, running_mean), momentum)
    var, count = _as(moments.var, running_var), moments.count
    if isinstance(count, int):
        # unbiased = var * n / (n - 1) = var + var / (n - 1): a lerp and a scaled add, no temporary.
        running_var.lerp_(var, momentum).add_(var, alpha=momentum / (count - 1))
    else:
        running_var.lerp_(var * count / (count - 1), momentum)


def _gather_moments(
    approx_mean: Tensor, sum_buf: Tensor, m2: Tensor, local_count: int,
    group: dist.ProcessGroup, world_size: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(count, mean, mean - approx_mean, M2)`` over every rank of ``group``: ONE all_gather."""
    num_channels = approx_mean.numel()
    stats = torch.empty(2 * num_channels + 1, dtype=approx_mean.dtype, device=approx_mean.device)
    stats[0] = local_count
    torch.add(approx_mean, sum_buf, alpha=1.0 / max(local_count, 1), out=stats[1 : num_channels + 1])
    stats[num_channels + 1 :] = m2
    # Flat output: gloo accepts only the concatenated form, not a (world_size, K) stack.
    gathered = stats.new_empty(world_size * stats.numel())
    _all_gather_single(gathered, stats, group=group)
    count, reference, mean_shift, m2 = _merge_moments(gathered.view(world_size, -1))
    # The offset from this rank's m0 as (reference - m0) + shift: the first difference is exact
    # when both are close, so the output does not round the global mean (~|mu| ulp) twice.
    offset = (reference - approx_mean).add_(mean_shift)
    return count, reference + mean_shift, offset, m2


def _sum_of_products(a: Tensor, b: Tensor) -> Tensor:
    """Per-channel ``sum(a * b)`` over all other dims, without an ``a``-sized temporary.

    Row blocks of ~1 MiB (CPU: stays in L2) or ~16 MiB (GPU: few launches) are multiplied
    and reduced one at a time; a full-size product would cost as much as the reduction in
    fresh-memory page faults and would add a tensor to the peak memory.
    """
    dims = _reduce_dims(a)
    block_bytes = (1 << 20) if a.device.type == "cpu" else (16 << 20)
    total_bytes = a.numel() * a.element_size()
    if total_bytes <= block_bytes:  # the common small case first: two ops, nothing else
        return torch.sum(a * b, dims)
    rows = max(block_bytes * a.shape[0] // total_bytes, 1)
    total = torch.sum(a[:rows] * b[:rows], dims)
    for start in range(rows, a.shape[0], rows):
        total.add_(torch.sum(a[start : start + rows] * b[start : start + rows], dims))
    return total


def _check_global_count(count: int | Tensor, local_count: int, shape: torch.Size) -> bool:
    """Raise if the global batch has 1 value per channel; return whether it has any.

    Only a rank that holds fewer than 2 values can see a global count below 2, so only such a
    rank pays for the device-to-host copy of a gathered count. Every rank of a 1-value batch
    raises, so no peer is left waiting in the backward collective.
    """
    if local_count >= 2:
        return True
    global_count = count if isinstance(count, int) else int(count.item())
    if global_count == 1:
        raise ValueError(
            f"Expected more than 1 value per channel when training, got input of shape "
            f"{tuple(shape)} and 1 value per channel over all ranks; use a larger batch."
        )
    return global_count > 0


def _merge_moments(gathered: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Merge per-rank rows ``[count, mean, M2]`` (Chan et al.) into the global count, a reference
    mean (one rank's), the global mean's shift from it, and the global M2."""
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
    return count, reference, mean_shift, m2
