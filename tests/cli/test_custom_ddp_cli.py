"""LightningCLI end to end with ``custom_ddp`` on 2 CPU processes (fit, and predict with options), and
the strategy's ``timeout`` in seconds or as a ``timedelta``.

Uses the default popen launcher, which re-runs ``train.py`` for rank 1: that the strategy name
resolves there proves it is registered at import of ``strategies``.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
import torch
import yaml
from conformance_harness import one_process_trainer
from entry_points import train_py_on_two_processes
from train_cli_helpers import WARNING_LINE

from lit_cifar.module import LitClassifier
from lit_cifar.transforms import normalize
from strategies import CustomDDPStrategy


@pytest.mark.distributed
@pytest.mark.slow  # the same 2-process popen fit as the quickstart test (tests/cli/test_train_cli.py), the registered
# name re-parsed by the child as in the predict test below, and custom_ddp_cpu.yaml parsed by test_train_cli_options
def test_train_py_fits_with_custom_ddp_on_two_processes(tmp_path: Path) -> None:
    train_py_on_two_processes(
        "fit",
        "--config",
        "configs/custom_ddp_cpu.yaml",
        "--trainer.strategy=custom_ddp",
        "--trainer.max_epochs=1",
        "--trainer.limit_train_batches=4",
        "--trainer.limit_val_batches=2",
        "--trainer.enable_progress_bar=false",
        "--trainer.enable_model_summary=false",
        f"--trainer.logger.init_args.save_dir={tmp_path}",
        f"--data.data_dir={tmp_path / 'data'}",
        "--data.dataset=synthetic",
        "--data.synthetic_train_size=512",
        "--data.synthetic_test_size=64",
        "--data.batch_size=16",
        "--data.eval_batch_size=32",
    )
    run_dir = tmp_path / "lightning_logs" / "version_0"
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["trainer"]["strategy"] == "custom_ddp"
    assert list((run_dir / "checkpoints").glob("*.ckpt"))
    assert list(run_dir.glob("events.out.tfevents.*"))


def _checkpoint_of_one_step(model: LitClassifier, datamodule, tmp_path: Path) -> Path:
    """One training step in this process, saved; its fit keeps its own checkpoints in another folder, so
    that the predict run's ModelCheckpoint sees its dirpath change (the warning train.py filters)."""
    trainer = one_process_trainer(
        limit_train_batches=1, limit_val_batches=0, enable_checkpointing=True, default_root_dir=tmp_path / "fit"
    )
    trainer.fit(model, datamodule=datamodule)
    checkpoint = tmp_path / "model.ckpt"
    trainer.save_checkpoint(checkpoint)
    return checkpoint


@pytest.mark.long
@pytest.mark.distributed
def test_predict_on_two_processes_by_registered_name_with_options(
    tmp_path: Path, data_dir: Path, tiny_datamodule
) -> None:
    """``train.py predict`` with ``custom_ddp`` + an option (the popen child re-parses the same argv):
    the merged file equals one process's predictions row for row; per-rank files split the rows; no warning."""
    datamodule = tiny_datamodule()
    model = LitClassifier(net="template")
    checkpoint = _checkpoint_of_one_step(model, datamodule, tmp_path)
    per_rank = tmp_path / "parts" / "preds.pt"
    output = train_py_on_two_processes(
        "predict",
        "--config",
        "configs/quickstart.yaml",
        f"--ckpt_path={checkpoint}",
        "--trainer.devices=2",
        "--trainer.strategy=custom_ddp",
        "--trainer.strategy.sync_mode=flat",
        "--trainer.enable_progress_bar=false",
        f"--trainer.logger.init_args.save_dir={tmp_path}",
        # Two writers: the default merged one, and one file per rank elsewhere.
        "--trainer.callbacks+=PredictionWriter",
        "--trainer.callbacks+=PredictionWriter",
        "--trainer.callbacks.merge=false",
        f"--trainer.callbacks.output_path={per_rank}",
        f"--data.data_dir={data_dir}",
        "--data.dataset=synthetic",
        "--data.synthetic_train_size=400",
        "--data.synthetic_test_size=200",
        "--data.val_size=100",
        "--data.eval_batch_size=30",
    )
    # README's predict, as typed, prints no warning (test: tests/cli/test_train_cli.py). Gone: the LeafSpec deprecation,
    # and ModelCheckpoint's "The dirpath has changed" (the checkpoint's fit saved into another folder).
    assert [line for line in output.splitlines() if WARNING_LINE.search(line)] == [], output
    merged_path = tmp_path / "lightning_logs" / "version_0" / "predictions.pt"
    assert f"wrote predictions for 200 samples to {merged_path}" in output
    config = yaml.safe_load((merged_path.parent / "config.yaml").read_text())
    assert config["trainer"]["strategy"]["init_args"]["sync_mode"] == "flat"

    merged = torch.load(merged_path)
    model.eval()
    datamodule.setup("test")
    with torch.no_grad():
        probs = model(normalize(datamodule.test_set.images)).softmax(dim=-1)
    assert torch.equal(merged["index"], torch.arange(200))
    torch.testing.assert_close(merged["probs"], probs)
    _assert_parts_split(per_rank, merged)


@pytest.mark.parametrize(
    ("timeout", "expected"),
    [
        (90, timedelta(seconds=90)),
        (2.5, timedelta(seconds=2.5)),
        (timedelta(minutes=5), timedelta(minutes=5)),
        (None, None),
    ],
)
def test_timeout_takes_seconds_or_a_timedelta(timeout, expected) -> None:
    assert CustomDDPStrategy(timeout=timeout)._timeout == expected


@pytest.mark.parametrize(
    ("timeout", "error", "match"),
    [
        (0, ValueError, "timeout=0 must be > 0 seconds"),
        (-5.0, ValueError, "timeout=-5.0 must be > 0"),
        (timedelta(0), ValueError, "must be > 0"),
        (float("nan"), ValueError, "must be > 0"),
        ("30", TypeError, "timeout='30' must be a number of seconds or a timedelta"),
        (True, TypeError, "timeout=True"),
    ],
)
def test_bad_timeout_is_rejected_with_the_fix(timeout, error, match) -> None:
    with pytest.raises(error, match=match):
        CustomDDPStrategy(timeout=timeout)


def _assert_parts_split(per_rank: Path, merged: dict) -> None:
    """The per-rank files hold 100 rows each, together every row once, each equal to the merged file's."""
    parts = [torch.load(per_rank.with_name(f"preds_rank{rank}.pt")) for rank in (0, 1)]
    assert [len(part["index"]) for part in parts] == [100, 100]
    for part in parts:
        torch.testing.assert_close(part["probs"], merged["probs"][part["index"]])
    assert torch.equal(torch.cat([part["index"] for part in parts]).sort().values, torch.arange(200))
