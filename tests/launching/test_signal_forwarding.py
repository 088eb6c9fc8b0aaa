"""A stop signal sent to the launching process of fork workers alone (Jupyter's "interrupt kernel",
``kill PID``) reaches the workers: they stop together with a checkpoint and the launching process
ends with 128 + signum, as a popen job's rank 0 does. Signals to the whole group: by hand (see
docs/stopping-and-resuming.md); a Ctrl+C that arrives twice counts once
(``tests/fault_tolerance/test_preemption.py``)."""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

import pytest
import torch
from conformance_harness import custom_strategy, make_trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel

from strategies.stopping.stop_signals import StopOnSignal

pytestmark = pytest.mark.distributed


class _SlowSteps(BoringModel):
    def training_step(self, batch: Any, batch_idx: int) -> Any:
        time.sleep(0.02)  # ~5 s of fit: the signal comes mid-training
        return super().training_step(batch, batch_idx)


def test_sigint_to_the_launching_process_alone_stops_every_worker_with_a_checkpoint(
    tmp_path, python_sigint_handler: None
) -> None:
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    trainer = make_trainer(
        custom_strategy(timeout_s=30),
        max_epochs=5,
        enable_checkpointing=True,
        default_root_dir=tmp_path,
        callbacks=[ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1000)],
    )
    timer = threading.Timer(1.5, os.kill, (os.getpid(), signal.SIGINT))  # to this process only
    timer.start()
    try:
        with pytest.raises(StopOnSignal) as stopped:
            trainer.fit(_SlowSteps())
    finally:
        timer.cancel()
    assert stopped.value.code == 130
    step = torch.load(tmp_path / "last.ckpt", weights_only=False)["global_step"]
    assert 0 < step < 5 * 32  # stopped mid-fit, not at its end
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the forwarding is gone
