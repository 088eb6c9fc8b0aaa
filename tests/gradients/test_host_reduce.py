"""SharedMemoryAllReduce: sums like gloo, on every rank the same bits, leaves no files, never hangs on a dead peer."""

from __future__ import annotations

import gc
import glob
import os
import threading
import time
import weakref
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn

from collectives.launcher import run_workers
from parallel.gradients.grad_sync import SyncedDataParallel
from parallel.host import host_reduce
from parallel.host.host_reduce import SharedMemoryAllReduce, open_shared_memory_all_reduce
from parallel.sync_config import GradSyncConfig
from strategies.fault_tolerance.exit_causes import is_peer_loss

pytestmark = pytest.mark.distributed

# Sizes that do not split evenly over 2 or 3 ranks, one smaller than the world, and several dtypes.
_SIZES = [(1, torch.float32), (7, torch.float64), (1001, torch.bfloat16), (100_003, torch.float32)]


def _contribution(rank: int, index: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(10 * index + rank)
    return torch.randn(numel, generator=gen, dtype=torch.float64).to(dtype)


def _keep_gloo_barriers_if(forced: bool) -> None:
    """In a worker: make every rank's futex check fail, as on a machine that is not x86-64."""
    if forced:
        host_reduce.local_problem = lambda peers: "forced by the test"


def _sum_both_ways(rank: int, world_size: int, barrier: str) -> dict:
    _keep_gloo_barriers_if(barrier == "gloo")
    host = SharedMemoryAllReduce()
    shared = host.allocate(_SIZES)
    zeroed = all(bool((every[rank] == 0).all()) for every in shared)
    gloo = []
    for index, ((numel, dtype), every) in enumerate(zip(_SIZES, shared, strict=True)):
        every[rank].copy_(_contribution(rank, index, numel, dtype))
        expected = _contribution(rank, index, numel, dtype)
        dist.all_reduce(expected)
        gloo.append(expected)
    for every in shared:  # queued back to back, waited once: launch order is kept
        future = host.all_reduce(every)
    future.wait()
    host.close()
    # This object's files only: tests running beside this one create and unlink their own meanwhile.
    leftovers = sorted(glob.glob(f"{host._prefix}*"))
    return {
        "zeroed": zeroed,
        "shm": [every[rank].clone() for every in shared],
        "gloo": gloo,
        "leftovers": leftovers,
        "barrier": host.barrier_kind,
    }


@pytest.mark.parametrize("barrier", ["futex", "gloo"])
@pytest.mark.parametrize("world_size", [2, 3])
def test_sum_equals_gloo_and_is_the_same_bits_on_every_rank(tmp_path, world_size, barrier):
    results = run_workers(_sum_both_ways, world_size, args=(barrier,), init_file=tmp_path / "store")
    reference = [sum(_contribution(r, i, n, d).double() for r in range(world_size)) for i, (n, d) in enumerate(_SIZES)]
    for result in results:
        assert result["barrier"] == barrier  # this suite runs on Linux x86-64: futex unless forced off
        assert result["zeroed"] and result["leftovers"] == []  # every name unlinked once all ranks mapped it
        for index, (shm, gloo, exact) in enumerate(zip(result["shm"], result["gloo"], reference, strict=True)):
            assert torch.equal(shm, results[0]["shm"][index])  # one summation per chunk: the same bits everywhere
            if world_size == 2:
                assert torch.equal(shm, gloo)  # a + b is exact in either order: gloo's bits
            tolerance = 1e-2 if shm.dtype == torch.bfloat16 else 1e-5
            torch.testing.assert_close(shm.double(), exact, atol=tolerance, rtol=tolerance)


def _peer_missing(rank: int, world_size: int, silent_s: float | None, barrier: str) -> dict:
    """Rank 1 never joins the sum: it ends (``silent_s`` None) or stays alive and silent that long."""
    _keep_gloo_barriers_if(barrier == "gloo")
    host = SharedMemoryAllReduce(timeout=None if silent_s is None else timedelta(seconds=2))
    (every,) = host.allocate([(1000, torch.float32)])
    if rank == 1:
        time.sleep(silent_s or 0)
        return {}  # then its process ends
    started = time.monotonic()
    try:
        host.all_reduce(every).wait()
    except RuntimeError as error:
        return {"error": str(error), "seconds": time.monotonic() - started}
    return {"error": None, "seconds": time.monotonic() - started}


@pytest.mark.parametrize("barrier", ["futex", "gloo"])
def test_a_dead_peer_raises_on_the_waiting_rank_within_seconds(tmp_path, barrier):
    # timeout_s bounds the group; the peer's exit (its closed sockets, its /proc entry) must end the wait long before.
    outcome = run_workers(
        _peer_missing, 2, args=(None, barrier), init_file=tmp_path / "store", timeout_s=60, deadline_margin_s=10
    )[0]
    assert outcome["error"] is not None and outcome["seconds"] < 10, outcome
    assert is_peer_loss(RuntimeError(outcome["error"]))  # the strategy's exit record reads it as a lost peer


@pytest.mark.parametrize("barrier", ["futex", "gloo"])
def test_a_silent_peer_raises_after_the_timeout(tmp_path, barrier):
    # Alive, its sockets open, but silent for 6 s: the group's 2 s timeout ends the wait.
    outcome = run_workers(_peer_missing, 2, args=(6.0, barrier), init_file=tmp_path / "store", timeout_s=30)[0]
    assert outcome["error"] is not None and 1.5 < outcome["seconds"] < 5, outcome


def _workers_alive() -> int:
    return sum(thread.name == "shm-all-reduce" for thread in threading.enumerate())


def _dropped_without_close(rank: int, world_size: int) -> list:
    before = _workers_alive()
    net = nn.Linear(4, 2)
    model = SyncedDataParallel(net)
    model(torch.ones(3, 4)).sum().backward()  # one shared sum: the hooks and the worker have run
    during, wrapper = _workers_alive(), weakref.ref(model)
    del model
    gc.collect()
    time.sleep(0.2)
    net(torch.ones(3, 4)).sum().backward()  # the net lives on; its hooks are now no-ops
    return [before, during, wrapper() is None, _workers_alive()]


def test_a_dropped_wrapper_is_collected_and_stops_its_worker_thread(tmp_path):
    # A long-lived process that builds wrappers (a notebook, a test session) must not collect them forever.
    for result in run_workers(_dropped_without_close, 2, init_file=tmp_path / "store"):
        assert result == [0, 1, True, 0]


def _choices(rank: int, world_size: int) -> dict:
    net = nn.Linear(4, 2)
    subgroup = dist.new_group([0, 1])
    auto = SyncedDataParallel(net, grad_transport="auto")
    fallback = SyncedDataParallel(nn.Linear(4, 2), grad_transport="auto", grad_compression="bf16")
    via_subgroup = open_shared_memory_all_reduce("auto", subgroup, [torch.device("cpu")], None)
    try:
        open_shared_memory_all_reduce("shared_memory", subgroup, [torch.device("cpu")], None)
        refused = ""
    except ValueError as error:
        refused = str(error)
    return {
        "auto": auto.grad_transport,
        "compressed": fallback.grad_transport,
        "subgroup": via_subgroup,
        "refused": refused,
    }


def test_auto_takes_shared_memory_where_it_applies_and_names_why_not(tmp_path):
    for result in run_workers(_choices, 2, init_file=tmp_path / "store"):
        assert result["auto"] == "shared_memory"
        assert result["compressed"] == "process_group" and result["subgroup"] is None
        assert "subgroup" in result["refused"] and "grad_transport='auto'" in result["refused"]


def _separate_shm(rank: int, world_size: int, root: str) -> dict:
    # Each rank gets a /dev/shm of its own, as two containers on one machine would.
    host_reduce.SHM_DIR = os.path.join(root, f"rank{rank}")
    os.makedirs(host_reduce.SHM_DIR)
    auto = SyncedDataParallel(nn.Linear(4, 2), grad_transport="auto").grad_transport
    try:
        SyncedDataParallel(nn.Linear(4, 2), grad_transport="shared_memory")
        refused = ""
    except ValueError as error:
        refused = str(error)
    return {"auto": auto, "refused": refused}


def test_ranks_that_do_not_share_dev_shm_fall_back(tmp_path):
    for result in run_workers(_separate_shm, 2, args=(str(tmp_path),), init_file=tmp_path / "store"):
        assert result["auto"] == "process_group"
        assert "rank 1 does not see rank 0's" in result["refused"]


@pytest.mark.parametrize(
    ("options", "match"),
    [
        (
            {"grad_transport": "shm"},
            r"grad_transport='shm' must be one of \('auto', 'process_group', 'shared_memory'\)",
        ),
        (
            {"grad_transport": "shared_memory", "grad_compression": "bf16"},
            r"use grad_transport='process_group' to compress",
        ),
    ],
)
def test_bad_transport_options_name_the_value_and_the_fix(options, match):
    with pytest.raises(ValueError, match=match):
        GradSyncConfig(**options)
