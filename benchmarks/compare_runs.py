"""The runs of the comparison: the variants, their ``train.py`` command lines and their execution.

Each run is a separate ``python train.py fit ...`` (Lightning's popen launcher re-runs it for the
other rank), exactly what a user types: fresh processes, so no run inherits another's memory or
caches. Two kinds of run:

- **timing** runs: one short epoch (``warmup + steps`` optimizer steps, no validation, no
  checkpoint) with :class:`callbacks.BenchmarkMonitor`, whose ``benchmark.json`` keeps every
  rank's raw step times;
- **accuracy** runs: the full schedule, then the final checkpoint is tested by ONE process in
  this process (the same yardstick for every strategy: no sampler padding, no strategy-specific
  evaluation path).
"""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["CompareConfig", "VARIANTS", "Variant", "accuracy_run", "collectives_run", "timing_run"]

_CHECKPOINT = "last.ckpt"
_CUSTOM = "strategies.custom_ddp.CustomDDPStrategy"
_DDP = "lightning.pytorch.strategies.DDPStrategy"


@dataclass(frozen=True)
class Variant:
    """One compared configuration: a label, what it is, and its ``train.py`` strategy flags."""

    label: str
    description: str
    flags: tuple[str, ...]
    processes: int = 2


def _flag(name: str, value: object) -> str:
    text = str(value).lower() if isinstance(value, bool) else str(value)
    return f"--{name}={text}"


def _custom(sync_batchnorm: bool) -> tuple[str, ...]:
    return (_flag("trainer.strategy", _CUSTOM), _flag("trainer.strategy.sync_batchnorm", sync_batchnorm),
            _flag("trainer.strategy.sync_mode", "bucketed"))


def _ddp(gradient_as_bucket_view: bool, forward_sync_buffers: bool) -> tuple[str, ...]:
    return (_flag("trainer.strategy", _DDP),
            _flag("trainer.strategy.gradient_as_bucket_view", gradient_as_bucket_view),
            _flag("trainer.strategy.forward_sync_buffers", forward_sync_buffers))


# On CPU torch.nn.SyncBatchNorm cannot run, so every ddp variant keeps LOCAL BatchNorm there; the
# like-for-like anchor of the gradient sync is custom_ddp with local BatchNorm vs ddp_tuned.
VARIANTS: dict[str, Variant] = {
    "custom_ddp": Variant("custom_ddp (SyncBN)", "hand-written SyncBatchNorm + bucketed accumulation-aware "
                          "gradient sync (25 MiB buckets), no buffer broadcast", _custom(True)),
    "custom_ddp_localbn": Variant("custom_ddp (local BN)", "custom_ddp with sync_batchnorm=false: local "
                                  "BatchNorm like ddp on CPU", _custom(False)),
    "ddp_default": Variant("ddp default (local BN)", "Lightning ddp as it comes: torch DDP, 25 MiB buckets, "
                           "gradient_as_bucket_view=False, forward_sync_buffers=True (rank 0's BN buffers "
                           "broadcast every forward)", _ddp(False, True)),
    "ddp_tuned": Variant("ddp tuned (local BN)", "torch DDP with gradient_as_bucket_view=True (no second "
                         "gradient copy) and forward_sync_buffers=False (torch 2.14's name for "
                         "broadcast_buffers; no buffer broadcast, like custom_ddp)", _ddp(True, False)),
    "single": Variant("1 process", "one process, same per-process batch: no communication at all",
                      (_flag("trainer.strategy", "auto"),), processes=1),
}


@dataclass(frozen=True)
class CompareConfig:
    """What every run shares; validated by :mod:`benchmarks.compare`'s parser."""

    out: str
    base_config: str
    net: str
    accumulates: tuple[int, ...]
    rounds: int
    steps: int
    warmup_steps: int
    accuracy_epochs: int
    count_nets: tuple[str, ...]
    batch_size: int
    synthetic_train_size: int
    synthetic_test_size: int
    seed: int
    run_timeout_s: float
    extra: tuple[str, ...] = field(default_factory=tuple)


def _shared_flags(cfg: CompareConfig) -> list[str]:
    return [_flag("config", cfg.base_config), _flag("seed_everything", cfg.seed),
            _flag("data.dataset", "synthetic"), _flag("data.batch_size", cfg.batch_size),
            _flag("data.val_size", 0.1), _flag("data.synthetic_train_size", cfg.synthetic_train_size),
            _flag("data.synthetic_test_size", cfg.synthetic_test_size), _flag("trainer.accelerator", "cpu"),
            _flag("trainer.enable_progress_bar", False), _flag("trainer.enable_model_summary", False)]


