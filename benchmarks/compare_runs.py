"""The training runs of the comparison: their ``train.py`` command lines and their execution.

Each run is a separate ``python train.py fit ...`` (Lightning's default popen launcher re-runs it
for the other ranks), exactly what a user types: fresh processes, so neither run inherits the
other's memory or caches. A run that will be tested is then evaluated from its final checkpoint
in THIS process on one device: the same yardstick for both strategies (no sampler padding, no
strategy-specific evaluation path) and no second start-up of torch and Lightning per run.
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["CompareConfig", "LOCAL_BN", "RunSpec", "STRATEGIES", "execute"]

STRATEGIES = ("custom_ddp", "ddp")
# custom_ddp with local BatchNorm: on CPU, where ddp cannot sync BatchNorm, the like-for-like
# anchor that separates the gradient-sync engine from the cost of synchronising BN statistics.
LOCAL_BN = "custom_ddp_localbn"
_CHECKPOINT = "last.ckpt"


@dataclass(frozen=True)
class CompareConfig:
    """Everything both strategies share; validated by :mod:`benchmarks.compare`'s parser."""

    out: str
    base_config: str
    devices: int
    accelerator: str
    accumulate: int
    sweep: tuple[int, ...]
    epochs: int
    sweep_epochs: int
    net: str
    dataset: str
    precision: str
    seed: int
    batch_size: int
    val_size: int | float
    synthetic_train_size: int
    synthetic_test_size: int
    warmup_steps: int
    bucket_cap_mb: float
    ddp_gradient_as_bucket_view: bool
    ddp_forward_sync_buffers: bool
    run_timeout_s: float
    extra: tuple[str, ...] = field(default_factory=tuple)

    @property
    def on_gpu(self) -> bool:
        return self.accelerator in ("gpu", "cuda")

    @property
    def backend(self) -> str:
        return "nccl" if self.on_gpu else "gloo"


@dataclass(frozen=True)
class RunSpec:
    """One training run: a strategy at one accumulation setting."""

    strategy: str
    accumulate: int
    epochs: int
    test: bool

    @property
    def name(self) -> str:
        return f"{self.strategy}_acc{self.accumulate}"


def _flag(name: str, value: object) -> str:
    text = str(value).lower() if isinstance(value, bool) else str(value)
    return f"--{name}={text}"


def _strategy_flags(cfg: CompareConfig, strategy: str) -> list[str]:
    """Both strategies' communication settings, spelled out so the record shows them."""
    if strategy in ("custom_ddp", LOCAL_BN):
        return [_flag("trainer.strategy", "strategies.custom_ddp.CustomDDPStrategy"),
                _flag("trainer.strategy.process_group_backend", cfg.backend),
                _flag("trainer.strategy.sync_batchnorm", strategy == "custom_ddp"),
                _flag("trainer.strategy.sync_mode", "bucketed"),
                _flag("trainer.strategy.bucket_cap_mb", cfg.bucket_cap_mb)]
    # nn.SyncBatchNorm is CUDA-only: on CPU Lightning's ddp must run with local BatchNorm.
    return [_flag("trainer.strategy", "lightning.pytorch.strategies.DDPStrategy"),
            _flag("trainer.strategy.process_group_backend", cfg.backend),
            _flag("trainer.strategy.bucket_cap_mb", cfg.bucket_cap_mb),
            _flag("trainer.strategy.gradient_as_bucket_view", cfg.ddp_gradient_as_bucket_view),
            _flag("trainer.strategy.forward_sync_buffers", cfg.ddp_forward_sync_buffers),
            _flag("trainer.sync_batchnorm", cfg.on_gpu)]


def _logger_flags(tb_root: Path, run: str, version: str) -> list[str]:
    return [_flag("trainer.logger", "lightning.pytorch.loggers.TensorBoardLogger"),
            _flag("trainer.logger.save_dir", tb_root), _flag("trainer.logger.name", run),
            _flag("trainer.logger.version", version),
            _flag("trainer.logger.default_hp_metric", False)]


