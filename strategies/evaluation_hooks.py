"""The strategy hooks of scatter evaluation and of gathers of uneven shapes, for :class:`~strategies.custom_ddp.CustomDDPStrategy`.

A mixin placed before ``DDPStrategy``: each evaluation hook delegates in one line to the strategy's
``_evaluation`` (:class:`strategies.evaluation.ScatteredEvaluation`, the one owner of scatter
evaluation), and the gathers call :mod:`parallel.uneven_gather`. Scatter evaluation gives ranks
shards of different lengths, so anything a rank keeps per sample has a different number of rows on
each rank: :meth:`ScatterEvaluationHooks.all_gather` still returns ``ddp``'s shape, and
:meth:`ScatterEvaluationHooks.all_gather_samples` returns each sample once, in dataset order.
"""

from __future__ import annotations

from typing import Any, Optional

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from lightning_utilities.core.apply_func import apply_to_collection
from typing_extensions import override

from parallel.uneven_gather import all_gather_padded, all_gather_rows
from strategies.evaluation import ScatteredEvaluation

__all__ = ["ScatterEvaluationHooks"]


class ScatterEvaluationHooks:
    """Strategy hooks of scatter evaluation and uneven gathers; mix in before ``DDPStrategy``."""

    _evaluation: ScatteredEvaluation  # set by the strategy's __init__

    @property
    def _trainer(self) -> Optional[pl.Trainer]:
        module = self.lightning_module
        return None if module is None else module._trainer

    @property
    def _collective_device(self) -> torch.device:
        return self.root_device if self.process_group_backend == "nccl" else torch.device("cpu")

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Evaluation loaders are sharded by the scatter: let the sampler Lightning injects be the
        # identity (full dataset, no padding duplicates, no "use devices=1" warning).
        if self._evaluation.applies(self._trainer):
            return {"num_replicas": 1, "rank": 0}
        return super().distributed_sampler_kwargs

    @override
    def process_dataloader(self, dataloader: object) -> object:
        if not self._evaluation.applies(self._trainer):
            return dataloader
        return self._evaluation.loader(dataloader, self._trainer, device=self._collective_device)

    @override
    def on_validation_start(self) -> None:
        self._evaluation.start(self._trainer, self.lightning_module, device=self._collective_device)

    @override
    def on_test_start(self) -> None:
        self._evaluation.start(self._trainer, self.lightning_module, device=self._collective_device)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluation.step(super().validation_step, *args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluation.step(super().test_step, *args, **kwargs)

    @override
    def on_validation_end(self) -> None:
        self._evaluation.end()

    @override
    def on_test_end(self) -> None:
        self._evaluation.end()

    # ----------------------------------------------------------------- gathers of uneven shapes

    @override
    def all_gather(self, tensor: torch.Tensor, group: Optional[Any] = None, sync_grads: bool = False) -> torch.Tensor:
        """``ddp``'s result on any shapes: ``world_size`` stacked along dim 0, short ranks padded.

        Shapes are exchanged first, so every rank takes the same decision: equal shapes give
        exactly ``ddp``'s gather; row counts that differ (per-sample outputs of uneven evaluation
        shards) are padded with repeats of the rank's own rows, as ``DistributedSampler`` pads, with
        a warning; other differences raise on every rank. :meth:`all_gather_samples` gives each
        sample once instead.
        """
        if not dist.is_available() or not dist.is_initialized():
            return tensor
        gathered, padding = all_gather_padded(tensor, group=group, sync_grads=sync_grads,
                                              device=self._collective_device)
        if padding:
            rank_zero_warn(f"custom_ddp: all_gather of per-rank row counts that differ: {padding} of the "
                           f"{gathered.shape[0] * gathered.shape[1]} gathered rows are padding (repeats of a rank's "
                           "own rows, as DistributedSampler pads). To get each sample once, in dataset order, "
                           "use self.trainer.strategy.all_gather_samples(...).")
        return gathered

    def all_gather_samples(self, data: Any, group: Optional[Any] = None, sync_grads: bool = False) -> Any:
        """Every rank's rows of each tensor in ``data`` once, concatenated in rank order.

        Scatter evaluation gives each rank a contiguous shard, so per-sample outputs kept in
        ``validation_step``/``test_step`` come back in dataset order, each sample once (Lightning's
        ``all_gather`` under ``ddp`` repeats padded samples). ``data``: a tensor or a collection of
        tensors; a 0-d tensor counts as one row; ``sync_grads=True`` keeps the gather differentiable.
        """
        if not dist.is_available() or not dist.is_initialized():
            return data
        return apply_to_collection(data, torch.Tensor, all_gather_rows, group=group, sync_grads=sync_grads,
                                   device=self._collective_device)
