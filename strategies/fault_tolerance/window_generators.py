"""Every rank's random generators at the start of its accumulation window, kept in the job's store.

The watchdog's last checkpoint (:mod:`last_checkpoint`) is written after a rank was lost
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

Cost per optimizer step: reading the generators takes 65 us on the main thread; encoding them
(15 us) and one ``set`` of about 14 KB per store run on the writing threads. On a 2-rank template-net
step (110 ms) the time added is 0.29 [-0.72, 1.47] ms with the job's store only and 0.41 [-1.14, 1.2]
ms with the mirror too: not measurable (``python -m benchmarks.costs.generator_keeping``; medians and 95 %
CIs, AMD EPYC, 1 thread per rank). Nothing is communicated between ranks, and the main thread never
waits for a store.

The store must outlive the rank lost. torchrun's agent store does; Lightning's launchers host the
job's store in rank 0's process, and rank 0 lost takes it along while rank 1 writes the checkpoint.
So, unless the store is torchrun's, rank 1 also hosts a mirror (a TCP store server of its own, its
address published in the job's store) and every other rank writes there too, each store by a thread
of its own (a stopped host never delays the other's writes); rank 1 reads its peers from the mirror,
rank 0 from the job's store. That doubles the traffic: about 14 KB per rank and optimizer step to each.

A rank lost within the few milliseconds between a window's start and its write, or both stores lost
(ranks 0 and 1), leaves the last checkpoint without generators: the resumed fit then says that it
draws its own.
"""

from __future__ import annotations

import logging
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from parallel.resume.rng_state import RngState, decode_rng_state, encode_rng_state, rng_state
from strategies.fault_tolerance.job_store import BoundedStore, connect_store, host_store

__all__ = ["WindowGenerators"]

log = logging.getLogger(__name__)

_TAG = struct.Struct("<qq")  # the value's first 16 bytes: the point's number, training batches processed then
FLUSH_S = 2.0  # how long a failing rank waits for its newest state to reach the stores
_MIRROR_HOST = 1  # hosts the mirror: LastCheckpoint.writer(rank0_lost=True), the rank that reads it
_MIRROR_KEY = "rng/mirror"  # in the job's store: the mirror's host:port
_MIRROR_PREFIX = "custom_ddp/"  # the mirror's keys: one job stage per mirror
_Kept = tuple[tuple[int, int], RngState]  # ((point, training batches processed), generators)


def _key(rank: int) -> str:
    return f"rng/{rank}"


@dataclass(eq=False)
class _Destination:
    """A store this rank's newest state goes to, by a thread of its own."""

    name: str
    open: Callable[[], BoundedStore | None]  # on the writer thread, until it gives a store (None: not yet)
    store: BoundedStore | None = None
    written: _Kept | None = None  # the newest tried (a store that failed is not asked again for it)


