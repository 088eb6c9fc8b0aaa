"""The few lines a finished ``train.py fit`` ends with on rank 0: accuracy, wall time, the data used, where it lives."""

from __future__ import annotations

from typing import Any

from lightning.pytorch import Trainer
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities.model_helpers import is_overridden

from measure.run_info import display_path

__all__ = ["fit_summary", "no_validation_reason"]


def _minutes(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 60 else f"{int(seconds // 60)} min {seconds % 60:02.0f} s"


def _validation_schedule(trainer: Trainer) -> str:
    """When the fit loop validates, in the Trainer's own flags."""
    interval, every = trainer.val_check_interval, trainer.check_val_every_n_epoch
    if isinstance(interval, int) and not isinstance(interval, bool):
        return f"every {interval} training batches (val_check_interval={interval})"
    if interval != 1.0:
        return f"every {interval:g} of an epoch (val_check_interval={interval:g})"
    return "at each epoch's end" if every == 1 else f"every {every} epochs (check_val_every_n_epoch={every})"


def no_validation_reason(trainer: Trainer) -> str:
    """Why a finished fit holds no validation result, in the flag or event that caused it."""
    if trainer.limit_val_batches == 0:
        return "limit_val_batches=0"
    if not any(is_overridden("val_dataloader", source) for source in (trainer.lightning_module, trainer.datamodule)):
        return "the data has no validation loader"
    if trainer.interrupted:
        return f"the fit was stopped after {trainer.global_step} optimizer steps, before the first validation"
    if trainer.max_steps != -1 and trainer.global_step >= trainer.max_steps:
        ended = f"the fit ended at max_steps={trainer.max_steps}"
    else:
        ended = f"the fit ended after {trainer.current_epoch} epoch(s), {trainer.global_step} optimizer steps"
    return f"{ended}, before the first validation ({_validation_schedule(trainer)})"


def fit_summary(trainer: Trainer, datamodule: Any, wall_s: float, strategy: str) -> str:
    """The few lines a finished fit ends with: accuracy, wall time, the data really used, where the run lives;
    ``strategy`` is the name the run was started with (``custom_ddp``, ``ddp``, ...)."""
    metrics = trainer.callback_metrics
    if "val/acc1" in metrics:
        top5 = f", top-5 {100 * float(metrics['val/acc5']):.1f} %" if "val/acc5" in metrics else ""
        validation = (
            f"top-1 {100 * float(metrics['val/acc1']):.1f} %{top5} (chance: 1 %), after "
            f"{trainer.current_epoch} epoch(s), {trainer.global_step} optimizer steps"
        )
    else:
        validation = f"none ran: {no_validation_reason(trainer)}"
    return "\n".join(
        [
            "=" * 78,
            f"lit-cifar fit done: {strategy} on {trainer.world_size} process(es), "
            f"wall time {_minutes(wall_s)} (start of train.py to now)",
            f"  validation  {validation}",
            f"  data        {_data_line(datamodule)}",
            f"  TensorBoard {_tensorboard_line(trainer)}",
            f"  checkpoint  {_checkpoint_line(trainer)}",
            "=" * 78,
        ]
    )


def _data_line(datamodule: Any) -> str:
    used = getattr(datamodule, "dataset_used", None)
    if used == "synthetic":
        asked = getattr(datamodule, "hparams", {}).get("dataset")
        why = "dataset=auto fell back: real CIFAR-100 not available" if asked == "auto" else "dataset=synthetic"
        return f"SYNTHETIC stand-in ({why}). These are NOT CIFAR-100 accuracies."
    return "CIFAR-100 (the real data set)" if used == "cifar100" else str(used)


def _tensorboard_line(trainer: Trainer) -> str:
    logger = trainer.logger
    if not isinstance(logger, TensorBoardLogger):
        return "no TensorBoard logger in this run"
    return f"tensorboard --logdir {display_path(logger.root_dir)}   (this run: {display_path(logger.log_dir)})"


def _checkpoint_line(trainer: Trainer) -> str:
    checkpoint = trainer.checkpoint_callback
    saved = getattr(checkpoint, "last_model_path", "") or getattr(checkpoint, "best_model_path", "")
    return display_path(saved) if saved else "none saved"
