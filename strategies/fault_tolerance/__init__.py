"""Fault tolerance: a stall, a crash or a lost peer ends every rank in seconds, with a diagnosis and a checkpoint.

- ``watchdog``: :class:`Watchdog`, the component the strategy hooks in; it owns the rest of this room.
- ``heartbeat``, ``stall_watch``: each rank's progress through the job's store, and the judgement of a stall.
- ``exit_causes``: a failing rank writes why it ends; the survivors name it.
- ``last_checkpoint``, ``window_generators``: the checkpoint of the last completed optimizer step, with every
  rank's random generators at its window's start.
- ``desync``: the opt-in collective fingerprint check (a desync is an error naming both sides).
- ``job_store``: the job's TCP store with bounded operations.
- ``process_group``: the default process group, its start bounded apart from its collectives, one per
  ``torchrun`` attempt.

May import: :mod:`parallel`, :mod:`measure`, Lightning, :mod:`strategies.options`, :mod:`strategies.stopping`
(the stop checkpoint's path) and :mod:`strategies.resume` (the checkpoint key of the generators). Nothing outside
this package imports its modules: use the names below.
"""

from strategies.fault_tolerance.desync import enable_desync_check, log_desync
from strategies.fault_tolerance.job_store import connect_store
from strategies.fault_tolerance.process_group import (
    collective_bound,
    rendezvous_store,
    startup_bound,
    uses_shared_agent_store,
)
from strategies.fault_tolerance.watchdog import Watchdog
from strategies.fault_tolerance.window_generators import WindowGenerators

__all__ = [
    "Watchdog",
    "WindowGenerators",
    "collective_bound",
    "connect_store",
    "enable_desync_check",
    "log_desync",
    "rendezvous_store",
    "startup_bound",
    "uses_shared_agent_store",
]
