"""Lightning adapter: a ``LayerSync`` plugin that swaps BatchNorm layers for :class:`SyncBatchNorm`.

``DDPStrategy.setup`` calls :meth:`CustomSyncBatchNorm.apply` on the LightningModule when fitting
and ``teardown`` calls :meth:`CustomSyncBatchNorm.revert`. Works on CPU (gloo), where Lightning's
own ``TorchSyncBatchNorm`` (``torch.nn.SyncBatchNorm``) cannot run.

Example:
    >>> trainer = Trainer(strategy="custom_ddp", plugins=[CustomSyncBatchNorm()])  # doctest: +SKIP
    >>> plugin = CustomSyncBatchNorm(compile=True)  # the layers' passes run torch.compile'd  # doctest: +SKIP
    >>> plugin = CustomSyncBatchNorm.in_consecutive_groups(2)  # on every rank, dist initialised  # doctest: +SKIP
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist
from lightning.pytorch.plugins import LayerSync
from torch.nn import Module
from typing_extensions import override

from parallel.dist_utils import consecutive_rank_group
from parallel.syncbn import SyncBatchNorm

__all__ = ["CustomSyncBatchNorm"]


class CustomSyncBatchNorm(LayerSync):
    """Synchronise the batch statistics of every BatchNorm layer across ranks.

    Args:
        process_group: Group the layers synchronise over; ``None`` for the whole world.
        compile: Convert to ``SyncBatchNorm(compile=True)`` layers (``torch.compile``'d passes).
    """

    def __init__(self, process_group: dist.ProcessGroup | None = None, compile: bool = False) -> None:
        self._process_group = process_group
        self._compile = compile

    @classmethod
    def in_consecutive_groups(
        cls, group_size: int, timeout: timedelta | None = None, compile: bool = False
    ) -> CustomSyncBatchNorm:
        """Synchronise within blocks of ``group_size`` consecutive ranks (0..k-1, k..2k-1, ...).

        Every rank must call this at the same point: it creates every block's process group
        (:func:`parallel.dist_utils.consecutive_rank_group`); ``timeout`` bounds their collectives.
        """
        return cls(consecutive_rank_group(group_size, timeout), compile)

    @property
    def process_group(self) -> dist.ProcessGroup | None:
        """The group the converted layers synchronise over (``None``: the whole world)."""
        return self._process_group

    @property
    def compile(self) -> bool:
        """Whether the converted layers run their passes compiled."""
        return self._compile

    @override
    def apply(self, model: Module) -> Module:
        """Replace every BatchNorm layer (any ``_BatchNorm``, user subclasses included) in ``model`` by :class:`SyncBatchNorm`."""
        return SyncBatchNorm.convert(model, self._process_group, compile=self._compile)

    @override
    def revert(self, model: Module) -> Module:
        """Turn every :class:`SyncBatchNorm` in ``model`` back into the class it replaced."""
        return SyncBatchNorm.revert(model)
