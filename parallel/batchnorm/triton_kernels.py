"""SyncBatchNorm's CUDA kernels in Triton: five launches per layer and step, as many as torch's CUDA SyncBatchNorm.

Imported only by :mod:`parallel.batchnorm.syncbn_fused`, lazily: ``triton.jit`` reads ``TRITON_INTERPRET`` when
this module is imported (``TRITON_INTERPRET=1`` runs every kernel on CPU tensors in Triton's numpy interpreter,
how the tests check them without a GPU).

The input is seen as ``(N, C, S)`` with strides ``(stride_n, stride_c, stride_s)``: the spatial dimensions of a
contiguous or a channels_last tensor merge into one (the caller checks that they do), so both memory formats
run in place. Programs are laid out per channel (reductions: one program per channel, as torch's NCHW statistics kernel
has one block per channel) or per block of ``N * S`` positions and channel (elementwise passes: the blocks on
the grid's first axis, which has no 65,535 limit). Arithmetic runs in the statistics buffer's dtype (fp32 at least,
as in the eager reference); loads of a bf16/fp16 input widen, stores narrow.

=========== ====================================================================================
kernel      what it does (the formulas are :mod:`parallel.batchnorm.syncbn_function`'s)
=========== ====================================================================================
moments     this rank's ``[count, mean, M2]`` row (the all_gather's input), chunk by chunk (Chan)
merge       the gathered rows -> what backward keeps (mean, invstd, count) and what the forward's
            normalise reads (scale, shift); the running statistics in place
normalise   ``y = (x - m0) * scale + shift``
grad_sums   ``[sum(g), sum(g (x - mu))]`` (the all_reduce's input); the local dgamma, dbeta
grad_input  ``dL/dx = g * scale + (x - mu) * coef_xmu + coef_const``, coefficients per channel inline
=========== ====================================================================================

Backward keeps ``2C + 1`` values per layer (``keep``), as torch's CUDA SyncBatchNorm keeps ``2C`` and a count per
rank; ``scale`` is recomputed from the weight (saved by reference, as torch does). Its ``x - mu`` uses the mean
rounded to the statistics' dtype, as the eager reference's backward does: for an fp32 input that rounding is at
most half the input's own spacing near ``mu``. Keeping ``m0`` and the offset from it instead cost one more C-vector
and bought little (2 ranks, 1e4 + N(0, 4), against fp64: dgamma 4.5e-3 vs 6.9e-3, dL/dx and the output the same).
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["grad_input_kernel", "grad_sums_kernel", "merge_kernel", "moments_kernel", "normalise_kernel"]


@triton.jit
def _position(idx, S, stride_n, stride_c, stride_s, channel):
    """Memory offset of element ``idx`` of the channel's ``N * S`` positions."""
    n = (idx // S).to(tl.int64)
    s = (idx % S).to(tl.int64)
    return n * stride_n + channel.to(tl.int64) * stride_c + s * stride_s


@triton.jit
def _load(ptr, idx, total, S, stride_n, stride_c, stride_s, channel, acc: tl.constexpr):
    """The channel's values at positions ``idx`` (0 from ``total`` on), widened to ``acc``."""
    where = _position(idx, S, stride_n, stride_c, stride_s, channel)
    return tl.load(ptr + where, mask=idx < total, other=0.0).to(acc)


@triton.jit
def moments_kernel(x_ptr, stats_ptr, total, S, stride_n, stride_c, stride_s, C, BLOCK: tl.constexpr):
    """``stats = [count, mean, M2, m0]`` (C-vectors) of this rank: the first ``2C + 1`` values are the all_gather's
    row, ``m0`` the centre of the elementwise passes. One program per channel, two reads of its values, as the
    eager reference: ``m0`` chunk by chunk (Chan et al.), then the deviations from it, where nothing cancels even
    for 1e4 + N(0, 1): ``mean = m0 + sum(x - m0) / n``, ``M2 = sum((x - m0)^2) - sum(x - m0)^2 / n``."""
    channel = tl.program_id(0)
    acc = stats_ptr.dtype.element_ty
    count = tl.zeros((), dtype=acc)
    centre = tl.zeros((), dtype=acc)
    for start in range(0, total, BLOCK):
        idx = start + tl.arange(0, BLOCK)
        inside = idx < total
        x = _load(x_ptr, idx, total, S, stride_n, stride_c, stride_s, channel, acc)
        chunk_count = tl.sum(inside.to(acc), axis=0)
        merged = count + chunk_count
        centre += (tl.sum(x, axis=0) / chunk_count - centre) * (chunk_count / merged)
        count = merged
    sum_dev = tl.zeros((BLOCK,), dtype=acc)
    sum_sq = tl.zeros((BLOCK,), dtype=acc)
    for start in range(0, total, BLOCK):
        idx = start + tl.arange(0, BLOCK)
        inside = idx < total
        x = _load(x_ptr, idx, total, S, stride_n, stride_c, stride_s, channel, acc)
        deviation = tl.where(inside, x - centre, 0.0)
        sum_dev += deviation
        sum_sq += deviation * deviation
    total_dev = tl.sum(sum_dev, axis=0)
    divisor = tl.maximum(count, 1.0)
    tl.store(stats_ptr + 1 + channel, centre + total_dev / divisor)
    tl.store(stats_ptr + 1 + C + channel, tl.maximum(tl.sum(sum_sq, axis=0) - total_dev * total_dev / divisor, 0.0))
    tl.store(stats_ptr + 1 + 2 * C + channel, centre)
    if channel == 0:  # count, not `total`: an int argument equal to 1 is specialised into a constant
        tl.store(stats_ptr, count)


@triton.jit
def _gathered_row(gathered_ptr, rank, row, channel, inside, acc: tl.constexpr):
    """Rank ``rank``'s gathered ``count`` and its per-channel ``mean``, widened to ``acc``."""
    rank_row = gathered_ptr + rank * row
    return tl.load(rank_row).to(acc), tl.load(rank_row + 1 + channel, mask=inside, other=0.0).to(acc)


@triton.jit
def _reference_and_count(gathered_ptr, world_size, row, channel, inside, acc: tl.constexpr, BLOCK_C: tl.constexpr):
    """The mean of the first rank with the most values (the same rank on every rank) and the global count."""
    count = tl.zeros((), dtype=acc)
    best = tl.full((), -1.0, dtype=acc)
    reference = tl.zeros((BLOCK_C,), dtype=acc)
    for rank in range(0, world_size):
        rank_count, rank_mean = _gathered_row(gathered_ptr, rank, row, channel, inside, acc)
        reference = tl.where(rank_count > best, rank_mean, reference)
        best = tl.maximum(best, rank_count)
        count += rank_count
    return reference, count


@triton.jit
def _mean_shift_and_var(
    gathered_ptr, world_size, row, C, channel, inside, reference, count, acc: tl.constexpr, BLOCK_C: tl.constexpr
):
    """The global mean's distance from ``reference`` and the biased variance, from every rank's mean and M2 (Chan):
    the means enter only as deviations from ``reference``, so nothing cancels."""
    divisor = tl.maximum(count, 1.0)
    shift_sum = tl.zeros((BLOCK_C,), dtype=acc)
    for rank in range(0, world_size):
        rank_count, rank_mean = _gathered_row(gathered_ptr, rank, row, channel, inside, acc)
        shift_sum += rank_count * (rank_mean - reference)
    mean_shift = shift_sum / divisor
    m2 = tl.zeros((BLOCK_C,), dtype=acc)
    for rank in range(0, world_size):
        rank_count, rank_mean = _gathered_row(gathered_ptr, rank, row, channel, inside, acc)
        rank_m2 = tl.load(gathered_ptr + rank * row + 1 + C + channel, mask=inside, other=0.0).to(acc)
        deviation = rank_mean - reference - mean_shift
        m2 += rank_m2 + rank_count * deviation * deviation
    return mean_shift, m2 / divisor


@triton.jit
def _update_running_stats(
    running_mean_ptr, running_var_ptr, channel, inside, mean, var, count, momentum, acc: tl.constexpr
):
    """``running += momentum * (batch - running)``, with the unbiased variance (the caller knows count >= 2)."""
    old_mean = tl.load(running_mean_ptr + channel, mask=inside, other=0.0).to(acc)
    old_var = tl.load(running_var_ptr + channel, mask=inside, other=0.0).to(acc)
    unbiased = var * (count / (count - 1.0))
    tl.store(running_mean_ptr + channel, old_mean + momentum * (mean - old_mean), mask=inside)
    tl.store(running_var_ptr + channel, old_var + momentum * (unbiased - old_var), mask=inside)


@triton.jit
def merge_kernel(
    gathered_ptr, own_ptr, weight_ptr, bias_ptr, running_mean_ptr, running_var_ptr, keep_ptr, out_ptr,
    world_size, C, momentum, eps,
    HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, UPDATE_RUNNING: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """Merge ``world_size`` gathered rows into ``keep = [mean, invstd, count]`` (what backward reads: 2 C-vectors and
    the global count, as torch keeps) and ``out = [scale, shift]`` (the forward's normalise, whose centre is this
    rank's ``m0``). The reference mean is that of the first rank with the most values, on every rank, so every rank
    computes the same mean and running statistics; ``shift = beta - ((reference - m0) + mean_shift) * scale``: the
    output does not round ``|mu| * scale`` (torch's ``x * scale + (beta - mu * scale)`` does), as in the eager
    reference."""
    channel = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    inside = channel < C
    acc = keep_ptr.dtype.element_ty
    row = 2 * C + 1
    reference, count = _reference_and_count(gathered_ptr, world_size, row, channel, inside, acc, BLOCK_C)
    mean_shift, var = _mean_shift_and_var(
        gathered_ptr, world_size, row, C, channel, inside, reference, count, acc, BLOCK_C
    )
    mean = reference + mean_shift
    own_mean = tl.load(own_ptr + 1 + 2 * C + channel, mask=inside, other=0.0).to(acc)
    offset = (reference - own_mean) + mean_shift
    invstd = 1.0 / tl.sqrt(var + eps)
    scale = invstd
    if HAS_WEIGHT:
        scale = invstd * tl.load(weight_ptr + channel, mask=inside, other=1.0).to(acc)
    shift = -offset * scale
    if HAS_BIAS:
        shift += tl.load(bias_ptr + channel, mask=inside, other=0.0).to(acc)
    if UPDATE_RUNNING:
        _update_running_stats(running_mean_ptr, running_var_ptr, channel, inside, mean, var, count, momentum, acc)
    tl.store(keep_ptr + channel, mean, mask=inside)
    tl.store(keep_ptr + C + channel, invstd, mask=inside)
    tl.store(out_ptr + channel, scale, mask=inside)
    tl.store(out_ptr + C + channel, shift, mask=inside)
    if tl.program_id(0) == 0:
        tl.store(keep_ptr + 2 * C, count)


@triton.jit
def normalise_kernel(
    x_ptr, y_ptr, centre_ptr, params_ptr, total, S, stride_n, stride_c, stride_s, C, BLOCK: tl.constexpr
):  # fmt: skip
    """``y = (x - m0) * scale + shift`` (``y`` has ``x``'s strides, ``m0`` at ``centre_ptr``); programs per (channel,
    block)."""
    channel = tl.program_id(1)
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    acc = params_ptr.dtype.element_ty
    x = _load(x_ptr, idx, total, S, stride_n, stride_c, stride_s, channel, acc)
    own_mean = tl.load(centre_ptr + channel)
    scale = tl.load(params_ptr + channel)
    shift = tl.load(params_ptr + C + channel)
    where = _position(idx, S, stride_n, stride_c, stride_s, channel)
    tl.store(y_ptr + where, (x - own_mean) * scale + shift, mask=idx < total)


@triton.jit
def grad_sums_kernel(
    x_ptr, g_ptr, keep_ptr, sums_ptr, grad_weight_ptr, grad_bias_ptr,
    total, S, stride_n, stride_c, stride_s, g_stride_n, g_stride_c, g_stride_s, C,
    WEIGHT_GRAD: tl.constexpr, BIAS_GRAD: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """``sums = [sum(g), sum(g (x - mu))]`` per channel, and the LOCAL dgamma = ``sum(g x_hat)``, dbeta = ``sum(g)``
    (the gradient sync averages them, as torch's SyncBatchNorm leaves it to); one program per channel."""
    channel = tl.program_id(0)
    acc = keep_ptr.dtype.element_ty
    mean = tl.load(keep_ptr + channel)
    sum_g = tl.zeros((BLOCK,), dtype=acc)
    sum_g_xmu = tl.zeros((BLOCK,), dtype=acc)
    for start in range(0, total, BLOCK):
        idx = start + tl.arange(0, BLOCK)
        x = _load(x_ptr, idx, total, S, stride_n, stride_c, stride_s, channel, acc)
        g = _load(g_ptr, idx, total, S, g_stride_n, g_stride_c, g_stride_s, channel, acc)  # 0 past the end
        xmu = x - mean  # -mean past the end, where g is 0
        sum_g += g
        sum_g_xmu += g * xmu
    total_g = tl.sum(sum_g, axis=0)
    total_g_xmu = tl.sum(sum_g_xmu, axis=0)
    tl.store(sums_ptr + channel, total_g)
    tl.store(sums_ptr + C + channel, total_g_xmu)
    if WEIGHT_GRAD:
        tl.store(grad_weight_ptr + channel, total_g_xmu * tl.load(keep_ptr + C + channel))
    if BIAS_GRAD:
        tl.store(grad_bias_ptr + channel, total_g)


@triton.jit
def grad_input_kernel(
    x_ptr, g_ptr, dx_ptr, keep_ptr, weight_ptr, sums_ptr,
    total, S, stride_n, stride_c, stride_s, g_stride_n, g_stride_c, g_stride_s, C,
    HAS_WEIGHT: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """``dL/dx = g * scale + (x - mu) * coef_xmu + coef_const`` with the global sums (``dx`` has ``x``'s strides):
    ``coef_const = -scale sum(g) / n``, ``coef_xmu = -scale invstd^2 sum(g (x - mu)) / n``."""
    channel = tl.program_id(1)
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    acc = keep_ptr.dtype.element_ty
    mean = tl.load(keep_ptr + channel)
    invstd = tl.load(keep_ptr + C + channel)
    scale = invstd
    if HAS_WEIGHT:  # as the forward's merge computed it
        scale = invstd * tl.load(weight_ptr + channel).to(acc)
    minus_scale_over_n = -scale / tl.maximum(tl.load(keep_ptr + 2 * C), 1.0)
    coef_const = minus_scale_over_n * tl.load(sums_ptr + channel)
    coef_xmu = minus_scale_over_n * invstd * invstd * tl.load(sums_ptr + C + channel)
    x = _load(x_ptr, idx, total, S, stride_n, stride_c, stride_s, channel, acc)
    g = _load(g_ptr, idx, total, S, g_stride_n, g_stride_c, g_stride_s, channel, acc)
    dx = g * scale + (x - mean) * coef_xmu + coef_const
    tl.store(dx_ptr + _position(idx, S, stride_n, stride_c, stride_s, channel), dx, mask=idx < total)
