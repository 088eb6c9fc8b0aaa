"""train.py: LightningCLI parsing of every shipped config, --print_config, and a fit through the CLI."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from lit_cifar.data import CIFAR100DataModule
from lit_cifar.module import LitClassifier

REPO = Path(__file__).resolve().parent.parent
CONFIGS = REPO / "configs"


def _load_train_module():
    # train.py is a script at the repository root, not part of the installed packages.
    spec = importlib.util.spec_from_file_location("train", REPO / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


train = _load_train_module()


def _print_config(capsys: pytest.CaptureFixture, *configs: str) -> dict:
    args = ["fit"] + [arg for name in configs for arg in ("--config", str(CONFIGS / name))] + ["--print_config"]
    with pytest.raises(SystemExit) as exit_info:
        train.main(args)
    assert exit_info.value.code in (0, None)
    return yaml.safe_load(capsys.readouterr().out)


def test_print_config_from_the_command_line() -> None:
    # The real entry point, as README shows it (a subprocess: argv parsing, imports, exit code).
    result = subprocess.run(
        [sys.executable, "train.py", "fit", "--config", "configs/quickstart.yaml", "--print_config"],
        cwd=REPO, capture_output=True, text=True, timeout=300, check=True,
    )
    config = yaml.safe_load(result.stdout)
    assert config["model"]["net"] == "template" and config["data"]["dataset"] == "auto"
    assert config["trainer"]["logger"]["class_path"] == "lightning.pytorch.loggers.TensorBoardLogger"


def _strategy_name(strategy: str | dict) -> str:
    return strategy["class_path"] if isinstance(strategy, dict) else strategy


@pytest.mark.parametrize(
    ("configs", "expected"),
    [
        (("cifar100_resnet18.yaml",), {"net": "resnet18", "devices": -1, "dataset": "cifar100"}),
        (("cifar100_template_net.yaml",),
         {"net": "template", "devices": 2, "accumulate": 2, "batch_size": 32, "strategy": "custom_ddp"}),
        (("custom_ddp_cpu.yaml",), {"devices": 2, "accumulate": 2, "strategy": "strategies.custom_ddp.CustomDDPStrategy"}),
        (("quickstart.yaml", "ddp_cpu.yaml"),
         {"net": "template", "devices": 2, "dataset": "auto", "strategy": "lightning.pytorch.strategies.DDPStrategy"}),
    ],
)
def test_shipped_configs_parse(capsys: pytest.CaptureFixture, configs: tuple[str, ...], expected: dict) -> None:
    config = _print_config(capsys, *configs)
    found = {
        "net": config["model"]["net"],
        "devices": config["trainer"]["devices"],
        "dataset": config["data"]["dataset"],
        "accumulate": config["trainer"]["accumulate_grad_batches"],
        "batch_size": config["data"]["batch_size"],
        "strategy": _strategy_name(config["trainer"]["strategy"]),
    }
    assert {key: found[key] for key in expected} == expected


def test_fit_through_the_cli(tmp_path: Path, data_dir: Path) -> None:
    cli = train.main([
        "fit", "--config", str(CONFIGS / "quickstart.yaml"),
        "--data.dataset=synthetic", f"--data.data_dir={data_dir}",
        "--data.synthetic_train_size=400", "--data.synthetic_test_size=200", "--data.val_size=100",
        "--data.batch_size=64", "--trainer.max_epochs=1", "--trainer.limit_train_batches=2",
        f"--trainer.logger.init_args.save_dir={tmp_path}", "--trainer.enable_progress_bar=false",
    ])
    assert cli.trainer.state.finished and cli.trainer.global_step == 2
    log_dir = tmp_path / "lightning_logs" / "version_0"
    assert (log_dir / "config.yaml").is_file() and (log_dir / "checkpoints" / "last.ckpt").is_file()
    assert list(log_dir.glob("events.out.tfevents.*"))
    assert yaml.safe_load((log_dir / "hparams.yaml").read_text())["dataset_used"] == "synthetic"
    # Checkpoints rebuild model and data (the recorded dataset_used is not an __init__ argument).
    checkpoint = log_dir / "checkpoints" / "last.ckpt"
    assert LitClassifier.load_from_checkpoint(checkpoint).hparams.net == "template"
    assert CIFAR100DataModule.load_from_checkpoint(checkpoint).hparams.synthetic_train_size == 400
