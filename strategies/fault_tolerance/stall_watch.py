"""Stall detection from the ranks' heartbeats: which rank stalled, one report, every rank ends in seconds.

Every rank's heartbeat thread (:mod:`heartbeat`) hands :class:`StallWatch` every rank's
record once a second; each rank judges all ranks the same way (:func:`judge`), by its own clock:

- **no heartbeat**: a rank's beat counter has not moved for ``stall_timeout``: its whole process
  is stopped (SIGSTOP), frozen (swapping, a dead filesystem in the kernel) or gone without a word.
- **no progress**: its beats go on but its main thread has set no progress marker (batch, optimizer
  step, stage boundary) for ``stall_timeout`` while NOT waiting in a collective: an endless loop, a
  deadlock, a DataLoader that blocks. Waiting in a collective is waiting for a peer, not a stall.
- **busy**: a legitimately slow phase (checkpoint save, ``torch.compile``, a declared
  :meth:`~heartbeat.Progress.busy` block) extends that rank's deadline to
  ``BUSY_FACTOR x stall_timeout``; its peers meanwhile wait in a collective and are never stalled.
- **all in collectives**: every rank waits in a collective and none moved for ``stall_timeout``:
  the ranks issued different collectives (a desync) or the network hangs.

The first rank to decide writes the verdict into the store (``compare_set``: one verdict per job).
Then every rank acts within a beat: a stalled rank whose thread still runs writes its main thread's
stack and exits; the lowest healthy rank waits up to ``ANSWER_S`` for the stacks, prints ONE
report, kills stalled ranks on its own machine that did not answer (a stopped process cannot exit
by itself) and exits; the other healthy ranks exit once the report is out. Every exit is
``os._exit(STALL_EXIT_STATUS)`` from the heartbeat thread: the main thread may be blocked in a gloo
collective that would otherwise wait for the full process-group timeout.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from parallel.host.shm_barrier import proc_stat

__all__ = [
    "ANSWER_S",
    "BUSY_FACTOR",
    "STALL_EXIT_STATUS",
    "Seen",
    "StallWatch",
    "describe_where",
    "judge",
    "process_state",
]

# Exit status of every rank of a job a stalled rank ended: EX_TEMPFAIL of sysexits.h ("temporary
# failure, retry"), distinct from a crash (1), a usage error (2) and signals (128 + signum).
STALL_EXIT_STATUS = 75
BUSY_FACTOR = 10  # a declared slow phase may stay silent this many stall timeouts
ANSWER_S = 3.0  # how long the reporter waits for a stalled rank's stack
REPORT_WAIT_S = 10.0  # how long the other ranks wait for the report before exiting anyway


@dataclass
class Seen:
    """What this rank saw of one rank's records, by its own monotonic clock."""

    seq: int
    seq_at: float
    marks: int
    marks_at: float


def _age(seen: Seen, now: float) -> tuple[float, float]:
    return now - seen.seq_at, now - seen.marks_at


def judge(
    records: list[dict[str, Any] | None], seen: dict[int, Seen], now: float, stall_timeout: float
) -> tuple[list[int], str]:
    """``(stalled ranks, why)`` from the latest records and when each last moved; ``([], "")`` if none."""
    stalled, why = [], []
    for rank, record in enumerate(records):
        if record is None or rank not in seen:
            continue
        beat_age, mark_age = _age(seen[rank], now)
        limit = stall_timeout * (BUSY_FACTOR if record.get("busy") else 1)
        if beat_age >= stall_timeout:
            stalled.append(rank)
            why.append(f"rank {rank}: no heartbeat for {beat_age:.1f} s")
        elif mark_age >= limit and not record.get("collective"):
            stalled.append(rank)
            busy = f" (busy in {record['busy']} beyond {BUSY_FACTOR} x stall_timeout)" if record.get("busy") else ""
            why.append(f"rank {rank}: main thread made no progress for {mark_age:.1f} s outside any collective{busy}")
    if stalled:
        return stalled, "; ".join(why)
    known = [rank for rank, record in enumerate(records) if record is not None and rank in seen]
    if (
        len(known) == len(records)
        and all(records[rank].get("collective") for rank in known)
        and all(_age(seen[rank], now)[1] >= stall_timeout for rank in known)
    ):
        return (
            known,
            "every rank waits in a collective and none moved: different collectives (a desync) or a hung network",
        )
    return [], ""


