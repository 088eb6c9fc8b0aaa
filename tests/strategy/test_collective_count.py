"""Collectives per training micro-batch, by source, on 2 CPU ranks (fork launching).

custom_ddp with 2 BatchNorm layers and Lightning's ddp (no BatchNorm), both at
accumulate_grad_batches=4, counted by :class:`callbacks.CollectiveCounter`;
and the context manager on a hand-written loop without Lightning.
"""

from __future__ import annotations

import json
from collections import Counter

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from conformance_harness import WORLD_SIZE, custom_strategy, make_trainer
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader, Subset, TensorDataset

from callbacks import CollectiveCounter
from collectives.launcher import run_workers
from measure.collective_count import count_collectives
from parallel.batchnorm.syncbn import SyncBatchNorm
from parallel.gradients.grad_sync import SyncedDataParallel

pytestmark = pytest.mark.distributed

BATCH, SAMPLES, ACCUMULATE = 4, 64, 4  # 8 micro-batches per rank (WORLD_SIZE 2): 2 optimizer steps


def _net(batchnorm: bool) -> nn.Sequential:
    torch.manual_seed(0)
    norm = nn.BatchNorm1d if batchnorm else lambda _: nn.Identity()
    return nn.Sequential(nn.Linear(8, 16), norm(16), nn.ReLU(), nn.Linear(16, 8), norm(8), nn.ReLU(), nn.Linear(8, 4))


class _Module(pl.LightningModule):
    def __init__(self, batchnorm: bool) -> None:
        super().__init__()
        self.net = _net(batchnorm)
        generator = torch.Generator().manual_seed(1)
        self.data = TensorDataset(
            torch.randn(SAMPLES, 8, generator=generator), torch.randint(0, 4, (SAMPLES,), generator=generator)
        )

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        inputs, labels = batch
        return F.cross_entropy(self.net(inputs), labels)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader:
        rank, world_size = self.trainer.global_rank, self.trainer.world_size
        return DataLoader(Subset(self.data, range(rank, SAMPLES, world_size)), batch_size=BATCH)


class _RecordBuckets(pl.Callback):
    """Each rank's gradient bucket sizes (elements), written next to the counter's files."""

    def __init__(self, out_dir) -> None:
        self.out_dir = out_dir

    def on_train_end(self, trainer, pl_module) -> None:
        model = trainer.strategy.model
        if isinstance(model, SyncedDataParallel):
            sizes = [b.buffer.numel() * b.buffer.element_size() for b in model.buckets]
        else:  # torch DDP: the bucket count from its logging data (bytes per bucket)
            sizes = [int(s) for s in str(model._get_ddp_logging_data()["bucket_sizes"]).split(",")]
        (self.out_dir / f"buckets_rank{trainer.global_rank}.json").write_text(json.dumps(sizes))


def _fit(tmp_path, strategy, batchnorm: bool, *callbacks) -> list[tuple[list[dict], list[int]]]:
    trainer = make_trainer(
        strategy,
        use_distributed_sampler=False,
        accumulate_grad_batches=ACCUMULATE,
        callbacks=[CollectiveCounter(tmp_path), _RecordBuckets(tmp_path), *callbacks],
    )
    trainer.fit(_Module(batchnorm))
    return [
        (
            json.loads((tmp_path / f"collectives_rank{r}.json").read_text()),
            json.loads((tmp_path / f"buckets_rank{r}.json").read_text()),
        )
        for r in range(WORLD_SIZE)
    ]


def _stepping(batch_idx: int) -> bool:
    return batch_idx % ACCUMULATE == ACCUMULATE - 1


