"""Scatter sharding of evaluation data and the one-collective metric reduction (pure torch, 2-3 gloo ranks)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile
from torch.utils.data import TensorDataset
from torchmetrics import MeanMetric, SumMetric
from torchmetrics.classification import MulticlassAccuracy

from parallel.metric_reduction import EpochMetricReducer
from collectives.launcher import run_workers
from parallel.eval_sharding import materialize, scatter_shards, shard_sizes


class _PairDataset(torch.utils.data.Dataset):
    """(uint8 image, int label) samples, like the CIFAR datasets."""

    def __init__(self, n: int) -> None:
        self.images = torch.arange(n * 12, dtype=torch.uint8).view(n, 3, 2, 2)

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return self.images[i], int(i)


def test_shard_sizes_cover_every_sample_once() -> None:
    assert shard_sizes(11, 2) == [6, 5]
    assert shard_sizes(10, 3) == [4, 3, 3]
    assert shard_sizes(1, 3) == [1, 0, 0]
    with pytest.raises(ValueError, match="world_size"):
        shard_sizes(4, 0)


def test_materialize_stacks_fields_in_index_order() -> None:
    images, labels = materialize(_PairDataset(7), indices=[6, 0, 3], batch_size=2)
    assert images.dtype == torch.uint8 and images.shape == (3, 3, 2, 2)
    assert labels.tolist() == [6, 0, 3]
    with pytest.raises(TypeError, match="flat tuple"):
        materialize([{"x": torch.zeros(1)}])


def _scatter_worker(rank: int, world_size: int, n: int) -> tuple[list[int], tuple, int, int]:
    fields = materialize(_PairDataset(n)) if rank == 0 else None
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        shard = scatter_shards(fields)
    scatters = sum(e.count for e in prof.key_averages() if e.key == "c10d::scatter_")
    images, labels = shard.fields
    assert torch.equal(images, _PairDataset(n).images[labels])  # images travelled with their labels
    return labels.tolist(), tuple(images.shape[1:]), shard.offset, scatters


@pytest.mark.distributed
@pytest.mark.parametrize("n, world_size", [(11, 2), (10, 3), (2, 3)])
def test_scatter_gives_each_sample_to_exactly_one_rank(tmp_path, n: int, world_size: int) -> None:
    results = run_workers(_scatter_worker, world_size, args=(n,), init_file=tmp_path / "store")
    seen = [label for labels, _, _, _ in results for label in labels]
    assert sorted(seen) == list(range(n))  # no duplicate, no dropped remainder
    assert [len(labels) for labels, _, _, _ in results] == shard_sizes(n, world_size)
    assert [offset for _, _, offset, _ in results] == [sum(shard_sizes(n, world_size)[:r]) for r in range(world_size)]
    assert all(shape == (3, 2, 2) for _, shape, _, _ in results)
    assert all(scatters == 2 for *_, scatters in results)  # one scatter per field


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
