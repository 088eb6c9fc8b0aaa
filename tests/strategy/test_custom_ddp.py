"""custom_ddp training on 2 CPU ranks (fork launching): parity, collective counts, resume, failure.

References: Lightning's own ``ddp`` (no BatchNorm) and one process on the concatenated global
batches (with BatchNorm, which SyncBatchNorm makes exact). With fork launching, the parent's
model receives rank 0's final weights.
"""

from __future__ import annotations

import json
import time

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from conformance_harness import WORLD_SIZE, assert_states_close, custom_strategy, make_trainer, state_of
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from torch import nn
from torch.profiler import ProfilerActivity, profile
from torch.utils.data import DataLoader, Subset, TensorDataset

import strategies  # noqa: F401  (registers "custom_ddp")
from parallel.host.host_reduce import parse_launch_label
from strategies.custom_ddp import CustomDDPStrategy

pytestmark = pytest.mark.distributed


class ToyModule(pl.LightningModule):
    """A small MLP (optionally with BatchNorm) on fixed random data; momentum SGD, decaying LR."""

    def __init__(
        self, batchnorm: bool = False, batch_size: int = 4, num_samples: int = 48, fail_at=None, optimizer: str = "sgd"
    ) -> None:
        super().__init__()
        torch.manual_seed(0)
        norm = nn.BatchNorm1d(16) if batchnorm else nn.Identity()
        self.net = nn.Sequential(nn.Linear(8, 16), norm, nn.ReLU(), nn.Linear(16, 4))
        generator = torch.Generator().manual_seed(1)
        self.data = TensorDataset(
            torch.randn(num_samples, 8, generator=generator), torch.randint(0, 4, (num_samples,), generator=generator)
        )
        self.batch_size = batch_size
        self.fail_at = fail_at  # (rank, batch_idx) that raises
        self.optimizer = optimizer

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        if self.fail_at == (self.global_rank, batch_idx):
            raise RuntimeError(f"rank {self.global_rank} failed on purpose")
        inputs, labels = batch
        return F.cross_entropy(self.net(inputs), labels)

    def configure_optimizers(self):
        # A per-step LR decay: with zero1 the scheduler must drive the re-created optimizer.
        if self.optimizer == "adamw":  # its `defaults` hold keys its constructor rejects
            optimizer = torch.optim.AdamW(self.parameters(), lr=0.01, weight_decay=0.1)
        else:
            optimizer = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.7**step)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def train_dataloader(self) -> DataLoader:
        # Rank r of W takes samples r, r+W, ...: global batch t is the one-process batch t of size
        # W * batch_size. (Lightning's injected DistributedSampler would shuffle the training set.)
        rank, world_size = self.trainer.global_rank, self.trainer.world_size
        return DataLoader(Subset(self.data, range(rank, len(self.data), world_size)), batch_size=self.batch_size)


def _trainer(strategy, **kwargs) -> pl.Trainer:
    return make_trainer(strategy, use_distributed_sampler=False, **kwargs)  # ToyModule shards its own data


def _fit(module: ToyModule, strategy, **kwargs) -> dict[str, torch.Tensor]:
    _trainer(strategy, **kwargs).fit(module)
    return state_of(module)


@pytest.mark.parametrize(
    "accumulate, zero1, optimizer", [(1, False, "sgd"), (3, False, "sgd"), (3, True, "sgd"), (1, True, "adamw")]
)
def test_matches_lightning_ddp_without_batchnorm(accumulate: int, zero1: bool, optimizer: str) -> None:
    initial = ToyModule().state_dict()
    expected = _fit(
        ToyModule(optimizer=optimizer), DDPStrategy(start_method="fork"), accumulate_grad_batches=accumulate
    )
    actual = _fit(ToyModule(optimizer=optimizer), custom_strategy(zero1=zero1), accumulate_grad_batches=accumulate)
    assert_states_close(actual, expected)
    assert not torch.equal(actual["net.0.weight"], initial["net.0.weight"])  # it did train


def test_bf16_mixed_with_clipping_matches_lightning_ddp() -> None:
    # Clipping by the global norm only matches if it sees the averaged gradients: the all-reduce
    # must finish inside the closure, before the precision plugin clips.
    options = dict(precision="bf16-mixed", gradient_clip_val=0.05, accumulate_grad_batches=2)
    expected = _fit(ToyModule(), DDPStrategy(start_method="fork"), **options)
    actual = _fit(ToyModule(), custom_strategy(), **options)
    assert_states_close(actual, expected)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_fp16_mixed_on_two_gpus_matches_lightning_ddp() -> None:
    options = dict(accelerator="gpu", precision="16-mixed", gradient_clip_val=0.05, accumulate_grad_batches=2)
    expected = _fit(ToyModule(), DDPStrategy(start_method="fork"), **options)
    actual = _fit(ToyModule(batchnorm=False), custom_strategy(), **options)  # NCCL by default on CUDA
    assert_states_close(actual, expected)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_one_gpu_fit_matches_one_process_without_the_strategy() -> None:
    """devices=1: a 1-rank NCCL group, SyncBatchNorm running torch's native (cuDNN) batch norm. Spawned: the
    Trainer has initialised CUDA in this process, and a forked child cannot use it."""
    options = dict(accelerator="gpu", devices=1, accumulate_grad_batches=2)
    actual = _fit(ToyModule(batchnorm=True), custom_strategy(start_method="spawn"), **options)
    expected = _fit(ToyModule(batchnorm=True), "auto", **options)
    assert_states_close(actual, expected)


