"""How compare drives its runs: fresh ``python train.py fit`` processes, as a user types them, per
variant of :data:`VARIANTS`; a timed fit, a collective count and a full-schedule accuracy fit. The
flags of a timed fit (:func:`fit_flags`, :func:`short_fit_flags`, :func:`monitor_flags`), its reading
(:func:`read_monitor`) and :func:`call_logged` serve ``benchmarks.paired_fits`` too, which runs the fits in-process."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.harness import slowest_rank
from benchmarks.launcher import without_launch_variables

REPO_ROOT = Path(__file__).resolve().parents[1]
MATCHED_THREADS = max(1, (os.cpu_count() or 1) // 2)  # Lightning's share for each of 2 processes
BASE_CONFIG = "configs/cifar100_template_net.yaml"
_CUSTOM, _DDP = "strategies.custom_ddp.CustomDDPStrategy", "lightning.pytorch.strategies.DDPStrategy"


@dataclass(frozen=True)
class Variant:
    """One compared configuration: a label, what it is, its ``train.py`` strategy flags, where it runs."""

    label: str
    description: str
    flags: tuple[str, ...]
    processes: int = 2
    threads: int | None = None  # OMP_NUM_THREADS of the run; None: the launcher's or torch's default
    nets: tuple[str, ...] = ("template", "resnet18")


def _flag(name: str, value: object) -> str:
    return f"--{name}={str(value).lower() if isinstance(value, bool) else value}"


def _strategy(path: str, **options: object) -> tuple[str, ...]:
    return (_flag("trainer.strategy", path), *(_flag(f"trainer.strategy.{k}", v) for k, v in options.items()))


VARIANTS: dict[str, Variant] = {
    "custom_ddp": Variant(
        "custom_ddp (SyncBN)",
        "hand-written SyncBatchNorm, bucketed accumulation-aware gradient "
        "sync (25 MiB buckets), broadcast_buffers=true (nothing to send: every buffer is a SyncBN "
        "statistic)",
        _strategy(_CUSTOM, sync_batchnorm=True, broadcast_buffers=True),
    ),
    "custom_ddp_compiled": Variant(
        "custom_ddp (SyncBN, compiled)",
        "syncbn_compile=true: the SyncBatchNorm passes "
        "torch.compile'd (compiled during the warm-up steps; inductor's disk cache shared by "
        "the runs)",
        _strategy(_CUSTOM, sync_batchnorm=True, syncbn_compile=True),
    ),
    # Compared with ddp_tuned, which broadcasts no buffers: the same setting on both sides.
    "custom_ddp_localbn": Variant(
        "custom_ddp (local BN)",
        "sync_batchnorm=false: local BatchNorm like ddp on CPU; "
        "broadcast_buffers=false like ddp tuned (forward_sync_buffers=false); "
        "grad_transport=auto: buckets summed in shared memory (one host)",
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
        "Lightning ddp as it comes: gradient_as_bucket_view=False, "
        "forward_sync_buffers=True (rank 0's BN buffers broadcast every forward)",
        _strategy(_DDP, gradient_as_bucket_view=False, forward_sync_buffers=True),
    ),
    "ddp_tuned": Variant(
        "ddp tuned (local BN)",
        "gradient_as_bucket_view=True, forward_sync_buffers=False",
        _strategy(_DDP, gradient_as_bucket_view=True, forward_sync_buffers=False),
    ),
    "custom_ddp_bf16": Variant(
        "custom_ddp (SyncBN), bf16 gradients",
        "grad_compression=bf16: buckets all-reduced "
        "in bfloat16 by gloo (compression turns grad_transport=auto's shared memory off: its "
        "ratio to custom_ddp includes the transport)",
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


def call_logged(command: list[str], log: Path, timeout_s: float, threads: int | None) -> float:
    """Run ``command`` from the repository root with ``threads`` intra-op threads (None: its launcher's or
    torch's default) and no inherited launch variables, output to ``log``; raise with its tail on failure."""
    env = {k: v for k, v in without_launch_variables(dict(os.environ)).items() if k != "OMP_NUM_THREADS"} | (
        {"OMP_NUM_THREADS": str(threads)} if threads else {}
    )
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("$ " + shlex.join(command) + "\n")
    start = time.perf_counter()
    with open(log, "a") as out:  # a run past ``timeout_s`` raises subprocess.TimeoutExpired, naming the command
        code = subprocess.call(command, stdout=out, stderr=subprocess.STDOUT, timeout=timeout_s, env=env)
    if code != 0:
        tail = "\n".join(log.read_text().splitlines()[-30:])
        raise RuntimeError(f"run failed ({code}): {shlex.join(command)}\nlast lines of {log}:\n{tail}")
    return time.perf_counter() - start


def run_settings(out: Path, quick: bool) -> dict[str, Any]:
    """The runs' folder (relative to the repository root, where they start, when inside it) and their data:
    ``--quick``'s tiny synthetic sets kept in its own folder, full ones in the checkout's ``data/``."""
    out = out.resolve()
    return {
        "out": str(out.relative_to(REPO_ROOT)) if out.is_relative_to(REPO_ROOT) else str(out),
        "train_size": 640 if quick else 6_000,
        "test_size": 64 if quick else 1_000,
        **({"data_dir": str(out / "data")} if quick else {}),
    }


def fit_flags(
    cfg: dict[str, Any], net: str, variant: str, accumulate: int, flags: dict[str, object], *callback: str
) -> list[str]:
    """The ``train.py fit`` options of ``variant``: the shared flags, ``flags`` and ``callback``."""
    v = VARIANTS[variant]
    shared = {
        "config": BASE_CONFIG,
        "seed_everything": 0,
        "model.net": net,
        "data.dataset": "synthetic",
        "data.batch_size": cfg["nets"][net]["batch_size"],
        "data.val_size": 0.1,
        "data.synthetic_train_size": cfg["train_size"],
        "data.synthetic_test_size": cfg["test_size"],
        "trainer.accelerator": "cpu",
        "trainer.enable_progress_bar": False,
        "trainer.enable_model_summary": False,
    }
    kwargs = {} if net == "template" else {"model.net_kwargs": "{}"}  # the base config's are the template's
    data = {"data.data_dir": cfg["data_dir"]} if "data_dir" in cfg else {}  # see run_settings
    own = {"trainer.devices": v.processes, "trainer.accumulate_grad_batches": accumulate} | flags
    return [
        *(_flag(k, x) for k, x in (shared | kwargs | data).items()),
        *v.flags,
        *(_flag(k, x) for k, x in own.items()),
        *callback,
    ]


def _fit(
    cfg: dict[str, Any], net: str, variant: str, accumulate: int, name: str, flags: dict[str, object], *callback: str
) -> tuple[str, float]:
    """``train.py fit`` of ``variant`` (:func:`fit_flags`) in a fresh process; its command and wall time."""
    command = [sys.executable, "train.py", "fit", *fit_flags(cfg, net, variant, accumulate, flags, *callback)]
    wall_s = call_logged(
        command, Path(cfg["out"], "logs", f"{name}.txt"), cfg["run_timeout_s"], VARIANTS[variant].threads
    )
    return shlex.join(command[1:]), wall_s


def short_fit_flags(run_dir: Path, accumulate: int, steps: int) -> dict[str, object]:
    """One epoch of ``steps`` optimizer steps in ``run_dir``, without validation, checkpoint or logger."""
    return {
        "trainer.max_epochs": 1,
        "trainer.limit_train_batches": accumulate * steps,
        "trainer.limit_val_batches": 0,
        "trainer.num_sanity_val_steps": 0,
        "trainer.enable_checkpointing": False,
        "trainer.logger": False,
        "trainer.default_root_dir": run_dir,
    }


def _short_fit(
    cfg: dict[str, Any], net: str, variant: str, accumulate: int, name: str, steps: int, *callback: str
) -> tuple[str, float, Path]:
    """:func:`short_fit_flags` in ``out/work/<name>``; ``callback`` replaces the base config's (a checkpoint
    and an LR monitor need what is off here)."""
    run_dir = Path(cfg["out"], "work", name)
    shutil.rmtree(run_dir, ignore_errors=True)
    return *_fit(cfg, net, variant, accumulate, name, short_fit_flags(run_dir, accumulate, steps), *callback), run_dir


def monitor_flags(warmup_steps: int) -> tuple[str, str]:
    """``BenchmarkMonitor`` as the fit's only callback, leaving ``warmup_steps`` out of its statistics."""
    return "--trainer.callbacks=callbacks.BenchmarkMonitor", _flag("trainer.callbacks.warmup_steps", warmup_steps)


def read_monitor(run_dir: Path, micro_batches: bool = False) -> dict[str, Any]:
    """A timed fit's intra-op threads and per-step seconds (the slowest rank's), with ``micro_batches`` its
    per-micro-batch seconds too (the slowest rank's, in order), from its ``benchmark.json``; removes ``run_dir``."""
    monitor = json.loads((run_dir / "benchmark.json").read_text())
    shutil.rmtree(run_dir, ignore_errors=True)
    micro = {"micro_batch_s": slowest_rank(monitor["micro_batch_s_per_rank"])} if micro_batches else {}
    return {
        "threads": monitor["run"]["intra_op_threads"],
        "step_s": slowest_rank(monitor["step_s_per_rank"]),
        **micro,
        "recorded": monitor["run"],
    }


def timing_run(cfg: dict[str, Any], net: str, variant: str, accumulate: int) -> dict[str, Any]:
    """One short timed fit: command, wall time, intra-op threads and per-step seconds (the slowest rank's)."""
    setting = cfg["nets"][net]
    command, wall_s, run_dir = _short_fit(
        cfg,
        net,
        variant,
        accumulate,
        f"{net}_{variant}_acc{accumulate}",
        setting["warmup_steps"] + setting["steps"],
        *monitor_flags(setting["warmup_steps"]),
    )
    return {"command": command, "wall_s": wall_s, **read_monitor(run_dir)}


def collectives_run(cfg: dict[str, Any], net: str, variant: str, accumulate: int) -> dict[str, Any]:
    """Rank 0's collectives and bytes by source in the last of 3 optimizer steps (its ``accumulate``
    micro-batches, the loop's SIGTERM broadcasts included): exact, hardware-independent counts."""
    name = f"{net}_{variant}_acc{accumulate}_collectives"
    command, _, run_dir = _short_fit(
        cfg,
        net,
        variant,
        accumulate,
        name,
        3,
        "--trainer.callbacks=callbacks.CollectiveCounter",
        _flag("trainer.callbacks.out_dir", Path(cfg["out"], "work", name)),
    )
    windows = [w for w in json.loads((run_dir / "collectives_rank0.json").read_text()) if w["batch_idx"] is not None]
    shutil.rmtree(run_dir, ignore_errors=True)
    return {
        "command": command,
        **{key: dict(sum((Counter(w[key]) for w in windows[-accumulate:]), Counter())) for key in ("counts", "bytes")},
    }


def accuracy_run(cfg: dict[str, Any], variant: str, accumulate: int) -> dict[str, Any]:
    """The template net's full schedule, TensorBoard logs under ``out/tb/<variant>``; then ONE process
    tests its last checkpoint (no sampler padding, no strategy-specific evaluation path)."""
    from lightning.pytorch import Trainer
    from lightning.pytorch.loggers import TensorBoardLogger

    from lit_cifar.data import CIFAR100DataModule
    from lit_cifar.module import LitClassifier

    tb_root = Path(cfg["out"], "tb")
    shutil.rmtree(tb_root / variant, ignore_errors=True)
    command, wall_s = _fit(
        cfg,
        "template",
        variant,
        accumulate,
        f"{variant}_accuracy",
        {
            "trainer.max_epochs": cfg["accuracy_epochs"],
            "trainer.logger": "lightning.pytorch.loggers.TensorBoardLogger",
            "trainer.logger.save_dir": tb_root,
            "trainer.logger.name": variant,
            "trainer.logger.version": "fit",
        },
    )
    checkpoint = tb_root / variant / "fit" / "checkpoints" / "last.ckpt"
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        logger=TensorBoardLogger(tb_root, name=variant, version="test"),
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.test(
        LitClassifier.load_from_checkpoint(checkpoint, map_location="cpu"),
        datamodule=CIFAR100DataModule.load_from_checkpoint(checkpoint),
        verbose=False,
    )
    shutil.rmtree(checkpoint.parent, ignore_errors=True)
    return {"accumulate": accumulate, "command": command, "wall_s": wall_s}