@pytest.mark.parametrize("sync_batchnorm", [True, False], ids=["syncbn", "local-bn"])
def test_custom_ddp_counts_per_micro_batch_by_source(tmp_path, sync_batchnorm: bool) -> None:
    # SyncBN: every buffer is a SyncBN statistic, so broadcast_buffers (on by default) sends nothing.
    # Local BN: ONE broadcast of every running stat before each training forward, micro-batches included.
    strategy = custom_strategy(sync_batchnorm=sync_batchnorm)
    for windows, bucket_bytes in _fit(tmp_path, strategy, batchnorm=True):
        buckets = len(bucket_bytes)
        assert buckets >= 1
        batches = [w for w in windows if w["batch_idx"] is not None]
        assert [w["batch_idx"] for w in batches] == list(range(SAMPLES // WORLD_SIZE // BATCH))
        for w in batches:
            expected = (
                {"lightning_sigterm": 1, "syncbn_forward": 2, "syncbn_backward": 2}
                if sync_batchnorm
                else {"lightning_sigterm": 1, "buffer_broadcast": 1}
            )
            if _stepping(w["batch_idx"]):
                expected["grad_buckets"] = buckets
            assert w["counts"] == expected, w["batch_idx"]
            if not sync_batchnorm:  # (2 x 16 + 2 x 8) float32 running stats + 2 int64 num_batches_tracked
                assert w["bytes"]["buffer_broadcast"] == 4 * (2 * 16 + 2 * 8) + 2 * 8
                continue
            # Payloads: an int64 flag; per layer [count, mean, M2] (2C+1) and [sum_dy, sum_dy_xmu] (2C).
            assert w["bytes"]["lightning_sigterm"] == 8
            assert w["bytes"]["syncbn_forward"] == 4 * ((2 * 16 + 1) + (2 * 8 + 1))
            assert w["bytes"]["syncbn_backward"] == 4 * (2 * 16 + 2 * 8)
            if _stepping(w["batch_idx"]):
                assert w["bytes"]["grad_buckets"] == sum(bucket_bytes)
            kinds = Counter((c["source"], c["kind"]) for c in w["collectives"])
            assert kinds[("syncbn_forward", "all_gather")] == kinds[("syncbn_backward", "all_reduce")] == 2
            # One host, buckets in shared memory: the statistics go there too, none through gloo.
            syncbn_ops = {c["op"] for c in w["collectives"] if c["source"].startswith("syncbn")}
            assert syncbn_ops == {"shared_memory_all_gather", "shared_memory_all_reduce"}
            assert kinds[("lightning_sigterm", "broadcast")] == 1
            assert all(c["before_batch"] == (c["source"] == "lightning_sigterm") for c in w["collectives"])
        assert all(w["counts"] == {} for w in windows if w["batch_idx"] is None)


@pytest.mark.parametrize("batchnorm", [False, True], ids=["no-bn", "plain-bn"])
def test_lightning_ddp_counts_per_micro_batch_by_source(tmp_path, batchnorm: bool) -> None:
    # Plain BatchNorm under ddp on CPU (torch's SyncBatchNorm is CUDA-only): not synchronised,
    # but its buffers are broadcast from rank 0 (broadcast_buffers=True).
    for windows, bucket_bytes in _fit(tmp_path, DDPStrategy(start_method="fork"), batchnorm):
        batches = [w for w in windows if w["batch_idx"] is not None]
        assert len(batches) == SAMPLES // WORLD_SIZE // BATCH
        for w in batches:
            expected = {"lightning_sigterm": 1}
            if _stepping(w["batch_idx"]):  # DDP's reducer: only outside no_sync()
                expected["ddp_grad_buckets"] = len(bucket_bytes)
            if w["batch_idx"] == ACCUMULATE:  # first forward after the first synced backward
                expected["ddp_bucket_rebuild"] = 2  # bucket sizes, then parameter indices (int32)
            if batchnorm and w["batch_idx"] % ACCUMULATE == 0:  # first forward after a synced one
                expected["ddp_buffers"] = 2  # float32 running stats, int64 num_batches_tracked
            assert w["counts"] == expected, w["batch_idx"]


class _BroadcastBetweenBatches(pl.Callback):
    """Like a checkpoint callback: ``strategy.broadcast`` (broadcast_object_list) after each batch."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        trainer.strategy.broadcast({"batch_idx": batch_idx})


def test_sigterm_broadcast_is_told_from_an_object_broadcast_between_batches(tmp_path) -> None:
    # broadcast_object_list also starts with a 1-element int64 broadcast from rank 0; it runs after
    # the counter's on_train_batch_end, so it lands before the NEXT batch, ahead of the SIGTERM flag.
    results = _fit(tmp_path, DDPStrategy(start_method="fork"), False, _BroadcastBetweenBatches())
    object_broadcast = [("other", "int64"), ("other", "uint8")]  # object sizes, then pickled bytes
    for windows, _ in results:
        for w in windows:
            before = [(c["source"], c["dtype"]) for c in w["collectives"] if c["before_batch"]]
            if w["batch_idx"] is None:  # after the last batch: no batch start, hence no SIGTERM flag
                assert w["counts"] == {"other": 2} and before == []
            elif w["batch_idx"] == 0:
                assert before == [("lightning_sigterm", "int64")]
            else:
                assert before == [*object_broadcast, ("lightning_sigterm", "int64")], w["batch_idx"]


def _manual_loop_worker(rank: int, world_size: int) -> list[list[tuple[str, str]]]:
    torch.manual_seed(0)
    model = SyncedDataParallel(SyncBatchNorm.convert(_net(batchnorm=True)))
    seen = []
    for micro_batch in range(2):
        x = torch.randn(3 + rank, 8)
        with count_collectives(model) as collectives:
            dist.broadcast(torch.zeros(1, dtype=torch.int64), src=0)  # no batch marker: "other"
            with model.no_sync() if micro_batch == 0 else torch.enable_grad():
                model(x).square().mean().backward()
            model.finish()
        seen.append([(c.source, c.kind) for c in collectives])
    return seen


def test_context_manager_counts_a_loop_without_lightning(tmp_path) -> None:
    results = run_workers(_manual_loop_worker, 2, init_file=tmp_path / "store")
    syncbn = [("syncbn_forward", "all_gather")] * 2 + [("syncbn_backward", "all_reduce")] * 2
    for accumulate, step in results:
        assert sorted(accumulate) == sorted([("other", "broadcast"), *syncbn])
        buckets = [c for c in step if c[0] == "grad_buckets"]
        assert len(buckets) >= 1 and sorted(step) == sorted([("other", "broadcast"), *syncbn, *buckets])


def test_max_batches_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_batches=0"):
        CollectiveCounter(max_batches=0)
