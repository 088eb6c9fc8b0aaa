"""Stall detection and exit causes (issue 23), in one process. The last checkpoint and ``--ckpt_path=last``:
``tests/fault_tolerance/test_last_checkpoint.py``.

The real faults (SIGSTOP, an endless loop, a blocked DataLoader, a slow save, torchrun restarts) run
on a 2-rank fit in ``tests/fault_tolerance/test_fault_matrix.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from parallel.gradients.buckets import Bucket
from parallel.host.shm_barrier import PEER_LOSS_TEXT
from strategies.custom_ddp import CustomDDPStrategy
from strategies.fault_tolerance.exit_causes import cause_text, is_peer_loss, peer_causes, write_exit_record
from strategies.fault_tolerance.heartbeat import Progress, main_thread_state, stack_text
from strategies.fault_tolerance.job_store import StoreUnanswered, connect_store, serve_store
from strategies.fault_tolerance.stall_watch import BUSY_FACTOR, STALL_EXIT_STATUS, Seen, StallWatch, judge
from strategies.options import DEFAULT_STALL_TIMEOUT_S

STALL = 20.0


def _record(rank: int, collective=None, busy=None) -> dict:
    return {
        "rank": rank,
        "pid": 1,
        "host": "h",
        "seq": 1,
        "marks": 1,
        "where": {"stage": "train", "step": 3},
        "collective": collective,
        "busy": busy,
    }


def _seen(beat_age: float, mark_age: float, now: float = 1000.0) -> Seen:
    return Seen(1, now - beat_age, 1, now - mark_age)


def test_a_silent_main_thread_outside_a_collective_stalls_its_peer_waiting_in_one_does_not() -> None:
    records = [_record(0, collective="all_gather(float32[17]) from SyncBN forward"), _record(1)]
    seen = {0: _seen(0.5, 25.0), 1: _seen(0.5, 25.0)}
    assert judge(records, seen, 1000.0, STALL)[0] == [1]
    seen[1] = _seen(0.5, 19.0)
    assert judge(records, seen, 1000.0, STALL) == ([], "")


def test_a_process_without_heartbeat_stalls_even_inside_a_collective() -> None:
    records = [_record(0, collective="x"), _record(1, collective="y")]
    stalled, why = judge(records, {0: _seen(0.5, 30.0), 1: _seen(21.0, 30.0)}, 1000.0, STALL)
    assert stalled == [1] and "no heartbeat for 21.0 s" in why


def test_a_busy_phase_extends_the_deadline_but_not_forever() -> None:
    records = [_record(0, busy="checkpoint save"), _record(1, collective="barrier()")]
    assert judge(records, {0: _seen(0.5, 2 * STALL), 1: _seen(0.5, 2 * STALL)}, 1000.0, STALL) == ([], "")
    stalled, why = judge(records, {0: _seen(0.5, BUSY_FACTOR * STALL), 1: _seen(0.5, 50)}, 1000.0, STALL)
    assert stalled == [0] and "busy in checkpoint save" in why


def test_every_rank_silent_in_a_collective_is_a_desync() -> None:
    records = [_record(0, collective="a"), _record(1, collective="b")]
    stalled, why = judge(records, {0: _seen(0.5, 21.0), 1: _seen(0.5, 22.0)}, 1000.0, STALL)
    assert stalled == [0, 1] and "desync" in why


def test_main_thread_state_reads_a_blocked_thread_and_a_declared_busy_phase() -> None:
    progress = Progress()
    with progress.busy("long validation"):
        assert progress.declared_busy == "long validation"
    assert progress.declared_busy is None and progress.marks == 2
    release = threading.Event()
    thread = threading.Thread(target=release.wait)
    thread.start()
    time.sleep(0.05)
    frames = [(frame, frame.f_lineno) for frame in _outermost_first(sys._current_frames()[thread.ident])]
    collective, busy = main_thread_state(frames)
    release.set()
    thread.join()
    assert collective is None and busy is None  # waiting on an Event is no collective
    assert "in wait" in stack_text(frames)


def test_a_thread_waiting_for_a_gradient_bucket_waits_for_its_peers() -> None:
    # A bucket's all-reduce is waited in parallel/gradients/buckets.py (gloo's Work, or the shared-memory
    # future): a rank parked there waits for a peer and is no stall of its own.
    bucket = Bucket(0, [], torch.zeros(1), [])
    bucket.work = torch.futures.Future()
    thread = threading.Thread(target=bucket.wait)
    thread.start()
    time.sleep(0.05)
    frames = [(frame, frame.f_lineno) for frame in _outermost_first(sys._current_frames()[thread.ident])]
    collective, _ = main_thread_state(frames)
    bucket.work.set_result(None)
    thread.join()
    assert (
        collective is not None and "gradient bucket (SyncedDataParallel) (parallel/gradients/buckets.py:" in collective
    )


def _outermost_first(frame):
    frames = []
    while frame is not None:
        frames.append(frame)
        frame = frame.f_back
    return list(reversed(frames))


@pytest.fixture
def store_host():
    server = serve_store("127.0.0.1")
    yield server
    del server


def test_the_verdict_is_agreed_once_and_the_reporter_names_the_stalled_rank(store_host, capfd) -> None:
    exits: list[int] = []
    stores = [connect_store("127.0.0.1", store_host.port, "job/") for _ in range(2)]
    clock = [0.0]
    notes: list[tuple[int, bool]] = []

    def note(rank: int):
        return lambda record, rank0_lost: notes.append((rank, rank0_lost)) or "newest checkpoint: none"

    watches = [
        StallWatch(
            rank,
            2,
            STALL,
            {"rank": rank, "pid": 10 + rank, "host": "other"},
            lambda: "  File x",
            note(rank),
            exit=exits.append,
            clock=lambda: clock[0],
        )
        for rank in range(2)
    ]
    records = [_record(0, collective="all_gather(float32[17]) from SyncBN forward"), _record(1)]
    for watch, store in zip(watches, stores, strict=True):
        watch(records, store)
    clock[0] = STALL + 1
    records[0] = {**records[0], "seq": 2}
    records[1] = {**records[1], "seq": 2}
    threading.Thread(target=watches[1], args=(records, stores[1])).start()  # the stalled rank answers
    watches[0](records, stores[0])
    time.sleep(0.3)
    assert exits == [STALL_EXIT_STATUS, STALL_EXIT_STATUS]
    report = capfd.readouterr().err
    assert report.count("custom_ddp stall:") == 1 and "STALLED rank 1" in report and "File x" in report
    assert notes == [(0, False)]  # only the reporter writes, and rank 0 is not the rank lost


def test_a_store_silent_for_stall_timeout_ends_the_rank_counted_from_the_unanswered_call(capfd) -> None:
    """The first StoreUnanswered comes STORE_OP_S after the call was sent: the silence counts from the send."""
    exits: list[int] = []

    def rank_1_watch() -> StallWatch:  # a fresh watch of rank 1 of 2 (stall_timeout STALL); its exits land in exits
        return StallWatch(
            1,
            2,
            STALL,
            {"rank": 1, "pid": 11, "host": "h"},
            lambda: "",
            lambda record, rank0_lost: "no checkpoint",
            exit=exits.append,
        )

    watch = rank_1_watch()
    watch.on_store_error(StoreUnanswered("check", since=time.monotonic() - STALL + 5.0))
    assert exits == []
    watch.on_store_error(StoreUnanswered("check", since=time.monotonic() - STALL - 0.2))  # still the same silence
    assert exits == []  # the silence began at the first error's send time: 5 s short of stall_timeout
    time.sleep(0.01)
    watch = rank_1_watch()
    watch.on_store_error(StoreUnanswered("check", since=time.monotonic() - STALL - 0.2))
    assert exits == [STALL_EXIT_STATUS]
    assert "the job's store has not answered for 20 s (StoreUnanswered)" in capfd.readouterr().err


def test_survivors_name_the_rank_that_raised_and_one_killed_without_a_word(store_host) -> None:
    store = connect_store("127.0.0.1", store_host.port, "job/")
    write_exit_record(store, 1, RuntimeError("injected fault"), {"stage": "train", "epoch": 1, "step": 15})
    causes = peer_causes(store, 0, [None, None], "h", wait_s=0.1)
    expected = "custom_ddp: rank 1 ended first: RuntimeError: injected fault at stage train epoch 1 step 15"
    assert causes.lines == [expected]
    assert causes.lost == {1}
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    heartbeat = {**_record(1), "pid": gone.pid, "host": "h"}
    started = time.monotonic()
    lines, lost = peer_causes(
        connect_store("127.0.0.1", store_host.port, "other/"), 0, [None, heartbeat], "h", wait_s=5.0
    )
    assert len(lines) == 1 and "rank 1" in lines[0] and "without a word" in lines[0] and lost == {1}
    # No wait for a record a dead process cannot write: Lightning's popen launcher SIGKILLs every rank
    # within 5 s of a child's failure, and rank 0 still has its last checkpoint to write.
    assert time.monotonic() - started < 1.0


class GoneStore:
    """The store of a job whose host (rank 0 under Lightning's launcher) has died."""

    def check(self, keys: list[str]) -> bool:
        raise RuntimeError("Connection reset by peer")


def test_rank_0_counts_as_lost_when_the_store_went_with_its_process() -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    rank0 = {**_record(0), "pid": gone.pid, "host": "h"}
    lines, lost = peer_causes(GoneStore(), 1, [rank0, _record(1)], "h", wait_s=0.1)  # type: ignore[arg-type]
    assert lost == {0} and "the job's store is gone with its host" in lines[0]
    alive = {**rank0, "pid": os.getpid()}  # a store that fails while rank 0 lives: nobody but rank 0 writes
    assert peer_causes(GoneStore(), 1, [alive, _record(1)], "h", wait_s=0.1).lost == set()  # type: ignore[arg-type]
    elsewhere = {**rank0, "host": "another machine"}  # its process cannot be seen from here
    assert peer_causes(GoneStore(), 1, [elsewhere, _record(1)], "h", wait_s=0.1).lost == set()  # type: ignore[arg-type]


def test_peer_loss_errors_are_recognised() -> None:
    error = RuntimeError("[../pair.cc:561] Connection closed by peer [127.0.0.1]:33443")
    assert is_peer_loss(error) and not is_peer_loss(ValueError("bad"))
    assert is_peer_loss(RuntimeError(f"{PEER_LOSS_TEXT}: rank 1 (pid 7) exited while rank 0 waited for it"))
    assert cause_text(ValueError("bad\nsecond line")) == "ValueError: bad"


@pytest.mark.parametrize("bad", [0, -1, True, "10", float("inf")])
def test_stall_timeout_must_be_positive_seconds(bad) -> None:
    with pytest.raises(ValueError, match="stall_timeout"):
        CustomDDPStrategy(stall_timeout=bad)
    assert CustomDDPStrategy().options.stall_timeout == DEFAULT_STALL_TIMEOUT_S
    assert CustomDDPStrategy(stall_timeout=None).options.stall_timeout is None
