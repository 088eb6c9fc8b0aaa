"""Scatter sharding of evaluation data by indices (pure torch, 2-3 gloo ranks)."""

from __future__ import annotations

import pytest
from torch.profiler import ProfilerActivity, profile
from torch.utils.data import DistributedSampler

from collectives.launcher import run_workers
from parallel.evaluation.eval_sharding import (
    ShardPlan,
    ShardSampler,
    broadcast_count,
    make_shards,
    scatter_shard_indices,
    shard_lengths,
    shard_sizes,
)


def test_shard_sizes_cover_every_sample_once() -> None:
    assert shard_sizes(11, 2) == [6, 5]
    assert shard_sizes(10, 3) == [4, 3, 3]
    assert shard_sizes(1, 3) == [1, 0, 0]
    with pytest.raises(ValueError, match="world_size"):
        shard_sizes(4, 0)


@pytest.mark.parametrize(
    "num_samples, batch_size, limit, layout, lengths",
    [
        (11, 4, 1.0, "contiguous", (6, 5)),  # 6 + 5 samples: 2 + 2 batches
        (5, 2, 0.5, "strided_padded", (3, 3)),  # 3 + 2 samples: 2 + 1 batches -> int(0.5 * 1) = 0 on rank 1
        (5, 2, 1, "contiguous", (3, 2)),  # an int limit keeps one batch on each rank
        (1, 4, 1.0, "strided_padded", (1, 1)),  # fewer samples than ranks
        (0, 4, 1.0, "contiguous", (0, 0)),  # nothing on any rank: every rank skips, consistently
    ],
)
def test_a_plan_keeps_every_rank_in_or_every_rank_out(num_samples, batch_size, limit, layout, lengths) -> None:
    plan = ShardPlan.decide(num_samples, 2, batch_size=batch_size, limit=limit)
    assert (plan.layout, plan.lengths, plan.world_size) == (layout, lengths, 2)
    assert plan.shards(list(range(num_samples))) == make_shards(list(range(num_samples)), 2, layout)


def test_a_plan_counts_batches_as_lightning_does_and_rejects_a_wrong_order() -> None:
    assert ShardPlan.decide(11, 2, batch_size=4).contiguous_batches == (2, 2)
    assert ShardPlan.decide(11, 2, batch_size=4, drop_last=True).contiguous_batches == (1, 1)
    assert ShardPlan.decide(40, 2, batch_size=4, limit=3).contiguous_batches == (3, 3)
    with pytest.raises(ValueError, match="the plan is for 11 samples, the order has 10"):
        ShardPlan.decide(11, 2, batch_size=4).shards(list(range(10)))
    with pytest.raises(ValueError, match="batch_size=0"):
        ShardPlan.decide(11, 2, batch_size=0)


@pytest.mark.parametrize(
    ("num_samples", "batch_size", "lengths"), [(11, 4, (4, 4)), (13, 3, (6, 6)), (20, 3, (9, 9)), (9, 2, (4, 4))]
)
def test_a_drop_last_plan_shards_whole_batches_of_the_samples_one_process_evaluates(
    num_samples, batch_size, lengths
) -> None:
    plan = ShardPlan.decide(num_samples, 2, batch_size=batch_size, drop_last=True)
    assert (plan.layout, plan.lengths) == ("contiguous", lengths)
    shards = plan.shards(list(range(num_samples)))
    # One process with drop_last evaluates the first (num_samples // batch_size) * batch_size samples.
    assert [i for shard in shards for i in shard] == list(range(num_samples // batch_size * batch_size))
    assert all(len(shard) % batch_size == 0 for shard in shards)  # each rank's loader drops nothing


def test_contiguous_shards_follow_the_given_order() -> None:
    order = [9, 3, 7, 1, 0, 5, 2]
    assert make_shards(order, 2) == [[9, 3, 7, 1], [0, 5, 2]]
    assert make_shards([], 2) == [[], []]
    assert shard_lengths(7, 2) == [4, 3]


def test_strided_padded_layout_is_distributed_samplers() -> None:
    for n, world_size in [(11, 2), (10, 3), (2, 3), (1, 4)]:
        expected = [
            list(DistributedSampler(range(n), num_replicas=world_size, rank=r, shuffle=False))
            for r in range(world_size)
        ]
        assert make_shards(list(range(n)), world_size, "strided_padded") == expected
        assert shard_lengths(n, world_size, "strided_padded") == [len(e) for e in expected]
    with pytest.raises(ValueError, match="layout"):
        shard_lengths(4, 2, "random")


def _scatter_worker(rank: int, world_size: int, n: int, layout: str) -> tuple[list[int], int]:
    order = list(range(n))[::-1] if rank == 0 else None  # the source's sampler order: reversed
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        count = broadcast_count(None if order is None else len(order))
        lengths = shard_lengths(count, world_size, layout)
        shards = None if order is None else make_shards(order, world_size, layout)
        indices = scatter_shard_indices(shards, lengths)
    collectives = sum(e.count for e in prof.key_averages() if e.key.startswith("c10d::"))
    assert list(ShardSampler(indices)) == indices and len(ShardSampler(indices)) == len(indices)
    return indices, collectives


@pytest.mark.distributed
@pytest.mark.parametrize("n, world_size", [(11, 2), (10, 3), (2, 3), (0, 2)])
def test_scatter_gives_each_index_to_exactly_one_rank(tmp_path, n: int, world_size: int) -> None:
    results = run_workers(_scatter_worker, world_size, args=(n, "contiguous"), init_file=tmp_path / "store")
    shards = [indices for indices, _ in results]
    assert shards == make_shards(list(range(n))[::-1], world_size)  # contiguous runs of rank 0's order
    assert sorted(i for shard in shards for i in shard) == list(range(n))  # no duplicate, nothing dropped
    assert all(collectives == 2 for _, collectives in results)  # one broadcast + one scatter, no samples


@pytest.mark.distributed
def test_scatter_of_the_padded_layout(tmp_path) -> None:
    results = run_workers(_scatter_worker, 2, args=(3, "strided_padded"), init_file=tmp_path / "store")
    assert [indices for indices, _ in results] == [[2, 0], [1, 2]]
