"""Sparse gradients (``nn.Embedding(sparse=True)``, ``nn.EmbeddingBag(sparse=True)``) averaged over ranks.

A sparse gradient has no fixed size, so it cannot live in a flat bucket: torch DDP keeps such
parameters out of its dense buckets too. Here every rank gathers every rank's (indices, values),
concatenates them in rank order, divides the values by the world size and coalesces (duplicate
rows add up): the rank average, bitwise the same on every rank. Per step: ONE all_gather of every
sparse parameter's entry count (-1: no gradient on this rank), then per parameter one all_gather of
the indices and one of the values, padded to the largest count. A parameter no rank produced a
gradient for keeps ``grad=None``. Backend-neutral (gloo's sparse all_reduce has no NCCL twin).
Pure torch; no Lightning import.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["SparseGradSync", "sparse_gradient_params"]


def sparse_gradient_params(module: nn.Module) -> set[nn.Parameter]:
    """Parameters whose gradient is sparse: those of ``Embedding``/``EmbeddingBag`` with ``sparse=True``.

    The same rule as torch DDP's ``_build_params_for_reducer``.
    """
    return {
        param
        for layer in module.modules()
        if isinstance(layer, (nn.Embedding, nn.EmbeddingBag)) and layer.sparse
        for param in layer.parameters(recurse=False)
    }


def _gather_padded(tensor: torch.Tensor, counts: list[int], group: dist.ProcessGroup | None) -> torch.Tensor:
    """Every rank's ``tensor`` (rows = counts[rank]) concatenated in rank order, via one padded all_gather."""
    longest = max(counts)
    padded = tensor.new_zeros((longest, *tensor.shape[1:]))
    padded[: tensor.shape[0]] = tensor
    gathered = [torch.empty_like(padded) for _ in counts]
    dist.all_gather(gathered, padded, group=group)
    return torch.cat([rows[:count] for rows, count in zip(gathered, counts, strict=True)])


class SparseGradSync:
    """Average the sparse gradients of ``params`` over ``process_group`` (see the module docstring).

    Args:
        params: The sparse-gradient parameters, in the same order on every rank.
        process_group: The group to average over (``None``: the default group).
        world_size: Its size; with 1 nothing is communicated.
    """

    def __init__(
        self, params: Sequence[nn.Parameter], process_group: dist.ProcessGroup | None, world_size: int
    ) -> None:
        self.params = list(params)
        self._group = process_group
        self._world_size = world_size

    def average(
        self, status: int = 0, divisor: float | None = None, contributes: bool = True
    ) -> tuple[int, ...] | None:
        """Replace each parameter's gradient by the rank average (every rank calls this, same order).

        ``status`` rides in the count all_gather; returns every rank's (None when nothing was sent),
        for a model whose gradients are all sparse (no dense bucket to carry it). ``divisor``: the world
        size unless given; ``contributes=False``: this rank sends no gradient (it trained nothing).
        """
        if not self.params or self._world_size == 1:
            return None
        local = [None if p.grad is None or not contributes else self._checked(p) for p in self.params]
        count = torch.tensor([-1 if g is None else g._nnz() for g in local] + [status], dtype=torch.int64)
        counts = [torch.empty_like(count) for _ in range(self._world_size)]
        dist.all_gather(counts, count, group=self._group)
        *per_param, statuses = torch.stack(counts).t().tolist()  # per_param[i][rank]
        for param, grad, param_counts in zip(self.params, local, per_param, strict=True):
            if max(param_counts) < 0:  # no rank sent a gradient: None everywhere
                param.grad = None
                continue
            param.grad = self._averaged(param, grad, [max(c, 0) for c in param_counts], divisor or self._world_size)
        return tuple(statuses)

    @staticmethod
    def _checked(param: nn.Parameter) -> torch.Tensor:
        if not param.grad.is_sparse:
            raise RuntimeError(
                f"a parameter of shape {tuple(param.shape)} from a sparse=True Embedding/EmbeddingBag "
                "got a dense gradient: set sparse=False on the layer, or keep its gradient sparse"
            )
        return param.grad.coalesce()

    def _averaged(
        self, param: nn.Parameter, grad: torch.Tensor | None, counts: list[int], divisor: float
    ) -> torch.Tensor:
        if grad is None:
            grad = torch.sparse_coo_tensor(
                torch.zeros(1, 0, dtype=torch.int64, device=param.device),
                param.new_zeros((0, *param.shape[1:])),
                param.shape,
            ).coalesce()
        indices = _gather_padded(grad.indices().t().contiguous(), counts, self._group).t()
        values = _gather_padded(grad.values(), counts, self._group) / divisor
        return torch.sparse_coo_tensor(indices, values, param.shape).coalesce()
