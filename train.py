"""Train CIFAR-100 classifiers with PyTorch Lightning: the LightningCLI entry point of lit-cifar.

Every option of the Trainer, the model (``lit_cifar.module.LitClassifier``) and the data
(``lit_cifar.data.CIFAR100DataModule``) is a command-line flag or a YAML key; configs compose left
to right and flags override them. Runs log to TensorBoard under ``lightning_logs/version_N/``
(metrics, learning rate, hyperparameters including ``dataset_used``, the strategy and its options,
and the full ``config.yaml``), next to their checkpoints, ``benchmark.json`` and ``predictions.pt``.
As in plain Lightning, ``--trainer.default_root_dir=DIR`` puts all of it under ``DIR/lightning_logs/``
(one folder per job); ``--trainer.logger.init_args.save_dir`` still chooses the logger's folder itself.
A bad option ends the command with one line saying why (``error: ...``, exit code 2);
``JSONARGPARSE_DEBUG=true`` shows jsonargparse's full report and the traceback instead.
The optimizer and LR schedule are the model's own options (``--model.optimizer``, ``--model.lr``,
``--model.schedule``, ...); LightningCLI's generic ``--optimizer``/``--lr_scheduler`` are refused
because they would silently replace its schedule and its no-weight-decay groups.

The quickstart: the hand-written ``custom_ddp`` strategy on 2 CPU processes, about a minute on 2
cores; trains on synthetic data (with a loud warning) when CIFAR-100 cannot be had offline, and
ends with a summary from rank 0 (validation top-1/top-5, wall time, the data actually used, where
the TensorBoard logs and the checkpoint are):
    python train.py fit --config configs/quickstart.yaml

The same on one process, or with Lightning's DDP (gloo) instead of custom_ddp:
    python train.py fit --config configs/quickstart.yaml --trainer.devices=1 --trainer.strategy=auto
    python train.py fit --config configs/quickstart.yaml --config configs/ddp_cpu.yaml

More of the hand-written data-parallel strategy (see docs/strategy.md):
    python train.py fit --config configs/quickstart.yaml --trainer.strategy.sync_mode=flat
    python train.py fit --config configs/custom_ddp_cpu.yaml   # 2 CPU processes, accumulate 2, every option shown
Its options follow the registered name (custom_ddp, custom_ddp_fork, custom_ddp_spawn) on the command
line; in YAML, and anywhere else, use the short class name CustomDDPStrategy as class_path:
    python train.py fit --config configs/custom_ddp_cpu.yaml --trainer.strategy=custom_ddp \\
        --trainer.strategy.sync_mode=flat --trainer.strategy.timeout=600    # timeout: seconds or h:m:s
    trainer: {strategy: {class_path: CustomDDPStrategy, init_args: {sync_mode: flat, timeout: 600}}}
(A YAML ``strategy: custom_ddp`` is a plain name: flags cannot add options to it.)

Real CIFAR-100, ResNet-18 on every GPU of one machine (Lightning launches the processes):
    python train.py fit --config configs/cifar100_resnet18.yaml --data.download=true

Multi-GPU / multi-node with torchrun (Lightning detects the torchrun environment; per node):
    torchrun --nnodes=2 --nproc-per-node=8 --node-rank=$NODE_RANK \\
        --master-addr=$MASTER_ADDR --master-port=29500 \\
        train.py fit --config configs/cifar100_resnet18.yaml --trainer.num_nodes=2 --trainer.devices=8

Stopping a custom_ddp fit: SIGTERM (SLURM, Kubernetes, torchrun), Ctrl+C or SIGUSR1 on any one process stops
every process after the same optimizer step; rank 0 prints the checkpoint it wrote (the ModelCheckpoint's
last.ckpt) and the exit status is 128 + the signal number (SIGTERM: 143). Resume from it:
    python train.py fit --config configs/quickstart.yaml --ckpt_path lightning_logs/version_0/checkpoints/last.ckpt
A collective only some processes issue waits for the timeout; with --trainer.strategy.desync_check=true it is
an error naming both sides instead (docs/stopping-and-resuming.md). A process that stops making progress (stopped,
looping, a blocked DataLoader) ends every process after --trainer.strategy.stall_timeout seconds (default 300)
with exit status 75 and one report from rank 0 naming it. The start waits for every process up to
--trainer.strategy.startup_timeout (default: the longer of the timeout and 30 min), not the collective timeout.

Restarts that resume: --ckpt_path=last resumes from the run's newest last.ckpt and starts fresh when there is
none yet, so one command serves the first run and every restart of torch elastic (or a SLURM requeue, see
docs/stopping-and-resuming.md):
    torchrun --standalone --nproc-per-node=2 --max-restarts=3 train.py fit --config configs/quickstart.yaml \
        --ckpt_path=last

The assignment's template net (batch 32, 2 processes, gradient accumulation 2, 20 epochs):
    python train.py fit --config configs/cifar100_template_net.yaml

Evaluate a checkpoint on the 10k test images; predict them; inspect the resolved configuration:
    python train.py test --config configs/quickstart.yaml --ckpt_path lightning_logs/version_0/checkpoints/last.ckpt
    python train.py predict --config configs/quickstart.yaml --ckpt_path lightning_logs/version_0/checkpoints/last.ckpt
    python train.py fit --config configs/quickstart.yaml --print_config
``predict`` writes ``predictions.pt`` into its run folder and prints the path (``callbacks.PredictionWriter``,
added unless the config has a prediction writer): ``torch.load`` gives ``index``, ``pred`` (top-1 class),
``top5``, ``probs`` (softmax) and ``target`` (label), one row per image in dataset order, merged over
processes. ``--data.predict_split=val|train`` predicts another split; add the writer yourself to choose
the file or one file per process: ``--trainer.callbacks+=PredictionWriter --trainer.callbacks.merge=false``.

Watch the runs; the HPARAMS tab compares them by strategy and its options, world size, data used
(``callbacks.RunHparams``, added to every fit / validate / test):
    tensorboard --logdir lightning_logs
"""

