"""SyncBatchNorm's statistics through shared memory (parallel.host.host_exchange): no gloo collective, gloo's bits, one
process's results, and a lost peer ends the step as the gradient buckets do."""

from __future__ import annotations

import os
import time
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from syncbn_cases import CASES, assert_matches, make_layer, reference, train_and_eval
from torch.profiler import ProfilerActivity, profile

from collectives.launcher import run_workers
from parallel.batchnorm.syncbn import SyncBatchNorm
from parallel.dist_utils import consecutive_rank_group
from parallel.host import host_reduce
from parallel.host.host_exchange import EXCHANGE_LABEL, SPIN_S, open_shared_memory_exchange, spin_seconds
from parallel.host.host_reduce import SharedMemoryAllReduce
from strategies.fault_tolerance.exit_causes import is_peer_loss

pytestmark = pytest.mark.distributed


def _c10d_ops(prof: profile) -> list[str]:
    return [event.name for event in prof.events() if event.name.startswith("c10d::")]


def _train(case, rank: int, exchange, group=None) -> dict:
    """``case`` through a fresh layer, its collectives through ``exchange`` (``None``: the process group)."""
    layer = make_layer(case)
    layer.process_group = group
    SyncBatchNorm.use_exchange(layer, exchange, group)
    return train_and_eval(layer, case, case.shard(rank), torch.float32)


def _run(case, rank: int, exchange, group=None) -> tuple[dict, list[str], list[str]]:
    """:func:`_train` profiled: the results, the c10d ops and the exchanges it issued."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        result = _train(case, rank, exchange, group)
    exchanges = [e.name for e in prof.events() if e.name.startswith(EXCHANGE_LABEL)]
    return result, _c10d_ops(prof), exchanges


def _both_ways(rank: int, world_size: int, name: str, group_size: int | None) -> dict:
    case = CASES[name]
    group = None if group_size is None else consecutive_rank_group(group_size)
    members = dist.get_process_group_ranks(dist.group.WORLD if group is None else group)
    host = SharedMemoryAllReduce()
    exchange = open_shared_memory_exchange(host, members, (2 * case.num_features + 1) * 8)
    shared, c10d_ops, exchanges = _run(case, rank, exchange, group)
    plain, plain_ops, _ = _run(case, rank, None, group)
    unprofiled = _train(case, rank, exchange, group)  # the exchange labels nothing then: the same bits
    host.close()
    return {
        "shared": shared,
        "unprofiled": unprofiled,
        "plain": plain,
        "c10d": c10d_ops,
        "exchanges": exchanges,
        "plain_c10d": plain_ops,
    }


@pytest.mark.parametrize(("name", "world_size"), [("4d-conv", 2), ("empty-rank", 2), ("empty-middle-3ranks", 3)])
def test_no_gloo_collective_the_same_bits_and_one_process_results(tmp_path, name, world_size):
    results = run_workers(_both_ways, world_size, args=(name, None), init_file=tmp_path / "store")
    case = CASES[name]
    for result in results:
        assert result["c10d"] == []  # forward and backward: not one collective of the process group
        kinds = [label.split("(")[0] for label in result["exchanges"]]
        assert kinds == [f"{EXCHANGE_LABEL}.all_gather", f"{EXCHANGE_LABEL}.all_reduce"] * case.steps
        assert len(result["plain_c10d"]) == 2 * case.steps  # the same layer through gloo: one each way per step
        for key, value in result["shared"].items():
            assert all(map(torch.equal, _flat(result["unprofiled"][key]), _flat(value))), key
        for key, value in result["plain"].items():  # gloo's bits (world_size 3: every rank adds in one order)
            if world_size == 2:
                assert all(map(torch.equal, _flat(result["shared"][key]), _flat(value))), key
            else:
                torch.testing.assert_close(result["shared"][key], value, rtol=1e-6, atol=1e-6)
    for key in ("running_mean", "running_var", "eval_output"):  # every rank the same bits
        assert all(all(map(torch.equal, _flat(r["shared"][key]), _flat(results[0]["shared"][key]))) for r in results)
    assert_matches([r["shared"] for r in results], reference(case), atol=1e-5, rtol=1e-5)


def test_consecutive_groups_exchange_within_their_block(tmp_path):
    """syncbn_group_size=2 on 4 ranks: each block of 2 its own slots and barrier; gloo's bits in each block."""
    case = replace(CASES["2d-uneven"], sizes=(3, 7, 2, 5))
    CASES["4-ranks"] = case  # a worker finds it by name (fork: this process's table)
    results = run_workers(_both_ways, 4, args=("4-ranks", 2), init_file=tmp_path / "store")
    for result in results:
        assert result["c10d"] == [] and len(result["exchanges"]) == 2 * case.steps
        for key, value in result["plain"].items():
            assert all(map(torch.equal, _flat(result["shared"][key]), _flat(value))), key
    # Blocks {0, 1} and {2, 3} have their own statistics.
    assert not torch.equal(results[0]["shared"]["running_mean"], results[2]["shared"]["running_mean"])


