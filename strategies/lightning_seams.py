"""Every private Lightning (and torchmetrics) name ``custom_ddp`` touches, in one place, checked at setup.

``custom_ddp`` uses Lightning's public strategy API wherever one exists. Where none does, it relies
on the private names below, read for the Lightning series :data:`VERIFIED_LIGHTNING`. At setup
:func:`check_private_seams` fails with one error naming what moved when the installed Lightning
is another series or lacks one of them, instead of a wrong result later.

A seam is ``(owner, name, user, why)``: ``owner`` an import path of a class or module (the name
must be an attribute of it), or ``None`` for an instance attribute only the version pins.
"""

from __future__ import annotations

import importlib
from typing import NamedTuple

import lightning

__all__ = ["PRIVATE_SEAMS", "VERIFIED_LIGHTNING", "Seam", "check_private_seams"]

VERIFIED_LIGHTNING = "2.6"


class Seam(NamedTuple):
    owner: str | None
    name: str
    user: str
    why: str


_DDP = "lightning.pytorch.strategies.ddp.DDPStrategy"
_MP = "lightning.pytorch.strategies.launchers.multiprocessing"
_POPEN = "lightning.pytorch.strategies.launchers.subprocess_script"

PRIVATE_SEAMS: tuple[Seam, ...] = (
    Seam(_DDP, "_setup_model", "synced_training", "wrap the module in SyncedDataParallel instead of torch DDP"),
    Seam(_DDP, "_configure_launcher", "custom_ddp", "install the one-stage-at-a-time launchers"),
    Seam(_DDP, "_get_process_group_backend", "custom_ddp", "the backend of a torchrun attempt's process group"),
    Seam(None, "Strategy._layer_sync", "custom_ddp", "the connector writes the LayerSync plugin here after __init__"),
    Seam(None, "Strategy._start_method / _timeout", "custom_ddp", "DDPStrategy keeps its arguments there"),
    Seam(_MP, "_MultiProcessingLauncher", "launchers", "subclassed: the fork/spawn launcher"),
    Seam(f"{_MP}._MultiProcessingLauncher", "_wrapping_function", "launchers", "a worker's stage, then its exit"),
    Seam(
        f"{_MP}._MultiProcessingLauncher",
        "_recover_results_in_main_process",
        "launchers",
        "rank 0's weights loaded back, then their temporary folder removed",
    ),
    Seam(_MP, "_disable_module_memory_sharing", "launchers", "forkserver workers' own copy of the module (CPU)"),
    Seam(_POPEN, "_SubprocessScriptLauncher", "launchers, popen_exit", "subclassed: the popen launcher"),
    Seam(
        f"{_POPEN}._SubprocessScriptLauncher",
        "_call_children_scripts",
        "launchers",
        "its launch, redone with an observer that spares rank 0 a while",
    ),
    Seam(
        "lightning.fabric.strategies.launchers.subprocess_script",
        "_ChildProcessObserver",
        "launchers",
        "subclassed: _terminate_all gives rank 0 a grace period",
    ),
    Seam(
        "lightning.fabric.strategies.launchers.subprocess_script._ChildProcessObserver",
        "_terminate_all",
        "launchers",
        "overridden (children, then rank 0 after RANK0_GRACE_S)",
    ),
    Seam(
        "lightning.fabric.utilities.distributed",
        "_init_dist_connection",
        "custom_ddp",
        "the process group made on the store every rank joined (start and collectives bounded apart)",
    ),
    Seam(
        "lightning.fabric.utilities.distributed",
        "_set_num_threads_if_needed",
        "launchers",
        "the launch's intra-op threads per rank, as Lightning sets them",
    ),
    Seam(
        None,
        "LightningModule._trainer",
        "scatter_eval, exact_resume",
        "the trainer while loaders are set up (no public path)",
    ),
    Seam(
        None,
        "_FitLoop._data_fetcher",
        "exact_resume",
        "its iterator made anew after the restore when workers drew the resumed epoch's indices too early",
    ),
    Seam(
        "lightning.pytorch.loops.training_epoch_loop._TrainingEpochLoop",
        "_broadcast_sigterm_tensor",
        "preemption",
        "the per-batch SIGTERM broadcast the stop protocol leaves in place",
    ),
    Seam(
        "lightning.pytorch.trainer.connectors.signal_connector._SignalConnector",
        "_sigterm_notifier_fn",
        "preemption",
        "Lightning's handler (broadcasts inside the handler) that preemption replaces",
    ),
    Seam(
        None,
        "LightningModule._current_fx_name",
        "uneven_training",
        "the hook a self.log call comes from: a rank on an empty batch logs neutral values in a step's hooks",
    ),
    Seam(
        None,
        "torchmetrics Metric._reductions",
        "parallel.evaluation.metric_sync",
        "each state's reduction (no public path)",
    ),
)


def _missing(seam: Seam) -> bool:
    if seam.owner is None:
        return False
    module_path, _, attribute = seam.owner.rpartition(".")
    try:
        module = importlib.import_module(seam.owner)
    except ImportError:
        try:
            module = getattr(importlib.import_module(module_path), attribute)
        except (ImportError, AttributeError):
            return True
    return not hasattr(module, seam.name)


def check_private_seams(version: str = lightning.__version__) -> None:
    """Raise ``RuntimeError`` naming every private seam that moved, or the unverified Lightning series."""
    problems = [
        f"{seam.owner}.{seam.name} (used by {seam.user}: {seam.why})" for seam in PRIVATE_SEAMS if _missing(seam)
    ]
    if version != VERIFIED_LIGHTNING and not version.startswith(VERIFIED_LIGHTNING + "."):
        problems.insert(0, f"found Lightning {version}, verified for {VERIFIED_LIGHTNING}.x")
    if problems:
        raise RuntimeError(
            "custom_ddp relies on private Lightning names listed in strategies/lightning_seams.py: "
            + "; ".join(problems)
            + ". Re-check the users named there against the installed Lightning and update "
            "VERIFIED_LIGHTNING, or install lightning>=2.6,<2.7 as pyproject.toml pins."
        )
