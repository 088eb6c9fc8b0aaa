"""``RunHparams``: one TensorBoard HPARAMS entry per run, with how the run was distributed.

Lightning logs the module's and the datamodule's hyperparameters to ``hparams.yaml``, but with
``TensorBoardLogger(default_hp_metric=False)`` and no metrics it writes no hparams *summary*, so
TensorBoard's HPARAMS tab stays empty ("No hparams data was found"). This callback writes one,
once, on rank 0, when fit / validate / test starts (everything is known by then: the data
actually used, the strategy with its options, the world size)::

    trainer:
      callbacks:
        - class_path: callbacks.RunHparams

``train.py`` adds it to every fit / validate / test unless the config has one. The recorded
hyperparameters (:func:`run_hparams`): the module's and datamodule's (``dataset_used``
included), ``strategy`` (its registered name: ``custom_ddp``, ``ddp``, ``single_device``) and
its options as ``strategy/<option>`` (:func:`measure.run_info.strategy_options`: custom_ddp's
``sync_mode``, ``bucket_cap_mb``, ..., ddp's ``_ddp_kwargs``, backend, start method),
``world_size``, ``num_nodes``, ``devices``, ``accumulate_grad_batches``, ``precision``,
``global_batch_size``, ``max_epochs``, ``seed`` and ``stage``. Nested values are flattened to
``a/b`` keys; everything is a str, bool, int or float (``None`` becomes ``"None"``, lists their text;
in TensorBoard bools read ``"True"``/``"False"``, which torch's converter would turn into 1.0/0.0).

What goes into the event file is TensorBoard's session-start record (the hparams plugin's
``_hparams_/session_start_info``) and, when the stage ends normally, its session-end record.
Deliberately NOT written: an experiment summary (``_hparams_/experiment``) and placeholder
metric values. ``logger.log_hyperparams(params, metrics={...})`` would write both: the
placeholders as real scalar points (``val/acc1 = 0`` at step 0 in every accuracy curve), and an
experiment summary whose column list TensorBoard takes from ONE arbitrary run for all runs (so a
single-process run listed first hides the ``strategy/sync_mode`` column of every custom_ddp run).
Without it TensorBoard builds the table itself: the union of every run's hyperparameters, and
every scalar tag of each run (``val/acc1``, ``val/acc5``, ``val/loss``, ``train/loss_epoch``,
``test/acc1``, ...) as a metric column, linked to that run's curves and showing its last value.
Loggers other than TensorBoard get the same parameters through ``logger.log_hyperparams``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.strategies import StrategyRegistry
from typing_extensions import override

from measure.run_info import strategy_options

__all__ = ["RunHparams", "flatten_hparams", "run_hparams", "strategy_name"]

Scalar = str | bool | int | float


def strategy_name(strategy: Any) -> str:
    """The name the strategy is registered under (``custom_ddp``, ``ddp``, ``single_device``), else its class name.

    The first registered name of the exact class: launch variants (``ddp_fork``) show up as
    ``strategy/start_method`` instead.
    """
    for name, entry in StrategyRegistry.items():
        if entry["strategy"] is type(strategy):
            return name
    return type(strategy).__name__


def _scalar(value: Any) -> Scalar:
    if isinstance(value, (str, bool, int, float)):
        return value
    if hasattr(value, "item") and getattr(value, "ndim", None) == 0:  # 0-d tensors and numpy scalars
        return value.item()
    return str(value)  # None -> "None", lists, dtypes, paths


def flatten_hparams(params: Mapping[str, Any], prefix: str = "") -> dict[str, Scalar]:
    """Nested mappings -> ``a/b`` keys; every value a str, bool, int or float TensorBoard accepts."""
    flat: dict[str, Scalar] = {}
    for key, value in params.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat.update(flatten_hparams(value, prefix=f"{name}/"))
        else:
            flat[name] = _scalar(value)
    return flat


def run_hparams(trainer: Trainer, pl_module: LightningModule) -> dict[str, Scalar]:
    """Everything worth comparing runs by: model, data, strategy and its options, scale, precision."""
    datamodule_hparams = dict(getattr(trainer.datamodule, "hparams", None) or {})
    params: dict[str, Any] = {**dict(pl_module.hparams), **datamodule_hparams}
    options = strategy_options(trainer.strategy)
    batch_size = datamodule_hparams.get("batch_size")
    params.update(
        {
            "strategy": strategy_name(trainer.strategy),
            "world_size": trainer.world_size,
            "num_nodes": trainer.num_nodes,
            "devices": trainer.num_devices,
            "accumulate_grad_batches": trainer.accumulate_grad_batches,
            "precision": str(trainer.precision),
            "max_epochs": trainer.max_epochs,
            "seed": os.environ.get("PL_GLOBAL_SEED"),  # set by seed_everything (LightningCLI: seed_everything)
            "stage": trainer.state.fn.value if trainer.state.fn is not None else None,
        }
    )
    if isinstance(batch_size, int) and not isinstance(batch_size, bool):
        params["global_batch_size"] = batch_size * trainer.world_size * trainer.accumulate_grad_batches
    seed = params["seed"]
    if isinstance(seed, str) and seed.lstrip("-").isdigit():
        params["seed"] = int(seed)
    # "_instantiator" and other private keys: LightningCLI bookkeeping, not hyperparameters.
    flat = flatten_hparams({k: v for k, v in params.items() if not k.startswith("_")})
    flat.update(flatten_hparams(options, prefix="strategy/"))  # strategy/class, strategy/sync_mode, ...
    return flat


def _tensorboard_values(params: Mapping[str, Scalar]) -> dict[str, Scalar]:
    # torch's summary.hparams() checks isinstance(v, (int, float)) first, so a bool would show as 1.0 / 0.0.
    return {k: str(v) if isinstance(v, bool) else v for k, v in params.items()}


def _file_writer(logger: TensorBoardLogger) -> Any:
    # The logger's own SummaryWriter (public: logger.experiment) and its event file. One file per
    # run: a second writer in the same folder can make a live TensorBoard stop reading the first.
    # _get_file_writer() reopens the file when a finished fit closed it (fit, then test, same logger);
    # it is the call Lightning's own TensorBoardLogger.log_hyperparams makes.
    return logger.experiment._get_file_writer()


class RunHparams(Callback):
    """Write the run's hyperparameters (see :func:`run_hparams`) as TensorBoard HPARAMS, once per stage, rank 0.

    Observation only: nothing is communicated and no metric is logged.
    """

    def __init__(self) -> None:
        self.hparams: dict[str, Scalar] | None = None  # what was written last (rank 0)

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._start(trainer, pl_module)

    @override
    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.state.fn == "validate":  # not the validation loops inside fit
            self._start(trainer, pl_module)

    @override
    def on_test_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._start(trainer, pl_module)

    @override
    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._end(trainer)

    @override
    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.state.fn == "validate":
            self._end(trainer)

    @override
    def on_test_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._end(trainer)

    def _start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not trainer.is_global_zero:
            return
        from torch.utils.tensorboard.summary import hparams

        self.hparams = run_hparams(trainer, pl_module)
        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger):
                # hparams() builds (experiment, session start, session end); only the start is written now.
                _, session_start, _ = hparams(_tensorboard_values(self.hparams), {})
                _file_writer(logger).add_summary(session_start, trainer.global_step)
                logger.experiment.flush()
            else:
                logger.log_hyperparams(self.hparams)

    def _end(self, trainer: Trainer) -> None:
        if not trainer.is_global_zero or self.hparams is None:
            return
        from torch.utils.tensorboard.summary import hparams

        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger):
                _, _, session_end = hparams(_tensorboard_values(self.hparams), {})  # status: success
                _file_writer(logger).add_summary(session_end, trainer.global_step)
                logger.experiment.flush()
