"""train.py: LightningCLI parsing of every shipped config, --print_config, fit and predict through the CLI
(under --trainer.default_root_dir), the quickstart command on 2 processes (its summary, its console),
fit/test/predict without a stray warning, strategy options by registered name or short class name, the
refused --optimizer flags, and bad options reported in one line."""

from __future__ import annotations

import re
import subprocess
import sys
from argparse import ArgumentError
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import yaml

from lit_cifar.data import CIFAR100DataModule
from lit_cifar.module import LitClassifier
from lit_cifar.transforms import normalize
from strategies import CustomDDPStrategy

REPO = Path(__file__).resolve().parent.parent
CONFIGS = REPO / "configs"


import train  # noqa: E402  (train.py at the repository root, on pytest's pythonpath)

# How Python (and Lightning) print a warning: "file.py:N: [Category: ]message".
_WARNING_LINE = re.compile(r"\.py:\d+: ")


def _stderr_lines(capsys: pytest.CaptureFixture) -> list[str]:
    """What this process wrote to stderr, without warnings (LightningCLI's about args next to pytest's argv)."""
    return [line for line in capsys.readouterr().err.splitlines() if not _WARNING_LINE.search(line)]


def _print_config(capsys: pytest.CaptureFixture, *configs: str, extra: tuple[str, ...] = ()) -> dict:
    args = ["fit"] + [arg for name in configs for arg in ("--config", str(CONFIGS / name))] + [*extra, "--print_config"]
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
        (("quickstart.yaml",),
         {"net": "template", "devices": 2, "dataset": "auto", "strategy": "strategies.CustomDDPStrategy"}),
        (("cifar100_resnet18.yaml",), {"net": "resnet18", "devices": -1, "dataset": "cifar100"}),
        (("cifar100_template_net.yaml",),
         {"net": "template", "devices": 2, "accumulate": 2, "batch_size": 32, "strategy": "strategies.CustomDDPStrategy"}),
        (("custom_ddp_cpu.yaml",), {"devices": 2, "accumulate": 2, "strategy": "strategies.CustomDDPStrategy"}),
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


TINY_ARGS = [
    "--data.dataset=synthetic", "--data.synthetic_train_size=400", "--data.synthetic_test_size=200",
    "--data.val_size=100", "--data.batch_size=64", "--trainer.enable_progress_bar=false",
    # In this process: the quickstart's 2 popen processes would re-run pytest's own command line.
    "--trainer.devices=1", "--trainer.strategy=auto",
]


@pytest.fixture(scope="module")
def fit_run(tmp_path_factory: pytest.TempPathFactory, data_dir: Path) -> tuple:
    """One 2-step fit through the CLI on TINY data, one process, in a job folder: (cli, root_dir)."""
    root_dir = tmp_path_factory.mktemp("job")
    cli = train.main([
        "fit", "--config", str(CONFIGS / "quickstart.yaml"), *TINY_ARGS, f"--data.data_dir={data_dir}",
        "--trainer.max_epochs=1", "--trainer.limit_train_batches=2", f"--trainer.default_root_dir={root_dir}",
        "--trainer.callbacks+=BenchmarkMonitor", "--trainer.callbacks.warmup_steps=1",
    ])
    return cli, root_dir


