"""How compare drives its runs: fresh ``python train.py fit`` processes, as a user types them, per
variant (:mod:`benchmarks.fits.variants`); a timed fit, a collective count and a full-schedule accuracy fit. The
flags of a timed fit (:func:`fit_flags`, :func:`short_fit_flags`, :func:`monitor_flags`), its reading
(:func:`read_monitor`), :func:`call_logged` and the options and settings both share (:func:`fits_parser`,
:func:`run_settings`, :func:`step_rows`) serve ``benchmarks.fits.paired_fits`` too, which runs the fits in-process."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from benchmarks.fits.variants import BASE_CONFIG, VARIANTS, flag
from benchmarks.harness import interleave, medians, parser
from benchmarks.report import fmt_value, table
from collectives.launcher import without_launch_variables
from measure.timing import slowest_rank

REPO_ROOT = Path(__file__).resolve().parents[2]


def fits_parser(name: str, doc: str | None, nets: Sequence[str], variants: dict[str, str]) -> argparse.ArgumentParser:
    """The options of a benchmark of fits: :func:`benchmarks.harness.parser`'s, the nets, the accumulation
    settings and the variants (``{"choices", "default", "help"}``)."""
    p = parser(name, doc)
    p.add_argument("--nets", nargs="+", choices=tuple(nets), default=list(nets))
    p.add_argument("--accumulate", type=int, nargs="+", default=[1, 2, 4], dest="accumulates")
    p.add_argument("--variants", nargs="+", **variants)
    return p


def call_logged(command: list[str], log: Path, timeout_s: float, threads: int | None) -> float:
    """Run ``command`` from the repository root with ``threads`` intra-op threads (None: its launcher's or
    torch's default) and no inherited launch variables, output to ``log``; raise with its tail on failure."""
    env = {k: v for k, v in without_launch_variables(dict(os.environ)).items() if k != "OMP_NUM_THREADS"}
    env |= {"OMP_NUM_THREADS": str(threads)} if threads else {}
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("$ " + shlex.join(command) + "\n")
    start = time.perf_counter()
    with open(log, "a") as out:  # a run past ``timeout_s`` raises subprocess.TimeoutExpired, naming the command
        code = subprocess.call(command, stdout=out, stderr=subprocess.STDOUT, timeout=timeout_s, env=env)
    if code != 0:
        tail = "\n".join(log.read_text().splitlines()[-30:])
        raise RuntimeError(f"run failed ({code}): {shlex.join(command)}\nlast lines of {log}:\n{tail}")
    return time.perf_counter() - start


def run_settings(args: argparse.Namespace, nets: dict[str, dict], quick_steps: dict[str, int]) -> dict[str, Any]:
    """The runs' folder (relative to the repository root, where they start, when inside it), their data
    (``--quick``'s tiny synthetic sets kept in its own folder, full ones in the checkout's ``data/``) and nets
    (``--quick``: ``quick_steps``)."""
    out = args.out.resolve()
    return {
        "out": str(out.relative_to(REPO_ROOT)) if out.is_relative_to(REPO_ROOT) else str(out),
        "train_size": 640 if args.quick else 6_000,
        "test_size": 64 if args.quick else 1_000,
        **({"data_dir": str(out / "data")} if args.quick else {}),
        "nets": {net: nets[net] | (quick_steps if args.quick else {}) for net in args.nets},
    }


def fit_flags(
    cfg: dict[str, Any], net: str, variant: str, accumulate: int, flags: dict[str, object], *callback: str
) -> list[str]:
    """The ``train.py fit`` options of ``variant``: the shared flags, ``flags`` and ``callback``."""
    shared = {
        "config": BASE_CONFIG,
        "seed_everything": 0,
        "model.net": net,
        "data.dataset": "synthetic",
        "data.batch_size": cfg["nets"][net]["batch_size"],
        "data.val_size": 0.1,
        "data.synthetic_train_size": cfg["train_size"],
        "data.synthetic_test_size": cfg["test_size"],
        "trainer.accelerator": cfg.get("accelerator", "cpu"),
        "trainer.enable_progress_bar": False,
        "trainer.enable_model_summary": False,
    }
    shared |= {} if net == "template" else {"model.net_kwargs": "{}"}  # the base config's are the template's
    shared |= {"data.data_dir": cfg["data_dir"]} if "data_dir" in cfg else {}  # see run_settings
    devices = cfg.get("devices", VARIANTS[variant].processes)  # one GPU: one process (compare --device cuda)
    own = {"trainer.devices": devices, "trainer.accumulate_grad_batches": accumulate}
    own |= ({"trainer.precision": cfg["precision"]} if "precision" in cfg else {}) | flags
    return [
        *(flag(k, x) for k, x in shared.items()),
        *VARIANTS[variant].flags,
        *(flag(k, x) for k, x in own.items()),
        *callback,
    ]


def _fit(
    cfg: dict[str, Any], net: str, variant: str, accumulate: int, name: str, flags: dict[str, object], *callback: str
) -> tuple[str, float]:
    """``train.py fit`` of ``variant`` (:func:`fit_flags`) in a fresh process; its command and wall time."""
    command = [sys.executable, "train.py", "fit", *fit_flags(cfg, net, variant, accumulate, flags, *callback)]
    log = Path(cfg["out"], "logs", f"{name}.txt")
    return shlex.join(command[1:]), call_logged(command, log, cfg["run_timeout_s"], VARIANTS[variant].threads)


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
    return "--trainer.callbacks=callbacks.BenchmarkMonitor", flag("trainer.callbacks.warmup_steps", warmup_steps)


def read_monitor(run_dir: Path, micro_batches: bool = False) -> dict[str, Any]:
    """A timed fit's intra-op threads and per-step seconds (the slowest rank's), with ``micro_batches`` its
    per-micro-batch seconds too (the slowest rank's, in order), from its ``benchmark.json``; removes ``run_dir``."""
    monitor = json.loads((run_dir / "benchmark.json").read_text())
    shutil.rmtree(run_dir, ignore_errors=True)
    micro = {"micro_batch_s": slowest_rank(monitor["micro_batch_s_per_rank"])} if micro_batches else {}
    step_s = slowest_rank(monitor["step_s_per_rank"])
    return {"threads": monitor["run"]["intra_op_threads"], "step_s": step_s, **micro, "recorded": monitor["run"]}


def timing_run(cfg: dict[str, Any], net: str, variant: str, accumulate: int) -> dict[str, Any]:
    """One short timed fit: command, wall time, intra-op threads and per-step seconds (the slowest rank's)."""
    warmup, steps, name = (
        cfg["nets"][net]["warmup_steps"],
        cfg["nets"][net]["steps"],
        f"{net}_{variant}_acc{accumulate}",
    )
    command, wall_s, run_dir = _short_fit(cfg, net, variant, accumulate, name, warmup + steps, *monitor_flags(warmup))
    return {"command": command, "wall_s": wall_s, **read_monitor(run_dir)}


def collectives_run(cfg: dict[str, Any], net: str, variant: str, accumulate: int) -> dict[str, Any]:
    """Rank 0's collectives and bytes by source in the last of 3 optimizer steps (its ``accumulate``
    micro-batches, the loop's SIGTERM broadcasts included): exact, hardware-independent counts."""
    name = f"{net}_{variant}_acc{accumulate}_collectives"
    counter = (
        "--trainer.callbacks=callbacks.CollectiveCounter",
        flag("trainer.callbacks.out_dir", Path(cfg["out"], "work", name)),
    )
    command, _, run_dir = _short_fit(cfg, net, variant, accumulate, name, 3, *counter)
    windows = [w for w in json.loads((run_dir / "collectives_rank0.json").read_text()) if w["batch_idx"] is not None]
    shutil.rmtree(run_dir, ignore_errors=True)
    totals = {
        key: dict(sum((Counter(w[key]) for w in windows[-accumulate:]), Counter())) for key in ("counts", "bytes")
    }
    return {"command": command, **totals}


def accuracy_run(cfg: dict[str, Any], variant: str, accumulate: int) -> dict[str, Any]:
    """The template net's full schedule, TensorBoard logs under ``out/tb/<variant>``; then ONE process
    tests its last checkpoint (no sampler padding, no strategy-specific evaluation path)."""
    from lightning.pytorch import Trainer
    from lightning.pytorch.loggers import TensorBoardLogger

    from lit_cifar.data import CIFAR100DataModule
    from lit_cifar.module import LitClassifier

    tb_root = Path(cfg["out"], "tb")
    shutil.rmtree(tb_root / variant, ignore_errors=True)
    flags = {
        "trainer.max_epochs": cfg["accuracy_epochs"],
        "trainer.logger": "lightning.pytorch.loggers.TensorBoardLogger",
        "trainer.logger.save_dir": tb_root,
        "trainer.logger.name": variant,
        "trainer.logger.version": "fit",
    }
    command, wall_s = _fit(cfg, "template", variant, accumulate, f"{variant}_accuracy", flags)
    checkpoint = tb_root / variant / "fit" / "checkpoints" / "last.ckpt"
    test_logger = TensorBoardLogger(tb_root, name=variant, version="test")
    trainer = Trainer(
        accelerator="cpu", devices=1, logger=test_logger, enable_progress_bar=False, enable_model_summary=False
    )
    model = LitClassifier.load_from_checkpoint(checkpoint, map_location="cpu")
    trainer.test(model, datamodule=CIFAR100DataModule.load_from_checkpoint(checkpoint), verbose=False)
    shutil.rmtree(checkpoint.parent, ignore_errors=True)
    return {"accumulate": accumulate, "command": command, "wall_s": wall_s}


def interleaved_fits(cfg: dict[str, Any], variants: dict[str, list[str]], rounds: int, fit: Callable) -> dict:
    """Per net and accumulation setting, ``rounds`` rounds of ``fit(net, variant, accumulate, round)`` for each
    of the net's ``variants``, their order alternating (:func:`benchmarks.harness.interleave`)."""
    return {
        net: {
            str(acc): interleave(variants[net], rounds, lambda v, i, net=net, acc=acc: fit(net, v, acc, i))
            for acc in cfg["accumulates"]
        }
        for net in cfg["nets"]
    }


def step_rows(timing: dict[str, Any], row: Any) -> dict[str, Any]:
    """Per net and accumulation setting of ``timing`` (runs by variant): the step medians per variant, their
    threads and ``row(samples, runs by variant, accumulate)``'s estimates; a run's steps are resampled whole."""
    analysis: dict[str, Any] = {}
    for net, by_acc in timing.items():
        for acc, by_variant in by_acc.items():
            samples = {v: [run["step_s"] for run in runs] for v, runs in by_variant.items()}
            threads = {v: sorted({run["threads"] for run in runs}) for v, runs in by_variant.items()}
            analysis.setdefault(net, {})[acc] = {"step_s": medians(samples), "threads": threads} | row(
                samples, by_variant, int(acc)
            )
    return analysis


def step_table(label: Callable, row: dict[str, Any], headers: Sequence[str], cells: Callable) -> list[str]:
    """A setting's variants: label, threads, median step with its CI, steps, then ``headers``: ``cells(variant)``."""
    rows = [
        [label(v), ", ".join(map(str, row["threads"][v])), fmt_value(step, "s"), step["n"], *cells(v)]
        for v, step in row["step_s"].items()
    ]
    return table(["variant", "threads", "step", "steps", *headers], rows)


def setting_title(cfg: dict[str, Any], net: str, acc: str) -> str:
    return f"### {net} net (batch {cfg['nets'][net]['batch_size']} per process), accumulate {acc}"
