"""Preemption-safe stops: rank status in the gradient all-reduce, the signal recorder, coordinated stops.

The Lightning tests start 2 ranks with fork and signal a rank from inside (``os.kill`` on itself
at a hook), which lands at a known point; ``tests/fault_tolerance/test_fault_matrix.py`` sends real signals from
outside to popen-launched ranks at moments inside collectives.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from conformance_harness import WORLD_SIZE, make_trainer
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus
from torch import nn
from torch.multiprocessing import ProcessExitedException
from torch.utils.data import DataLoader, Subset, TensorDataset

from collectives.launcher import run_workers
from parallel.gradients.grad_sync import SyncedDataParallel
from strategies.custom_ddp import CustomDDPStrategy
from strategies.stopping.preemption import Preemption, stop_checkpoint_path
from strategies.stopping.stop_signals import SignalRecorder, StopOnSignal, exit_status

STEPS_PER_EPOCH = 4  # 32 samples / 2 ranks / batch 4


# ------------------------------------------------------------------ rank status (pure torch)


def _status_worker(rank: int, world_size: int, mode: str, compression) -> list:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    model = SyncedDataParallel(
        net,
        mode=mode,
        grad_compression=compression,
        carry_rank_status=True,
        bucket_cap_mb=0.0001,
        first_bucket_cap_mb=0.0001,
    )
    seen = [model.rank_status]
    for value in (0, 15 if rank == 1 else 0, 2 if rank == 0 else 15):
        model.set_rank_status(value)
        with model.no_sync():  # an accumulating micro-batch carries nothing
            model(torch.randn(3, 4)).sum().backward()
        seen.append(model.rank_status)
        model(torch.randn(3, 4)).sum().backward()
        model.finish()
        seen.append(model.rank_status)
    return seen


@pytest.mark.distributed
@pytest.mark.parametrize(
    "mode,compression", [("bucketed", None), ("flat", "bf16"), ("per_param", "bf16"), ("per_param_overlap", None)]
)
def test_every_rank_reads_every_ranks_status_after_the_step(tmp_path: Path, mode: str, compression) -> None:
    results = run_workers(_status_worker, WORLD_SIZE, args=(mode, compression), init_file=tmp_path / "store")
    expected = [None, None, (0, 0), (0, 0), (0, 15), (0, 15), (2, 15)]
    assert results == [expected, expected]


def test_status_without_peers_and_bad_values() -> None:
    model = SyncedDataParallel(nn.Linear(2, 1), carry_rank_status=True)
    model.set_rank_status(10)
    model(torch.ones(1, 2)).sum().backward()
    model.finish()
    assert model.rank_status == (10,)
    for bad in (-1, 128, 1.5, True):
        with pytest.raises(ValueError, match="rank status"):
            model.set_rank_status(bad)
    plain = SyncedDataParallel(nn.Linear(2, 1))
    plain(torch.ones(1, 2)).sum().backward()
    plain.finish()
    assert plain.rank_status is None  # no status carried without carry_rank_status


# ------------------------------------------------------------------ recorder, exit status, version


def test_recorder_records_the_first_signal_once_and_restores() -> None:
    before = signal.getsignal(signal.SIGUSR1)
    calls: list[int] = []
    recorder = SignalRecorder()
    recorder.install([signal.SIGUSR1, signal.SIGUSR2], calls.append)
    try:
        assert recorder.is_current()
        signal.raise_signal(signal.SIGUSR2)
        signal.raise_signal(signal.SIGUSR1)
        assert recorder.signum == signal.SIGUSR2 and calls == [signal.SIGUSR2]
    finally:
        recorder.restore()
    assert signal.getsignal(signal.SIGUSR1) is before and not recorder.installed


def test_second_sigint_interrupts_at_once(python_sigint_handler: None) -> None:
    recorder = SignalRecorder()
    recorder.repeat_after_s = 0.0
    recorder.install([signal.SIGINT])
    try:
        signal.raise_signal(signal.SIGINT)  # recorded, no exception
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
    finally:
        recorder.restore()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_one_ctrl_c_delivered_twice_within_moments_is_one_stop() -> None:
    # From the terminal to the whole process group, and passed on by fork/spawn workers' launching process.
    recorder = SignalRecorder()
    recorder.install([signal.SIGINT])
    try:
        signal.raise_signal(signal.SIGINT)
        signal.raise_signal(signal.SIGINT)  # well within repeat_after_s: the same Ctrl+C
        assert recorder.signum == signal.SIGINT
    finally:
        recorder.restore()


def test_preemption_owns_the_stop_state_and_never_reads_the_strategy() -> None:
    # The straight path: signal -> recorder -> local_status (handed to the gradient sync by the
    # strategy) -> agree(every rank's status) -> the stop. The trainer double has no ``strategy``:
    # Preemption gets the cluster environment and launcher at attach and reads nothing back.
    trainer = SimpleNamespace(callbacks=[], state=SimpleNamespace(fn=TrainerFn.FITTING), global_rank=1)
    before = signal.getsignal(signal.SIGTERM)
    preemption = Preemption()
    preemption.attach(trainer, environment=None, launcher=None)
    assert trainer.callbacks == [preemption]
    try:
        preemption.on_train_start(trainer, None)
        assert preemption._recorder.installed and preemption.local_status == 0
        signal.raise_signal(signal.SIGTERM)  # recorded only: no collective, no exception
        assert preemption.local_status == signal.SIGTERM
        preemption.agree((0, 0))  # a step whose all-reduce carried no signal
        assert preemption._stop is None
        preemption.agree((0, int(signal.SIGTERM)))  # the same tuple on every rank
        assert preemption._stop == (0, signal.SIGTERM)
    finally:
        preemption.detach()
    assert trainer.callbacks == [] and signal.getsignal(signal.SIGTERM) == before


@pytest.mark.parametrize(
    "status, says",
    [
        (TrainerStatus.RUNNING, "the fit finished normally"),
        (TrainerStatus.INTERRUPTED, "the fit was already ending on an error"),
    ],
)
def test_a_signal_too_late_to_stop_together_is_reported_as_what_happened(caplog, status, says: str) -> None:
    """torchrun's agent sends SIGTERM to the ranks that survive a failed one: that fit did not finish normally."""
    trainer = SimpleNamespace(callbacks=[], state=SimpleNamespace(fn=TrainerFn.FITTING, status=status), global_rank=0)
    preemption = Preemption()
    preemption.attach(trainer, environment=None, launcher=None)
    try:
        preemption.on_train_start(trainer, None)
        signal.raise_signal(signal.SIGTERM)  # never agreed at a step
    finally:
        with caplog.at_level("WARNING", logger="strategies.stopping.preemption"):
            preemption.detach()
    assert f"SIGTERM on rank 0 arrived after the last point where the ranks could stop together; {says}" in caplog.text