def _call(command: list[str], log: Path, timeout_s: float) -> float:
    """Run ``command`` from the repository root, output to ``log``; raise with its tail on failure."""
    log.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with open(log, "w") as out:
        out.write("$ " + shlex.join(command) + "\n")
        out.flush()
        try:
            code: object = subprocess.call(command, stdout=out, stderr=subprocess.STDOUT, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            code = "timeout"
    if code != 0:
        tail = "\n".join(log.read_text().splitlines()[-30:])
        raise RuntimeError(f"run failed ({code}): {shlex.join(command)}\nlast lines of {log}:\n{tail}")
    return time.perf_counter() - start


def _short_fit(cfg: CompareConfig, variant: str, accumulate: int, run_dir: Path, steps: int,
               callbacks: list[str], net: str) -> list[str]:
    """A one-epoch fit of ``steps`` optimizer steps: no validation, checkpoint or logger."""
    v = VARIANTS[variant]
    net_flags = [_flag("model.net", net)] + ([] if net == "template" else [_flag("model.net_kwargs", "{}")])
    return [sys.executable, "train.py", "fit", *_shared_flags(cfg), *net_flags, *v.flags,
            _flag("trainer.devices", v.processes), _flag("trainer.accumulate_grad_batches", accumulate),
            _flag("trainer.max_epochs", 1), _flag("trainer.limit_train_batches", accumulate * steps),
            _flag("trainer.limit_val_batches", 0), _flag("trainer.num_sanity_val_steps", 0),
            _flag("trainer.enable_checkpointing", False), _flag("trainer.logger", False),
            # Replaces the base config's callbacks (a checkpoint and an LR monitor need what is off here).
            _flag("trainer.default_root_dir", run_dir), *callbacks, *cfg.extra]


def timing_run(cfg: CompareConfig, variant: str, accumulate: int, work: Path, logs: Path) -> dict[str, Any]:
    """One short timed fit; returns its ``benchmark.json`` (raw step times included) and command."""
    name = f"{variant}_acc{accumulate}"
    run_dir = work / name
    shutil.rmtree(run_dir, ignore_errors=True)
    monitor = ["--trainer.callbacks=callbacks.BenchmarkMonitor", _flag("trainer.callbacks.warmup_steps",
                                                                       cfg.warmup_steps)]
    command = _short_fit(cfg, variant, accumulate, run_dir, cfg.warmup_steps + cfg.steps, monitor, cfg.net)
    wall_s = _call(command, logs / f"{name}.txt", cfg.run_timeout_s)
    report = json.loads((run_dir / "benchmark.json").read_text())
    shutil.rmtree(run_dir, ignore_errors=True)
    return {"command": shlex.join(command[1:]), "wall_s": wall_s, "benchmark": report}


def collectives_run(cfg: CompareConfig, net: str, variant: str, accumulate: int, work: Path,
                    logs: Path) -> dict[str, Any]:
    """3 optimizer steps under :class:`callbacks.collective_count.CollectiveCounter`; rank 0's last window.

    Returns the collectives and bytes by source of the last optimizer step (its ``accumulate``
    micro-batches, the loop's SIGTERM broadcasts included): exact, hardware-independent counts.
    """
    name = f"{net}_{variant}_acc{accumulate}_collectives"
    run_dir = work / name
    shutil.rmtree(run_dir, ignore_errors=True)
    counter = ["--trainer.callbacks=callbacks.collective_count.CollectiveCounter",
               _flag("trainer.callbacks.out_dir", run_dir)]
    command = _short_fit(cfg, variant, accumulate, run_dir, 3, counter, net)
    _call(command, logs / f"{name}.txt", cfg.run_timeout_s)
    windows = [w for w in json.loads((run_dir / "collectives_rank0.json").read_text()) if w["batch_idx"] is not None]
    counts: Counter[str] = Counter()
    payload: Counter[str] = Counter()
    for window in windows[-accumulate:]:
        counts.update(window["counts"])
        payload.update(window["bytes"])
    shutil.rmtree(run_dir, ignore_errors=True)
    return {"command": shlex.join(command[1:]), "counts": dict(counts), "bytes": dict(payload)}


def accuracy_run(cfg: CompareConfig, variant: str, accumulate: int, tb_root: Path, logs: Path) -> dict[str, Any]:
    """The full schedule with TensorBoard logs under ``tb_root/<variant>``; then one-process test."""
    shutil.rmtree(tb_root / variant, ignore_errors=True)
    v = VARIANTS[variant]
    command = [sys.executable, "train.py", "fit", *_shared_flags(cfg), _flag("model.net", cfg.net), *v.flags,
               _flag("trainer.devices", v.processes), _flag("trainer.accumulate_grad_batches", accumulate),
               _flag("trainer.max_epochs", cfg.accuracy_epochs),
               _flag("trainer.logger", "lightning.pytorch.loggers.TensorBoardLogger"),
               _flag("trainer.logger.save_dir", tb_root), _flag("trainer.logger.name", variant),
               _flag("trainer.logger.version", "fit"), *cfg.extra]
    wall_s = _call(command, logs / f"{variant}_accuracy.txt", cfg.run_timeout_s)
    _test_checkpoint(tb_root, variant)
    shutil.rmtree(tb_root / variant / "fit" / "checkpoints", ignore_errors=True)
    return {"command": shlex.join(command[1:]), "wall_s": wall_s}


def _test_checkpoint(tb_root: Path, variant: str) -> None:
    """Test the run's final checkpoint on one device; scalars go to ``<variant>/test``."""
    from lightning.pytorch import Trainer
    from lightning.pytorch.loggers import TensorBoardLogger

    from lit_cifar.data import CIFAR100DataModule
    from lit_cifar.module import LitClassifier

    checkpoint = tb_root / variant / "fit" / "checkpoints" / _CHECKPOINT
    logger = TensorBoardLogger(tb_root, name=variant, version="test")
    trainer = Trainer(accelerator="cpu", devices=1, logger=logger, enable_progress_bar=False,
                      enable_model_summary=False)
    trainer.test(LitClassifier.load_from_checkpoint(checkpoint, map_location="cpu"),
                 datamodule=CIFAR100DataModule.load_from_checkpoint(checkpoint), verbose=False)
