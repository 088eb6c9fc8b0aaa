"""Lightning adapters of the hand-written core in :mod:`parallel`; importing this package registers ``custom_ddp``.

- ``custom_ddp``: ``CustomDDPStrategy``, Lightning's DDP strategy with the core's SyncBatchNorm,
  gradient sync, ZeRO-1 and scatter evaluation plugged in through public strategy hooks.
- ``layer_sync``: ``CustomSyncBatchNorm``, the ``LayerSync`` plugin that swaps BatchNorm layers.
- ``evaluation``: the glue between scattered evaluation loaders, the Trainer's hooks and the
  module's torchmetrics.
- ``preemption``, ``stop_signals``: a signal on any rank stops every rank at the same optimizer
  step with a checkpoint and exit status 128 + signum.
- ``desync``: the opt-in collective fingerprint check (a desync is an error naming both sides).

Registration happens here, on the Lightning side, because Lightning resolves
``Trainer(strategy="custom_ddp")`` and ``--trainer.strategy=custom_ddp`` through its
``StrategyRegistry``, and the popen launcher starts every rank by re-running the script, which
imports this package again (``train.py`` imports it). The core in :mod:`parallel` never imports
Lightning and is importable without it.
"""

from lightning.pytorch.strategies import StrategyRegistry

from strategies.custom_ddp import CustomDDPStrategy

if CustomDDPStrategy.strategy_name not in StrategyRegistry:
    CustomDDPStrategy.register_strategies(StrategyRegistry)

__all__ = ["CustomDDPStrategy"]