def test_exit_status_is_128_plus_signal() -> None:
    stop = StopOnSignal(signal.SIGTERM, [1], "last.ckpt")
    assert isinstance(stop, SystemExit) and stop.code == exit_status(signal.SIGTERM) == 143
    assert exit_status(signal.SIGINT) == 130


def test_stop_checkpoint_is_the_model_checkpoints_last_file(tmp_path: Path) -> None:
    trainer = pl.Trainer(
        default_root_dir=tmp_path, callbacks=[ModelCheckpoint(dirpath=tmp_path / "ckpts")], logger=False
    )
    assert stop_checkpoint_path(trainer) == str(tmp_path / "ckpts" / "last.ckpt")
    assert stop_checkpoint_path(pl.Trainer(default_root_dir=tmp_path, enable_checkpointing=False, logger=False)) == str(
        tmp_path / "preempted.ckpt"
    )


# ------------------------------------------------------------------ coordinated stops (2 fork ranks)


class _Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        # Dropout: the stop checkpoint holds every rank's generators, so the resume draws the same masks.
        self.net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 4))
        generator = torch.Generator().manual_seed(1)
        self.data = TensorDataset(
            torch.randn(32, 8, generator=generator), torch.randint(0, 4, (32,), generator=generator)
        )

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        return F.cross_entropy(self.net(batch[0]), batch[1])

    def validation_step(self, batch, batch_idx: int) -> None:
        self.log("val_loss", F.cross_entropy(self.net(batch[0]), batch[1]))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    def train_dataloader(self) -> DataLoader:
        rank, world = self.trainer.global_rank, self.trainer.world_size
        return DataLoader(Subset(self.data, range(rank, len(self.data), world)), batch_size=4)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=4)


class _SignalSelf(Callback):
    """``os.kill(own pid, signum)`` on ``rank`` at the start of a training / validation batch."""

    def __init__(self, rank: int, epoch: int, batch: int, stage: str = "train", signum=signal.SIGTERM) -> None:
        self.where, self.stage, self.signum = (rank, epoch, batch), stage, signum

    def _maybe(self, trainer, batch_idx: int) -> None:
        if (trainer.global_rank, trainer.current_epoch, batch_idx) == self.where:
            os.kill(os.getpid(), self.signum)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        if self.stage == "train":
            self._maybe(trainer, batch_idx)

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx: int, dataloader_idx: int = 0) -> None:
        if self.stage == "val" and not trainer.sanity_checking:
            self._maybe(trainer, batch_idx)