def test_fit_through_the_cli_writes_everything_under_default_root_dir(fit_run: tuple) -> None:
    cli, root_dir = fit_run
    assert cli.trainer.state.finished and cli.trainer.global_step == 2
    log_dir = root_dir / "lightning_logs" / "version_0"
    assert (log_dir / "config.yaml").is_file() and (log_dir / "checkpoints" / "last.ckpt").is_file()
    assert list(log_dir.glob("events.out.tfevents.*")) and (log_dir / "benchmark.json").is_file()
    # The saved config names the folder the logger really used (re-running it writes there too).
    saved = yaml.safe_load((log_dir / "config.yaml").read_text())["trainer"]
    assert saved["logger"]["init_args"]["save_dir"] == saved["default_root_dir"] == str(root_dir)
    summary = train.fit_summary(cli.trainer, cli.datamodule, wall_s=1.0)
    assert f"tensorboard --logdir {root_dir / 'lightning_logs'}   (this run: {log_dir})" in summary
    assert f"  checkpoint  {log_dir / 'checkpoints' / 'last.ckpt'}" in summary
    assert yaml.safe_load((log_dir / "hparams.yaml").read_text())["dataset_used"] == "synthetic"
    # Checkpoints rebuild model and data (the recorded dataset_used is not an __init__ argument).
    checkpoint = log_dir / "checkpoints" / "last.ckpt"
    assert LitClassifier.load_from_checkpoint(checkpoint).hparams.net == "template"
    assert CIFAR100DataModule.load_from_checkpoint(checkpoint).hparams.synthetic_train_size == 400
    # The optimizer is the module's own (auto_configure_optimizers=False): SGD with the no-decay
    # group and the config's per-step one-cycle schedule, not something the CLI substituted.
    (optimizer,) = cli.trainer.optimizers
    assert isinstance(optimizer, torch.optim.SGD) and [g["weight_decay"] for g in optimizer.param_groups] == [5e-4, 0]
    (scheduler_config,) = cli.trainer.lr_scheduler_configs
    assert isinstance(scheduler_config.scheduler, torch.optim.lr_scheduler.OneCycleLR)


def test_predict_through_the_cli_writes_the_predictions(fit_run: tuple, data_dir: Path) -> None:
    _, root_dir = fit_run
    checkpoint = root_dir / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt"
    cli = train.main([
        "predict", "--config", str(CONFIGS / "quickstart.yaml"), *TINY_ARGS, f"--data.data_dir={data_dir}",
        "--data.eval_batch_size=48", f"--trainer.default_root_dir={root_dir}", f"--ckpt_path={checkpoint}",
    ])
    path = root_dir / "lightning_logs" / "version_1" / "predictions.pt"  # the predict run's own log dir
    (writer,) = [cb for cb in cli.trainer.callbacks if isinstance(cb, train.PredictionWriter)]
    assert writer.written == [path]
    saved = torch.load(path)
    assert torch.equal(saved["index"], torch.arange(200))  # the test split, in dataset order (5 batches merged)
    # Same as the checkpoint's model on the test images, row for row.
    model = LitClassifier.load_from_checkpoint(checkpoint).eval()
    test_set = cli.datamodule.test_set
    with torch.no_grad():
        probs = model(normalize(test_set.images)).softmax(dim=-1)
    torch.testing.assert_close(saved["probs"], probs)
    assert torch.equal(saved["target"], test_set.labels)
    assert torch.equal(saved["pred"], probs.argmax(dim=-1)) and torch.equal(saved["top5"][:, 0], saved["pred"])


