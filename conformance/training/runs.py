"""Run a training pattern under one process, Lightning's ``ddp`` or ``custom_ddp`` and compare its weights.

:func:`fit_pattern` trains one :class:`conformance.training.patterns.TrainingPattern` (2 CPU ranks
started with fork + gloo, or one process on the global batch) and returns what every rank held at
the end of ``fit``: its ``state_dict`` (parameters and buffers) and the module's ``records``.
:func:`compare` turns a run and its truth into the table's numbers: the largest absolute weight
difference on any rank, and whether the ranks hold identical (bitwise) states.
"""

from __future__ import annotations

import functools
import tempfile
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy

from conformance.training.base import WORLD_SIZE, TrainingPattern
from strategies.custom_ddp import CustomDDPStrategy

__all__ = ["SETTINGS", "compare", "fit_pattern"]

SETTINGS = ("one_process", "ddp", "custom_ddp")


class _SaveRankState(pl.Callback):
    """Every rank writes its final ``state_dict`` and the module's ``records`` (fork hands back rank 0's only)."""

    def __init__(self, out_dir: Path) -> None:
        self.out_dir = out_dir

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:  # after every on_train_end
        state = {name: value.detach().clone() for name, value in pl_module.state_dict().items()}
        torch.save({"state": state, "records": pl_module.records}, self.out_dir / f"rank{trainer.global_rank}.pt")


def _strategy(pattern: type[TrainingPattern], setting: str) -> Any:
    if setting == "one_process":
        return "auto"
    if setting == "ddp":
        return DDPStrategy(
            start_method="fork", timeout=timedelta(seconds=pattern.timeout_s), **(pattern.ddp_options or {})
        )
    return CustomDDPStrategy(
        start_method="fork", timeout=timedelta(seconds=pattern.timeout_s), **pattern.custom_options
    )


def fit_pattern(pattern: type[TrainingPattern], setting: str, interrupt: bool = True) -> list[dict[str, Any]]:
    """Train ``pattern`` under ``setting``; one ``{"state", "records"}`` per rank. A pattern with
    ``resume_after_steps`` is stopped there and resumed from the checkpoint of that step (unless
    ``interrupt`` is false: its truth, the same fit uninterrupted)."""
    if setting not in SETTINGS:
        raise ValueError(f"setting={setting!r} must be one of {SETTINGS}")
    if pattern.resume_after_steps is None or not interrupt:
        return _fit(pattern, setting)
    with tempfile.TemporaryDirectory() as checkpoints:
        every = ModelCheckpoint(
            dirpath=checkpoints, filename="interrupted", every_n_train_steps=pattern.resume_after_steps
        )
        _fit(pattern, setting, max_steps=pattern.resume_after_steps, checkpoint=every)
        return _fit(pattern, setting, ckpt_path=Path(checkpoints) / "interrupted.ckpt")


def _fit(
    pattern: type[TrainingPattern],
    setting: str,
    max_steps: int = -1,
    checkpoint: ModelCheckpoint | None = None,
    ckpt_path: Path | None = None,
) -> list[dict[str, Any]]:
    devices = 1 if setting == "one_process" else WORLD_SIZE
    module = pattern()
    callbacks = [*module.callbacks(), *([checkpoint] if checkpoint else [])]
    with tempfile.TemporaryDirectory() as out:
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=devices,
            strategy=_strategy(pattern, setting),
            max_epochs=pattern.max_epochs,
            max_steps=max_steps,
            use_distributed_sampler=False,
            logger=False,
            enable_checkpointing=checkpoint is not None,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[_SaveRankState(Path(out)), *callbacks],
            **pattern.trainer_options,
        )
        fit = functools.partial(trainer.fit, module.fit_argument(), ckpt_path=ckpt_path)
        if devices == 1 and pattern.compiles:
            # Compiled in a child: a process that compiled a backward may fork no ranks any more (autograd: "Unable to
            # handle autograd's threading in combination with fork-based multiprocessing"), and later runs fork theirs.
            _in_forked_child(fit)
        else:
            fit()
        return [torch.load(Path(out) / f"rank{rank}.pt", weights_only=False) for rank in range(devices)]


def _in_forked_child(run: Callable[[], object]) -> None:
    """Call ``run`` in a forked child process; its exception is raised here (``ProcessRaisedException``)."""
    threads = torch.get_num_threads()

    def child(_: int) -> None:
        # A forked child rebuilds the intra-op thread pool at the first call that needs it; two threads at once (this
        # one and autograd's workers, which a compiled backward starts) can lose it ("Invalid thread pool!"). Rebuild
        # it here, before another thread runs, as Lightning's launcher does in its workers.
        torch.set_num_threads(threads)
        run()

    torch.multiprocessing.start_processes(child, nprocs=1, start_method="fork")


def max_difference(states: list[dict[str, torch.Tensor]], truth: dict[str, torch.Tensor]) -> float:
    """Largest |a - b| over every rank's floating-point entries against ``truth``."""
    worst = 0.0
    for state in states:
        if state.keys() != truth.keys():
            raise ValueError(f"state keys differ: {sorted(state)} vs {sorted(truth)}")
        for name, value in truth.items():
            if value.is_floating_point():
                worst = max(worst, (state[name].double() - value.double()).abs().max().item())
    return worst


def ranks_agree(states: list[dict[str, torch.Tensor]]) -> bool:
    """Whether every rank holds bitwise the same state as rank 0."""
    return all(torch.equal(state[name], states[0][name]) for state in states[1:] for name in states[0])


def compare(run: list[dict[str, Any]], truth: list[dict[str, Any]]) -> dict[str, Any]:
    """``{"max_diff", "ranks_agree"}`` of ``run`` against rank 0 of ``truth``."""
    states = [rank["state"] for rank in run]
    return {"max_diff": max_difference(states, truth[0]["state"]), "ranks_agree": ranks_agree(states)}
