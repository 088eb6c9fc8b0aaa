"""train.py's parsing: every shipped config, strategy options by registered name or short class name (command
line and YAML), the refused --optimizer flags, and bad options reported in one line with the fix. Runs:
``tests/cli/test_train_cli.py``."""

from __future__ import annotations

import logging
from argparse import ArgumentError
from datetime import timedelta
from pathlib import Path

import pytest
from train_cli_helpers import CONFIGS, print_config, stderr_lines

import train
from strategies import CustomDDPStrategy


def _strategy_name(strategy: str | dict) -> str:
    return strategy["class_path"] if isinstance(strategy, dict) else strategy


@pytest.mark.parametrize(
    ("configs", "expected"),
    [
        (
            ("quickstart.yaml",),
            {"net": "template", "devices": 2, "dataset": "auto", "strategy": "strategies.CustomDDPStrategy"},
        ),
        (("cifar100_resnet18.yaml",), {"net": "resnet18", "devices": -1, "dataset": "cifar100"}),
        (
            ("cifar100_template_net.yaml",),
            {
                "net": "template",
                "devices": 2,
                "accumulate": 2,
                "batch_size": 32,
                "strategy": "strategies.CustomDDPStrategy",
            },
        ),
        (("custom_ddp_cpu.yaml",), {"devices": 2, "accumulate": 2, "strategy": "strategies.CustomDDPStrategy"}),
        (
            ("quickstart.yaml", "ddp_cpu.yaml"),
            {
                "net": "template",
                "devices": 2,
                "dataset": "auto",
                "strategy": "lightning.pytorch.strategies.DDPStrategy",
            },
        ),
    ],
)
def test_shipped_configs_parse(capsys: pytest.CaptureFixture, configs: tuple[str, ...], expected: dict) -> None:
    config = print_config(capsys, *configs)
    found = {
        "net": config["model"]["net"],
        "devices": config["trainer"]["devices"],
        "dataset": config["data"]["dataset"],
        "accumulate": config["trainer"]["accumulate_grad_batches"],
        "batch_size": config["data"]["batch_size"],
        "strategy": _strategy_name(config["trainer"]["strategy"]),
    }
    assert {key: found[key] for key in expected} == expected


@pytest.mark.parametrize("flag", ["--optimizer=torch.optim.Adam", "--lr_scheduler.class_path=StepLR"])
def test_optimizer_flags_are_refused_with_the_fix(capsys: pytest.CaptureFixture, flag: str) -> None:
    with pytest.raises(SystemExit) as exit_info:
        train.main(["fit", "--config", str(CONFIGS / "quickstart.yaml"), flag, "--print_config"])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert f"{flag} is not an option here" in error and "--model.optimizer=sgd|adamw" in error


def test_optimizer_key_in_a_config_file_is_rejected(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    config = tmp_path / "optimizer.yaml"
    config.write_text("optimizer:\n  class_path: torch.optim.Adam\n")
    with pytest.raises(SystemExit) as exit_info:
        train.main(["fit", "--config", str(CONFIGS / "quickstart.yaml"), "--config", str(config), "--print_config"])
    assert exit_info.value.code == 2 and "'optimizer.class_path' is not accepted" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (
            ["--trainer.strategy=custom_ddp", "--trainer.strategy.sync_mode=flat"],
            {"sync_mode": "flat", "start_method": "popen"},
        ),
        (
            ["--trainer.strategy", "custom_ddp_fork", "--trainer.strategy.zero1=true"],
            {"zero1": True, "start_method": "fork", "sync_mode": "bucketed"},
        ),
        (
            ["--trainer.strategy=custom_ddp_spawn", "--trainer.strategy.init_args.start_method=popen"],
            {"start_method": "popen"},
        ),  # the user's option wins over the registered one
        (
            [
                "--trainer.strategy=CustomDDPStrategy",
                "--trainer.strategy.bucket_cap_mb=4",
                "--trainer.strategy.timeout=90",
            ],
            {"bucket_cap_mb": 4.0, "timeout": 90.0},
        ),
    ],
    ids=["registered-name", "fork-name-space-separated", "user-wins", "short-class-name"],
)
def test_strategy_options_from_the_command_line(capsys: pytest.CaptureFixture, args: list[str], expected: dict) -> None:
    strategy = print_config(capsys, "quickstart.yaml", extra=tuple(args))["trainer"]["strategy"]
    assert strategy["class_path"].endswith("CustomDDPStrategy")
    assert {key: strategy["init_args"][key] for key in expected} == expected


@pytest.mark.parametrize(("timeout", "seconds"), [("90", 90), ("2.5", 2.5), ("0:05:00", 300)])
def test_strategy_options_from_yaml_by_short_class_name(tmp_path: Path, timeout: str, seconds: float) -> None:
    config = tmp_path / "strategy.yaml"
    config.write_text(
        "trainer:\n  strategy:\n    class_path: CustomDDPStrategy\n"
        f"    init_args:\n      sync_mode: per_param\n      timeout: {timeout}\n"
    )
    # A flag still overrides one option of it; the rest stays.
    cli = train.main(
        ["--config", str(CONFIGS / "quickstart.yaml"), "--config", str(config), "--trainer.strategy.zero1=true"],
        run=False,
    )
    strategy = cli.trainer.strategy
    assert isinstance(strategy, CustomDDPStrategy)
    options = strategy.options
    assert (options.sync_mode, options.zero1, strategy._timeout) == ("per_param", True, timedelta(seconds=seconds))


