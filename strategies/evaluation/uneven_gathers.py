"""Gathers of uneven shapes for :class:`~strategies.custom_ddp.CustomDDPStrategy` (a strategy mixin).

Scatter evaluation (:mod:`scatter_eval`) gives ranks shards of different lengths, so
anything a rank keeps per sample has a different number of rows on each rank, where Lightning's
``all_gather`` (a plain ``dist.all_gather``) needs equal shapes and gloo aborts the process on a
mismatch. :meth:`UnevenGathers.all_gather` still returns ``ddp``'s shape, and
:meth:`UnevenGathers.all_gather_samples` returns each sample once, in dataset order; the
collectives are :mod:`parallel.evaluation.uneven_gather`'s.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from lightning_utilities.core.apply_func import apply_to_collection
from typing_extensions import override

from parallel.evaluation.uneven_gather import all_gather_padded, all_gather_rows

__all__ = ["UnevenGathers"]


class UnevenGathers:
    """``all_gather`` for uneven row counts and ``all_gather_samples``; mix in before ``DDPStrategy``."""

    _collective_device: torch.device  # the strategy's: CPU for gloo, the rank's device for NCCL

    @override
    def all_gather(self, tensor: torch.Tensor, group: Any | None = None, sync_grads: bool = False) -> torch.Tensor:
        """``ddp``'s result on any shapes: ``world_size`` stacked along dim 0, short ranks padded.

        Shapes are exchanged first, so every rank takes the same decision: equal shapes give
        exactly ``ddp``'s gather; row counts that differ (per-sample outputs of uneven evaluation
        shards) are padded with repeats of the rank's own rows, as ``DistributedSampler`` pads, with
        a warning; other differences raise on every rank. :meth:`all_gather_samples` gives each
        sample once instead.
        """
        if not dist.is_available() or not dist.is_initialized():
            return tensor
        gathered, padding = all_gather_padded(
            tensor, group=group, sync_grads=sync_grads, device=self._collective_device
        )
        if padding:
            rank_zero_warn(
                f"custom_ddp: all_gather of per-rank row counts that differ: {padding} of the "
                f"{gathered.shape[0] * gathered.shape[1]} gathered rows are padding (repeats of a rank's "
                "own rows, as DistributedSampler pads). To get each sample once, in dataset order, "
                "use self.trainer.strategy.all_gather_samples(...)."
            )
        return gathered

    def all_gather_samples(self, data: Any, group: Any | None = None, sync_grads: bool = False) -> Any:
        """Every rank's rows of each tensor in ``data`` once, concatenated in rank order.

        Scatter evaluation gives each rank a contiguous shard, so per-sample outputs kept in
        ``validation_step``/``test_step`` come back in dataset order, each sample once (Lightning's
        ``all_gather`` under ``ddp`` repeats padded samples). ``data``: a tensor or a collection of
        tensors; a 0-d tensor counts as one row; ``sync_grads=True`` keeps the gather differentiable.
        """
        if not dist.is_available() or not dist.is_initialized():
            return data
        return apply_to_collection(
            data, torch.Tensor, all_gather_rows, group=group, sync_grads=sync_grads, device=self._collective_device
        )
