"""``BenchmarkMonitor``: per-rank training time and peak memory, gathered, logged and saved.

Works with any strategy (``ddp``, ``custom_ddp``, single device) and from YAML::

    trainer:
      callbacks:
        - class_path: callbacks.BenchmarkMonitor
          init_args: {warmup_steps: 3}

Every rank measures itself (see :mod:`measure.timing` and :mod:`measure.memory` for what each
number covers); nothing is communicated while an epoch trains. At each epoch end the per-rank
summaries travel in ONE ``all_gather`` of a small float64 vector, rank 0 logs the cross-rank view
to every logger under ``prefix`` (TensorBoard: ``bench/step_time_s``, ...), and at the end of
the fit one more gather produces ``<log_dir>/benchmark.json``: the per-epoch and whole-fit
numbers of every rank plus the run configuration, hardware, versions and dataset kind.

Across ranks, times and memory take the maximum (a data-parallel step is as slow as its slowest
rank, and the largest rank decides whether a job fits) and sample counts the sum.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

import torch
import yaml
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.data import extract_batch_size
from typing_extensions import override

from callbacks.rank_gather import gather_rows, gather_samples, nanmax
from measure.memory import CpuMethod, PeakMemory
from measure.run_info import environment, strategy_options, to_jsonable
from measure.stats import summarize
from measure.timing import EpochTiming, StepTimer

__all__ = ["BenchmarkMonitor", "SCHEMA"]

SCHEMA = "lit_cifar.benchmark/v1"
_DATASET_KEYS = ("dataset_used", "dataset_kind", "dataset")


class BenchmarkMonitor(Callback):
    """Measure training speed and peak memory of every rank; log and save them.

    Args:
        warmup_steps: Optimizer steps at the start of the fit left out of step statistics.
        prefix: Prefix of the logged metric names.
        filename: Name of the JSON file written into the trainer's log directory.
        memory_method: CPU peak-memory method, ``"auto"``, ``"kernel"`` or ``"sample"``
            (see :class:`measure.memory.PeakMemory`).
        sample_interval_s: RSS sampling period of the ``"sample"`` method.
        config: Extra description of the run (e.g. the comparison's settings), stored verbatim
            in the JSON.
    """

    def __init__(
        self,
        warmup_steps: int = 3,
        prefix: str = "bench/",
        filename: str = "benchmark.json",
        memory_method: CpuMethod = "auto",
        sample_interval_s: float = 0.005,
        config: dict[str, Any] | None = None,
    ) -> None:
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
        if not filename.endswith(".json"):
            raise ValueError(f"filename must end with '.json', got {filename!r}")
        self._warmup_steps = warmup_steps
        self._prefix = prefix
        self._filename = filename
        self._memory_method = memory_method
        self._sample_interval_s = sample_interval_s
        self._config = dict(config or {})
        self._timer: StepTimer | None = None
        self._memory: PeakMemory | None = None
        self._fit = EpochTiming()
        self._fit_peak: dict[str, float] = {}
        self._epochs: list[dict[str, Any]] = []
        self._step_before = 0
        self.path: str | None = None  # where the JSON went (rank 0), set at the end of fit

    @property
    def epochs(self) -> list[dict[str, Any]]:
        """Gathered per-epoch records of the current fit (same on every rank)."""
        return self._epochs

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        device = trainer.strategy.root_device
        self._timer = StepTimer(device, self._warmup_steps, trainer.accumulate_grad_batches)
        self._memory = PeakMemory(device, self._memory_method, self._sample_interval_s)
        self._fit, self._epochs = EpochTiming(), []
        # Usage after the data and the model exist but before the strategy wraps the model: the
        # peak above it is what distributed training adds (wrappers, gradient buckets, gradients,
        # optimizer state, activations, synchronisation buffers). On CPU both are RSS: a model that adds less than
        # the process returns to the kernel between here and the epoch reads a peak below it (a negative value).
        self._fit_peak = {"start_bytes": self._memory.current()}

    @override
    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        assert self._timer is not None and self._memory is not None
        self._memory.start()
        self._timer.epoch_start()

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        assert self._timer is not None
        self._step_before = trainer.global_step
        self._timer.batch_start(extract_batch_size(batch))

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        assert self._timer is not None
        self._timer.batch_end(stepped=trainer.global_step != self._step_before)

    @override
    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._timer is not None and trainer.state.fn == "fit":
            self._timer.pause()

    @override
    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._timer is not None and trainer.state.fn == "fit":
            self._timer.resume()

    @override
    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        assert self._timer is not None and self._memory is not None
        timing, peak = self._timer.epoch_end(), self._memory.stop()
        peak["start_bytes"] = self._fit_peak["start_bytes"]
        self._accumulate(timing, peak)
        record = {
            "epoch": trainer.current_epoch,
            "global_step": trainer.global_step,
            **gather_rows(trainer, _row(timing, peak)),
        }
        self._epochs.append(record)
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(self._metrics(record["global"]), step=trainer.global_step)

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        summary = gather_rows(trainer, _row(self._fit, self._fit_peak))
        # The raw steady-state step and micro-batch times of every rank: what confidence intervals are computed from.
        step_samples, micro_batch_samples = gather_samples(trainer, self._fit.step_s, self._fit.micro_batch_s)
        log_dir = trainer.log_dir  # a broadcast inside: every rank must ask
        if not trainer.is_global_zero or log_dir is None:
            return
        os.makedirs(log_dir, exist_ok=True)
        self.path = os.path.join(log_dir, self._filename)
        payload = to_jsonable(
            {
                "schema": SCHEMA,
                "run": _run_description(trainer, pl_module, self._warmup_steps, self._memory),
                "config": self._config,
                "cli_config": _cli_config(log_dir),
                "environment": environment(),
                "final_metrics": {
                    k: float(v)
                    for k, v in trainer.callback_metrics.items()
                    if isinstance(v, torch.Tensor) and v.numel() == 1
                },
                "summary": summary,
                "step_s_per_rank": step_samples,
                # accumulate_grad_batches per step, in order: the last of each step's is the one that syncs and steps
                "micro_batch_s_per_rank": micro_batch_samples,
                "epochs": self._epochs,
            }
        )
        with open(self.path, "w") as out:
            json.dump(payload, out, indent=2, allow_nan=False)

    def _accumulate(self, timing: EpochTiming, peak: dict[str, float]) -> None:
        for name in ("step_s", "micro_batch_s", "data_wait_s", "step_samples"):
            getattr(self._fit, name).extend(getattr(timing, name))
        self._fit.epoch_s += timing.epoch_s
        self._fit.epoch_samples += timing.epoch_samples
        for key in ("peak_bytes", "peak_reserved_bytes"):
            self._fit_peak[key] = nanmax([self._fit_peak.get(key, math.nan), peak[key]])

    def _metrics(self, values: dict[str, float]) -> dict[str, float]:
        names = {
            "step_s_median": "step_time_s",
            "step_s_trimmed_mean": "step_time_trimmed_s",
            "micro_batch_s_median": "micro_batch_time_s",
            "data_wait_s_median": "data_wait_s",
            "time_s": "epoch_time_s",
            "samples_per_s": "samples_per_s",
            "steady_samples_per_s": "steady_samples_per_s",
        }
        metrics = {self._prefix + name: values[key] for key, name in names.items()}
        metrics[self._prefix + "peak_memory_mb"] = values["peak_bytes"] / 2**20
        metrics[self._prefix + "peak_above_start_mb"] = values["peak_above_start_bytes"] / 2**20
        if not math.isnan(values["peak_reserved_bytes"]):
            metrics[self._prefix + "peak_reserved_mb"] = values["peak_reserved_bytes"] / 2**20
        return {k: v for k, v in metrics.items() if not math.isnan(v)}


def _row(timing: EpochTiming, peak: dict[str, float]) -> dict[str, float]:
    """One rank's numbers of a span (an epoch or the whole fit) as a flat dict of floats."""
    row: dict[str, float] = {
        "time_s": timing.epoch_s,
        "samples": float(timing.epoch_samples),
        "steady_samples": float(sum(timing.step_samples)),
        "steady_s": sum(timing.step_s) + sum(timing.data_wait_s),
    }
    for name in ("step_s", "micro_batch_s", "data_wait_s"):
        row.update({f"{name}_{k}": v for k, v in summarize(getattr(timing, name)).items()})
    row["peak_bytes"] = peak.get("peak_bytes", math.nan)
    row["peak_reserved_bytes"] = peak.get("peak_reserved_bytes", math.nan)
    row["peak_above_start_bytes"] = row["peak_bytes"] - peak.get("start_bytes", math.nan)
    return row


def _dataset_kind(trainer: Trainer, pl_module: LightningModule) -> str | None:
    for owner in (trainer.datamodule, pl_module):
        hparams = getattr(owner, "hparams", None) or {}
        for key in _DATASET_KEYS:
            if key in hparams:
                return str(hparams[key])
    return None


def _run_description(
    trainer: Trainer, pl_module: LightningModule, warmup_steps: int, memory: PeakMemory | None
) -> dict[str, Any]:
    datamodule = trainer.datamodule
    return {
        "world_size": trainer.world_size,
        "num_nodes": trainer.num_nodes,
        "devices_per_node": trainer.num_devices,
        "device": str(trainer.strategy.root_device),
        "accelerator": type(trainer.accelerator).__name__,
        "strategy": strategy_options(trainer.strategy),
        "precision": trainer.precision,
        "accumulate_grad_batches": trainer.accumulate_grad_batches,
        "max_epochs": trainer.max_epochs,
        "global_step": trainer.global_step,
        "dataset": _dataset_kind(trainer, pl_module),
        "warmup_steps": warmup_steps,
        "intra_op_threads": torch.get_num_threads(),  # rank 0's; Lightning's launchers give every rank the same
        "memory_kind": memory.kind if memory is not None else None,
        "module": f"{type(pl_module).__module__}.{type(pl_module).__qualname__}",
        "module_hparams": dict(pl_module.hparams),
        "datamodule_hparams": dict(getattr(datamodule, "hparams", None) or {}),
    }


def _cli_config(log_dir: str) -> Any:
    """The LightningCLI's saved ``config.yaml`` of this run, when there is one."""
    path = os.path.join(log_dir, "config.yaml")
    if not os.path.exists(path):
        return None
    with open(path) as config:
        return yaml.safe_load(config)
