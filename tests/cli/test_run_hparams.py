"""RunHparams: every fit / validate / test run carries a TensorBoard HPARAMS session with the strategy, its
options, the world size, accumulation and the data used; read back from the event file as TensorBoard does."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from conformance_harness import one_process_trainer
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.hparams import metadata as hparams_metadata
from tensorboard.plugins.hparams import plugin_data_pb2
from train_cli_helpers import CONFIGS, TINY_ARGS

import train  # train.py at the repository root, on pytest's pythonpath
from callbacks.run_hparams import RunHparams, flatten_hparams, strategy_name
from lit_cifar.module import LitClassifier
from strategies import CustomDDPStrategy


def read_hparams_plugin(run_dir: Path) -> tuple[dict[str, Any], set[str], EventAccumulator]:
    """The session-start hparams of ``run_dir`` (name -> value), the hparams plugin tags present, the events."""
    events = EventAccumulator(str(run_dir))
    events.Reload()
    content = events.PluginTagToContent(hparams_metadata.PLUGIN_NAME)
    start = plugin_data_pb2.HParamsPluginData.FromString(content[hparams_metadata.SESSION_START_INFO_TAG])
    values = {
        name: getattr(value, value.WhichOneof("kind")) for name, value in start.session_start_info.hparams.items()
    }
    return values, set(content), events


def _check_session(run_dir: Path) -> tuple[dict[str, Any], EventAccumulator]:
    hparams, tags, events = read_hparams_plugin(run_dir)
    # Start and end of the session; no experiment summary (TensorBoard would take ONE run's column list
    # for all runs) and no placeholder metric points: val/acc1 holds the one real validation only.
    assert tags == {hparams_metadata.SESSION_START_INFO_TAG, hparams_metadata.SESSION_END_INFO_TAG}
    assert len(events.Scalars("val/acc1")) == 1
    return hparams, events


def _fit_through_the_cli(tmp_path: Path, data_dir: Path, *strategy_flags: str) -> Any:
    """``train.py fit`` of the quickstart config on the tiny data: 2 batches, accumulated 2, logged under tmp_path."""
    return train.main(
        [
            "fit",
            "--config",
            str(CONFIGS / "quickstart.yaml"),
            *TINY_ARGS,
            "--trainer.enable_model_summary=false",
            "--trainer.max_epochs=1",
            "--trainer.limit_train_batches=2",
            *strategy_flags,
            "--trainer.accumulate_grad_batches=2",
            f"--data.data_dir={data_dir}",
            f"--trainer.logger.init_args.save_dir={tmp_path}",
        ]
    )


def _assert_values(hparams: dict[str, Any], expected: dict[str, Any]) -> None:
    """The session holds ``expected``'s keys with its values (and may hold others)."""
    assert {key: hparams[key] for key in expected} == expected


def test_single_process_fit_through_the_cli(tmp_path: Path, data_dir: Path) -> None:
    _fit_through_the_cli(tmp_path, data_dir, "--trainer.devices=1", "--trainer.strategy=auto")
    hparams, _ = _check_session(tmp_path / "lightning_logs" / "version_0")
    _assert_values(
        hparams,
        {
            "strategy": "single_device",
            "world_size": 1,
            "accumulate_grad_batches": 2,
            "dataset_used": "synthetic",
            "stage": "fit",
            "precision": "32-true",
            "net": "template",
            "global_batch_size": 128,
            "seed": 0,
        },
    )
    assert "strategy/sync_mode" not in hparams and not any(key.startswith("_") for key in hparams)


@pytest.mark.distributed
def test_custom_ddp_two_processes_through_the_cli(tmp_path: Path, data_dir: Path) -> None:
    # custom_ddp_fork: the quickstart's strategy on its 2 processes, forked from this one (seconds, not a re-run).
    cli = _fit_through_the_cli(
        tmp_path, data_dir, "--trainer.strategy=custom_ddp_fork", "--trainer.strategy.sync_mode=flat"
    )
    assert cli.trainer.world_size == 2
    hparams, _ = _check_session(tmp_path / "lightning_logs" / "version_0")
    _assert_values(
        hparams,
        {
            "strategy": "custom_ddp",
            "strategy/sync_mode": "flat",
            "strategy/start_method": "fork",
            "strategy/sync_batchnorm": "True",
            "strategy/bucket_cap_mb": 25.0,
            "strategy/process_group_backend": "gloo",
            "world_size": 2,
            "accumulate_grad_batches": 2,
            "dataset_used": "synthetic",
            "global_batch_size": 256,
        },
    )


def test_validate_and_test_stages_and_other_loggers(tmp_path: Path, tiny_datamodule) -> None:
    """Direct Trainer use: one session per stage; a non-TensorBoard logger gets the same parameters."""
    csv = CSVLogger(tmp_path, name="csv")
    trainer = one_process_trainer(
        limit_val_batches=1,
        limit_test_batches=1,
        callbacks=[RunHparams()],
        logger=[TensorBoardLogger(tmp_path, name="tb", default_hp_metric=False), csv],
    )
    model, datamodule = LitClassifier(net="template"), tiny_datamodule()
    trainer.validate(model, datamodule=datamodule, verbose=False)
    hparams, tags, _ = read_hparams_plugin(tmp_path / "tb" / "version_0")
    assert hparams["stage"] == "validate" and hparams["strategy"] == "single_device"
    assert hparams_metadata.SESSION_END_INFO_TAG in tags
    assert yaml.safe_load(Path(csv.log_dir, "hparams.yaml").read_text())["strategy"] == "single_device"
    trainer.test(model, datamodule=datamodule, verbose=False)
    (callback,) = [cb for cb in trainer.callbacks if isinstance(cb, RunHparams)]
    assert callback.hparams["stage"] == "test"


def test_flatten_hparams_gives_tensorboard_scalars() -> None:
    flat = flatten_hparams({"a": {"b": 1, "c": {"d": None}}, "e": [1, 2], "f": True, "g": 0.5, "h": {}})
    assert flat == {"a/b": 1, "a/c/d": "None", "e": "[1, 2]", "f": True, "g": 0.5, "h": "{}"}


def test_strategy_name_is_the_registered_name() -> None:
    class MyDDP(DDPStrategy):
        pass

    assert strategy_name(CustomDDPStrategy()) == "custom_ddp"
    assert strategy_name(CustomDDPStrategy(start_method="fork")) == "custom_ddp"  # the start method is an option
    assert strategy_name(DDPStrategy()) == "ddp"
    assert strategy_name(SingleDeviceStrategy("cpu")) == "single_device"
    assert strategy_name(MyDDP()) == "MyDDP"
