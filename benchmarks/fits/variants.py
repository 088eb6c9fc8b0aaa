"""What the fits benchmarks compare: each variant's ``train.py`` strategy flags, label and description
(:data:`VARIANTS`), and the per-net settings of a timed fit (:data:`NETS`; one GPU: :data:`GPU`, :data:`GPU_NETS`).
Shared by ``benchmarks.fits.compare`` and ``benchmarks.fits.paired_fits``."""

from __future__ import annotations

import os
from dataclasses import dataclass

from parallel.torch_compat import DDP_SYNC_BUFFERS

__all__ = ["BASE_CONFIG", "GPU", "GPU_NETS", "MATCHED_THREADS", "NETS", "VARIANTS", "Variant", "flag", "variants_for"]

MATCHED_THREADS = max(1, (os.cpu_count() or 1) // 2)  # Lightning's share for each of 2 processes
BASE_CONFIG = "configs/cifar100_template_net.yaml"
_CUSTOM, _DDP = "strategies.custom_ddp.CustomDDPStrategy", "lightning.pytorch.strategies.DDPStrategy"
# Per net: batch per process, warm-up and timed optimizer steps of a timing run. ResNet-18's CIFAR
# stem keeps 32x32 maps in its first stage: ~0.2 s per 8-image micro-batch on one core.
NETS = {
    "template": {"batch_size": 32, "warmup_steps": 3, "steps": 16},
    "resnet18": {"batch_size": 8, "warmup_steps": 2, "steps": 8},
}
# One GPU (issue 45): ResNet-18 at batch 256 in bf16, one process; its steps are bound by kernel launches (~20 ms).
GPU = {"accelerator": "gpu", "devices": 1, "precision": "bf16-mixed", "train_size": 36_000}
GPU_NETS = {"resnet18": {"batch_size": 256, "warmup_steps": 20, "steps": 100}}


@dataclass(frozen=True)
class Variant:
    """One compared configuration: a label, what it is, its ``train.py`` strategy flags, where it runs."""

    label: str
    description: str
    flags: tuple[str, ...]
    processes: int = 2
    threads: int | None = None  # OMP_NUM_THREADS of the run; None: the launcher's or torch's default
    nets: tuple[str, ...] = ("template", "resnet18")


def flag(name: str, value: object) -> str:
    """One ``--name=value`` flag as LightningCLI takes it (booleans lower-case)."""
    return f"--{name}={str(value).lower() if isinstance(value, bool) else value}"


def _strategy(path: str, **options: object) -> tuple[str, ...]:
    return (flag("trainer.strategy", path), *(flag(f"trainer.strategy.{k}", v) for k, v in options.items()))


VARIANTS: dict[str, Variant] = {
    "custom_ddp": Variant(
        "custom_ddp (SyncBN)",
        "hand-written SyncBatchNorm, bucketed accumulation-aware gradient sync (25 MiB buckets), "
        "broadcast_buffers=true (nothing to send: every buffer is a SyncBN statistic)",
        _strategy(_CUSTOM, sync_batchnorm=True, broadcast_buffers=True),
    ),
    "custom_ddp_compiled": Variant(
        "custom_ddp (SyncBN, compiled)",
        "syncbn_compile=true: the SyncBatchNorm passes torch.compile'd (compiled during the warm-up steps; "
        "inductor's disk cache shared by the runs)",
        _strategy(_CUSTOM, sync_batchnorm=True, syncbn_compile=True),
    ),
    # Compared with ddp_tuned, which broadcasts no buffers: the same setting on both sides.
    "custom_ddp_localbn": Variant(
        "custom_ddp (local BN)",
        "sync_batchnorm=false: local BatchNorm like ddp on CPU; broadcast_buffers=false like ddp tuned "
        "(forward_sync_buffers=false); grad_transport=auto: buckets summed in shared memory (one host)",
        _strategy(_CUSTOM, sync_batchnorm=False, broadcast_buffers=False),
    ),
    # The same with gloo summing the buckets over TCP loopback: what grad_transport=auto's shared memory changes.
    "custom_ddp_localbn_gloo": Variant(
        "custom_ddp (local BN, gloo transport)",
        "custom_ddp (local BN) with grad_transport=process_group: buckets summed by dist.all_reduce over gloo",
        _strategy(_CUSTOM, sync_batchnorm=False, broadcast_buffers=False, grad_transport="process_group"),
    ),
    "ddp_default": Variant(
        "ddp default (local BN)",
        "Lightning ddp as it comes: gradient_as_bucket_view=False, forward_sync_buffers=True (rank 0's BN buffers "
        "broadcast every forward)",
        _strategy(_DDP, gradient_as_bucket_view=False, **{DDP_SYNC_BUFFERS: True}),
    ),
    "ddp_tuned": Variant(
        "ddp tuned (local BN)",
        "gradient_as_bucket_view=True, forward_sync_buffers=False",
        _strategy(_DDP, gradient_as_bucket_view=True, **{DDP_SYNC_BUFFERS: False}),
    ),
    "custom_ddp_bf16": Variant(
        "custom_ddp (SyncBN), bf16 gradients",
        "grad_compression=bf16: buckets all-reduced in bfloat16 by gloo (compression turns grad_transport=auto's "
        "shared memory off: its ratio to custom_ddp includes the transport)",
        _strategy(_CUSTOM, sync_batchnorm=True, grad_compression="bf16"),
        nets=("resnet18",),
    ),
    "single_matched": Variant(
        f"1 process, {MATCHED_THREADS} thread{'s' * (MATCHED_THREADS > 1)}",
        "thread-matched to each 2-process rank: no communication",
        _strategy("auto"),
        1,
        MATCHED_THREADS,
    ),
    "single": Variant(
        "1 process, all cores",
        "torch's default threads: what a user of this machine would run instead",
        _strategy("auto"),
        1,
    ),
}


def variants_for(net: str) -> list[str]:
    """The variants timed on ``net``, in the interleaving order."""
    return [name for name, variant in VARIANTS.items() if net in variant.nets]
