"""Stopping on a signal: a SIGTERM, SIGINT or SIGUSR1 on any rank stops every rank at one optimizer step.

- ``preemption``: :class:`Preemption`, the component (the signal recorded, agreed on in the gradient buckets,
  the stop checkpoint written, every rank raising :class:`StopOnSignal`); :func:`stop_checkpoint_path`.
- ``stop_signals``: handlers that only record, and the exit status ``128 + signum`` of a stopped run.
- ``popen_exit``: a rank started by Lightning's popen launcher exits after local rank 0, whose status a scheduler
  reads.
- ``signal_forwarding``: :class:`SignalForwarding`, the launching process of fork/spawn/forkserver workers
  passes stop signals on to them; :func:`restore_in_worker`.

May import: :mod:`parallel` and Lightning only (the other rooms of :mod:`strategies` import this one). Nothing
outside this package imports its modules: use the names below.
"""

from strategies.stopping.preemption import Preemption, stop_checkpoint_path
from strategies.stopping.signal_forwarding import SignalForwarding, restore_in_worker
from strategies.stopping.stop_signals import StopOnSignal, exit_status, signal_name

__all__ = [
    "Preemption",
    "SignalForwarding",
    "StopOnSignal",
    "exit_status",
    "restore_in_worker",
    "signal_name",
    "stop_checkpoint_path",
]
