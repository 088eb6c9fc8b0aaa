"""LightningCLI end to end: ``train.py fit --trainer.strategy=custom_ddp`` on 2 CPU processes.

Uses the default popen launcher, which re-runs ``train.py`` for rank 1: that the strategy name
resolves there proves it is registered at import of ``strategies``.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.distributed
def test_train_py_fits_with_custom_ddp_on_two_processes(tmp_path: Path) -> None:
    command = [
        sys.executable, "train.py", "fit", "--config", "configs/custom_ddp_cpu.yaml",
        "--trainer.strategy=custom_ddp",
        "--trainer.max_epochs=1", "--trainer.limit_train_batches=4", "--trainer.limit_val_batches=2",
        "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
        f"--trainer.logger.init_args.save_dir={tmp_path}",
        f"--data.data_dir={tmp_path / 'data'}", "--data.dataset=synthetic",
        "--data.synthetic_train_size=512", "--data.synthetic_test_size=64",
        "--data.batch_size=16", "--data.eval_batch_size=32",
    ]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    assert "GLOBAL_RANK: 1, MEMBER: 2/2" in output  # the popen launcher started rank 1
    run_dir = tmp_path / "lightning_logs" / "version_0"
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["trainer"]["strategy"] == "custom_ddp"
    assert list((run_dir / "checkpoints").glob("*.ckpt"))
    assert list(run_dir.glob("events.out.tfevents.*"))