from __future__ import annotations

import sys
import time
from typing import Any

_PROCESS_START = time.perf_counter()  # before the heavy imports: the summary's wall time includes them

from jsonargparse import Namespace
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import BasePredictionWriter
from lightning.pytorch.cli import ArgsType, LightningArgumentParser, LightningCLI
from lightning.pytorch.strategies import StrategyRegistry

import strategies  # noqa: F401  (registers the "custom_ddp" strategy name)

# Every project callback imported (callbacks/ loads them lazily), so configs may name it by its short class name.
from callbacks import BenchmarkMonitor, CollectiveCounter, PredictionWriter, RunHparams  # noqa: F401
from callbacks.run_hparams import strategy_name
from lit_cifar.cli.console import quiet_checkpoint_dirpath_warning, quiet_leafspec_deprecation, quiet_lightning_tips
from lit_cifar.cli.fit_summary import fit_summary
from lit_cifar.cli.option_errors import check_strategy_config, short_option_errors
from lit_cifar.cli.run_dir import DEFAULT_SAVE_DIR, follow_default_root_dir, resume_last_version
from lit_cifar.data import CIFAR100DataModule
from lit_cifar.module import LitClassifier
from strategies import CustomDDPStrategy
from strategies.options import check_init_args

quiet_lightning_tips()  # Lightning's "💡 Tip" adverts for litlogger / litmodels, on every run
quiet_leafspec_deprecation()  # Lightning 2.6's use of torch 2.14's deprecated LeafSpec, once per process

TRAINER_DEFAULTS = {
    "logger": {
        "class_path": "lightning.pytorch.loggers.TensorBoardLogger",
        # hp_metric=False: no placeholder "-1" metric next to the real hparams in TensorBoard.
        # save_dir: the working directory, or --trainer.default_root_dir (lit_cifar.cli.run_dir).
        "init_args": {"save_dir": DEFAULT_SAVE_DIR, "name": "lightning_logs", "default_hp_metric": False},
    },
}
_STRATEGY = "--trainer.strategy"
_OPTIMIZER_HELP = (
    "the optimizer and its LR schedule are configured in one place, LitClassifier's own arguments "
    "(weight decay never on biases and norm parameters, a per-step schedule): use --model.optimizer=sgd|adamw, "
    "--model.lr, --model.momentum, --model.nesterov, --model.weight_decay, --model.schedule=cosine|onecycle|none "
    "and --model.warmup_fraction."
)


def _custom_ddp_names() -> dict[str, tuple[type, dict[str, Any]]]:
    """Registered names of CustomDDPStrategy (custom_ddp, _fork, _spawn) -> (class, registered init args)."""
    return {
        name: (entry["strategy"], entry["init_params"])
        for name, entry in StrategyRegistry.items()
        if isinstance(entry["strategy"], type) and issubclass(entry["strategy"], CustomDDPStrategy)
    }


def _expand_strategy_name(argv: list[str]) -> list[str]:
    """``--trainer.strategy=custom_ddp`` + ``--trainer.strategy.<option>=...`` -> the class-path form.

    jsonargparse takes strategy options only after a class path: after a registered name (parsed as
    a plain string) it fails with "Expected a dot import path". When options are given, the name
    becomes its class path plus the init args it was registered with (``custom_ddp_fork`` ->
    ``start_method=fork``), placed before the user's options so theirs win. Without options the
    name is kept as typed, so configs record ``custom_ddp``.
    """
    if not any(arg.startswith(f"{_STRATEGY}.") and not arg.startswith(f"{_STRATEGY}.help") for arg in argv):
        return argv
    names, expanded, i = _custom_ddp_names(), [], 0
    while i < len(argv):
        flag, sep, value = argv[i].partition("=")
        width = 2 if flag == _STRATEGY and not sep and i + 1 < len(argv) else 1  # "--trainer.strategy NAME"
        value = argv[i + 1] if width == 2 else value
        entry = names.get(value.lower()) if flag == _STRATEGY else None  # the Trainer lower-cases names too
        if entry is None:
            expanded += argv[i : i + width]
        else:
            cls, init_params = entry
            expanded.append(f"{_STRATEGY}={cls.__module__}.{cls.__qualname__}")
            expanded += [f"{_STRATEGY}.{key}={val}" for key, val in init_params.items()]
        i += width
    return expanded


