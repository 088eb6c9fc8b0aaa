"""FutexBarrier alone, with two threads of one process standing in for two ranks (no process group)."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from parallel.host.shm_barrier import PEER_LOSS_TEXT, FutexBarrier, ProcessIdentity, local_problem, own_identity


def _words(count: int) -> list[torch.Tensor]:
    return [torch.zeros(16, dtype=torch.int32) for _ in range(count)]


@pytest.mark.parametrize("spin_s", [0.0, 200e-6], ids=["sleep", "spin-then-sleep"])
def test_no_rank_passes_a_barrier_before_every_rank_arrived(spin_s: float) -> None:
    words, arrived, passed_early = _words(2), [0, 0], []
    barriers = [FutexBarrier(words, rank, [own_identity()] * 2, spin_s=spin_s) for rank in range(2)]

    def rank_loop(rank: int) -> None:
        for round_ in range(1, 2001):
            arrived[rank] = round_
            if rank == 1 and round_ % 500 == 0:
                time.sleep(0.15)  # longer than a poll: the peer sleeps in the futex and must wake
            barriers[rank].wait()
            if arrived[1 - rank] < round_:
                passed_early.append((rank, round_))

    threads = [threading.Thread(target=rank_loop, args=(rank,)) for rank in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(thread.is_alive() for thread in threads) and passed_early == []


@pytest.mark.parametrize("spin_s", [0.0, 0.05], ids=["sleep", "spin-then-sleep"])
def test_a_peer_that_is_gone_raises_within_a_poll(spin_s: float) -> None:
    gone = ProcessIdentity(own_identity().pid, own_identity().start_ticks + 1)  # same pid, another start: reused
    barrier = FutexBarrier(_words(2), 0, [own_identity(), gone], spin_s=spin_s)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=f"{PEER_LOSS_TEXT}: rank 1 .* exited while rank 0 waited"):
        barrier.wait()
    assert time.monotonic() - started < 1.0


def test_local_problem_names_peers_this_rank_cannot_see() -> None:
    me = own_identity()
    assert local_problem([me]) is None
    hidden = ProcessIdentity(2**22 + 7, 1)  # above pid_max (4194304 at most): no such process
    assert f"peer processes [{hidden.pid}] are not visible" in local_problem([me, hidden])
    assert me.pid == os.getpid()
