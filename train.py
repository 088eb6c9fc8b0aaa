"""Train CIFAR-100 classifiers with PyTorch Lightning: the LightningCLI entry point of lit-cifar.

Every option of the Trainer, the model (``lit_cifar.module.LitClassifier``) and the data
(``lit_cifar.data.CIFAR100DataModule``) is a command-line flag or a YAML key; configs compose left
to right and flags override them. Runs log to TensorBoard under ``lightning_logs/version_N/``
(metrics, learning rate, hyperparameters including ``dataset_used``, and the full ``config.yaml``).

One process (CPU or one GPU); trains on synthetic data when CIFAR-100 cannot be had offline:
    python train.py fit --config configs/quickstart.yaml

Two CPU processes with Lightning's DDP (gloo), on one machine:
    python train.py fit --config configs/quickstart.yaml --config configs/ddp_cpu.yaml

The hand-written data-parallel strategy instead of Lightning's (see README, "The custom_ddp strategy"):
    python train.py fit --config configs/quickstart.yaml --config configs/ddp_cpu.yaml --trainer.strategy=custom_ddp
    python train.py fit --config configs/custom_ddp_cpu.yaml   # 2 CPU processes, accumulate 2, every option shown

Real CIFAR-100, ResNet-18 on every GPU of one machine (Lightning launches the processes):
    python train.py fit --config configs/cifar100_resnet18.yaml --data.download=true

Multi-GPU / multi-node with torchrun (Lightning detects the torchrun environment; per node):
    torchrun --nnodes=2 --nproc-per-node=8 --node-rank=$NODE_RANK \\
        --master-addr=$MASTER_ADDR --master-port=29500 \\
        train.py fit --config configs/cifar100_resnet18.yaml --trainer.num_nodes=2 --trainer.devices=8

The assignment's template net (batch 32, 2 processes, gradient accumulation 2, 20 epochs):
    python train.py fit --config configs/cifar100_template_net.yaml

Evaluate a checkpoint on the 10k test images; inspect the resolved configuration:
    python train.py test --config configs/quickstart.yaml --ckpt_path lightning_logs/version_0/checkpoints/last.ckpt
    python train.py fit --config configs/quickstart.yaml --print_config

Watch the runs:
    tensorboard --logdir lightning_logs
"""

from __future__ import annotations

from lightning.pytorch.cli import ArgsType, LightningCLI

import callbacks  # noqa: F401  (project callbacks, importable by short name in configs)
import strategies  # noqa: F401  (registers the "custom_ddp" strategy name)
from lit_cifar.data import CIFAR100DataModule
from lit_cifar.module import LitClassifier

TRAINER_DEFAULTS = {
    "logger": {
        "class_path": "lightning.pytorch.loggers.TensorBoardLogger",
        # hp_metric=False: no placeholder "-1" metric next to the real hparams in TensorBoard.
        "init_args": {"save_dir": ".", "name": "lightning_logs", "default_hp_metric": False},
    },
}


def main(args: ArgsType = None) -> LightningCLI:
    """Parse ``args`` (default: ``sys.argv``), build model, data and Trainer, and run the subcommand."""
    return LightningCLI(
        LitClassifier,
        CIFAR100DataModule,
        trainer_defaults=TRAINER_DEFAULTS,
        seed_everything_default=0,
        save_config_kwargs={"overwrite": True},
        args=args,
    )


if __name__ == "__main__":
    main()
