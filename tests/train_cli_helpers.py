"""What the ``train.py`` tests share: the configs' folder, the tiny synthetic data's flags, how a warning line looks,
and train.py's ``--print_config`` as a dict."""

from __future__ import annotations

import re

import pytest
import yaml
from entry_points import REPO

import train  # train.py at the repository root, on pytest's pythonpath

CONFIGS = REPO / "configs"
# The session's tiny synthetic set (conftest.TINY, generated once in the data_dir fixture) as train.py flags.
TINY_ARGS = [
    "--data.dataset=synthetic",
    "--data.synthetic_train_size=400",
    "--data.synthetic_test_size=200",
    "--data.val_size=100",
    "--data.batch_size=64",
    "--trainer.enable_progress_bar=false",
]
# How Python (and Lightning) print a warning: "file.py:N: [Category: ]message".
WARNING_LINE = re.compile(r"\.py:\d+: ")


def stderr_lines(capsys: pytest.CaptureFixture) -> list[str]:
    """What this process wrote to stderr, without warnings (LightningCLI's about args next to pytest's argv)."""
    return [line for line in capsys.readouterr().err.splitlines() if not WARNING_LINE.search(line)]


def print_config(capsys: pytest.CaptureFixture, *configs: str, extra: tuple[str, ...] = ()) -> dict:
    """``train.py fit --config <configs/each> <extra> --print_config``, in this process, as the parsed YAML."""
    args = ["fit"] + [arg for name in configs for arg in ("--config", str(CONFIGS / name))] + [*extra, "--print_config"]
    with pytest.raises(SystemExit) as exit_info:
        train.main(args)
    assert exit_info.value.code in (0, None)
    return yaml.safe_load(capsys.readouterr().out)