@pytest.mark.distributed
def test_quickstart_command_on_two_processes_ends_with_one_summary_and_a_quiet_console(tmp_path: Path) -> None:
    """README's first command as typed (custom_ddp, 2 processes started by popen, dataset=auto falling back to
    synthetic data), on tiny sizes, plus BenchmarkMonitor: what the console shows, and what it no longer shows."""
    command = [
        sys.executable, "train.py", "fit", "--config", "configs/quickstart.yaml",
        f"--data.data_dir={tmp_path / 'data'}", "--data.download=false",  # never fetch 160 MB in a test
        "--data.synthetic_train_size=400", "--data.synthetic_test_size=200", "--data.val_size=100",
        "--data.batch_size=32", "--data.eval_batch_size=50", "--trainer.max_epochs=1",
        "--trainer.limit_train_batches=3", "--trainer.log_every_n_steps=1", "--trainer.enable_progress_bar=false",
        f"--trainer.logger.init_args.save_dir={tmp_path}",
        "--trainer.callbacks+=BenchmarkMonitor", "--trainer.callbacks.warmup_steps=1",
    ]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    assert "GLOBAL_RANK: 1, MEMBER: 2/2" in output  # the popen launcher started rank 1, which re-ran the CLI
    run_dir = tmp_path / "lightning_logs" / "version_0"
    # The summary: once (rank 0), with the accuracy, the wall time, SYNTHETIC said loudly, the logs, the checkpoint.
    assert output.count("lit-cifar fit done: custom_ddp on 2 process(es), wall time ") == 1
    assert "  validation  top-1 " in output and ", top-5 " in output
    assert "  data        SYNTHETIC stand-in (dataset=auto fell back: real CIFAR-100 not available)" in output
    assert f"  TensorBoard tensorboard --logdir {tmp_path / 'lightning_logs'}   (this run: {run_dir})" in output
    assert f"  checkpoint  {run_dir / 'checkpoints' / 'last.ckpt'}" in output
    assert (run_dir / "checkpoints" / "last.ckpt").is_file() and (run_dir / "benchmark.json").is_file()
    # The fallback banner once, without the warning call's source line under it.
    assert output.count("FALLING BACK TO SYNTHETIC DATA") == 1 and "rank_zero_warn(" not in output
    assert "💡 Tip" not in output  # Lightning's litlogger / litmodels adverts
    # No warning on either rank but the fallback banner (a header line naming where prepare_data was called, then it).
    lines = output.splitlines()
    (header,) = [i for i, line in enumerate(lines) if _WARNING_LINE.search(line)]
    assert lines[header + 1] == "!" * 78, output
    assert not [line for line in output.splitlines() if "all_gather" in line and "deprecated" in line]
    total_flops = [line for line in output.splitlines() if line.endswith("Total Flops")]
    assert len(total_flops) == 1 and not total_flops[0].startswith("0 "), total_flops


def test_lightning_tips_are_dropped_and_other_messages_kept() -> None:
    # train.py's import installed the filter; a handler on the logger sees what passes it.
    import logging

    from lightning.pytorch import Trainer

    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logger = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    logger.addHandler(handler)
    try:
        Trainer(accelerator="cpu", logger=False, enable_checkpointing=True)  # litlogger tip at construction
    finally:
        logger.removeHandler(handler)
    assert any(message.startswith("GPU available") for message in seen)
    assert not any("Tip" in message for message in seen), seen


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
        (["--trainer.strategy=custom_ddp", "--trainer.strategy.sync_mode=flat"],
         {"sync_mode": "flat", "start_method": "popen"}),
        (["--trainer.strategy", "custom_ddp_fork", "--trainer.strategy.zero1=true"],
         {"zero1": True, "start_method": "fork", "sync_mode": "bucketed"}),
        (["--trainer.strategy=custom_ddp_spawn", "--trainer.strategy.init_args.start_method=popen"],
         {"start_method": "popen"}),  # the user's option wins over the registered one
        (["--trainer.strategy=CustomDDPStrategy", "--trainer.strategy.bucket_cap_mb=4", "--trainer.strategy.timeout=90"],
         {"bucket_cap_mb": 4.0, "timeout": 90.0}),
    ],
    ids=["registered-name", "fork-name-space-separated", "user-wins", "short-class-name"],
)
def test_strategy_options_from_the_command_line(capsys: pytest.CaptureFixture, args: list[str], expected: dict) -> None:
    strategy = _print_config(capsys, "quickstart.yaml", extra=tuple(args))["trainer"]["strategy"]
    assert strategy["class_path"].endswith("CustomDDPStrategy")
    assert {key: strategy["init_args"][key] for key in expected} == expected