def test_a_ddp_configuration_runs_with_only_its_class_path_changed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # torch DDP's flags as Lightning's DDPStrategy takes them: accepted, no effect, one line each on rank 0.
    flags = {"find_unused_parameters": True, "static_graph": True, "gradient_as_bucket_view": False}
    ddp_config = "".join(f"      {name}: {str(value).lower()}\n" for name, value in flags.items())
    config = tmp_path / "strategy.yaml"
    config.write_text(
        "trainer:\n  strategy:\n    class_path: CustomDDPStrategy\n    init_args:\n      timeout: 600\n" + ddp_config
    )
    with caplog.at_level(logging.INFO):
        cli = train.main(["--config", str(CONFIGS / "quickstart.yaml"), "--config", str(config)], run=False)
    strategy = cli.trainer.strategy
    assert isinstance(strategy, CustomDDPStrategy) and strategy._timeout == timedelta(seconds=600)
    assert strategy.options == CustomDDPStrategy().options  # nothing changed but what ddp also knows
    said = [record.getMessage() for record in caplog.records]
    assert [line.split(",")[0] for line in said if "a ddp option" in line] == [
        f"custom_ddp: {name}={value}" for name, value in flags.items()
    ]


def test_registered_name_without_options_stays_a_name(capsys: pytest.CaptureFixture) -> None:
    config = print_config(capsys, "quickstart.yaml", extra=("--trainer.strategy=custom_ddp",))
    assert config["trainer"]["strategy"] == "custom_ddp"


def test_strategy_built_from_name_options_and_seconds() -> None:
    cli = train.main(
        [
            "--config",
            str(CONFIGS / "quickstart.yaml"),
            "--trainer.strategy=custom_ddp_fork",
            "--trainer.strategy.sync_mode=flat",
            "--trainer.strategy.timeout=90",
            "--trainer.strategy.startup_timeout=0:10:00",
        ],
        run=False,
    )
    strategy = cli.trainer.strategy
    assert isinstance(strategy, CustomDDPStrategy) and strategy.options.sync_mode == "flat"
    assert strategy._timeout == timedelta(seconds=90) and strategy._start_method == "fork"
    assert strategy._startup_timeout == timedelta(minutes=10)


@pytest.mark.parametrize(
    ("options", "reason"),
    [
        # The strategy's own checks, which jsonargparse would fold into its 58-line Union report.
        (("--trainer.strategy.bucket_cap_mb=-1",), "CustomDDPStrategy: bucket_cap_mb=-1.0 must be a number > 0"),
        (
            ("--trainer.strategy=custom_ddp", "--trainer.strategy.timeout=0"),
            "CustomDDPStrategy: timeout=0.0 must be > 0 seconds",
        ),
        (
            ("--trainer.strategy=custom_ddp", "--trainer.strategy.startup_timeout=-1"),
            "CustomDDPStrategy: startup_timeout=-1.0 must be > 0 seconds",
        ),
        # A parse error inside the same Union, and one after 60 lines of usage: the innermost reason and its key.
        (
            ("--trainer.strategy.sync_mode=foo",),
            "trainer.strategy.sync_mode: Expected a typing.Literal['bucketed', 'flat', 'per_param', "
            "'per_param_overlap']",
        ),
        (("--data.dataset=foo",), "data.dataset: Expected a typing.Literal['cifar100', 'synthetic', 'auto']"),
        # An innermost Union: what each of its types said.
        (
            ("--trainer.strategy.timeout=abc",),
            "trainer.strategy.timeout: Expected a <class 'float'> / Not of type timedelta: Expected a string with form",
        ),
        # The data's and the model's own checks (OptionError), raised while LightningCLI builds them.
        (("--data.batch_size=0",), "batch_size (0) and eval_batch_size (500) must be >= 1."),
        (("--model.net=foo",), "unknown net 'foo'; choose one of ['resnet18', 'template']."),
        (
            ('--model.net_kwargs={"widht": 0.5}',),
            "model.net_kwargs {'widht': 0.5}: net 'template' takes no 'widht'; it takes ['dropout']",
        ),
    ],
    ids=[
        "strategy-check",
        "strategy-timeout",
        "strategy-startup-timeout",
        "strategy-literal",
        "data-literal",
        "strategy-union",
        "data-check",
        "model-check",
        "net-kwargs",
    ],
)
def test_a_bad_option_is_reported_in_one_line(
    capsys: pytest.CaptureFixture, options: tuple[str, ...], reason: str
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        train.main(["--config", str(CONFIGS / "quickstart.yaml"), *options], run=False)
    assert exit_info.value.code == 2
    error, hint = stderr_lines(capsys)  # nothing else
    assert error.startswith(f"error: {reason}"), error
    assert hint == "  (every option: python train.py --help; jsonargparse's full report: JSONARGPARSE_DEBUG=true)"


def test_the_hint_names_the_subcommand(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        train.main(
            [
                "test",
                "--config",
                str(CONFIGS / "quickstart.yaml"),
                "--trainer.devices=1",
                "--trainer.strategy=auto",
                "--trainer.nonsense=1",
            ]
        )
    assert stderr_lines(capsys) == [
        "error: unrecognized arguments: --trainer.nonsense=1",
        "  (every option: python train.py test --help; jsonargparse's full report: JSONARGPARSE_DEBUG=true)",
    ]


def test_jsonargparse_debug_lets_the_full_report_through(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("JSONARGPARSE_DEBUG", "true")
    with pytest.raises(ArgumentError, match="Does not validate against any of the Union subtypes"):
        train.main(["--config", str(CONFIGS / "quickstart.yaml"), "--trainer.strategy.sync_mode=foo"], run=False)
    with pytest.raises(ValueError, match="bucket_cap_mb=-1.0 must be a number > 0"):
        train.main(["--config", str(CONFIGS / "quickstart.yaml"), "--trainer.strategy.bucket_cap_mb=-1"], run=False)
