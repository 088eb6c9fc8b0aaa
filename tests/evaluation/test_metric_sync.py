"""MetricSync and the uneven gathers under it: exact metrics from uneven shards (pure torch + torchmetrics, 2 gloo
ranks).

Rank 0 holds samples 0-5, rank 1 samples 6-10 (the contiguous shards of 11 on 2 ranks), in
batches of 4: 2 batches on each rank, of unequal sizes. One process on all 11 is the reference.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torchmetrics import MaxMetric, MeanMetric, Metric, MinMetric, SumMetric
from torchmetrics.aggregation import CatMetric
from torchmetrics.classification import BinaryAUROC, MulticlassAccuracy
from torchmetrics.retrieval import RetrievalMAP
from torchmetrics.utilities.data import dim_zero_cat

from collectives.launcher import run_workers
from conformance.evaluation.patterns import MeanStateMetric
from measure.collective_count import count_collectives
from parallel.evaluation.eval_sharding import ShardPlan, broadcast_count, scatter_shard_indices
from parallel.evaluation.metric_sync import MetricSync, merge_kinds
from parallel.evaluation.uneven_gather import (
    UnevenGatherError,
    all_gather_padded,
    all_gather_rows,
    exchange_layouts,
    gather_tensors,
)

pytestmark = pytest.mark.distributed
SHARDS = (slice(0, 6), slice(6, 11))


def _data(n: int = 11) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return (
        torch.randn(n, 3, generator=generator),
        torch.randint(0, 3, (n,), generator=generator),
        torch.rand(n, generator=generator),
    )


def _metrics() -> list:
    # sum states (accuracy, mean), max, min, cat (AUROC's list states), and one never updated
    return [MulticlassAccuracy(3, average="micro"), MeanMetric(), MaxMetric(), MinMetric(), BinaryAUROC(), SumMetric()]


def _update(metrics: list, logits: torch.Tensor, labels: torch.Tensor, scores: torch.Tensor) -> None:
    metrics[0].update(logits, labels)
    metrics[1].update(scores)
    metrics[2].update(scores)
    metrics[3].update(scores)
    metrics[4].update(scores, (labels > 1).long())  # 7 positives, 4 negatives


def _batches(part: slice):
    for start in range(part.start, part.stop, 4):
        yield slice(start, min(start + 4, part.stop))


def _reference() -> list[float]:
    metrics = _metrics()
    _update(metrics, *_data())
    return [float(m.compute()) for m in metrics[:5]]


def _sync_worker(rank: int, world_size: int) -> dict:
    logits, labels, scores = _data()
    metrics = _metrics()
    sync = MetricSync()
    sync.begin(metrics)
    for batch in _batches(SHARDS[rank]):
        _update(metrics, logits[batch], labels[batch], scores[batch])
    with count_collectives() as early:
        local = [float(m.compute()) for m in metrics[:5]]  # before the last step is done: this rank's own
    sync.set_ready(True)
    with count_collectives() as merged:
        values = [float(m.compute()) for m in metrics[:5]]
        again = [float(m.compute()) for m in metrics[:5]]  # served from the same merge
    sync.end()
    restored = all(m.distributed_available_fn is not sync._is_ready and m.compute_with_cache for m in metrics)
    return {
        "local": local,
        "values": values,
        "again": again,
        "early": len(early),
        "restored": restored,
        "merged": Counter(c.kind for c in merged),
        "merges": sync.merges,
    }


def test_sum_max_min_and_cat_states_equal_one_process_in_four_collectives(tmp_path) -> None:
    expected = _reference()
    for rank, result in enumerate(run_workers(_sync_worker, 2, init_file=tmp_path / "store")):
        assert result["values"] == pytest.approx(expected, rel=1e-6, abs=1e-7)
        assert result["values"][0] == expected[0]  # a ratio of integer counts: bit-exact
        assert result["again"] == result["values"] and result["merges"] == 1
        # sums in one all_reduce, max/min in one, cat states: one layout exchange + one padded gather
        assert result["merged"] == {"all_reduce": 2, "all_gather": 2}, result["merged"]
        assert result["early"] == 0 and result["restored"]
        shard = _metrics()
        _update(shard, *(t[SHARDS[rank]] for t in _data()))
        assert result["local"] == pytest.approx([float(m.compute()) for m in shard[:5]])


def _scatter_and_sync_worker(rank: int, world_size: int, device: str, collective_device: str) -> dict:
    """Scatter evaluation's two steps as the strategy runs them: rank 0 scatters the sample indices (through
    ``collective_device``), each rank updates metrics that live on ``device``, one merge."""
    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())  # one GPU: both ranks on it
    order = list(range(11)) if rank == 0 else None
    count = broadcast_count(None if order is None else len(order), device=collective_device)
    plan = ShardPlan.decide(count, world_size, batch_size=4)
    shards = None if order is None else plan.shards(order)
    indices = scatter_shard_indices(shards, plan.lengths, device=collective_device)
    logits, labels, scores = (t.to(device) for t in _data())
    metrics = [metric.to(device) for metric in _metrics()]
    sync = MetricSync(device=collective_device)
    sync.begin(metrics)
    for start in range(0, len(indices), 4):
        batch = torch.tensor(indices[start : start + 4], device=device)
        _update(metrics, logits[batch], labels[batch], scores[batch])
    sync.set_ready(True)
    computed = [metric.compute() for metric in metrics[:5]]
    sync.end()
    return {"indices": indices, "values": [float(v) for v in computed], "devices": {v.device.type for v in computed}}


@pytest.mark.parametrize(
    "device, collective_device, backend",
    [
        ("cpu", "cpu", "gloo"),
        pytest.param(
            "cuda",
            "cpu",
            "gloo",  # two ranks sharing one GPU: gloo stages through the host, as the strategy does under gloo
            marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")],
        ),
        pytest.param(
            "cuda",
            "cuda",
            "nccl",
            marks=[pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")],
        ),
    ],
)
def test_scattered_shards_and_merged_metrics_equal_one_process_on_every_device(
    tmp_path, device: str, collective_device: str, backend: str
) -> None:
    # spawn on CUDA: a forked child cannot initialise CUDA once the parent has.
    start_method = "spawn" if device == "cuda" else "fork"
    kwargs = {"init_file": tmp_path / "store", "backend": backend, "start_method": start_method, "timeout_s": 120}
    results = run_workers(_scatter_and_sync_worker, 2, args=(device, collective_device), **kwargs)
    assert [result["indices"] for result in results] == [list(range(6)), list(range(6, 11))]
    for result in results:
        assert result["values"] == pytest.approx(_reference(), rel=1e-6, abs=1e-7)
        assert result["devices"] == {device}  # the merged values come back where the metric lives


class _IntCat(Metric):
    """A list state of int64 values, concatenated across ranks."""

    def __init__(self) -> None:
        super().__init__()
        self.add_state("values", default=[], dist_reduce_fx="cat")

    def update(self, values: torch.Tensor) -> None:
        self.values.append(values)

    def compute(self) -> torch.Tensor:
        return dim_zero_cat(self.values)


def _special_worker(rank: int, world_size: int) -> dict:
    only_rank0 = CatMetric()  # a cat state one rank never adds to
    huge = _IntCat()  # int64 beyond float64's 2**53: travels as bytes
    local = MaxMetric(sync_on_compute=False)
    mean_state = MeanStateMetric()  # "mean" reduction: torchmetrics' own sync
    sync = MetricSync()
    sync.begin([only_rank0, huge, local, mean_state])
    if rank == 0:
        only_rank0.update(torch.tensor([1.0, 2.0]))
    huge.update(torch.tensor([2**60 + rank], dtype=torch.int64))
    local.update(torch.tensor(float(rank)))
    mean_state.update(torch.full((2 + rank,), float(rank)))
    sync.set_ready(True)
    out = {
        "only_rank0": only_rank0.compute().tolist(),
        "huge": huge.compute().tolist(),
        "local": float(local.compute()),
        "mean_state": float(mean_state.compute()),
    }
    sync.end()
    return out


def test_empty_ranks_exact_integers_local_metrics_and_unmergeable_states(tmp_path) -> None:
    for rank, result in enumerate(run_workers(_special_worker, 2, init_file=tmp_path / "store")):
        assert result["only_rank0"] == [1.0, 2.0]
        assert result["huge"] == [2**60, 2**60 + 1]
        assert result["local"] == float(rank)
        assert result["mean_state"] == 0.5  # mean over ranks of (sum 0, 1 batch) and (sum 1, 1 batch)
    assert merge_kinds(MeanStateMetric()) == {"batch_mean_sum": "own", "batches": "own"}
    assert merge_kinds(BinaryAUROC()) == {"preds": "cat", "target": "cat"}


def _retrieval_worker(rank: int, world_size: int) -> tuple[float, Counter]:
    scores, labels, queries = (
        torch.rand(11, generator=torch.Generator().manual_seed(1)),
        _data()[1] > 1,
        torch.arange(11) // 3,
    )
    metric = RetrievalMAP()
    sync = MetricSync()
    sync.begin([metric])
    for batch in [slice(0, 2), slice(2, 4), slice(4, 6)] if rank == 0 else [slice(6, 11)]:  # 3 updates vs 1
        metric.update(scores[batch], labels[batch], indexes=queries[batch])
    sync.set_ready(True)
    with count_collectives() as collectives:
        value = float(metric.compute())
    sync.end()
    return value, Counter(c.kind for c in collectives)


def test_list_states_of_retrieval_metrics_with_different_update_counts_per_rank(tmp_path) -> None:
    # torchmetrics' own sync would issue one gather per update: 3 on rank 0, 1 on rank 1 (a hang)
    reference = RetrievalMAP()
    reference.update(
        torch.rand(11, generator=torch.Generator().manual_seed(1)), _data()[1] > 1, indexes=torch.arange(11) // 3
    )
    for value, collectives in run_workers(_retrieval_worker, 2, init_file=tmp_path / "store"):
        assert value == pytest.approx(float(reference.compute()), rel=1e-6)
        assert collectives == {"all_gather": 3}  # element counts, layouts, bytes


def _gather_worker(rank: int, world_size: int) -> dict:
    rows = torch.arange(6 - rank, dtype=torch.float32).mul(10**rank).requires_grad_()  # 6 and 5 rows
    padded, padding = all_gather_padded(rows)
    exact = all_gather_rows(rows, sync_grads=True)
    exact.sum().backward()
    layouts = exchange_layouts([rows.detach(), None if rank else torch.ones(2, 2, dtype=torch.bool)])
    mixed = gather_tensors([rows.detach(), None if rank else torch.ones(2, 2, dtype=torch.bool)], layouts)
    try:
        all_gather_padded(torch.zeros(3, 2 + rank))
        error = None
    except UnevenGatherError as err:
        error = str(err)
    return {
        "padded": padded.tolist(),
        "padding": padding,
        "exact": exact.tolist(),
        "grad": rows.grad.tolist(),
        "mixed": [[None if t is None else t.tolist() for t in r] for r in mixed],
        "error": error,
    }


def test_uneven_gathers_pad_like_distributed_sampler_or_give_each_row_once(tmp_path) -> None:
    results = run_workers(_gather_worker, 2, init_file=tmp_path / "store")
    rank0, rank1 = list(range(6)), [0.0, 10.0, 20.0, 30.0, 40.0]
    for result in results:
        assert result["padded"] == [rank0, rank1 + [0.0]] and result["padding"] == 1  # repeats of the rank's rows
        assert result["exact"] == rank0 + rank1
        assert result["mixed"] == [[rank0, [[True, True], [True, True]]], [rank1, None]]
        assert "dimensions after the first" in result["error"] and "rank 1: (3, 3)" in result["error"]
    # sync_grads: each rank's rows get the gradient of their one appearance, from both ranks' losses
    assert results[0]["grad"] == [2.0] * 6 and results[1]["grad"] == [2.0] * 5
