"""train.py run as users run it: --print_config from the command line, fit and predict through the CLI (under
--trainer.default_root_dir), the quickstart command on 2 processes (its summary, its console), fit/test/predict
without a stray warning, Lightning's tips dropped, the logger's folder. Parsing the configs and options, and
errors: ``tests/cli/test_train_cli_options.py``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from entry_points import run_python, train_py, train_py_on_two_processes
from train_cli_helpers import CONFIGS, TINY_ARGS, WARNING_LINE

import train
from lit_cifar.data import CIFAR100DataModule
from lit_cifar.module import LitClassifier
from lit_cifar.transforms import normalize


@pytest.mark.slow  # the quickstart and fit/test/predict tests run the entry point too; print_config is parsed
# in this process by test_train_cli_options
def test_print_config_from_the_command_line() -> None:
    # The real entry point, as README shows it (a subprocess: argv parsing, imports, exit code).
    result = run_python("train.py", "fit", "--config", "configs/quickstart.yaml", "--print_config")
    config = yaml.safe_load(result.stdout)
    assert config["model"]["net"] == "template" and config["data"]["dataset"] == "auto"
    assert config["trainer"]["logger"]["class_path"] == "lightning.pytorch.loggers.TensorBoardLogger"


# In this process: the quickstart's 2 popen processes would re-run pytest's own command line.
ONE_PROCESS_TINY_ARGS = [*TINY_ARGS, "--trainer.devices=1", "--trainer.strategy=auto"]


@pytest.fixture(scope="module")
def fit_run(tmp_path_factory: pytest.TempPathFactory, data_dir: Path) -> tuple:
    """One 2-step fit through the CLI on TINY data, one process, in a job folder: (cli, root_dir)."""
    root_dir = tmp_path_factory.mktemp("job")
    cli = train.main(
        [
            "fit",
            "--config",
            str(CONFIGS / "quickstart.yaml"),
            *ONE_PROCESS_TINY_ARGS,
            f"--data.data_dir={data_dir}",
            "--trainer.max_epochs=1",
            "--trainer.limit_train_batches=2",
            f"--trainer.default_root_dir={root_dir}",
            "--trainer.callbacks+=BenchmarkMonitor",
            "--trainer.callbacks.warmup_steps=1",
        ]
    )
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
    summary = train.fit_summary(cli.trainer, cli.datamodule, wall_s=1.0, strategy="auto")
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
    cli = train.main(
        [
            "predict",
            "--config",
            str(CONFIGS / "quickstart.yaml"),
            *ONE_PROCESS_TINY_ARGS,
            f"--data.data_dir={data_dir}",
            "--data.eval_batch_size=48",
            f"--trainer.default_root_dir={root_dir}",
            f"--ckpt_path={checkpoint}",
        ]
    )
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


@pytest.mark.long
@pytest.mark.distributed
def test_quickstart_command_on_two_processes_ends_with_one_summary_and_a_quiet_console(tmp_path: Path) -> None:
    """README's first command as typed (custom_ddp, 2 processes started by popen, dataset=auto falling back to
    synthetic data), on tiny sizes, plus BenchmarkMonitor: what the console shows, and what it no longer shows."""
    output = train_py_on_two_processes(
        "fit",
        "--config",
        "configs/quickstart.yaml",
        f"--data.data_dir={tmp_path / 'data'}",
        "--data.download=false",  # never fetch 160 MB in a test
        "--data.synthetic_train_size=400",
        "--data.synthetic_test_size=200",
        "--data.val_size=100",
        "--data.batch_size=32",
        "--data.eval_batch_size=50",
        "--trainer.max_epochs=1",
        "--trainer.limit_train_batches=3",
        "--trainer.log_every_n_steps=1",
        "--trainer.enable_progress_bar=false",
        f"--trainer.logger.init_args.save_dir={tmp_path}",
        "--trainer.callbacks+=BenchmarkMonitor",
        "--trainer.callbacks.warmup_steps=1",
    )
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
    (header,) = [i for i, line in enumerate(lines) if WARNING_LINE.search(line)]
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


@pytest.mark.parametrize(
    ("flags", "save_dir"),
    [
        ((), "."),
        (("--trainer.default_root_dir={tmp}/job",), "{tmp}/job"),
        (("--trainer.default_root_dir={tmp}/job", "--trainer.logger.init_args.save_dir={tmp}/logs"), "{tmp}/logs"),
    ],
    ids=["working-directory", "default-root-dir", "explicit-save-dir-wins"],
)
def test_the_logger_follows_default_root_dir_unless_given_its_own(
    tmp_path: Path, flags: tuple[str, ...], save_dir: str
) -> None:
    cli = train.main(
        [
            "--config",
            str(CONFIGS / "quickstart.yaml"),
            "--trainer.devices=1",
            "--trainer.strategy=auto",
            *(flag.format(tmp=tmp_path) for flag in flags),
        ],
        run=False,
    )
    assert cli.trainer.logger.save_dir == save_dir.format(tmp=tmp_path)
    assert Path(cli.trainer.log_dir).parent == Path(save_dir.format(tmp=tmp_path)) / "lightning_logs"


@pytest.mark.long
def test_test_prints_no_warning(tmp_path: Path, data_dir: Path, fit_run: tuple) -> None:
    """``train.py test`` of a fit's checkpoint (the module's one-process CLI fit), on tiny data, in a process of its
    own: no console line is a warning (the fit's console: the 2-process quickstart test; predict's: the 2-process
    predict test of tests/cli/test_custom_ddp_cli.py). Gone: torch's LeafSpec deprecation from Lightning's _pytree
    (every run) and ModelCheckpoint's "The dirpath has changed" (the checkpoint's job folder is not this one). A
    new warning fails here."""
    _, fit_root = fit_run
    args = [
        "--config",
        "configs/quickstart.yaml",
        "--trainer.devices=1",
        "--trainer.strategy=auto",
        f"--trainer.default_root_dir={tmp_path}",
        f"--data.data_dir={data_dir}",
        "--data.dataset=synthetic",
        "--data.synthetic_train_size=400",
        "--data.synthetic_test_size=200",
        "--data.val_size=100",
        "--data.batch_size=32",
        "--data.eval_batch_size=50",
        "--trainer.enable_progress_bar=false",
        f"--ckpt_path={fit_root / 'lightning_logs' / 'version_0' / 'checkpoints' / 'last.ckpt'}",
    ]
    output = train_py("test", *args)
    assert [line for line in output.splitlines() if WARNING_LINE.search(line)] == [], output
