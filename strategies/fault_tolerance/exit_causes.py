"""Survivors name the cause: a failing rank writes why it ends into the job's store; its peers read it.

When one rank raises or dies, its peers' collectives fail with gloo's ``Connection closed by peer``,
which names neither the rank nor the cause. Here, the failing rank writes ``exit/<rank>`` (the
exception's type and message and where the rank was: stage, epoch, batch, step) into the job's TCP
store before it exits; a rank whose own error is such a peer loss waits up to ``CAUSE_WAIT_S``
for its peers' records and adds one line per failed peer to its error (a note on the exception and
a log line): ``custom_ddp: rank 1 ended first: RuntimeError: ... at train epoch 1 batch 3 step 15``.
A peer that left no record (SIGKILL, the OOM killer) is named from its last heartbeat and, on the
same machine, its process state.

The store is hosted by rank 0 under Lightning's launchers: when rank 0 itself dies the store goes
with it and the survivors can only say that rank 0 (the store's host) is gone. Under ``torchrun``
the elastic agent hosts it and every rank's cause survives.
"""

from __future__ import annotations

import json
import re
import time
from typing import Any, NamedTuple

import torch.distributed as dist

from parallel.host.shm_barrier import PEER_LOSS_TEXT
from strategies.fault_tolerance.stall_watch import describe_where, process_state

__all__ = [
    "CAUSE_WAIT_S",
    "PeerCauses",
    "cause_text",
    "chained_text",
    "is_peer_loss",
    "peer_causes",
    "write_exit_record",
]

CAUSE_WAIT_S = 2.0
_PEER_LOSS = re.compile(
    r"Connection closed by peer|Connection reset by peer|Broken pipe|Socket Timeout|"
    r"Timed out waiting|Connection refused|ECONNRESET|" + re.escape(PEER_LOSS_TEXT),
    re.IGNORECASE,
)


def chained_text(error: BaseException) -> str:
    """The messages of ``error`` and of every exception it chains (cause, else context), one per line."""
    texts, seen = [], error
    while seen is not None:
        texts.append(str(seen))
        seen = seen.__cause__ or seen.__context__
    return "\n".join(texts)


def is_peer_loss(error: BaseException) -> bool:
    """Whether ``error`` (or one it chains) is a collective failing because a peer went away or timed out."""
    return _PEER_LOSS.search(chained_text(error)) is not None


def cause_text(error: BaseException) -> str:
    """``"RuntimeError: first line of the message"`` (300 characters at most)."""
    if isinstance(error, SystemExit):
        return f"{type(error).__name__} (exit status {error.code})"
    first = (str(error).strip().splitlines() or [""])[0][:300]
    return f"{type(error).__name__}: {first}" if first else type(error).__name__


def write_exit_record(store: dist.Store, rank: int, error: BaseException, where: dict[str, Any]) -> None:
    """Record why this rank ends; a store that cannot be reached is ignored (the cause is in this rank's log)."""
    record = {
        "rank": rank,
        "cause": cause_text(error),
        "where": where,
        "peer_loss": is_peer_loss(error),
        "t": time.time(),
    }
    try:
        store.set(f"exit/{rank}", json.dumps(record))
    except Exception:  # noqa: BLE001 - best effort on the way out
        pass


def _may_still_write(heartbeat: dict[str, Any] | None, host: str) -> bool:
    """Whether a peer without a record may yet write one: not known gone from this machine's /proc."""
    return heartbeat is None or heartbeat.get("host") != host or process_state(heartbeat["pid"]) not in ("gone", "Z")


def _read_records(
    store: dist.Store, heartbeats: list[dict[str, Any] | None], rank: int, host: str, wait_s: float
) -> dict[int, dict[str, Any]]:
    """Peers' exit records, waiting up to ``wait_s`` for one that is not itself a peer loss while a peer
    without a record may still write one (no wait for a peer already gone: SIGKILL leaves no record).
    Every moment counts: Lightning's popen launcher SIGKILLs all ranks within 5 s of a child's failure."""
    peers = [peer for peer in range(len(heartbeats)) if peer != rank]
    deadline, found = time.monotonic() + wait_s, {}
    while True:
        for peer in peers:
            if peer not in found and store.check([f"exit/{peer}"]):
                found[peer] = json.loads(store.get(f"exit/{peer}"))
        waiting = [peer for peer in peers if peer not in found and _may_still_write(heartbeats[peer], host)]
        if any(not record["peer_loss"] for record in found.values()) or not waiting or time.monotonic() >= deadline:
            return found
        time.sleep(0.1)


def _gone(heartbeat: dict[str, Any], host: str) -> bool:
    """Whether the process of this heartbeat is known gone (it ran on this machine and has exited)."""
    return heartbeat.get("host") == host and process_state(heartbeat["pid"]) in ("gone", "Z")


def _silent_peer(rank: int, record: dict[str, Any] | None, host: str) -> str | None:
    if record is None:
        return None
    if _gone(record, host):
        return (
            f"custom_ddp: rank {rank} (pid {record['pid']}) ended without a word: killed by a signal it cannot "
            f"catch (SIGKILL, the OOM killer) or a hard crash; its last heartbeat (at most 1 s before) showed "
            f"{describe_where(record)}"
        )
    return None


class PeerCauses(NamedTuple):
    """What a rank whose collective failed knows of its peers."""

    lines: list[str]  # one line per peer that ended first, for the error's notes and the log
    lost: frozenset[int]  # the peers known to have ended first (their record, or their process gone)


def peer_causes(
    store: dist.Store | None,
    rank: int,
    heartbeats: list[dict[str, Any] | None],
    host: str,
    wait_s: float = CAUSE_WAIT_S,
) -> PeerCauses:
    """The peers that ended first: from their records, else from their last heartbeat and process."""
    peers = [peer for peer in range(len(heartbeats)) if peer != rank]
    try:
        records = _read_records(store, heartbeats, rank, host, wait_s) if store is not None else {}
    except Exception:  # noqa: BLE001 - the store's host (rank 0 under Lightning's launcher) is gone
        gone = rank != 0 and heartbeats[0] is not None and _gone(heartbeats[0], host)
        return PeerCauses(
            [
                "custom_ddp: the job's store is gone with its host (rank 0 under Lightning's launcher): "
                "rank 0 ended first; its cause is in its own output"
            ],
            frozenset({0} if gone else ()),
        )
    failed = {peer: record for peer, record in sorted(records.items()) if not record["peer_loss"]}
    if failed:
        return PeerCauses(
            [
                f"custom_ddp: rank {peer} ended first: {record['cause']} at {_place(record['where'])}"
                for peer, record in failed.items()
            ],
            frozenset(failed),
        )
    silent = {
        peer: line
        for peer in peers
        if peer not in records
        for line in [_silent_peer(peer, heartbeats[peer], host)]
        if line
    }
    return PeerCauses(list(silent.values()), frozenset(silent))


def _place(where: dict[str, Any]) -> str:
    return " ".join(f"{key} {value}" for key, value in where.items()) or "setup"
