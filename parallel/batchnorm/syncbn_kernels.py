"""The x-sized passes of SyncBatchNorm: the eager reference and the same math compiled.

:func:`parallel.batchnorm.syncbn_function.sync_batch_norm` runs four passes over x-sized memory (the
first moments, the normalisation, the backward's two reductions, the input gradient) with the
collectives and the C-sized math between them; a :class:`Kernels` set supplies the passes, so
every set runs the same collectives and the same formulas.

:data:`EAGER_KERNELS`, the readable reference, is plain eager torch. Large inputs are
memory-bound: the forward makes 6 passes over x-sized memory (mean of x; ``buf = x - m0``; sum
and sum of squares of ``buf``; scale and shift in place), the backward 6 (``x - mu``; sum of g;
sum of g (x - mu); the folded ``dL/dx = a * g + b * (x - mu) + c`` in three in-place passes),
each direction allocating ONE x-sized buffer (the output, ``dL/dx``), as torch's kernel does:
fresh large buffers cost page faults on CPU. Large CPU inputs (:data:`BLOCKED_MIN_BYTES`) run each
pass in row blocks that stay in L2 between its ops: 3 passes over memory forward, 2 backward.
Small inputs are dispatch-bound (~1 us per torch op called from Python, ~2 us when a Python
number must become a tensor operand): 1/n factors ride in ``alpha=`` / ``value=`` arguments,
and 2-D inputs broadcast (C,) vectors without views and scale-and-shift in one ``addcmul``.

:func:`compiled_kernels` writes each pass as one plain function of tensors and compiles it with
``torch.compile`` (inductor: fused C++ loops on CPU, Triton on CUDA): 2 reads of x forward
(mean; the deviations' sum and sum of squares in one loop) plus one read and one write to
normalise, one read of x and g for both backward sums, one pass for dL/dx; no call-by-call
dispatch. Only tensors enter a compiled function (a Python float would be specialised and
recompile per value); the batch dimension is marked dynamic, so a new batch size or a ragged
last batch reuses the graph (inductor still keeps separate graphs for batch sizes 1, 2-16 and
>= 17: at most 3 per layer shape, dtype and memory format, counted in tests/batchnorm/test_syncbn_compiled.py).
Layers of the same shape share every graph. If compiling fails (no C++ compiler, an inductor
error, an unsupported Python), the set warns ONCE and runs the same plain functions eagerly.

Pure torch; no Lightning import.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor

__all__ = ["COMPILED_KERNELS", "EAGER_KERNELS", "Kernels", "compiled_kernels", "one_line"]


class Kernels(NamedTuple):
    """The passes over x-sized memory. ``state`` is what a set carries from a reduction pass to
    the elementwise pass after it: the eager set's centred buffer (reused in place as the
    result), the compiled set's ``x`` itself (the difference is recomputed inside a fused loop).
    ``handles(x)``: whether the set is used for input ``x`` (else the eager set is)."""

    handles: Callable[[Tensor], bool]

    # x, local count -> (state, m0, sum(x - m0), M2 = sum((x - m0)^2) - sum(x - m0)^2 / n_local)
    moments: Callable[[Tensor, int], tuple[Tensor, Tensor, Tensor, Tensor]]
    # state, m0, scale, shift -> (x - m0) * scale + shift
    normalise: Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]
    # x, g, mu -> (state, sum(g), sum(g * (x - mu)))
    backward_sums: Callable[[Tensor, Tensor, Tensor], tuple[Tensor, Tensor, Tensor]]
    # state, g, mu, scale, coef_xmu, coef_const -> g * scale + (x - mu) * coef_xmu + coef_const
    input_grad: Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]


# ----------------------------------------------------------------------------- eager reference


def _eager_moments(x: Tensor, local_count: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``buf = x - m0`` (fp32 at least; the forward's only x-sized allocation, which becomes its
    output), ``m0``, ``sum(buf)`` and ``M2``.

    Corrected two-pass algorithm (Chan, Golub & LeVeque): ``m0`` is a first, rounded mean; the
    deviations ``buf`` give both its correction, ``mean(buf)``, and ``M2 = sum(buf^2) -
    sum(buf)^2 / n``, where nothing cancels even for 1e4 + N(0, 1) (``E[x^2] - E[x]^2`` would
    lose every digit there).
    """
    dims = _reduce_dims(x)
    acc_dtype = torch.promote_types(x.dtype, torch.float32)
    if local_count:
        approx_mean = x.mean(dims, dtype=acc_dtype)
    else:  # an empty shard: mean() would be NaN, and the gather would spread it
        approx_mean = x.new_zeros(x.shape[1], dtype=acc_dtype)
    if _blocked(x):
        buf, sum_buf, sum_squares = _centred_sums(x, approx_mean, None)
    else:
        buf = x - _per_channel(approx_mean, x)  # type promotion: fp32 at least
        sum_buf, sum_squares = buf.sum(dims), _sum_of_products(buf, buf)
    m2 = torch.addcmul(sum_squares, sum_buf, sum_buf, value=-1.0 / max(local_count, 1))
    return buf, approx_mean, sum_buf, m2.clamp_min_(0)