class WindowGenerators:
    """This rank's generators at its newest possible window start, written to the stores by threads."""

    def __init__(
        self, store: BoundedStore, rank: int, world_size: int, mirror_toward: tuple[str, int] | None = None
    ) -> None:
        """``mirror_toward``: the job store's host and port when the store lives in rank 0's process (module
        docstring): rank 1 then hosts the mirror, reachable from there, and every other rank writes to it."""
        self._rank, self._world_size = rank, world_size
        self._points = 0  # points kept so far (the main thread's count)
        self._kept: _Kept | None = None  # the newest
        self._stopped = False
        self._changed = threading.Condition()
        self._encoded: tuple[_Kept | None, bytes] = (None, b"")  # the newest kept, as the stores' value
        self._encoding = threading.Lock()
        self._mirror: BoundedStore | None = None  # rank 1's mirror: its server there, a client elsewhere
        self._read_from, self._read_name = store, "the job's store"  # where the checkpoint's writer reads its peers
        self._destinations = [_Destination("the job's store", lambda: store)]
        if mirror_toward is not None and rank == _MIRROR_HOST:
            self._host_mirror(store, mirror_toward)
        elif mirror_toward is not None:
            self._destinations.append(_Destination(f"rank {_MIRROR_HOST}'s mirror", lambda: self._open_mirror(store)))
        for destination in self._destinations:
            threading.Thread(
                target=self._write_newest, args=(destination,), daemon=True, name=f"custom_ddp-rng-{rank}"
            ).start()

    def keep(self, batches_processed: int, state: RngState | None = None) -> None:
        """A window may begin here, after ``batches_processed`` training batches, with this rank's generators as
        they are now (or as ``state``, the ones a resume to this point restores): keep them, the threads write
        them. Every rank calls it at the same points."""
        self._points += 1
        kept = ((self._points, batches_processed), rng_state() if state is None else state)
        with self._changed:
            self._kept = kept
            self._changed.notify_all()

    def flush(self, timeout_s: float = FLUSH_S) -> bool:
        """Wait until the newest kept state was written to every store, or tried (a failing rank, before it
        exits); ``False`` after ``timeout_s`` without."""
        with self._changed:
            return self._changed.wait_for(
                lambda: self._stopped or all(d.written is self._kept for d in self._destinations), timeout_s
            )

    def stop(self) -> None:
        """End the writing threads; what was kept stays readable (this rank may still write the last checkpoint)."""
        with self._changed:
            self._stopped = True
            self._changed.notify_all()

    def close(self) -> None:
        """Stop, and close the mirror: its server on rank 1, the connection to it elsewhere."""
        self.stop()
        if self._mirror is not None:
            self._mirror.close()

    def every_rank(self) -> tuple[list[RngState] | None, str]:
        """Every rank's generators at this rank's newest point, its window's start (and ``""``), or ``None`` and
        why not (a rank wrote none, or an older or newer point, or the store does not answer)."""
        kept = self._kept
        if kept is None:
            return None, f"rank {self._rank} kept none"
        peers = [rank for rank in range(self._world_size) if rank != self._rank]
        keys = [_key(rank) for rank in peers]
        store = self._read_from
        try:
            if keys and not store.check(keys):
                missing = [rank for rank, key in zip(peers, keys, strict=True) if not store.check([key])]
                return None, f"rank(s) {missing} wrote none to {self._read_name}"
            values = dict(zip(peers, store.multi_get(keys), strict=True)) if keys else {}
        except Exception as error:  # noqa: BLE001 - the checkpoint is written without them either way
            return None, f"{self._read_name} did not give them ({type(error).__name__}: {error})"
        states: list[RngState] = []
        for rank in range(self._world_size):
            if rank == self._rank:
                states.append(kept[1])
                continue
            tag = _TAG.unpack_from(values[rank])
            if tag != kept[0]:
                return None, (
                    f"rank {rank}'s newest are from point {tag[0]} (after {tag[1]} training batches), the "
                    f"window's from point {kept[0][0]} (after {kept[0][1]})"
                )
            states.append(decode_rng_state(values[rank][_TAG.size :]))
        return states, ""

    def _host_mirror(self, store: BoundedStore, toward: tuple[str, int]) -> None:
        try:
            self._mirror, address = host_store(toward, _MIRROR_PREFIX)
            store.set(_MIRROR_KEY, address)
        except (RuntimeError, OSError) as error:  # the job's store alone: rank 0 lost, the checkpoint has none
            log.warning("custom_ddp: rank %d hosts no mirror of the random generators: %s", self._rank, error)
            return
        self._read_from, self._read_name = self._mirror, f"rank {_MIRROR_HOST}'s mirror of the job's store"
        log.debug("custom_ddp: rank %d hosts the random generators' mirror at %s", self._rank, address)

    def _open_mirror(self, store: BoundedStore) -> BoundedStore | None:
        """Rank 1's mirror, once its address is published (rank 1 publishes it at setup); ``None`` if stopped."""
        while not self._stopped:
            if store.check([_MIRROR_KEY]):
                host, port = store.get(_MIRROR_KEY).decode().rsplit(":", 1)
                self._mirror = connect_store(host, int(port), _MIRROR_PREFIX)
                return self._mirror
            time.sleep(0.05)
        return None

    def _value(self, kept: _Kept) -> bytes:
        """``kept`` as a store's value: encoded once, by the first writing thread that needs it."""
        with self._encoding:
            if self._encoded[0] is not kept:
                self._encoded = (kept, _TAG.pack(*kept[0]) + encode_rng_state(kept[1]))
            return self._encoded[1]

    def _write_newest(self, destination: _Destination) -> None:
        while True:
            with self._changed:
                self._changed.wait_for(lambda: self._kept is not destination.written or self._stopped)
                if self._stopped:
                    return
                kept = self._kept
            assert kept is not None
            try:
                destination.store = destination.store or destination.open()
                if destination.store is not None:
                    destination.store.set(_key(self._rank), self._value(kept))
            except Exception as error:  # noqa: BLE001 - a lost store: the writer finds none and says so
                log.debug(
                    "custom_ddp: rank %d could not write its generators to %s: %s", self._rank, destination.name, error
                )
            with self._changed:
                destination.written = kept  # tried: a store that failed is not asked again for this state
                self._changed.notify_all()