def _flat(value) -> list[torch.Tensor]:
    return list(value) if isinstance(value, list) else [value]


def _alternating_shapes(rank: int, world_size: int) -> list[list[torch.Tensor]]:
    """Tensors of several shapes and dtypes in turn, as a model's layers exchange them (each shape's views of the
    slots are kept between calls)."""
    exchange = open_shared_memory_exchange(SharedMemoryAllReduce(), [0, 1], 1024)
    results = []
    for step in range(3):
        for numel, dtype in ((5, torch.float32), (3, torch.float64), (5, torch.float64), (129, torch.float32)):
            mine = torch.arange(numel, dtype=dtype) + 100 * rank + step
            results.append([exchange.all_gather(mine), exchange.all_reduce_(mine.clone()), mine])
    return results


def test_tensors_of_several_shapes_in_turn_gather_and_sum_right(tmp_path):
    results = run_workers(_alternating_shapes, 2, init_file=tmp_path / "store")
    for rank_results in results:
        for call, (gathered, summed, _) in enumerate(rank_results):
            ours, theirs = results[0][call][2], results[1][call][2]
            assert torch.equal(gathered, torch.cat([ours, theirs])) and torch.equal(summed, ours + theirs)


def _one_member_each(rank: int, world_size: int) -> list[torch.Tensor]:
    exchange = open_shared_memory_exchange(SharedMemoryAllReduce(), [rank], 64)  # a group of one rank each
    mine = torch.arange(4.0) + rank
    return [exchange.all_gather(mine), exchange.all_reduce_(mine.clone()), mine]


def test_a_group_of_one_gathers_and_sums_its_own_tensor(tmp_path):
    for gathered, summed, mine in run_workers(_one_member_each, 2, init_file=tmp_path / "store"):
        assert torch.equal(gathered, mine) and torch.equal(summed, mine)


def test_an_exchange_spins_only_where_every_member_has_a_core():
    cores = len(os.sched_getaffinity(0))
    assert spin_seconds(cores) == SPIN_S > 0 and spin_seconds(cores + 1) == 0.0


def _peer_missing(rank: int, world_size: int) -> dict:
    host = SharedMemoryAllReduce()
    exchange = open_shared_memory_exchange(host, [0, 1], 1024)
    if rank == 1:
        return {}  # its process ends without taking part
    layer = SyncBatchNorm(4)
    SyncBatchNorm.use_exchange(layer, exchange, None)
    started = time.monotonic()
    try:
        layer(torch.randn(3, 4))
    except RuntimeError as error:
        return {"error": str(error), "seconds": time.monotonic() - started, "tracked": int(layer.num_batches_tracked)}
    return {"error": None}


def test_a_dead_peer_ends_the_forward_within_seconds_as_a_lost_peer(tmp_path):
    outcome = run_workers(_peer_missing, 2, init_file=tmp_path / "store", timeout_s=60, deadline_margin_s=10)[0]
    assert outcome["error"] is not None and outcome["seconds"] < 5, outcome
    assert is_peer_loss(RuntimeError(outcome["error"]))  # the strategy's exit record names the lost peer
    assert outcome["tracked"] == 0  # no batch counted: a checkpoint written now resumes exactly


def _where_it_cannot_apply(rank: int, world_size: int) -> list:
    host_reduce.local_problem = lambda peers: "forced by the test"  # gloo barriers, as off x86-64
    host = SharedMemoryAllReduce()
    return [open_shared_memory_exchange(None, [0, 1], 64), open_shared_memory_exchange(host, [0, 1], 64)]


def test_without_futex_barriers_or_shared_buckets_the_process_group_keeps_them(tmp_path, caplog):
    for result in run_workers(_where_it_cannot_apply, 2, init_file=tmp_path / "store"):
        assert result == [None, None]


def test_copies_of_a_layer_drop_the_exchange():
    layer = SyncBatchNorm(3)
    layer._exchange = object()
    assert layer.__getstate__()["_exchange"] is None and layer._exchange is not None
