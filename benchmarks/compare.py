"""Compare the hand-written ``custom_ddp`` strategy with Lightning's ``ddp``: speed, memory, quality.

Run from the repository root::

    python -m benchmarks.compare --out benchmarks/results/compare

Both strategies train back to back as separate ``train.py fit`` runs with the same seed, data,
net and hyper-parameters (``--accumulate``, default 2, ``--epochs`` epochs), each with
:class:`callbacks.BenchmarkMonitor`; their final checkpoints are then tested by one process.
Short extra runs at the ``--sweep`` accumulation settings (default 1 and 4) show how the step
time of each strategy scales with gradient accumulation. ``ddp`` gets its communication options
set explicitly (bucket size, ``gradient_as_bucket_view``, ``forward_sync_buffers``) and, on GPU,
``sync_batchnorm=True``; on CPU ``torch.nn.SyncBatchNorm`` cannot run, so ``ddp`` keeps local
BatchNorm there and the report says so.

Writes into ``--out``: ``report.md`` (infrastructure, command, tables, targets, notes),
``compare.json`` (everything, machine-readable), ``curves.png`` and ``time_memory.png``, the
runs' TensorBoard logs under ``tb/`` (``tensorboard --logdir <out>/tb`` shows them side by
side) and each run's console output under ``logs/``.

Two GPUs (``ddp`` then uses ``nn.SyncBatchNorm``; NCCL)::

    python -m benchmarks.compare --accelerator gpu --out benchmarks/results/compare_gpu

Tiny smoke run (no sweep; about a minute on 2 quiet cores, mostly process start-up)::

    python -m benchmarks.compare --out /tmp/compare --epochs 1 --sweep --synthetic-train-size 320 \
        --synthetic-test-size 64 --warmup-steps 1
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Sequence

from benchmarks.compare_plots import plot_curves, plot_time_memory
from benchmarks.compare_report import headline, read_scalars, render_markdown, targets
from benchmarks.compare_runs import LOCAL_BN, STRATEGIES, CompareConfig, RunSpec, execute
from callbacks.run_info import environment, to_jsonable
from parallel.sync_config import DEFAULT_BUCKET_CAP_MB

__all__ = ["main", "parse_config"]

REPO_ROOT = Path(__file__).resolve().parents[1]


def _positive(kind: type) -> Any:
    def parse(text: str) -> Any:
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value
    return parse


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.compare",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="benchmarks/results/compare", help="results folder")
    p.add_argument("--base-config", default="configs/cifar100_template_net.yaml",
                   help="train.py config both runs start from")
    p.add_argument("--devices", type=_positive(int), default=2, help="processes (>= 2)")
    p.add_argument("--accelerator", default="cpu", choices=("cpu", "gpu"))
    p.add_argument("--accumulate", type=_positive(int), default=2, help="main setting (>= 2)")
    p.add_argument("--sweep", type=_positive(int), nargs="*", default=[1, 4],
                   help="extra accumulation settings timed with --sweep-epochs")
    p.add_argument("--epochs", type=_positive(int), default=6)
    p.add_argument("--sweep-epochs", type=_positive(int), default=1)
    p.add_argument("--net", default="template")
    p.add_argument("--dataset", default="synthetic", choices=("synthetic", "cifar100", "auto"))
    p.add_argument("--precision", default="32-true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=_positive(int), default=32, help="per process")
    p.add_argument("--val-size", type=_count_or_fraction, default=0.1,
                   help="validation images: a count, or a fraction of the training set")
    p.add_argument("--synthetic-train-size", type=_positive(int), default=6_000)
    p.add_argument("--synthetic-test-size", type=_positive(int), default=1_000)
    p.add_argument("--warmup-steps", type=int, default=5, help="optimizer steps not timed")
    p.add_argument("--bucket-cap-mb", type=_positive(float), default=DEFAULT_BUCKET_CAP_MB, help="both strategies")
    p.add_argument("--ddp-gradient-as-bucket-view", type=_bool, default=True)
    p.add_argument("--ddp-forward-sync-buffers", type=_bool, default=True,
                   help="DDP broadcasts rank 0's BN buffers every forward (torch's default)")
    p.add_argument("--run-timeout-s", type=_positive(float), default=1800.0)
    p.add_argument("--render-only", action="store_true",
                   help="re-render report.md and the plots from an existing <out>/compare.json")
    p.add_argument("--extra", action="append", default=[], metavar="FLAG",
                   help="train.py flag for every run, e.g. --extra=--model.lr=0.02 (repeatable)")
    return p


def _count_or_fraction(text: str) -> int | float:
    value = float(text)
    if not (0 < value < 1 or (value >= 1 and value.is_integer())):
        raise argparse.ArgumentTypeError(f"expected a count >= 1 or a fraction in (0, 1), got {text}")
    return value if value < 1 else int(value)


def _bool(text: str) -> bool:
    if text.lower() not in ("true", "false"):
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    return text.lower() == "true"


def parse_config(argv: Sequence[str] | None = None) -> tuple[CompareConfig, bool]:
    """Parse and validate the command line (errors name the flag and the fix).

    Returns:
        The comparison's settings and whether only the report should be re-rendered.
    """
    parser = _parser()
    args = parser.parse_args(argv)
    if args.devices < 2:
        parser.error(f"--devices must be >= 2 to compare data-parallel strategies, got {args.devices}")
    if args.accumulate < 2:
        parser.error(f"--accumulate must be >= 2 (the assignment's setting), got {args.accumulate}")
    if args.warmup_steps < 0:
        parser.error(f"--warmup-steps must be >= 0, got {args.warmup_steps}")
    if not (REPO_ROOT / args.base_config).is_file():
        parser.error(f"--base-config {args.base_config!r} not found under {REPO_ROOT}")
    values = {k: v for k, v in vars(args).items() if k not in ("sweep", "extra", "render_only")}
    sweep = tuple(sorted(set(args.sweep) - {args.accumulate}))
    # Relative to the repository root, where the runs start (recorded commands stay portable).
    out = Path(args.out).resolve()
    values["out"] = str(out.relative_to(REPO_ROOT)) if out.is_relative_to(REPO_ROOT) else str(out)
    return CompareConfig(**values, sweep=sweep, extra=tuple(args.extra)), args.render_only


def _strategy_notes(cfg: CompareConfig) -> dict[str, str]:
    bn = ("torch.nn.SyncBatchNorm (sync_batchnorm=True)" if cfg.on_gpu else
          "LOCAL BatchNorm: torch.nn.SyncBatchNorm cannot run on CPU, so ddp does less "
          "communication than custom_ddp here")
    notes = {
        "custom_ddp": f"hand-written SyncBatchNorm, bucketed accumulation-aware gradient sync "
                      f"(bucket {cfg.bucket_cap_mb} MB), scatter-based validation; backend {cfg.backend}",
        "ddp": f"torch DistributedDataParallel, bucket_cap_mb={cfg.bucket_cap_mb}, "
               f"gradient_as_bucket_view={cfg.ddp_gradient_as_bucket_view}, "
               f"forward_sync_buffers={cfg.ddp_forward_sync_buffers}, {bn}; backend {cfg.backend}",
    }
    if not cfg.on_gpu:
        notes[LOCAL_BN] = ("custom_ddp with sync_batchnorm=false (local BatchNorm like ddp on CPU): "
                           "the like-for-like anchor for the gradient sync")
    return notes


def _collect(cfg: CompareConfig, spec: RunSpec, tb_root: Path, logs: Path) -> dict[str, Any]:
    record = execute(cfg, spec, tb_root, logs)
    run_dir = tb_root / spec.name
    benchmark = json.loads((run_dir / "fit" / "benchmark.json").read_text())
    curves = read_scalars(run_dir / "fit")
    if spec.test:
        curves.update(read_scalars(run_dir / "test"))
    record.update(headline=headline(benchmark, curves), curves=curves,
                  recorded=benchmark["run"], fit_summary=benchmark["summary"]["global"])
    return record


def _notes(cfg: CompareConfig, load_before: float) -> list[str]:
    notes = [
        "Times are the maximum over ranks of each rank's median (a step is as slow as its slowest "
        "rank); memory is the maximum over ranks. Step time sums the micro-batches of one "
        "optimizer step (forward, backward, gradient sync, optimizer), data loading excluded.",
        f"Final accuracy and loss: the last checkpoint of each run tested by one process on all "
        f"{cfg.synthetic_test_size if cfg.dataset == 'synthetic' else 10_000} test images; "
        "val: the last epoch's validation.",
    ]
    if not cfg.on_gpu:
        notes.append("CPU peak memory is each process's peak resident set size (kernel VmHWM, reset "
                     "at each epoch start, validation included); most of it is the Python/torch "
                     "runtime and the data. 'Above pre-wrap usage' subtracts the RSS measured after "
                     "the data and model exist but before the strategy wraps the model.")
    if load_before > 0.5 * (os.cpu_count() or 1):
        notes.append(f"The machine was busy (1-min load {load_before:.1f} on {os.cpu_count()} cores "
                     "when the comparison started): timings are noisy; re-run on a quiet machine.")
    return notes


def _rerender(out: Path) -> dict[str, Any]:
    """Load ``compare.json`` (JSON has no NaN: missing numbers were saved as null)."""
    result = json.loads((out / "compare.json").read_text())

    def nan(values: dict[str, Any]) -> dict[str, Any]:
        return {k: math.nan if v is None else v for k, v in values.items()}

    result["main"] = {s: nan(h) for s, h in result["main"].items()}
    result["sweep"] = [{k: nan(v) if isinstance(v, dict) else v for k, v in row.items()}
                       for row in result["sweep"]]
    result["targets"] = [nan(row) for row in result["targets"]]
    if result.get("local_bn"):
        result["local_bn"] = nan(result["local_bn"])
    _write(out, result)
    return result


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the comparison and write its report; returns what ``compare.json`` holds."""
    cfg, render_only = parse_config(argv)
    os.chdir(REPO_ROOT)  # train.py, its data/ folder and the relative paths of the recorded commands
    out = Path(cfg.out)
    if render_only:
        return _rerender(out)
    tb_root, logs = out / "tb", out / "logs"
    load_before, start = os.getloadavg()[0], time.perf_counter()
    specs = [RunSpec(s, cfg.accumulate, cfg.epochs, test=True) for s in STRATEGIES]
    if not cfg.on_gpu:  # between the two sweeps' alternating orders: drift hits it like the others
        specs.append(RunSpec(LOCAL_BN, cfg.accumulate, cfg.epochs, test=False))
    for i, acc in enumerate(cfg.sweep):  # alternate the order: drifting load hits both alike
        order = STRATEGIES if i % 2 else tuple(reversed(STRATEGIES))
        specs += [RunSpec(s, acc, cfg.sweep_epochs, test=False) for s in order]
    runs = {spec.name: _collect(cfg, spec, tb_root, logs) for spec in specs}

    def by_acc(acc: int) -> dict[str, dict[str, float]]:
        return {s: runs[f"{s}_acc{acc}"]["headline"] for s in STRATEGIES}

    main_setting = by_acc(cfg.accumulate)
    sweep = [{"accumulate": a, **by_acc(a)} for a in sorted({*cfg.sweep, cfg.accumulate})]
    command = "python -m benchmarks.compare " + shlex.join(sys.argv[1:] if argv is None else argv)
    result = {
        "config": asdict(cfg), "command": command.strip(), "environment": environment(),
        "backend": cfg.backend, "load_before": load_before, "load_after": os.getloadavg()[0],
        "wall_s": time.perf_counter() - start, "tb_root": str(tb_root),
        "strategy_notes": _strategy_notes(cfg), "main": main_setting, "sweep": sweep,
        "targets": targets(main_setting["custom_ddp"], main_setting["ddp"], cfg.on_gpu),
        "local_bn": runs.get(f"{LOCAL_BN}_acc{cfg.accumulate}", {}).get("headline"),
        "notes": _notes(cfg, load_before), "runs": runs,
    }
    _write(out, result)
    return result


def _write(out: Path, result: dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    main_runs = {s: result["runs"][f"{s}_acc{result['config']['accumulate']}"]["curves"]
                 for s in STRATEGIES}
    plot_curves(main_runs, out / "curves.png")
    plot_time_memory(result["sweep"], result["main"], out / "time_memory.png")
    (out / "report.md").write_text(render_markdown(result))
    with open(out / "compare.json", "w") as f:
        json.dump(to_jsonable(result), f, indent=1, allow_nan=False)


if __name__ == "__main__":
    outcome = main()
    for row in outcome["targets"]:
        status = "met" if row["met"] else f"MISSED by {row['missed_by']:.3f}"
        print(f"{row['target']}: {row['measured']:.3f} (limit {row['limit']}) {status}")
    print(f"report: {Path(outcome['config']['out']) / 'report.md'}")