@pytest.mark.parametrize(("timeout", "seconds"), [("90", 90), ("2.5", 2.5), ("0:05:00", 300)])
def test_strategy_options_from_yaml_by_short_class_name(tmp_path: Path, timeout: str, seconds: float) -> None:
    config = tmp_path / "strategy.yaml"
    config.write_text("trainer:\n  strategy:\n    class_path: CustomDDPStrategy\n"
                      f"    init_args:\n      sync_mode: per_param\n      timeout: {timeout}\n")
    # A flag still overrides one option of it; the rest stays.
    cli = train.main(["--config", str(CONFIGS / "quickstart.yaml"), "--config", str(config),
                      "--trainer.strategy.zero1=true"], run=False)
    strategy = cli.trainer.strategy
    assert isinstance(strategy, CustomDDPStrategy)
    options = strategy.options
    assert (options.sync_mode, options.zero1, strategy._timeout) == ("per_param", True, timedelta(seconds=seconds))


def test_registered_name_without_options_stays_a_name(capsys: pytest.CaptureFixture) -> None:
    config = _print_config(capsys, "quickstart.yaml", extra=("--trainer.strategy=custom_ddp",))
    assert config["trainer"]["strategy"] == "custom_ddp"


def test_strategy_built_from_name_options_and_seconds() -> None:
    cli = train.main(["--config", str(CONFIGS / "quickstart.yaml"), "--trainer.strategy=custom_ddp_fork",
                      "--trainer.strategy.sync_mode=flat", "--trainer.strategy.timeout=90"], run=False)
    strategy = cli.trainer.strategy
    assert isinstance(strategy, CustomDDPStrategy) and strategy.options.sync_mode == "flat"
    assert strategy._timeout == timedelta(seconds=90) and strategy._start_method == "fork"


@pytest.mark.parametrize(
    ("options", "reason"),
    [
        # The strategy's own checks, which jsonargparse would fold into its 58-line Union report.
        (("--trainer.strategy.bucket_cap_mb=-1",), "CustomDDPStrategy: bucket_cap_mb=-1.0 must be a number > 0"),
        (("--trainer.strategy=custom_ddp", "--trainer.strategy.timeout=0"),
         "CustomDDPStrategy: timeout=0.0 must be > 0 seconds"),
        # A parse error inside the same Union, and one after 60 lines of usage: the innermost reason and its key.
        (("--trainer.strategy.sync_mode=foo",),
         "trainer.strategy.sync_mode: Expected a typing.Literal['bucketed', 'flat', 'per_param', 'per_param_overlap']"),
        (("--data.dataset=foo",), "data.dataset: Expected a typing.Literal['cifar100', 'synthetic', 'auto']"),
        # An innermost Union: what each of its types said.
        (("--trainer.strategy.timeout=abc",),
         "trainer.strategy.timeout: Expected a <class 'float'> / Not of type timedelta: Expected a string with form"),
        # The data's and the model's own checks (OptionError), raised while LightningCLI builds them.
        (("--data.batch_size=0",), "batch_size (0) and eval_batch_size (500) must be >= 1."),
        (("--model.net=foo",), "unknown net 'foo'; choose one of ['resnet18', 'template']."),
        (("--model.net_kwargs={\"widht\": 0.5}",),
         "model.net_kwargs {'widht': 0.5}: net 'template' takes no 'widht'; it takes ['dropout']"),
    ],
    ids=["strategy-check", "strategy-timeout", "strategy-literal", "data-literal", "strategy-union", "data-check",
         "model-check", "net-kwargs"],
)
def test_a_bad_option_is_reported_in_one_line(capsys: pytest.CaptureFixture, options: tuple[str, ...],
                                              reason: str) -> None:
    with pytest.raises(SystemExit) as exit_info:
        train.main(["--config", str(CONFIGS / "quickstart.yaml"), *options], run=False)
    assert exit_info.value.code == 2
    error, hint = _stderr_lines(capsys)  # nothing else
    assert error.startswith(f"error: {reason}"), error
    assert hint == "  (every option: python train.py --help; jsonargparse's full report: JSONARGPARSE_DEBUG=true)"


