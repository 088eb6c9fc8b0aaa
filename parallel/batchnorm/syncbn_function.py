"""The autograd function behind :class:`parallel.batchnorm.syncbn.SyncBatchNorm`: one collective per pass.

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

The passes over x-sized memory (first moments, normalisation, backward sums, input gradient)
come from a :class:`parallel.batchnorm.syncbn_kernels.Kernels` set: the eager reference by default, the
same formulas compiled with ``torch.compile`` for ``SyncBatchNorm(compile=True)``. Collectives and
the C-sized math between the passes are here, shared by both.

Pure torch; no Lightning import.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

import torch
import torch.distributed as dist
from torch import Tensor
from torch.autograd.function import once_differentiable

from parallel.batchnorm.syncbn_kernels import EAGER_KERNELS, Kernels
from parallel.torch_compat import all_gather_single

__all__ = ["StatsExchange", "check_global_count", "sync_batch_norm"]


class StatsExchange(Protocol):
    """The two collectives of a group through another transport (:mod:`parallel.host.host_exchange`)."""

    def fits(self, device: torch.device, nbytes: int) -> bool:
        """Whether a tensor of ``nbytes`` on ``device`` can go this way (else: the group's collectives)."""

    def all_gather(self, tensor: Tensor) -> Tensor:
        """Every rank's ``tensor``, flat, in rank order."""

    def all_reduce_(self, tensor: Tensor) -> Tensor:
        """The sum over ranks, in place."""


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
    kernels: Kernels | None = None,
    exchange: StatsExchange | None = None,
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
        kernels: The x-sized passes (:mod:`parallel.batchnorm.syncbn_kernels`); ``None``, or a set that does
            not handle ``x`` (an empty local batch, a small input), for the eager reference.
        exchange: With ``group``: the same ranks' collectives through another transport
            (:class:`parallel.host.host_exchange.SharedMemoryExchange`); ``None``, or one whose capacity the
            statistics of ``x`` exceed, for ``group``'s own collectives.

    Returns:
        The normalised tensor, in ``x``'s dtype and memory format.
    """
    if kernels is None or not kernels.handles(x):
        kernels = EAGER_KERNELS
    stats_bytes = (2 * x.shape[1] + 1) * torch.promote_types(x.dtype, torch.float32).itemsize
    if exchange is not None and not exchange.fits(x.device, stats_bytes):
        exchange = None
    args = (x, weight, bias, running_mean, running_var, momentum, eps, group, world_size, kernels, exchange)
    if not torch.is_autocast_enabled(x.device.type):
        return _SyncBatchNormFunction.apply(*args)
    # Statistics and reductions run in (at least) fp32 whatever the autocast context says;
    # only the output goes back to the input dtype.
    with torch.autocast(x.device.type, enabled=False):
        return _SyncBatchNormFunction.apply(*args)


class _SyncBatchNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, *args: Any) -> Tensor:  # type: ignore[override]
        # The arguments of sync_batch_norm, which documents them (their types too), in its order.
        x, weight, bias, running_mean, running_var, momentum, eps, group, world_size, kernels, exchange = args
        local_count = x.numel() // x.shape[1]
        state, approx_mean, moments = _batch_moments(x, kernels, local_count, group, world_size, exchange)
        has_values = check_global_count(moments.count, local_count, x.shape)
        if running_mean is not None and running_var is not None and has_values:
            _update_running_stats(running_mean, running_var, moments, momentum)
        invstd = moments.var.add_(eps).rsqrt_()
        scale = invstd if weight is None else invstd * weight
        # Save the input itself (alive anyway for the caller) and C-sized vectors, never x_hat.
        ctx.save_for_backward(x, moments.mean, invstd, scale)
        ctx.group, ctx.exchange, ctx.inv_count, ctx.kernels = group, exchange, moments.inv_count, kernels
        ctx.weight_dtype = None if weight is None else weight.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        # y = (x - mu) * scale + beta = (x - m0) * scale + (beta - (mu - m0) * scale): x - m0 is
        # centred, so |mu| >> sigma costs no precision (torch's x * scale + (beta - mu * scale)
        # rounds |mu| * scale).
        if bias is None:
            shift = torch.mul(moments.offset, scale).mul_(-moments.offset_scale)
        else:
            shift = torch.addcmul(bias, moments.offset, scale, value=-moments.offset_scale)
        out = kernels.normalise(state, approx_mean, scale, shift)
        return out if out.dtype == x.dtype else out.to(x.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        x, mean, invstd, scale = ctx.saved_tensors
        state, sum_dy, sum_dy_xmu = ctx.kernels.backward_sums(x, grad_out, mean)
        # Parameter gradients are the LOCAL sums, as in torch.nn.SyncBatchNorm.
        grad_weight = sum_dy_xmu * invstd if ctx.needs_input_grad[1] else None
        grad_bias = sum_dy if ctx.needs_input_grad[2] else None
        if ctx.group is not None:
            sums = torch.cat([sum_dy, sum_dy_xmu])
            if ctx.exchange is None:
                dist.all_reduce(sums, group=ctx.group)
            else:
                ctx.exchange.all_reduce_(sums)
            sum_dy, sum_dy_xmu = sums.view(2, -1).unbind()
        grad_input = None
        if ctx.needs_input_grad[0]:
            # dL/dx = scale * g + coef_xmu * (x - mu) + coef_const, with scale = gamma * r and
            # coef_const = -scale * sum(g) / n, coef_xmu = -scale * r^2 * sum(g * (x - mu)) / n.
            minus_scale_over_n = scale * -ctx.inv_count
            coef_const = minus_scale_over_n * sum_dy
            coef_xmu = minus_scale_over_n.mul_(invstd).mul_(invstd).mul_(sum_dy_xmu)
            grad_input = ctx.kernels.input_grad(state, grad_out, mean, scale, coef_xmu, coef_const)
            grad_input = grad_input if grad_input.dtype == x.dtype else grad_input.to(x.dtype)
        if grad_weight is not None and grad_weight.dtype != ctx.weight_dtype:
            grad_weight = grad_weight.to(ctx.weight_dtype)
        if grad_bias is not None and grad_bias.dtype != ctx.bias_dtype:
            grad_bias = grad_bias.to(ctx.bias_dtype)
        return grad_input, grad_weight, grad_bias, None, None, None, None, None, None, None, None


class _Moments(NamedTuple):
    """The batch's statistics per channel (over every rank of the group, if any)."""

    count: int | Tensor  # an int without a group, the gathered 1-element total with one
    inv_count: float | Tensor
    mean: Tensor
    var: Tensor  # biased
    offset: Tensor  # mean - m0 == offset * offset_scale (offset_scale folds a 1/n into a later op)
    offset_scale: float


def _batch_moments(
    x: Tensor,
    kernels: Kernels,
    local_count: int,
    group: dist.ProcessGroup | None,
    world_size: int,
    exchange: StatsExchange | None,
) -> tuple[Tensor, Tensor, _Moments]:
    """The kernels' state after their first pass, the rounded local mean ``m0`` and the batch's
    moments (merged over ``group`` with ONE all_gather when there is one)."""
    state, approx_mean, sum_buf, m2 = kernels.moments(x, local_count)
    inv_local = 1.0 / max(local_count, 1)
    if group is None:
        mean = torch.add(approx_mean, sum_buf, alpha=inv_local)
        return state, approx_mean, _Moments(local_count, inv_local, mean, m2.mul_(inv_local), sum_buf, inv_local)
    merged = _gather_moments(approx_mean, sum_buf, m2, local_count, group, world_size, exchange)
    count, inv_count, mean, offset, m2 = merged
    return state, approx_mean, _Moments(count, inv_count, mean, m2.mul_(inv_count), offset, 1.0)


def _as(value: Tensor, like: Tensor) -> Tensor:
    return value if value.dtype == like.dtype else value.to(like.dtype)


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
    approx_mean: Tensor,
    sum_buf: Tensor,
    m2: Tensor,
    local_count: int,
    group: dist.ProcessGroup,
    world_size: int,
    exchange: StatsExchange | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(count, 1 / max(count, 1), mean, mean - approx_mean, M2)`` over every rank of ``group``: ONE all_gather
    (``exchange``'s, if given)."""
    # Three torch calls build the row [count, mean, M2]: each call from Python costs microseconds, a share of a
    # small layer's time worth counting.
    local_mean = torch.add(approx_mean, sum_buf, alpha=1.0 / max(local_count, 1))
    stats = torch.cat([approx_mean.new_full((1,), local_count), local_mean, m2])
    if exchange is not None:
        gathered = exchange.all_gather(stats)
    else:  # flat output: gloo accepts only the concatenated form, not a (world_size, K) stack
        gathered = stats.new_empty(world_size * stats.numel())
        all_gather_single(gathered, stats, group=group)
    count, clamped_count, reference, mean_shift, m2 = _merge_moments(gathered.view(world_size, -1))
    # The offset from this rank's m0 as (reference - m0) + shift: the first difference is exact
    # when both are close, so the output does not round the global mean (~|mu| ulp) twice.
    offset = (reference - approx_mean).add_(mean_shift)
    return count, clamped_count.reciprocal_(), reference + mean_shift, offset, m2


def check_global_count(count: int | Tensor, local_count: int, shape: torch.Size) -> bool:
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


def _merge_moments(gathered: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Merge per-rank rows ``[count, mean, M2]`` (Chan et al.) into the global count, ``max(count, 1)``, a
    reference mean (one rank's), the global mean's shift from it, and the global M2."""
    num_channels = (gathered.shape[1] - 1) // 2
    counts, means, m2s = gathered.split([1, num_channels, num_channels], dim=1)
    count = counts.sum()
    clamped_count = count.clamp(min=1)
    # Weighted sums of the deviations from one rank's mean, not of the means: n_k * mu_k is
    # large when |mu| >> sigma and its fp32 rounding would shift the merged mean.
    reference = means[counts.argmax()]
    deviations = means - reference
    mean_shift = (counts * deviations).sum(0) / clamped_count
    m2 = m2s.sum(0) + (counts * (deviations - mean_shift).square()).sum(0)
    return count, clamped_count, reference, mean_shift, m2
