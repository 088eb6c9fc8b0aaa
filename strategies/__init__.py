"""Lightning adapters of the hand-written core in :mod:`parallel`; importing this package registers ``custom_ddp``.

The strategy's own wiring stands at the top; each concern it plugs in is a room of its own:

- ``custom_ddp``: ``CustomDDPStrategy``, Lightning's DDP strategy with the rooms below plugged in through
  public strategy hooks; ``options`` (``CustomDDPOptions``: every option, validated once), ``launchers``
  (Lightning's launchers, refusing a trainer call inside another), ``lightning_seams`` (every private
  Lightning name used, checked at setup), ``loaders`` (a user's DataLoader rebuilt around another sampler).
- ``training/``: the gradient sync, the SyncBatchNorm ``LayerSync`` plugin, ZeRO-1.
- ``evaluation/``: scatter evaluation, gathers of uneven shapes.
- ``resume/``: exact mid-epoch resume with the interrupted fit's random generators.
- ``stopping/``: a signal on any rank stops every rank at the same optimizer step.
- ``fault_tolerance/``: a stall, a crash or a lost peer ends every rank with a diagnosis and a last checkpoint.

Each room's ``__init__`` names what the others may use and what it may import itself; no module reaches
into another room's modules (``tests/test_layout.py`` checks it). ``options``, ``loaders`` and
``lightning_seams`` import no room, and every room may use them; ``custom_ddp`` and ``launchers`` import the rooms.

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