class LitCifarCLI(LightningCLI):
    """LightningCLI with strategy options by registered name, no optimizer flags, its logger under
    default_root_dir, run hyperparameters in TensorBoard, a summary after fit, and a predictions file."""

    def __init__(self, *args: Any, started: float | None = None, **kwargs: Any) -> None:
        self.started = time.perf_counter() if started is None else started
        super().__init__(*args, **kwargs)

    def parse_arguments(self, parser: LightningArgumentParser, args: ArgsType) -> None:
        if isinstance(args, (dict, Namespace)):
            super().parse_arguments(parser, args)
            return
        argv = list(sys.argv[1:] if args is None else args)
        # auto_configure_optimizers=False already makes these unknown; say what to use instead.
        refused = [arg for arg in argv if arg.partition("=")[0].split(".")[0] in ("--optimizer", "--lr_scheduler")]
        if refused:
            parser.error(f"{refused[0]} is not an option here: {_OPTIMIZER_HELP}")
        expanded = _expand_strategy_name(argv)
        if args is None and expanded != argv:
            # LightningCLI's own parse of a list, minus its warning about args given next to sys.argv
            # (they ARE sys.argv, rewritten). sys.argv stays as typed: the popen launcher re-runs it.
            self.config = parser.parse_args(expanded)
        else:
            super().parse_arguments(parser, None if args is None else expanded)

    def before_instantiate_classes(self) -> None:
        """The logger follows ``default_root_dir``; ``CustomDDPStrategy``'s options are checked."""
        config = self.config[self.subcommand] if self.subcommand else self.config
        follow_default_root_dir(config.trainer)
        if self.subcommand == "fit":  # --ckpt_path=last: the run's newest last.ckpt, or a fresh start
            resume_last_version(config.trainer, config.get("ckpt_path"))
        # Before jsonargparse builds the strategy: it would bury this error in a report of its Union type.
        check_strategy_config(config.trainer.strategy, CustomDDPStrategy, check_init_args)

    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        trainer = super().instantiate_trainer(**kwargs)
        if self.subcommand in ("validate", "test", "predict"):
            quiet_checkpoint_dirpath_warning()  # a ModelCheckpoint saves nothing here (lit_cifar.cli.console)
        # `predict` always leaves a file (and says where), unless the config chose its own writer.
        if self.subcommand == "predict" and not any(isinstance(cb, BasePredictionWriter) for cb in trainer.callbacks):
            trainer.callbacks.append(PredictionWriter())
        # Every fit / validate / test shows up in TensorBoard's HPARAMS tab with its strategy and options.
        if self.subcommand in ("fit", "validate", "test") and not any(
            isinstance(cb, RunHparams) for cb in trainer.callbacks
        ):
            trainer.callbacks.append(RunHparams())
        return trainer

    def after_fit(self) -> None:
        """Rank 0 ends the fit with :func:`fit_summary` (the other ranks print nothing)."""
        if self.trainer.is_global_zero:
            wall_s, strategy = time.perf_counter() - self.started, strategy_name(self.trainer.strategy)
            print(fit_summary(self.trainer, self.datamodule, wall_s, strategy), flush=True)


def _help_command(args: ArgsType) -> str:
    """``python train.py [SUBCOMMAND] --help`` for the subcommand in ``args`` (default: ``sys.argv``)."""
    argv = sys.argv[1:] if args is None else args
    subcommand = argv[0] if isinstance(argv, list) and argv and argv[0] in LightningCLI.subcommands() else None
    return " ".join(word for word in ("python train.py", subcommand, "--help") if word)


def main(args: ArgsType = None, run: bool = True, started: float | None = None) -> LightningCLI:
    """Parse ``args`` (default: ``sys.argv``), build model, data and Trainer, and run the subcommand.

    ``run=False`` only builds them (``args`` then has no subcommand). ``started``: the
    ``time.perf_counter()`` the fit summary's wall time counts from (default: now).
    """
    # A bad option ends in one line saying why (lit_cifar.cli.option_errors), not in jsonargparse's usage dump.
    with short_option_errors(help_command=_help_command(args)):
        return LitCifarCLI(
            LitClassifier,
            CIFAR100DataModule,
            trainer_defaults=TRAINER_DEFAULTS,
            seed_everything_default=0,
            save_config_kwargs={"overwrite": True},
            # The module's configure_optimizers is the only optimizer setup: LightningCLI's automatic
            # --optimizer/--lr_scheduler would silently replace its schedule and no-decay groups.
            auto_configure_optimizers=False,
            # Parse errors are raised (ArgumentError) for short_option_errors instead of printed with the usage.
            parser_kwargs={"exit_on_error": False},
            args=args,
            run=run,
            started=started,
        )


if __name__ == "__main__":
    main(started=_PROCESS_START)
