"""A barrier for the ranks of one host: one word per rank in shared memory, and Linux futexes.

The shared-memory gradient sum (:mod:`parallel.host.host_reduce`) separates its steps with three
barriers per bucket. A gloo barrier is TCP round trips on loopback, each a wake-up of gloo's threads
on cores that are busy with backward. Here each rank owns one 32-bit word that every rank maps; a
barrier is::

    write my generation into my word, wake whoever sleeps on it
    for every peer: sleep (FUTEX_WAIT) while its word still holds the previous generation

A peer is at most one generation ahead (it cannot pass the next barrier before this rank arrives
at it), so "not the previous generation" means "arrived". What it saves in a step:
``benchmarks/results/grad_sync``, variant ``bucketed_25mb_gloo_barriers`` against ``bucketed_25mb``.

Memory ordering: a rank's data (gradients written by backward, chunks summed by its worker thread)
must be visible to a peer that sees its new generation, and a peer's reads of this rank's buffer
must be done before this rank, past the last barrier, writes it again. x86-64 keeps stores in
program order, loads in program order, and never moves a store before an earlier load (TSO,
multi-copy atomic); every store of a word is a separate C call after the data's kernels returned,
so no fence is needed. Elsewhere :func:`local_problem` says no and the caller keeps gloo barriers.

Liveness: a sleeping rank wakes every ``POLL_S`` to check its peers in ``/proc`` (a peer that
exited, or a zombie its parent has not reaped yet, is gone) and the deadline. A dead peer raises
within ~``POLL_S``; one alive but silent (stopped, stuck) raises after ``timeout``. Both messages
carry :data:`PEER_LOSS_TEXT`. Pure Python + ctypes; no Lightning.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import sys
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import NamedTuple

import torch

__all__ = [
    "POLL_S",
    "PEER_LOSS_TEXT",
    "FutexBarrier",
    "ProcessIdentity",
    "is_running",
    "local_problem",
    "own_identity",
    "proc_stat",
]

POLL_S = 0.1  # seconds a rank sleeps before it looks at its peers again
PEER_LOSS_TEXT = "peer lost at a shared-memory barrier"  # strategies.fault_tolerance.exit_causes matches it
_DEFAULT_TIMEOUT = timedelta(minutes=30)  # torch.distributed's default for gloo
_SYS_FUTEX = 202  # x86-64 syscall number
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1  # shared (not FUTEX_PRIVATE): the words are mapped by several processes
_GENERATIONS = 0x7FFFFFFF  # generations count modulo this (a positive int32)


class ProcessIdentity(NamedTuple):
    """A process as ``/proc`` names it: a pid alone may be reused, with its start time it is unique."""

    pid: int
    start_ticks: int


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def proc_stat(pid: int) -> tuple[str, int] | None:
    """``(state, start time in clock ticks)`` of ``pid`` from ``/proc``, ``None`` if there is none."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()  # the name in parentheses may hold spaces
    except OSError:
        return None
    return fields[0], int(fields[19])


def own_identity() -> ProcessIdentity:
    stat = proc_stat(os.getpid())
    return ProcessIdentity(os.getpid(), stat[1] if stat else -1)


def is_running(identity: ProcessIdentity) -> bool:
    """Whether that very process still runs: not gone, not a zombie, its pid not reused."""
    stat = proc_stat(identity.pid)
    return stat is not None and stat[1] == identity.start_ticks and stat[0] not in ("Z", "X")


def local_problem(peers: Sequence[ProcessIdentity]) -> str | None:
    """Why this rank cannot use a :class:`FutexBarrier` with ``peers``, or ``None``."""
    if sys.platform != "linux" or platform.machine() != "x86_64":
        return f"futex barriers need Linux on x86-64 (store order), not {sys.platform} {platform.machine()}"
    hidden = [peer.pid for peer in peers if not is_running(peer)]
    if hidden:  # another pid namespace (a container sharing /dev/shm): liveness could not be read
        return f"peer processes {hidden} are not visible in this rank's /proc"
    return None


_libc = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None


def _futex(address: int, operation: int, value: int, timeout: _Timespec | None) -> int:
    """The futex syscall (ctypes drops the GIL around it); 0 or the errno it failed with."""
    pointer = ctypes.byref(timeout) if timeout is not None else None
    if _libc.syscall(_SYS_FUTEX, ctypes.c_void_p(address), operation, ctypes.c_int(value), pointer, None, 0) == 0:
        return 0
    return ctypes.get_errno()


class FutexBarrier:
    """A barrier over ``words`` (``words[k]``: rank k's int32 tensor in shared memory, zero at first).

    One thread of each rank calls :meth:`wait`, every rank the same number of times. ``peers[k]``
    identifies rank k's process for the liveness check; ``timeout`` bounds the wait for a live peer.
    ``spin_s``: how long a rank polls a peer's word before it sleeps. A sleep and its wake-up cost ~15-40 us
    (informal, 2 Zen 5 cores); polling costs the waiting thread's core, so only a thread with nothing else to do
    on a core of its own should spin (SyncBatchNorm's exchange, not the gradient sum's worker thread).
    """

    def __init__(
        self,
        words: Sequence[torch.Tensor],
        rank: int,
        peers: Sequence[ProcessIdentity],
        timeout: timedelta | None = None,
        spin_s: float = 0.0,
    ) -> None:
        assert all(word.dtype == torch.int32 and word.numel() >= 1 for word in words)
        assert spin_s >= 0.0, spin_s
        self._words = list(words)  # keeps the mappings alive for the raw addresses below
        self._addresses = [word.data_ptr() for word in words]
        self._cells = [ctypes.c_int32.from_address(address) for address in self._addresses]
        self._rank, self._peers = rank, list(peers)
        self._timeout_s = (timeout or _DEFAULT_TIMEOUT).total_seconds()
        self._generation = 0
        self._poll = _Timespec(int(POLL_S), int(POLL_S % 1 * 1e9))
        self._spin_s = spin_s

    def wait(self) -> None:
        """Return once every rank called :meth:`wait` as often as this one; raise on a lost peer."""
        self._generation = generation = (self._generation + 1) % _GENERATIONS
        self._cells[self._rank].value = generation  # one aligned 4-byte store: atomic
        _futex(self._addresses[self._rank], _FUTEX_WAKE, _GENERATIONS, None)
        previous = (generation - 1) % _GENERATIONS
        deadline = time.monotonic() + self._timeout_s
        for peer, cell in enumerate(self._cells):
            if self._spin_s and cell.value == previous:
                spin_end = time.perf_counter() + self._spin_s
                while cell.value == previous and time.perf_counter() < spin_end:
                    pass
            while cell.value == previous:
                failed = _futex(self._addresses[peer], _FUTEX_WAIT, previous, self._poll)
                if failed == errno.ETIMEDOUT:
                    self._check(peer, deadline)
                elif failed not in (0, errno.EAGAIN, errno.EINTR):  # EAGAIN: the word changed first
                    raise OSError(failed, f"futex wait on rank {peer}'s barrier word: {os.strerror(failed)}")

    def _check(self, peer: int, deadline: float) -> None:
        identity = self._peers[peer]
        if not is_running(identity):
            raise RuntimeError(
                f"{PEER_LOSS_TEXT}: rank {peer} (pid {identity.pid}) exited while rank {self._rank} waited for it"
            )
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"{PEER_LOSS_TEXT}: rank {peer} (pid {identity.pid}) did not arrive within the "
                f"timeout of {self._timeout_s:g} s (alive but stopped or stuck elsewhere); "
                "raise the strategy's timeout if it is only slow"
            )