def _eager_normalise(buf: Tensor, approx_mean: Tensor, scale: Tensor, shift: Tensor) -> Tensor:
    """``buf * scale + shift`` in place (``buf`` is ``x - m0`` already)."""
    return _scale_shift_(buf, scale, shift)


def _eager_backward_sums(x: Tensor, grad_out: Tensor, mean: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The backward's one x-sized buffer (fp32 at least, by type promotion): ``x - mu``, which
    becomes dL/dx in place; ``sum(g)`` and ``sum(g * (x - mu))``."""
    if _blocked(x):
        return _centred_sums(x, mean, grad_out)
    buf = x - _per_channel(mean, x)
    return buf, grad_out.sum(_reduce_dims(x), dtype=mean.dtype), _sum_of_products(buf, grad_out)


def _eager_input_grad(buf: Tensor, grad_out: Tensor, mean: Tensor, scale: Tensor, coef_xmu: Tensor, coef_const: Tensor):
    scale = _per_channel(scale, buf)
    if not _blocked(buf):
        return _scale_shift_(buf, coef_xmu, coef_const).addcmul_(grad_out, scale)
    for rows in _row_blocks(buf, CPU_BLOCK_BYTES):
        _scale_shift_(buf[rows], coef_xmu, coef_const).addcmul_(grad_out[rows], scale)
    return buf


EAGER_KERNELS = Kernels(lambda x: True, _eager_moments, _eager_normalise, _eager_backward_sums, _eager_input_grad)
"""The readable reference: plain eager torch calls, one x-sized buffer per direction."""


# Above this many bytes a CPU input's passes run in row blocks of CPU_BLOCK_BYTES, which stay in L2 between a pass's
# ops. Below it the per-block calls cost more than they save (informal, 2 processes contending on 2 Zen 3 cores:
# 8x64x32x32 fp32, 2 MiB, 1.08-1.28x slower blocked; 32x128x32x32 to 128x64x32x32, 16-32 MiB, 0.83-0.94x).
BLOCKED_MIN_BYTES = 4 << 20
CPU_BLOCK_BYTES = 1 << 20


def _blocked(x: Tensor) -> bool:
    # Not inside a model the user compiles: inductor fuses the whole-tensor ops itself.
    large = x.device.type == "cpu" and x.dim() > 2 and x.numel() * x.element_size() > BLOCKED_MIN_BYTES
    return large and not torch.compiler.is_compiling()


def _row_blocks(x: Tensor, block_bytes: int) -> list[slice]:
    """Slices of dim 0 holding about ``block_bytes`` of ``x`` each (one row at least)."""
    rows = max(block_bytes * x.shape[0] // max(x.numel() * x.element_size(), 1), 1)
    return [slice(start, start + rows) for start in range(0, x.shape[0], rows)]


def _centred_sums(x: Tensor, centre: Tensor, other: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """Row block by row block: ``buf = x - centre`` (in ``centre``'s dtype at least), ``sum(o)`` and
    ``sum(buf * o)``, where ``o`` is ``other``, or ``buf`` itself when ``other`` is None."""
    dims, centre_view = _reduce_dims(x), _per_channel(centre, x)
    buf = torch.empty_like(x, dtype=torch.promote_types(x.dtype, centre.dtype))  # x's memory format
    sums, products = centre.new_zeros(centre.shape), centre.new_zeros(centre.shape)
    for rows in _row_blocks(buf, CPU_BLOCK_BYTES):
        block = torch.sub(x[rows], centre_view, out=buf[rows])
        factor = block if other is None else other[rows]
        sums.add_(factor.sum(dims, dtype=centre.dtype))
        products.add_(torch.sum(block * factor, dims))
    return buf, sums, products


def _reduce_dims(x: Tensor) -> int | list[int]:
    """Every dimension but the channel dimension 1 (a plain int for 2-D input: a cheaper call)."""
    return 0 if x.dim() == 2 else [0, *range(2, x.dim())]


def _per_channel(vector: Tensor, like: Tensor) -> Tensor:
    """A (C,) vector shaped to broadcast over ``like`` (N, C, *); a 2-D input needs no view."""
    return vector if like.dim() == 2 else vector.view(-1, *(1,) * (like.dim() - 2))


def _scale_shift_(buf: Tensor, scale: Tensor, shift: Tensor) -> Tensor:
    """``buf * scale + shift`` per channel, in place."""
    if buf.dim() == 2:
        # The vectors run along the contiguous dim: one vectorised pass.
        return torch.addcmul(shift, buf, scale, out=buf)
    # Two in-place ops: an addcmul with two per-channel (stride-0) operands runs
    # unvectorised on CPU, ~5x slower than both of these together.
    scale, shift = _per_channel(scale, buf), _per_channel(shift, buf)
    if not _blocked(buf):
        return buf.mul_(scale).add_(shift)
    for rows in _row_blocks(buf, CPU_BLOCK_BYTES):
        buf[rows].mul_(scale).add_(shift)
    return buf


def _sum_of_products(a: Tensor, b: Tensor) -> Tensor:
    """Per-channel ``sum(a * b)`` over all other dims, without an ``a``-sized temporary.

    Row blocks of ~1 MiB (CPU: stays in L2) or ~16 MiB (GPU: few launches) are multiplied
    and reduced one at a time; a full-size product would cost as much as the reduction in
    fresh-memory page faults and would add a tensor to the peak memory.
    """
    dims = _reduce_dims(a)
    block_bytes = CPU_BLOCK_BYTES if a.device.type == "cpu" else (16 << 20)
    if a.numel() * a.element_size() <= block_bytes:  # the common small case first: two ops, nothing else
        return torch.sum(a * b, dims)
    first, *rest = _row_blocks(a, block_bytes)
    total = torch.sum(a[first] * b[first], dims)
    for rows in rest:
        total.add_(torch.sum(a[rows] * b[rows], dims))
    return total


# ----------------------------------------------------------------------------- compiled passes
# The same formulas as the eager set, as plain functions of tensors: inductor fuses each into
# one or two loops. Accumulation in fp32 at least, results in x's dtype, as in the eager set.


def _sum_dtype(x: Tensor) -> torch.dtype:
    """The reductions' accumulator. Inductor's CPU sums run sequentially within 4,096-element
    chunks, where torch's eager sums are pairwise: in fp32 that made M2 (and so the output) ~10x
    less accurate than eager at 131,072 values per channel (1.4e-5 vs 1e-6 max error at offset
    1e4, 128x64x32x32). Summing the fp32 deviations in fp64 restores eager's accuracy (6.5e-7) at
    no measurable cost on CPU, where these passes are memory-bound. GPUs keep fp32 (slow fp64)."""
    return torch.float64 if x.device.type == "cpu" else torch.promote_types(x.dtype, torch.float32)


def _moments_pass(x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    acc, dims = torch.promote_types(x.dtype, torch.float32), _reduce_dims(x)
    xf = x.to(acc)
    approx_mean = xf.mean(dims)
    deviation = (xf - _per_channel(approx_mean, x)).to(_sum_dtype(x))  # centred in acc, as in eager
    sum_dev = deviation.sum(dims)
    m2 = (deviation * deviation).sum(dims) - sum_dev * sum_dev / (x.numel() // x.shape[1])
    return approx_mean, sum_dev.to(acc), m2.clamp_min(0).to(acc)


def _normalise_pass(x: Tensor, approx_mean: Tensor, scale: Tensor, shift: Tensor) -> Tensor:
    xf = x.to(approx_mean.dtype)
    return ((xf - _per_channel(approx_mean, x)) * _per_channel(scale, x) + _per_channel(shift, x)).to(x.dtype)


def _backward_sums_pass(x: Tensor, grad_out: Tensor, mean: Tensor) -> tuple[Tensor, Tensor]:
    dims, g = _reduce_dims(x), grad_out.to(_sum_dtype(x))
    xmu = (x.to(mean.dtype) - _per_channel(mean, x)).to(g.dtype)  # centred in acc, as in eager
    return g.sum(dims).to(mean.dtype), (g * xmu).sum(dims).to(mean.dtype)


def _input_grad_pass(x: Tensor, grad_out: Tensor, mean: Tensor, scale: Tensor, coef_xmu: Tensor, coef_const: Tensor):
    xmu = x.to(mean.dtype) - _per_channel(mean, x)
    grad = grad_out.to(mean.dtype) * _per_channel(scale, x) + xmu * _per_channel(coef_xmu, x)
    return (grad + _per_channel(coef_const, x)).to(x.dtype)


# Below this many elements, or on (N, C) inputs, the eager kernel was faster in informal 1-thread
# timings (a compiled call costs ~20 us of dynamo/AOT wrappers, 4 calls per step; inductor's
# reductions over the outer dim of (N, C) were no faster than torch's): the compiled set
# hands those inputs to the eager one.
COMPILED_MIN_ELEMENTS = 1 << 16


class _CompiledPass:
    """``fn`` compiled on its first call, with the batch dimension of its first ``batched``
    arguments dynamic; ``fn`` run eagerly once compiling has failed for any pass of the set."""

    def __init__(self, fn: Callable[..., Any], batched: int, backend: str | Callable[..., Any], failure: dict) -> None:
        self._fn, self._batched, self._backend, self._failure = fn, batched, backend, failure
        self._compiled: Callable[..., Any] | None = None

    def __call__(self, *args: Tensor) -> Any:
        # Inside a model the user compiles, the outer compile traces the plain function.
        if self._failure or torch.compiler.is_compiling():
            return self._fn(*args)
        try:
            if self._compiled is None:
                self._compiled = torch.compile(self._fn, backend=self._backend, dynamic=False)
            for tensor in args[: self._batched]:
                torch._dynamo.maybe_mark_dynamic(tensor, 0)
            return self._compiled(*args)
        except Exception as error:  # noqa: BLE001 -- any compile failure: eager gives the same result or the real error
            self._failure["error"] = error
            warnings.warn(
                f"SyncBatchNorm(compile=True): torch.compile failed ({one_line(error)}); running the "
                "same math eagerly (slower, same results)",
                RuntimeWarning,
                stacklevel=2,
            )
            return self._fn(*args)


def one_line(error: BaseException) -> str:
    """``Outer <- Root: first line of the root cause`` (dynamo wraps a backend's error; Triton a compiler's)."""
    root = error
    while (inner := getattr(root, "inner_exception", None) or root.__cause__) is not None:
        root = inner
    chain = type(error).__name__ + (f" <- {type(root).__name__}" if root is not error else "")
    return f"{chain}: {(str(root).strip().splitlines() or [''])[0][:200]}"


def compiled_kernels(
    backend: str | Callable[..., Any] = "inductor",
    min_elements: int = COMPILED_MIN_ELEMENTS,
    spatial_only: bool = True,
) -> Kernels:
    """A compiled kernel set (compiles lazily, on the first training forward/backward).

    Args:
        backend: ``torch.compile`` backend; a failing one makes the set warn once and run eagerly.
        min_elements: Smaller inputs go to the eager set (see :data:`COMPILED_MIN_ELEMENTS`).
        spatial_only: (N, C) inputs go to the eager set; (N, C, *) ones are compiled.
    """
    failure: dict = {}  # shared by the four passes: one failure (one warning) switches them all

    def compiled(fn: Callable[..., Any], batched: int) -> _CompiledPass:
        return _CompiledPass(fn, batched, backend, failure)

    moments, normalise = compiled(_moments_pass, 1), compiled(_normalise_pass, 1)
    backward_sums, input_grad = compiled(_backward_sums_pass, 2), compiled(_input_grad_pass, 2)
    return Kernels(
        handles=lambda x: x.numel() >= max(min_elements, 1) and (x.dim() > 2 or not spatial_only),
        moments=lambda x, local_count: (x, *moments(x)),
        normalise=normalise,
        backward_sums=lambda x, grad_out, mean: (x, *backward_sums(x, grad_out, mean)),
        input_grad=input_grad,
    )


COMPILED_KERNELS = compiled_kernels()
"""The set every ``SyncBatchNorm(compile=True)`` layer shares: layers of one shape share its graphs."""