def _trainer(tmp_path: Path, *callbacks: Callback, max_epochs: int = 2, zero1: bool = False) -> pl.Trainer:
    strategy = CustomDDPStrategy(start_method="fork", timeout=30, zero1=zero1)
    return make_trainer(
        strategy,
        max_epochs=max_epochs,
        enable_checkpointing=True,
        use_distributed_sampler=False,
        num_sanity_val_steps=0,
        default_root_dir=tmp_path,
        callbacks=[ModelCheckpoint(dirpath=tmp_path / "ckpts", save_top_k=0), *callbacks],
    )


def _fit(tmp_path: Path, *callbacks: Callback, ckpt_path=None, zero1: bool = False) -> dict[str, torch.Tensor]:
    module = _Net()
    _trainer(tmp_path, *callbacks, zero1=zero1).fit(module, ckpt_path=ckpt_path)
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _stopped_step(tmp_path: Path, signaller: _SignalSelf, zero1: bool = False) -> int:
    # Every fork worker exits with 143; the launching process ends with that status too (strategies.launchers).
    with pytest.raises(StopOnSignal) as stopped:
        _fit(tmp_path, signaller, zero1=zero1)
    assert stopped.value.code == 143 and isinstance(stopped.value.__cause__, ProcessExitedException)
    return torch.load(tmp_path / "ckpts" / "last.ckpt", weights_only=False)["global_step"]


@pytest.mark.distributed
@pytest.mark.parametrize("zero1", [False, True])
@pytest.mark.parametrize("batch", [1, STEPS_PER_EPOCH - 1], ids=["mid_epoch", "last_batch"])
def test_sigterm_on_rank_1_stops_both_ranks_at_that_step_and_resumes_exactly(
    tmp_path: Path, zero1: bool, batch: int
) -> None:
    # The resumed run must end with the uninterrupted run's weights, from the last batch of epoch 0
    # and from the middle of it (exact_resume: the loader leaves out the batches already trained).
    # With zero1 the stop's checkpoint consolidates the sharded optimizer state: collectives.
    uninterrupted = _fit(tmp_path / "full", zero1=zero1)
    step = _stopped_step(tmp_path, _SignalSelf(rank=1, epoch=0, batch=batch), zero1=zero1)
    assert step == batch + 1  # the signalled batch's own optimizer step, nothing after it
    resumed = _fit(tmp_path / "resumed", ckpt_path=tmp_path / "ckpts" / "last.ckpt", zero1=zero1)
    for name, value in uninterrupted.items():
        torch.testing.assert_close(resumed[name], value, rtol=0, atol=0, msg=name)


@pytest.mark.distributed
def test_sigterm_during_validation_stops_at_the_next_optimizer_step(tmp_path: Path) -> None:
    assert _stopped_step(tmp_path, _SignalSelf(rank=0, epoch=0, batch=1, stage="val")) == STEPS_PER_EPOCH + 1


@pytest.mark.distributed
def test_signal_outside_fit_stops_the_stage_without_a_checkpoint(tmp_path: Path) -> None:
    # Both ranks signalled (as a scheduler does): each stops after its current batch, exit 128 + signum.
    signallers = [_SignalSelf(rank, 0, 1, "val", signal.SIGUSR1) for rank in range(WORLD_SIZE)]
    trainer = _trainer(tmp_path, *signallers)
    with pytest.raises(StopOnSignal) as stopped:
        trainer.validate(_Net(), verbose=False)
    assert stopped.value.code == exit_status(signal.SIGUSR1)
    assert not (tmp_path / "ckpts").exists()


def test_preemption_leaves_no_trace_after_the_stage(tmp_path: Path) -> None:
    before = signal.getsignal(signal.SIGTERM)
    trainer = make_trainer(CustomDDPStrategy(), devices=1, enable_checkpointing=True, default_root_dir=tmp_path)
    try:
        trainer.fit(_Net())
    finally:
        if torch.distributed.is_initialized():  # ddp on 1 device leaves its 1-rank group behind
            torch.distributed.destroy_process_group()
    assert not any(isinstance(cb, Preemption) for cb in trainer.callbacks)
    assert signal.getsignal(signal.SIGTERM) is before
