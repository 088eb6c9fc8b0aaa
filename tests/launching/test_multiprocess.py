"""The worker launcher every distributed test and benchmark builds on."""

import os
import time

import pytest
import torch
import torch.distributed as dist

from collectives.launcher import WorkerError, run_workers

pytestmark = pytest.mark.distributed


def _sum_of_ranks(rank: int, world_size: int, scale: float) -> torch.Tensor:
    t = torch.tensor([float(rank) * scale])
    dist.all_reduce(t)
    return t


def _raises_on_rank_1(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("boom from rank 1")
    dist.all_reduce(torch.ones(1))


def _dies_on_rank_1(rank: int, world_size: int) -> None:
    if rank == 1:
        os._exit(3)
    dist.all_reduce(torch.ones(1))


def _sleeps(rank: int, world_size: int) -> None:
    time.sleep(30)


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_results_come_back_ordered_by_rank(tmp_path, world_size):
    out = run_workers(_sum_of_ranks, world_size, args=(2.0,), init_file=tmp_path / "store")
    expected = 2.0 * sum(range(world_size))
    assert [t.item() for t in out] == [expected] * world_size


def test_worker_exception_reaches_parent_with_rank_and_cause(tmp_path):
    with pytest.raises(WorkerError, match="boom from rank 1"):
        run_workers(_raises_on_rank_1, 2, init_file=tmp_path / "store", timeout_s=10)


def test_dead_peer_is_an_error_not_a_hang(tmp_path):
    start = time.monotonic()
    with pytest.raises(WorkerError):
        run_workers(_dies_on_rank_1, 2, init_file=tmp_path / "store", timeout_s=10)
    assert time.monotonic() - start < 30


def test_stuck_workers_time_out(tmp_path, monkeypatch):
    start = time.monotonic()
    with pytest.raises(TimeoutError):
        run_workers(_sleeps, 2, init_file=tmp_path / "store", timeout_s=1, deadline_margin_s=1)
    assert time.monotonic() - start < 15


def test_bad_arguments_name_the_fix(tmp_path):
    with pytest.raises(ValueError, match="world_size"):
        run_workers(_sum_of_ranks, 0)
    used = tmp_path / "store"
    used.write_text("")
    with pytest.raises(ValueError, match="fresh path"):
        run_workers(_sum_of_ranks, 2, init_file=used)


def test_a_fork_after_cuda_was_initialised_is_refused_naming_spawn(monkeypatch):
    """The child of such a fork dies in its first CUDA call ('Cannot re-initialize CUDA in forked subprocess')."""
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(ValueError, match="start_method='spawn'"):
        run_workers(_sum_of_ranks, 2)


def test_its_own_store_folder_is_removed_after_success_and_failure(tmp_path, monkeypatch):
    """Without an init_file the launcher makes a temporary folder for the store and leaves none behind,
    also when a rank died (the store's file then outlives the group)."""
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    assert [t.item() for t in run_workers(_sum_of_ranks, 2, args=(1.0,))] == [1.0, 1.0]
    with pytest.raises(WorkerError):
        run_workers(_dies_on_rank_1, 2, timeout_s=10)
    assert list(tmp_path.iterdir()) == []