def describe_where(record: dict[str, Any] | None) -> str:
    if not record:
        return "never reported"
    where = record.get("where") or {}
    place = " ".join(f"{key} {value}" for key, value in where.items()) or "setup"
    if record.get("collective"):
        place += f", waiting in {record['collective']}"
    if record.get("busy"):
        place += f", busy in {record['busy']}"
    return place


def process_state(pid: int) -> str:
    """``"R"``/``"S"``/``"T"`` (stopped)/... from ``/proc``, ``"gone"`` if no such process (this machine only)."""
    stat = proc_stat(pid)
    return stat[0] if stat is not None else "gone"


def _write(text: str) -> None:
    os.write(2, (text.rstrip("\n") + "\n").encode(errors="replace"))


class StallWatch:
    """The ``watch`` of a :class:`~heartbeat.Heartbeat`: judge, agree on a verdict, report, end.

    ``main_stack()`` gives this rank's main-thread stack; ``checkpoint_note(own record or None,
    rank0_lost)`` writes the last checkpoint where it can (the reporter, before any stalled rank is
    killed: its main thread still waits in its collective; rank 1 when rank 0 is the rank lost) and
    returns the report's line on what to resume from.
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        stall_timeout: float,
        identity: dict[str, Any],
        main_stack: Callable[[], str],
        checkpoint_note: Callable[[dict[str, Any] | None, bool], str],
        exit: Callable[[int], None] = os._exit,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.rank, self.world_size, self.stall_timeout = rank, world_size, stall_timeout
        self._identity, self._main_stack, self._checkpoint_note = identity, main_stack, checkpoint_note
        self._exit, self._clock = exit, clock
        self.seen: dict[int, Seen] = {}
        self._store_failing_since: float | None = None
        self.last_records: list[dict[str, Any] | None] = [None] * world_size

    def observe(self, records: list[dict[str, Any] | None], now: float) -> None:
        for rank, record in enumerate(records):
            if record is None:
                continue
            old = self.seen.get(rank)
            if old is None:
                self.seen[rank] = Seen(record["seq"], now, record["marks"], now)
                continue
            if record["seq"] != old.seq:
                old.seq, old.seq_at = record["seq"], now
            if record["marks"] != old.marks:
                old.marks, old.marks_at = record["marks"], now

    def __call__(self, records: list[dict[str, Any] | None], store: dist.Store) -> None:
        now = self._clock()
        self._store_failing_since = None
        self.last_records = records
        self.observe(records, now)
        verdict = store.get("verdict") if store.check(["verdict"]) else b""
        if not verdict:
            stalled, why = judge(records, self.seen, now, self.stall_timeout)
            if not stalled:
                return
            ages = {rank: round(now - self.seen[rank].marks_at, 1) for rank in stalled}
            mine = json.dumps({"ranks": stalled, "why": why, "by": self.rank, "silent_s": ages})
            verdict = store.compare_set("verdict", "", mine)
        self._act(json.loads(verdict), records, store)

    def _act(self, verdict: dict[str, Any], records: list[dict[str, Any] | None], store: dist.Store) -> None:
        stalled = verdict["ranks"]
        healthy = [rank for rank in range(self.world_size) if rank not in stalled]
        reporter = healthy[0] if healthy else 0  # every rank stalled (a desync): rank 0 still reports
        if self.rank in stalled:
            store.set(f"stack/{self.rank}", self._main_stack())
        if self.rank == reporter:
            stacks = self._collect_stacks(store, stalled)
            note = self._checkpoint_note(records[self.rank], 0 in stalled)
            killed = self._kill_silent(stalled, records, stacks)
            _write(self.report(verdict, records, stacks, killed, note))
            store.set("reported", str(self.rank))
        else:
            self._wait(store, "reported", REPORT_WAIT_S)
        self._exit(STALL_EXIT_STATUS)

    def _wait(self, store: dist.Store, key: str, seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            try:
                if store.check([key]):
                    return True
            except Exception:  # noqa: BLE001 - the store's host already exited: nothing left to wait for
                return False
            time.sleep(0.1)
        return False

    def _collect_stacks(self, store: dist.Store, ranks: list[int]) -> dict[int, str]:
        deadline, stacks = time.monotonic() + ANSWER_S, {}
        while time.monotonic() < deadline and len(stacks) < len(ranks):
            for rank in ranks:
                if rank not in stacks and store.check([f"stack/{rank}"]):
                    stacks[rank] = store.get(f"stack/{rank}").decode(errors="replace")
            time.sleep(0.1)
        return stacks

    def _kill_silent(
        self, stalled: list[int], records: list[dict[str, Any] | None], stacks: dict[int, str]
    ) -> list[int]:
        """SIGKILL stalled ranks on this machine that could not answer: a stopped process never exits."""
        killed = []
        for rank in stalled:
            record = records[rank]
            if rank in stacks or not record or record.get("host") != self._identity["host"]:
                continue
            if process_state(record["pid"]) not in ("gone", "Z"):
                os.kill(record["pid"], signal.SIGKILL)
                killed.append(rank)
        return killed

    def report(
        self,
        verdict: dict[str, Any],
        records: list[dict[str, Any] | None],
        stacks: dict[int, str],
        killed: list[int],
        checkpoint_note: str,
    ) -> str:
        """The one report rank 0 (the lowest healthy rank) prints."""
        stalled = verdict["ranks"]
        names = ", ".join(map(str, stalled))
        lines = [
            f"custom_ddp stall: rank(s) {names} stalled (stall_timeout {self.stall_timeout:g} s): {verdict['why']}; "
            f"every rank ends with exit status {STALL_EXIT_STATUS}"
        ]
        for rank, record in enumerate(records):
            silent = (
                f", no progress for {verdict['silent_s'][str(rank)]:.1f} s" if str(rank) in verdict["silent_s"] else ""
            )
            tag = "STALLED " if rank in stalled else ""
            last = "last heartbeat: " if rank in stalled and f"rank {rank}: no heartbeat" in verdict["why"] else ""
            lines.append(
                f"  {tag}rank {rank} (pid {record['pid'] if record else '?'}): {last}{describe_where(record)}{silent}"
            )
        for rank in stalled:
            if rank in stacks:
                lines.append(f"  rank {rank} main thread (innermost last):\n{stacks[rank]}")
            else:
                what = "killed" if rank in killed else "left to its launcher (another machine)"
                lines.append(f"  rank {rank}: no answer: process stopped or frozen ({what})")
        lines.append(f"  {checkpoint_note}")
        return "\n".join(lines)

    def on_store_error(self, error: Exception) -> None:
        """The store did not answer: after ``stall_timeout`` of that, end this rank with its own report."""
        now = self._clock()
        if self._store_failing_since is None:
            # A StoreUnanswered error says when the unanswered operation was sent (job_store).
            self._store_failing_since = getattr(error, "since", now)
        if now - self._store_failing_since < self.stall_timeout:
            return
        host = [record for record in self.last_records if record and record["rank"] == 0]
        state = process_state(host[0]["pid"]) if host and host[0]["host"] == self._identity["host"] else "?"
        # Written before a stopped rank 0 is killed: this rank's main thread still waits in its collective.
        note = self._checkpoint_note(None, state in ("T", "gone", "Z"))
        if state == "T":
            os.kill(host[0]["pid"], signal.SIGKILL)
        _write(
            f"custom_ddp stall: rank {self.rank}: the job's store has not answered for "
            f"{now - self._store_failing_since:.0f} s ({type(error).__name__}): its host (rank 0 under Lightning's "
            f"launcher, torchrun's agent otherwise) is stopped, frozen or gone (rank 0 process state: {state}"
            f"{', killed' if state == 'T' else ''}); exit status {STALL_EXIT_STATUS}\n  {note}"
        )
        self._exit(STALL_EXIT_STATUS)
