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
from lightning.pytorch.plugins import LayerSync, TorchSyncBatchNorm
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.nn import Module
from typing_extensions import override

from parallel.batchnorm.syncbn import SyncBatchNorm
from parallel.dist_utils import consecutive_rank_group
from strategies.options import check_syncbn_group_size

__all__ = ["BatchNormSyncChoice", "CustomSyncBatchNorm"]


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
        """Replace every BatchNorm layer (any ``_BatchNorm``, user subclasses included) by :class:`SyncBatchNorm`."""
        return SyncBatchNorm.convert(model, self._process_group, compile=self._compile)

    @override
    def revert(self, model: Module) -> Module:
        """Turn every :class:`SyncBatchNorm` in ``model`` back into the class it replaced."""
        return SyncBatchNorm.revert(model)


class BatchNormSyncChoice:
    """Which ``LayerSync`` plugin converts BatchNorm while ``custom_ddp`` fits.

    A plugin the user passed (``plugins=[CustomSyncBatchNorm(group)]``) is kept; Lightning's
    CUDA-only ``TorchSyncBatchNorm`` (``Trainer(sync_batchnorm=True)``) is replaced; otherwise
    the strategy's ``syncbn_group_size`` / ``syncbn_compile`` options decide.
    """

    def __init__(self, group_size: int | None, compile: bool, timeout: timedelta | None) -> None:
        self._group_size, self._compile, self._timeout = group_size, compile, timeout
        self._groups: tuple[object, CustomSyncBatchNorm] | None = None  # (world group, plugin for its blocks)

    def plugin(self, current: LayerSync | None) -> LayerSync:
        """The plugin for this fit, given the one Lightning's connector set (``strategy._layer_sync``)."""
        if current is not None and not isinstance(current, TorchSyncBatchNorm):
            if self._group_size is not None or self._compile:
                chosen = "syncbn_compile=True" if self._group_size is None else f"syncbn_group_size={self._group_size}"
                raise ValueError(
                    f"CustomDDPStrategy: {chosen} and the plugin {type(current).__name__} both choose "
                    "the BatchNorm sync; pass only one"
                )
            return current  # a plugin the user passed, e.g. CustomSyncBatchNorm(process_group)
        if isinstance(current, TorchSyncBatchNorm):
            rank_zero_info("custom_ddp: replacing torch.nn.SyncBatchNorm (sync_batchnorm=True) by the hand-written one")
        if self._group_size is None:
            return CustomSyncBatchNorm(compile=self._compile)
        # dist.new_group is collective and its groups live as long as the world group: made once per
        # world, on every rank (a second fit in the same processes reuses them).
        if self._groups is None or self._groups[0] is not dist.group.WORLD:
            check_syncbn_group_size(self._group_size, dist.get_world_size())
            plugin = CustomSyncBatchNorm.in_consecutive_groups(self._group_size, self._timeout, self._compile)
            self._groups = (dist.group.WORLD, plugin)
        return self._groups[1]