def _shared_flags(cfg: CompareConfig) -> list[str]:
    return [_flag("config", cfg.base_config), _flag("seed_everything", cfg.seed),
            _flag("model.net", cfg.net), _flag("data.dataset", cfg.dataset),
            _flag("data.batch_size", cfg.batch_size), _flag("data.val_size", cfg.val_size),
            _flag("data.synthetic_train_size", cfg.synthetic_train_size),
            _flag("data.synthetic_test_size", cfg.synthetic_test_size),
            _flag("trainer.accelerator", cfg.accelerator), _flag("trainer.precision", cfg.precision),
            _flag("trainer.enable_progress_bar", False)]


def fit_command(cfg: CompareConfig, spec: RunSpec, tb_root: Path) -> list[str]:
    return [sys.executable, "train.py", "fit", *_shared_flags(cfg),
            _flag("trainer.devices", cfg.devices), _flag("trainer.max_epochs", spec.epochs),
            _flag("trainer.accumulate_grad_batches", spec.accumulate),
            *_strategy_flags(cfg, spec.strategy), *_logger_flags(tb_root, spec.name, "fit"),
            "--trainer.callbacks+=callbacks.BenchmarkMonitor",
            _flag("trainer.callbacks.warmup_steps", cfg.warmup_steps), *cfg.extra]


def evaluate(tb_root: Path, spec: RunSpec) -> None:
    """Test the run's final checkpoint on one CPU/GPU device; scalars go to ``<run>/test``."""
    from lightning.pytorch import Trainer
    from lightning.pytorch.loggers import TensorBoardLogger

    from lit_cifar.data import CIFAR100DataModule
    from lit_cifar.module import LitClassifier

    checkpoint = tb_root / spec.name / "fit" / "checkpoints" / _CHECKPOINT
    logger = TensorBoardLogger(tb_root, name=spec.name, version="test", default_hp_metric=False)
    trainer = Trainer(accelerator="auto", devices=1, logger=logger, enable_progress_bar=False,
                      enable_model_summary=False)
    trainer.test(LitClassifier.load_from_checkpoint(checkpoint, map_location="cpu"),
                 datamodule=CIFAR100DataModule.load_from_checkpoint(checkpoint), verbose=False)


def _call(command: list[str], log: Path, timeout_s: float) -> float:
    """Run ``command`` from the repository root, output to ``log``; raise with its tail on failure."""
    log.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with open(log, "w") as out:
        out.write("$ " + shlex.join(command) + "\n")
        out.flush()
        try:
            code = subprocess.call(command, stdout=out, stderr=subprocess.STDOUT, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            code = "timeout"
    if code != 0:
        tail = "\n".join(log.read_text().splitlines()[-30:])
        raise RuntimeError(f"run failed ({code}): {shlex.join(command)}\nlast lines of {log}:\n{tail}")
    return time.perf_counter() - start


def execute(cfg: CompareConfig, spec: RunSpec, tb_root: Path, logs: Path) -> dict[str, object]:
    """Fit (and test) one run; checkpoints are deleted afterwards (results keep only logs)."""
    shutil.rmtree(tb_root / spec.name, ignore_errors=True)  # never mix with an older run
    record: dict[str, object] = {"name": spec.name, "strategy": spec.strategy,
                                 "accumulate": spec.accumulate, "epochs": spec.epochs}
    fit = fit_command(cfg, spec, tb_root)
    record["fit_command"] = shlex.join(fit[1:])
    record["fit_wall_s"] = _call(fit, logs / f"{spec.name}_fit.txt", cfg.run_timeout_s)
    if spec.test:
        start = time.perf_counter()
        evaluate(tb_root, spec)
        record["test_wall_s"] = time.perf_counter() - start
    shutil.rmtree(tb_root / spec.name / "fit" / "checkpoints", ignore_errors=True)
    return record