def test_syncbn_matches_one_process_on_global_batches() -> None:
    # Each rank: batches of 4, two micro-batches per step; reference: batches of 8, same steps.
    actual = _fit(ToyModule(batchnorm=True), custom_strategy(), accumulate_grad_batches=2)
    expected = _fit(ToyModule(batchnorm=True, batch_size=8), "auto", devices=1, accumulate_grad_batches=2)
    assert_states_close(actual, expected)  # includes BatchNorm running stats


class _CountGradCollectives(Callback):
    """Per training batch, the all-reduces issued; written with the bucket count to one file per rank."""

    def __init__(self, out_dir) -> None:
        self.out_dir = out_dir
        self.counts: list[int] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._profiler = profile(activities=[ProfilerActivity.CPU])
        self._profiler.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._profiler.__exit__(None, None, None)
        self.counts.append(
            sum(
                e.count
                for e in self._profiler.key_averages()  # gloo's, or shared-memory launches
                if e.key == "c10d::allreduce_" or parse_launch_label(e.key)
            )
        )

    def on_train_end(self, trainer, pl_module) -> None:
        record = {"counts": self.counts, "buckets": len(trainer.strategy.model.buckets)}
        (self.out_dir / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


def test_accumulation_sends_one_bucket_pass_per_optimizer_step(tmp_path) -> None:
    module = ToyModule(num_samples=64)  # 8 micro-batches per rank = 2 optimizer steps
    _fit(module, custom_strategy(), accumulate_grad_batches=4, callbacks=[_CountGradCollectives(tmp_path)])
    for rank in range(WORLD_SIZE):
        record = json.loads((tmp_path / f"rank{rank}.json").read_text())
        buckets = record["buckets"]
        assert buckets >= 1
        assert record["counts"] == [0, 0, 0, buckets, 0, 0, 0, buckets]  # zero on micro-batches


@pytest.mark.parametrize("zero1", [False, True])
def test_resume_from_mid_training_checkpoint_matches_uninterrupted_run(tmp_path, zero1: bool) -> None:
    # Momentum SGD: a resume that lost the (sharded) optimizer state would diverge.
    def run(ckpt_path=None, dirpath=None):
        callbacks = [ModelCheckpoint(dirpath=dirpath, every_n_epochs=1, save_top_k=-1)] if dirpath else []
        module = ToyModule(num_samples=24)  # 3 optimizer steps per epoch
        strategy = custom_strategy(zero1=zero1)
        trainer = _trainer(strategy, max_epochs=2, enable_checkpointing=bool(dirpath), callbacks=callbacks)
        trainer.fit(module, ckpt_path=ckpt_path)
        return state_of(module)

    uninterrupted = run(dirpath=tmp_path)
    first_epoch = next(tmp_path.glob("epoch=0-*.ckpt"))
    # The checkpoint holds the full optimizer state (consolidated from the shards with zero1).
    saved = torch.load(first_epoch, weights_only=False)["optimizer_states"][0]["state"]
    assert sorted(saved) == [0, 1, 2, 3] and all("momentum_buffer" in s for s in saved.values())
    resumed = run(ckpt_path=first_epoch)
    assert_states_close(resumed, uninterrupted)


class _RecordOptimizer(Callback):
    def __init__(self, out_dir) -> None:
        self.out_dir = out_dir

    def on_train_end(self, trainer, pl_module) -> None:
        optimizer = trainer.optimizers[0]
        record = {"type": type(optimizer).__name__, "local_states": len(optimizer.local_optimizer.state)}
        (self.out_dir / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


def test_zero1_shards_the_optimizer_state(tmp_path) -> None:
    _fit(ToyModule(), custom_strategy(zero1=True), max_steps=2, callbacks=[_RecordOptimizer(tmp_path)])
    records = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(WORLD_SIZE)]
    assert all(r["type"] == "ShardedOptimizer" for r in records)
    local = [r["local_states"] for r in records]
    assert sum(local) == 4 and max(local) < 4  # every parameter's momentum lives on exactly one rank


def test_an_exception_on_one_rank_ends_the_run_on_all_ranks(tmp_path) -> None:
    start = time.monotonic()
    with pytest.raises(Exception, match="rank 1 failed on purpose"):
        _fit(ToyModule(fail_at=(1, 2)), custom_strategy(), default_root_dir=tmp_path)
    assert time.monotonic() - start < 60
    # Rank 0 saved the last completed optimizer step (batch 2 never finished on rank 1) where the
    # Trainer keeps its files: here, not in the directory pytest runs in.
    checkpoint = torch.load(tmp_path / "preempted.ckpt", weights_only=False)
    assert checkpoint["global_step"] == 2


def test_registered_by_name_with_ddp_defaults() -> None:
    assert StrategyRegistry["custom_ddp"]["strategy"] is CustomDDPStrategy
    strategy = pl.Trainer(strategy="custom_ddp", accelerator="cpu", devices=2, logger=False).strategy
    assert isinstance(strategy, CustomDDPStrategy) and strategy._start_method == "popen"
    options = strategy.options
    assert (options.sync_batchnorm, options.sync_mode, options.bucket_cap_mb, options.zero1, options.scatter_eval) == (
        True,
        "bucketed",
        25.0,
        False,
        True,
    )
    for start_method in ("fork", "spawn"):
        strategy = pl.Trainer(
            strategy=f"custom_ddp_{start_method}", accelerator="cpu", devices=2, logger=False
        ).strategy
        assert isinstance(strategy, CustomDDPStrategy) and strategy._start_method == start_method


def test_bad_options_name_every_problem_and_fix() -> None:
    with pytest.raises(ValueError) as error:
        CustomDDPStrategy(sync_mode="ring", bucket_cap_mb=0, zero1="yes")
    message = str(error.value)
    assert "sync_mode='ring'" in message and "bucket_cap_mb=0" in message and "zero1='yes'" in message
    assert "bucketed" in message
