"""Stop signals sent to the launching process of fork/spawn/forkserver workers reach the workers.

Under ``start_method`` fork, spawn or forkserver the process the user started is no rank: it waits
for its workers. A SIGINT or SIGTERM sent to it alone (Jupyter's "interrupt kernel", ``kill PID``, a
container runtime signalling PID 1) never reached the workers: Lightning caught the KeyboardInterrupt
there and exited, the interpreter then waited for its non-daemon workers, and they trained on to
the end of the fit. Under popen the process the user started is rank 0, whose handler stops every
rank at one optimizer step (:mod:`preemption`).

:class:`SignalForwarding` installs, in the launching process and while its workers run, handlers
that pass each stop signal on to every live worker; the workers then stop together with a
checkpoint and exit with ``128 + signum``, which :meth:`SignalForwarding.stopped_by` recognises.
A forked worker inherits the handlers and puts back the ones they replaced as it starts
(:func:`restore_in_worker`). Handlers a user installed stay (as in :mod:`preemption`).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Sequence
from types import FrameType
from typing import Any

from strategies.stopping.stop_signals import SignalRecorder, exit_status, signal_name, write_stderr

__all__ = ["SignalForwarding", "restore_in_worker"]

# The launching process's replaced handlers: a forked worker finds them here (a spawned one imports
# this module afresh and finds none).
_REPLACED: dict[int, Any] = {}
_LAUNCHER_PID = [0]


_STOP_SIGNALS = tuple(s for s in (signal.SIGTERM, signal.SIGINT, getattr(signal, "SIGUSR1", None)) if s is not None)


# Python's own handling, which nobody replaced: SIGINT raises KeyboardInterrupt, the others kill the process.
_UNTOUCHED = {signal.SIGINT: (signal.default_int_handler,)}


def _forwardable() -> list[int]:
    """The stop signals whose handling nobody replaced (a user's handler stays)."""
    return [s for s in _STOP_SIGNALS if signal.getsignal(s) in _UNTOUCHED.get(s, (signal.SIG_DFL, None))]


def restore_in_worker() -> None:
    """In a forked worker: put back the handlers the launching process had before forwarding."""
    if _REPLACED and os.getpid() != _LAUNCHER_PID[0]:
        for signum, previous in _REPLACED.items():
            signal.signal(signum, previous)
        _REPLACED.clear()


class SignalForwarding:
    """While installed in the launching process, each stop signal goes on to every live worker."""

    def __init__(self, workers: Callable[[], Sequence[Any]]) -> None:
        self._workers = workers  # the launcher's processes once started (multiprocessing.Process)
        self._received = 0
        self._received_at = 0.0

    def install(self) -> None:
        _LAUNCHER_PID[0] = os.getpid()
        for signum in _forwardable():
            _REPLACED[signum] = signal.signal(signum, self._forward)

    def restore(self) -> None:
        for signum, previous in _REPLACED.items():
            if signal.getsignal(signum) == self._forward:
                signal.signal(signum, previous)
        _REPLACED.clear()

    def stopped_by(self, exit_code: int | None) -> int:
        """The stop signal whose status (``128 + signum``) a worker exited with, else 0."""
        return next((s for s in _STOP_SIGNALS if exit_code == exit_status(s)), 0)

    def _forward(self, signum: int, frame: FrameType | None) -> None:
        workers = [w for w in self._workers() if w.is_alive()] if os.getpid() == _LAUNCHER_PID[0] else []
        if not workers:  # a worker forked a moment ago (before restore_in_worker), or none started yet
            signal.signal(signum, _REPLACED.get(signum, signal.SIG_DFL))
            os.kill(os.getpid(), signum)  # what the signal did before forwarding
            return
        again = bool(self._received) and signum == signal.SIGINT
        if again and time.monotonic() - self._received_at < SignalRecorder.repeat_after_s:
            return  # the same Ctrl+C twice (the workers count it once too)
        if not self._received:
            self._received, self._received_at = signum, time.monotonic()
        write_stderr(
            f"custom_ddp: the launching process got {signal_name(signum)}: passed on to its {len(workers)} worker(s)"
        )
        for worker in workers:
            os.kill(worker.pid, signum)
        if again:
            raise KeyboardInterrupt  # a second Ctrl+C: the workers stop at once, and this process stops waiting
