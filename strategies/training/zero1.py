"""ZeRO-1 for ``custom_ddp``: the configured optimizers re-created as
:class:`parallel.gradients.zero.ShardedOptimizer`."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import torch

from parallel.gradients.zero import ShardedOptimizer

__all__ = ["shard_optimizers"]

_REPOINTED_SCHEDULER_WARNING = r"Seems like `optimizer\.step\(\)` has been overridden after learning rate scheduler"


def shard_optimizers(
    optimizers: Sequence[torch.optim.Optimizer], lr_scheduler_configs: Sequence[Any]
) -> list[ShardedOptimizer]:
    """Each optimizer as a ShardedOptimizer (state sharded over ranks), its LR schedulers re-pointed to it.

    The group dicts are shared with the original optimizer, so hyperparameters a scheduler already
    set (``lr``, ``initial_lr``) carry over.
    """
    sharded = [ShardedOptimizer.from_optimizer(optimizer) for optimizer in optimizers]
    for original, replacement in zip(optimizers, sharded, strict=True):
        for config in lr_scheduler_configs:
            if config.scheduler.optimizer is original:
                config.scheduler.optimizer = replacement
                # torch marks the optimizer a scheduler was built on and warns at the first scheduler
                # step that the re-pointed one's step() "has been overridden": intended.
                warnings.filterwarnings("ignore", message=_REPOINTED_SCHEDULER_WARNING, category=UserWarning)
    return sharded
