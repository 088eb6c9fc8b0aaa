"""Signal handlers that only record, and the exit status of a run a signal stopped.

:class:`SignalRecorder` installs handlers for the stop signals that do nothing but note the first
signal in this process (and call one short, non-communicating callback). Everything that needs
other ranks (agreeing on the stop, the checkpoint) happens later, in the main flow of the run, at a
point every rank reaches in the same collective order: see :mod:`preemption`.

Exit status: a stopped run exits with ``128 + signum`` (SIGTERM 143, SIGINT 130, SIGUSR1 138), the
status a shell reports for a process that signal killed. Schedulers and wrappers read it as
"stopped by a signal": ``$? -gt 128``; ``$? -eq 143`` for SIGTERM. No Lightning import beyond its
``SIGTERMException`` base class, so ``except SIGTERMException`` catches ``ddp``'s stop and ours.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from types import FrameType
from typing import Any

from lightning.pytorch.utilities.exceptions import SIGTERMException

__all__ = ["SignalRecorder", "StopOnSignal", "exit_status", "signal_name", "write_stderr"]


def exit_status(signum: int) -> int:
    """The exit status of a run stopped by ``signum``: ``128 + signum``, as a shell reports it."""
    return 128 + int(signum)


def signal_name(signum: int) -> str:
    """``"SIGTERM"`` for 15; the number itself for one Python does not name."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class StopOnSignal(SIGTERMException):
    """Raised on every rank to end a run a signal stopped; ``code`` is the exit status (128 + signum).

    A ``SystemExit``: unless caught, the process exits with ``code`` and no traceback. Lightning
    still runs its interrupt path (``on_exception`` of callbacks, loggers finalised, teardown).

    Attributes:
        signum: The signal that stopped the run (the one of the lowest rank that got one).
        ranks: The ranks that received a signal.
        checkpoint: Path of the checkpoint written before stopping, ``None`` when none was written.

    The launching process of fork/spawn workers raises one too when its workers exited with a stop
    status; it cannot know ``ranks`` (empty) nor ``checkpoint`` (``None``): rank 0's line names them.
    """

    def __init__(self, signum: int, ranks: Sequence[int], checkpoint: str | None) -> None:
        super().__init__(exit_status(signum))
        self.signum = int(signum)
        self.ranks = tuple(ranks)
        self.checkpoint = checkpoint


class SignalRecorder:
    """Handlers that only record the first stop signal of this process.

    The handler runs in the main thread between two Python bytecodes (or once a blocking C call,
    such as a collective, returns). It must not communicate: the other ranks may be inside any
    collective at that moment, and one extra collective on one rank desynchronises all of them. It
    stores the signal number and calls ``on_first(signum)`` once; ``on_first`` must be short and
    must not communicate either (setting a Python attribute, writing one line to stderr).

    A second SIGINT raises ``KeyboardInterrupt`` at once: pressing Ctrl+C twice still stops a run
    that cannot reach its coordinated stop (Lightning then ends it without a checkpoint). Only one
    that comes ``repeat_after_s`` or more after the first counts: one Ctrl+C can arrive twice within
    milliseconds (from the terminal to the whole process group, and passed on by the launching
    process of fork/spawn workers, :mod:`signal_forwarding`).
    DataLoader worker processes forked while the handler is installed inherit it; there it ignores
    the signal, so workers keep serving batches until their main process stops them.
    """

    repeat_after_s = 2.0  # a SIGINT this long after the first is a second Ctrl+C, not the same one twice

    def __init__(self) -> None:
        self._signum = 0
        self._first_at = 0.0
        self._previous: dict[int, Any] = {}
        self._owner_pid = os.getpid()
        self._on_first: Callable[[int], None] | None = None

    @property
    def signum(self) -> int:
        """The first signal received since :meth:`install`, 0 when none."""
        return self._signum

    @property
    def installed(self) -> bool:
        return bool(self._previous)

    def install(self, signums: Iterable[int], on_first: Callable[[int], None] | None = None) -> None:
        """Replace the handlers of ``signums`` (main thread only, like Lightning's own handlers)."""
        if threading.current_thread() is not threading.main_thread():
            return  # signal.signal raises elsewhere; Lightning installs nothing there either
        self._signum = 0
        self._owner_pid = os.getpid()
        self._on_first = on_first
        for signum in signums:
            self._previous[signum] = signal.signal(signum, self._handle)

    def is_current(self) -> bool:
        """Whether every handler installed by :meth:`install` is still the active one."""
        return all(signal.getsignal(signum) == self._handle for signum in self._previous)

    def restore(self) -> None:
        """Put back the handlers that :meth:`install` replaced (where ours is still the active one)."""
        for signum, previous in self._previous.items():
            if signal.getsignal(signum) == self._handle:
                signal.signal(signum, previous)
        self._previous.clear()
        self._on_first = None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if os.getpid() != self._owner_pid:
            return  # a forked DataLoader worker: its main process decides when to stop it
        if self._signum:
            if signum == signal.SIGINT and time.monotonic() - self._first_at >= self.repeat_after_s:
                raise KeyboardInterrupt  # second Ctrl+C: stop now, without the coordinated checkpoint
            return
        self._signum, self._first_at = signum, time.monotonic()
        if self._on_first is not None:
            self._on_first(signum)


def write_stderr(line: str) -> None:
    """One line to stderr from a signal handler: ``os.write`` is not a buffered stream, which a
    handler that interrupted a ``print`` on the same stream could not re-enter."""
    os.write(2, (line.rstrip("\n") + "\n").encode(errors="replace"))
