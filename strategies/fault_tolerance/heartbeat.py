"""Per-rank heartbeat through the job's TCP store: progress markers, what the main thread is in, its stack.

Every rank runs one daemon thread (:class:`Heartbeat`) that never touches the process group. Once a
second it writes this rank's record into the job's own ``torch.distributed`` TCP store (the
rendezvous store: hosted by rank 0 under Lightning's launchers, by the elastic agent under
``torchrun``; every operation bounded in time, :mod:`job_store`) and hands every rank's
record to a ``watch`` callback (:mod:`stall_watch`
decides from them). The record holds:

- ``seq``: the beat counter. It stops when the whole process stops (SIGSTOP, a frozen machine, a
  process killed without a word): the heartbeat is from a thread so that it does NOT stop when the
  main thread is merely busy.
- ``marks`` and ``where``: the main thread's progress, counted by :meth:`Progress.mark` (called by
  the strategy's callback at every batch, optimizer step and stage boundary). A main thread that
  loops forever or blocks outside a collective stops moving ``marks`` while ``seq`` goes on.
- ``collective``: the ``torch.distributed`` collective the main thread is blocked in, with its
  source, read from the main thread's frames (``sys._current_frames``) at each beat: a rank waiting
  for a peer is not itself stalled.
- ``busy``: a legitimately slow phase the main thread is in: a checkpoint save (Lightning's
  ``Trainer.save_checkpoint`` on the stack), a ``torch.compile`` (dynamo / inductor frames), or a
  phase user code declares with :meth:`Progress.busy`.

The thread also answers the watch's stack request: a stalled rank whose thread still runs (a looping
or blocked main thread) writes its main thread's Python stack, ``faulthandler``-style, into the store.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

from strategies.fault_tolerance.desync import _collective_call, _source
from strategies.fault_tolerance.job_store import BoundedStore

__all__ = ["BEAT_S", "Heartbeat", "Progress", "main_thread_state", "stack_text"]

BEAT_S = 1.0  # seconds between two records of one rank
# Frames that make a slow main thread legitimately busy: (path part, function or "" for any, label).
_BUSY_FRAMES = (
    ("lightning/pytorch/trainer/trainer.py", "save_checkpoint", "checkpoint save"),
    ("torch/_dynamo/", "", "torch.compile"),
    ("torch/_inductor/", "", "torch.compile"),
)
# Innermost frames of a main thread that waits for peers: a collective, a gradient bucket's all-reduce
# (gloo's Work waited in parallel/gradients/buckets.py, the shared-memory one in a torch future), a shared-memory
# barrier.
_WAIT_FRAMES = (
    "torch/distributed/",
    "torch/futures/",
    "parallel/gradients/grad_sync.py",
    "parallel/gradients/reducer.py",
    "parallel/gradients/buckets.py",
    "parallel/host/shm_barrier.py",  # SyncBatchNorm's statistics through shared memory (parallel/host/host_exchange.py)
)


class Progress:
    """The main thread's progress markers: plain attribute writes, nothing else (cheap at every batch)."""

    def __init__(self) -> None:
        self.marks = 0
        self.where: dict[str, Any] = {}
        self.declared_busy: str | None = None

    def mark(self, **where: Any) -> None:
        """The main thread moved: ``where`` is e.g. ``stage="train", epoch=1, batch=3, step=15``."""
        self.where = where
        self.marks += 1

    @contextmanager
    def busy(self, label: str) -> Iterator[None]:
        """Declare a legitimately slow phase of the main thread (see :mod:`stall_watch`)."""
        previous, self.declared_busy = self.declared_busy, label
        self.marks += 1
        try:
            yield
        finally:
            self.declared_busy = previous
            self.marks += 1


def _frames(thread_id: int) -> list[tuple[FrameType, int]]:
    """The thread's frames, outermost first (as ``traceback.walk_tb`` gives them)."""
    frame = sys._current_frames().get(thread_id)
    return list(reversed(list(traceback.walk_stack(frame)))) if frame is not None else []


def main_thread_state(frames: list[tuple[FrameType, int]]) -> tuple[str | None, str | None]:
    """``(collective it waits in, busy phase)`` of a thread from its frames (outermost first)."""
    if not frames:
        return None, None
    innermost = frames[-1][0].f_code.co_filename.replace("\\", "/")
    collective = None
    if any(part in innermost for part in _WAIT_FRAMES):
        call = _collective_call(frames)
        collective = f"{'gradient bucket wait' if call == 'a collective' else call} from {_source(frames)}"
    for frame, _ in frames:
        path, name = frame.f_code.co_filename.replace("\\", "/"), frame.f_code.co_name
        for part, function, label in _BUSY_FRAMES:
            if part in path and (not function or name == function):
                return collective, label
    return collective, None


def stack_text(frames: list[tuple[FrameType, int]], limit: int = 12) -> str:
    """The innermost ``limit`` frames, innermost last, one ``file:line in function`` per line."""
    lines = [
        f'  File "{frame.f_code.co_filename}", line {lineno}, in {frame.f_code.co_name}'
        for frame, lineno in frames[-limit:]
    ]
    return "\n".join(lines)


class Heartbeat(threading.Thread):
    """This rank's heartbeat thread: publish the record, answer stack requests, call ``watch`` each beat.

    ``watch(records, store)`` gets every rank's latest record (``None`` for a rank not seen yet) and
    may end the process; an exception from the store (its host stopped or gone) is passed to
    ``on_store_error`` instead.
    """

    def __init__(
        self,
        store: BoundedStore,
        rank: int,
        world_size: int,
        progress: Progress,
        watch: Callable[[list[dict[str, Any] | None], BoundedStore], None],
        on_store_error: Callable[[Exception], None],
    ) -> None:
        super().__init__(name=f"custom_ddp-heartbeat-{rank}", daemon=True)
        self.store, self.rank, self.world_size, self.progress = store, rank, world_size, progress
        self._watch, self._on_store_error = watch, on_store_error
        self._main = threading.get_ident()  # started from the thread that runs the stage
        self._stopped = threading.Event()
        self._seq = 0
        self.identity = {"rank": rank, "pid": os.getpid(), "host": socket.gethostname()}

    def stop(self) -> None:
        self._stopped.set()

    def record(self) -> dict[str, Any]:
        """This rank's record now (see the module docstring)."""
        collective, busy = main_thread_state(_frames(self._main))
        self._seq += 1
        return {
            **self.identity,
            "t": time.time(),
            "seq": self._seq,
            "marks": self.progress.marks,
            "where": self.progress.where,
            "collective": collective,
            "busy": self.progress.declared_busy or busy,
        }

    def main_stack(self) -> str:
        return stack_text(_frames(self._main))

    def run(self) -> None:
        keys = [f"hb/{rank}" for rank in range(self.world_size)]
        while not self._stopped.wait(BEAT_S):
            try:
                self.store.set(keys[self.rank], json.dumps(self.record()))
                # One round trip per beat once every rank has reported (check() is all-or-nothing).
                present = keys if self.store.check(keys) else [key for key in keys if self.store.check([key])]
                values = dict(zip(present, self.store.multi_get(present), strict=True)) if present else {}
                records = [json.loads(values[key]) if key in values else None for key in keys]
            except Exception as error:  # noqa: BLE001 - any store failure is reported, never raised here
                if not self._stopped.is_set():
                    self._on_store_error(error)
                continue
            if not self._stopped.is_set():
                self._watch(records, self.store)
