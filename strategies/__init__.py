"""Hand-written data parallelism; importing this package registers the ``custom_ddp`` strategy.

Registration happens at import because Lightning resolves ``Trainer(strategy="custom_ddp")`` and
``--trainer.strategy=custom_ddp`` through its ``StrategyRegistry``, and the popen launcher starts
every rank by re-running the script, which imports this package again. The cost is that any
``strategies.*`` import also imports Lightning; the pure-torch modules themselves do not use it.
"""

from lightning.pytorch.strategies import StrategyRegistry

from strategies.custom_ddp import CustomDDPStrategy

if CustomDDPStrategy.strategy_name not in StrategyRegistry:
    CustomDDPStrategy.register_strategies(StrategyRegistry)

__all__ = ["CustomDDPStrategy"]
