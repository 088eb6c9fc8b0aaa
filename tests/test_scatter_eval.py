"""Scatter sharding of evaluation data and the one-collective metric reduction (pure torch, 2-3 gloo ranks)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile
from torch.utils.data import DistributedSampler
from torchmetrics import MeanMetric, SumMetric
from torchmetrics.classification import MulticlassAccuracy

from parallel.metric_reduction import EpochMetricReducer
from collectives.launcher import run_workers
from parallel.eval_sharding import (
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


def test_contiguous_shards_follow_the_given_order() -> None:
    order = [9, 3, 7, 1, 0, 5, 2]
    assert make_shards(order, 2) == [[9, 3, 7, 1], [0, 5, 2]]
    assert make_shards([], 2) == [[], []]
    assert shard_lengths(7, 2) == [4, 3]


def test_strided_padded_layout_is_distributed_samplers() -> None:
    for n, world_size in [(11, 2), (10, 3), (2, 3), (1, 4)]:
        expected = [list(DistributedSampler(range(n), num_replicas=world_size, rank=r, shuffle=False))
                    for r in range(world_size)]
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


def _metrics() -> list:
    return [MulticlassAccuracy(3, top_k=1, average="micro"), MulticlassAccuracy(3, top_k=2, average="micro"),
            MeanMetric(), SumMetric()]


def _update(metrics: list, logits: torch.Tensor, labels: torch.Tensor, losses: torch.Tensor) -> None:
    metrics[0].update(logits, labels)
    metrics[1].update(logits, labels)
    metrics[2].update(losses)
    metrics[3].update(torch.tensor(float(labels.numel())))


def _data(n: int = 11) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return torch.randn(n, 3, generator=generator), torch.randint(0, 3, (n,), generator=generator), torch.rand(n)


def _reduce_worker(rank: int, world_size: int) -> tuple[list[float], int, int]:
    logits, labels, losses = _data()
    part = slice(0, 6) if rank == 0 else slice(6, None)  # uneven shards: 6 and 5 samples
    metrics, idle = _metrics(), SumMetric()
    reducer = EpochMetricReducer()
    reducer.begin([*metrics, idle])
    for start in range(part.start, part.stop or len(labels), 4):  # rank 0: 2 batches, rank 1: 2 batches
        stop = min(start + 4, part.stop or len(labels))
        _update(metrics, logits[start:stop], labels[start:stop], losses[start:stop])
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        reduced = reducer.reduce()
        values = [float(m.compute()) for m in metrics]  # compute-time sync is off: no collective
    reducer.end()
    collectives = sum(e.count for e in prof.key_averages() if e.key.startswith("c10d::"))
    return values, collectives, len(reduced)


@pytest.mark.distributed
def test_one_all_reduce_makes_uneven_shard_metrics_exact(tmp_path) -> None:
    results = run_workers(_reduce_worker, 2, init_file=tmp_path / "store")
    reference = _metrics()
    _update(reference, *_data())
    expected = [float(m.compute()) for m in reference]
    for values, collectives, num_reduced in results:
        assert values == pytest.approx(expected, rel=1e-6, abs=0)
        assert values[:2] == expected[:2] and values[3] == 11.0  # counts are exact
        assert collectives == 1 and num_reduced == 4  # the idle metric is not touched


def test_reducer_rejects_non_sum_states() -> None:
    from torchmetrics import MaxMetric

    metric = MaxMetric()
    reducer = EpochMetricReducer()
    reducer.begin([metric])
    metric.update(torch.tensor(1.0))
    with pytest.raises(TypeError, match="scatter_eval=False"):
        reducer.reduce()
    reducer.end()
    assert metric.distributed_available_fn is not None and metric.distributed_available_fn.__name__ != "_never_distributed"


def test_reducer_restores_own_sync() -> None:
    metric = SumMetric()
    own = metric.distributed_available_fn
    reducer = EpochMetricReducer()
    reducer.begin([metric])
    assert metric.distributed_available_fn is not own and reducer.active
    reducer.end()
    assert metric.distributed_available_fn is own and not reducer.active
    assert not dist.is_initialized()