def test_the_hint_names_the_subcommand(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        train.main(["test", "--config", str(CONFIGS / "quickstart.yaml"), "--trainer.devices=1",
                    "--trainer.strategy=auto", "--trainer.nonsense=1"])
    assert _stderr_lines(capsys) == [
        "error: unrecognized arguments: --trainer.nonsense=1",
        "  (every option: python train.py test --help; jsonargparse's full report: JSONARGPARSE_DEBUG=true)",
    ]


def test_jsonargparse_debug_lets_the_full_report_through(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("JSONARGPARSE_DEBUG", "true")
    with pytest.raises(ArgumentError, match="Does not validate against any of the Union subtypes"):
        train.main(["--config", str(CONFIGS / "quickstart.yaml"), "--trainer.strategy.sync_mode=foo"], run=False)
    with pytest.raises(ValueError, match="bucket_cap_mb=-1.0 must be a number > 0"):
        train.main(["--config", str(CONFIGS / "quickstart.yaml"), "--trainer.strategy.bucket_cap_mb=-1"], run=False)


@pytest.mark.parametrize(
    ("flags", "save_dir"),
    [((), "."), (("--trainer.default_root_dir={tmp}/job",), "{tmp}/job"),
     (("--trainer.default_root_dir={tmp}/job", "--trainer.logger.init_args.save_dir={tmp}/logs"), "{tmp}/logs")],
    ids=["working-directory", "default-root-dir", "explicit-save-dir-wins"],
)
def test_the_logger_follows_default_root_dir_unless_given_its_own(tmp_path: Path, flags: tuple[str, ...],
                                                                  save_dir: str) -> None:
    cli = train.main(["--config", str(CONFIGS / "quickstart.yaml"), "--trainer.devices=1", "--trainer.strategy=auto",
                      *(flag.format(tmp=tmp_path) for flag in flags)], run=False)
    assert cli.trainer.logger.save_dir == save_dir.format(tmp=tmp_path)
    assert Path(cli.trainer.log_dir).parent == Path(save_dir.format(tmp=tmp_path)) / "lightning_logs"


def test_fit_test_predict_print_no_warning(tmp_path: Path, data_dir: Path) -> None:
    """README's fit, then test and predict of its checkpoint, on tiny data and one process (the 2-process quickstart
    test checks custom_ddp's fit console too): no console line is a warning. Gone: torch's LeafSpec deprecation from
    Lightning's _pytree (every run) and ModelCheckpoint's "The dirpath has changed" (test and predict). A new
    warning fails here."""
    common = [
        "--config", "configs/quickstart.yaml", "--trainer.devices=1", "--trainer.strategy=auto",
        f"--trainer.default_root_dir={tmp_path}",
        f"--data.data_dir={data_dir}", "--data.dataset=synthetic", "--data.synthetic_train_size=400",
        "--data.synthetic_test_size=200", "--data.val_size=100", "--data.batch_size=32", "--data.eval_batch_size=50",
        "--trainer.enable_progress_bar=false",
    ]
    checkpoint = tmp_path / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt"
    runs = {
        # log_every_n_steps=1: with 2 batches Lightning would rightly warn about the quickstart's 10.
        "fit": ["--trainer.max_epochs=1", "--trainer.limit_train_batches=2", "--trainer.log_every_n_steps=1"],
        "test": [f"--ckpt_path={checkpoint}"],
        "predict": [f"--ckpt_path={checkpoint}"],
    }
    for subcommand, flags in runs.items():
        done = subprocess.run([sys.executable, "train.py", subcommand, *common, *flags], cwd=REPO,
                              capture_output=True, text=True, timeout=300)
        output = done.stdout + done.stderr
        assert done.returncode == 0, output[-4000:]
        assert [line for line in output.splitlines() if _WARNING_LINE.search(line)] == [], f"{subcommand}:\n{output}"
