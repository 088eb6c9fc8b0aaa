"""Every rank's random generators at the start of its accumulation window, kept in the job's store.

The watchdog's last checkpoint (:mod:`strategies.last_checkpoint`) is written after a rank was lost
(a crash, a kill, a stall). It holds the state after the last completed optimizer step, the start of
the accumulation window the fault came in, and a resume from it trains that window again. For that
resume to draw what the uninterrupted fit drew (dropout masks, noise, ``np.random``), the checkpoint
needs every rank's generators as they were at that window's start, the lost rank's too, and nobody
can ask a lost rank any more. So each rank keeps them at every point where a window may begin
(:meth:`WindowGenerators.keep`: after a batch that stepped, after validation and at an epoch's end
while fitting, at training start), numbered (every rank passes the same points in the same order) and
tagged with the training batches processed so far, and a thread writes the newest into the job's TCP
store under ``rng/<rank>``. No point comes inside a window, so the writer's own newest is its window's
start; it reads every rank's back (:meth:`WindowGenerators.every_rank`) and the checkpoint holds them
only when every rank's newest is the same point. The rank that fails with an exception writes its own
before it exits (:meth:`WindowGenerators.flush`).

Cost per optimizer step: 83 us on the main thread (reading the generators, with the writing thread
running), and 0.19 ms until the store holds them (encoding, about 15 us, and one ``set`` of about
14 KB; medians, AMD EPYC, 1 thread). Nothing is communicated between ranks, and the main thread never
waits for the store.

A rank lost within the few milliseconds between a window's start and its write, or a store lost with
its host (rank 0's process under Lightning's launchers; torchrun's agent store outlives the workers),
leaves the last checkpoint without generators: the resumed fit then says that it draws its own.
"""

from __future__ import annotations

import logging
import struct
import threading
from typing import Optional

from parallel.rng_state import RngState, decode_rng_state, encode_rng_state, rng_state
from strategies.job_store import BoundedStore

__all__ = ["WindowGenerators"]

log = logging.getLogger(__name__)

_TAG = struct.Struct("<qq")  # the value's first 16 bytes: the point's number, training batches processed then
FLUSH_S = 2.0  # how long a failing rank waits for its newest state to reach the store


def _key(rank: int) -> str:
    return f"rng/{rank}"


class WindowGenerators:
    """This rank's generators at its newest possible window start, written to the store by a thread."""

    def __init__(self, store: BoundedStore, rank: int, world_size: int) -> None:
        self._store, self._rank, self._world_size = store, rank, world_size
        self._points = 0  # points kept so far (the main thread's count)
        self._kept: Optional[tuple[tuple[int, int], RngState]] = None  # ((point, batches processed), state): newest
        self._written: Optional[tuple[tuple[int, int], RngState]] = None  # the newest in the store
        self._stopped = False
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._write_newest, name=f"custom_ddp-rng-{rank}", daemon=True)
        self._thread.start()

    def keep(self, batches_processed: int, state: Optional[RngState] = None) -> None:
        """A window may begin here, after ``batches_processed`` training batches, with this rank's generators as
        they are now (or as ``state``, the ones a resume to this point restores): keep them, the thread writes
        them. Every rank calls it at the same points."""
        self._points += 1
        kept = ((self._points, batches_processed), rng_state() if state is None else state)
        with self._changed:
            self._kept = kept
            self._changed.notify_all()

    def flush(self, timeout_s: float = FLUSH_S) -> bool:
        """Wait until the newest kept state was written to the store, or tried (a failing rank, before it exits);
        ``False`` after ``timeout_s`` without."""
        with self._changed:
            return self._changed.wait_for(lambda: self._written is self._kept or self._stopped, timeout_s)

    def stop(self) -> None:
        with self._changed:
            self._stopped = True
            self._changed.notify_all()

    def every_rank(self) -> tuple[Optional[list[RngState]], str]:
        """Every rank's generators at this rank's newest point, its window's start (and ``""``), or ``None`` and
        why not (a rank wrote none, or an older or newer point, or the store does not answer)."""
        kept = self._kept
        if kept is None:
            return None, f"rank {self._rank} kept none"
        peers = [rank for rank in range(self._world_size) if rank != self._rank]
        keys = [_key(rank) for rank in peers]
        try:
            if keys and not self._store.check(keys):
                missing = [rank for rank, key in zip(peers, keys) if not self._store.check([key])]
                return None, f"rank(s) {missing} wrote none to the job's store"
            values = dict(zip(peers, self._store.multi_get(keys))) if keys else {}
        except Exception as error:  # noqa: BLE001 - the checkpoint is written without them either way
            return None, f"the job's store did not give them ({type(error).__name__}: {error})"
        states: list[RngState] = []
        for rank in range(self._world_size):
            if rank == self._rank:
                states.append(kept[1])
                continue
            tag = _TAG.unpack_from(values[rank])
            if tag != kept[0]:
                return None, (f"rank {rank}'s newest are from point {tag[0]} (after {tag[1]} training batches), the "
                              f"window's from point {kept[0][0]} (after {kept[0][1]})")
            states.append(decode_rng_state(values[rank][_TAG.size:]))
        return states, ""

    def _write_newest(self) -> None:
        while True:
            with self._changed:
                self._changed.wait_for(lambda: self._kept is not self._written or self._stopped)
                if self._stopped:
                    return
                kept = self._kept
            assert kept is not None
            try:
                self._store.set(_key(self._rank), _TAG.pack(*kept[0]) + encode_rng_state(kept[1]))
            except Exception as error:  # noqa: BLE001 - a lost store: the writer finds none and says so
                log.debug("custom_ddp: rank %d could not write its generators to the job's store: %s", self._rank,
                          error)
            with self._changed:
                self._written = kept  # tried: a store that failed is not asked again for this state
                self._changed.notify_all()
