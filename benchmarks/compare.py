"""Compare the hand-written ``custom_ddp`` strategy with Lightning's ``ddp``: step time, accuracy, collectives.

Run from the repository root, on a quiet machine (about 20 minutes on 2 CPU cores)::

    python -m benchmarks.compare --out benchmarks/results/compare

What it compares (variants in :mod:`benchmarks.compare_runs`): custom_ddp with SyncBatchNorm and
with local BatchNorm, Lightning's ddp at its defaults and tuned, and one process at the same
per-process batch (the no-communication reference). For every accumulation setting
(``--accumulate``, default 1 2 4) each variant runs ``--rounds`` short timed fits, interleaved
so that drifting load hits every variant alike; then custom_ddp and ddp_default train the full
schedule once for accuracy, tested by one process. Step-time ratios, exposed communication and
scaling efficiency carry bootstrap 95 % CIs (:mod:`benchmarks.compare_report`); the quietness
record says whether the numbers are comparable at all (:mod:`benchmarks.harness`).

Writes into ``--out``: ``results.json`` (the record, ``headline`` included), ``results.md``,
``step_time.png``, ``curves.png``, the accuracy runs' TensorBoard logs under ``tb/`` and every
run's console output under ``logs/``.

Smoke run (a minute or two)::

    python -m benchmarks.compare --out /tmp/compare --quick
"""

from __future__ import annotations

import argparse
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any, Sequence

from benchmarks.compare_plots import plot_curves, plot_step_time
from benchmarks.compare_report import analyse, headline, read_scalars, render_markdown
from benchmarks.compare_runs import VARIANTS, CompareConfig, accuracy_run, collectives_run, timing_run
from benchmarks.harness import interleave, make_record, wait_for_quiet, write_record

__all__ = ["main", "parse_config"]

REPO_ROOT = Path(__file__).resolve().parents[1]
ACCURACY_VARIANTS = ("custom_ddp", "ddp_default")
COUNTED_VARIANTS = ("custom_ddp", "custom_ddp_localbn", "ddp_default", "ddp_tuned")
_QUICK = {"accumulates": (2,), "rounds": 1, "steps": 3, "warmup_steps": 1, "accuracy_epochs": 1,
          "synthetic_train_size": 640, "synthetic_test_size": 64, "count_nets": ("template",)}


def _positive(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.compare", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="benchmarks/results/compare", help="results folder")
    p.add_argument("--base-config", default="configs/cifar100_template_net.yaml")
    p.add_argument("--net", default="template", help="template or resnet18")
    p.add_argument("--accumulate", type=_positive, nargs="+", default=[1, 2, 4], dest="accumulates")
    p.add_argument("--rounds", type=_positive, default=3, help="interleaved timed fits per variant and setting")
    p.add_argument("--steps", type=_positive, default=16, help="timed optimizer steps per fit")
    p.add_argument("--warmup-steps", type=int, default=3, help="optimizer steps not timed")
    p.add_argument("--accuracy-epochs", type=_positive, default=6)
    p.add_argument("--batch-size", type=_positive, default=32, help="per process")
    p.add_argument("--synthetic-train-size", type=_positive, default=6_000)
    p.add_argument("--synthetic-test-size", type=_positive, default=1_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--run-timeout-s", type=float, default=1800.0)
    p.add_argument("--max-wait-s", type=float, default=300.0, help="wait this long for a quiet machine")
    p.add_argument("--count-nets", nargs="*", default=["template", "resnet18"],
                   help="nets whose collectives per optimizer step are counted (at the largest --accumulate)")
    p.add_argument("--quick", action="store_true", help="smoke run: tiny data, one round, accumulate 2")
    p.add_argument("--extra", action="append", default=[], metavar="FLAG",
                   help="train.py flag for every run, e.g. --extra=--model.lr=0.02 (repeatable)")
    return p


def parse_config(argv: Sequence[str] | None = None) -> tuple[CompareConfig, float]:
    """Parse the command line (errors name the flag and the fix); returns the config and the quiet wait."""
    parser = _parser()
    args = vars(parser.parse_args(argv))
    if args["warmup_steps"] < 0:
        parser.error(f"--warmup-steps must be >= 0, got {args['warmup_steps']}")
    if not (REPO_ROOT / args["base_config"]).is_file():
        parser.error(f"--base-config {args['base_config']!r} not found under {REPO_ROOT}")
    max_wait_s = args.pop("max_wait_s")
    if args.pop("quick"):
        args.update(_QUICK)
    out = Path(args["out"]).resolve()  # relative to the repository root, where the runs start
    args["out"] = str(out.relative_to(REPO_ROOT)) if out.is_relative_to(REPO_ROOT) else str(out)
    args["accumulates"], args["extra"] = tuple(sorted(set(args["accumulates"]))), tuple(args["extra"])
    args["count_nets"] = tuple(args["count_nets"])
    return CompareConfig(**args), max_wait_s


def _timing(cfg: CompareConfig, out: Path) -> dict[str, dict[str, list[dict[str, Any]]]]:
    timing: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for acc in cfg.accumulates:
        runs = interleave(list(VARIANTS), cfg.rounds,
                          lambda variant, _: timing_run(cfg, variant, acc, out / "work", out / "logs"))
        timing[str(acc)] = runs
    return timing


def _accuracy(cfg: CompareConfig, out: Path, accumulate: int) -> tuple[dict[str, Any], dict[str, Any]]:
    numbers, curves = {}, {}
    for variant in ACCURACY_VARIANTS:
        run = accuracy_run(cfg, variant, accumulate, out / "tb", out / "logs")
        curves[variant] = {**read_scalars(out / "tb" / variant / "fit"), **read_scalars(out / "tb" / variant / "test")}
        last = {tag: series[-1][1] for tag, series in curves[variant].items()}
        numbers[variant] = {"accumulate": accumulate, "test_acc1": 100 * last["test/acc1"],
                            "test_loss": last["test/loss"], **run}
    return numbers, curves


def _collectives(cfg: CompareConfig, out: Path) -> dict[str, Any]:
    accumulate = max(cfg.accumulates)
    return {"accumulate": accumulate,
            "nets": {net: {variant: collectives_run(cfg, net, variant, accumulate, out / "work", out / "logs")
                           for variant in COUNTED_VARIANTS} for net in cfg.count_nets}}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the comparison and write its record and report; returns the record."""
    cfg, max_wait_s = parse_config(argv)
    os.chdir(REPO_ROOT)  # train.py, its data/ folder and the relative paths of the recorded commands
    out = Path(cfg.out)
    quiet = wait_for_quiet(max_wait_s=max_wait_s)
    timing = _timing(cfg, out)
    accuracy, curves = _accuracy(cfg, out, accumulate=2 if 2 in cfg.accumulates else cfg.accumulates[0])
    collectives = _collectives(cfg, out)
    analysis = analyse(timing)
    record = make_record("compare", asdict(cfg), quiet.finish(), argv=argv, headline=headline(analysis, accuracy),
                         analysis=analysis, accuracy=accuracy, collectives=collectives,
                         variants={k: asdict(v) for k, v in VARIANTS.items()},
                         runs={acc: {v: [{"command": r["command"], "wall_s": r["wall_s"],
                                          "recorded": r["benchmark"]["run"]} for r in runs]
                                     for v, runs in by_variant.items()} for acc, by_variant in timing.items()})
    write_record(out, record, render_markdown(record).splitlines())
    plot_step_time(analysis, out / "step_time.png", record["quietness"]["comparable"])
    plot_curves(curves, out / "curves.png")
    return record


if __name__ == "__main__":
    result = main()
    for name, value in result["headline"].items():
        print(name, value)
    print(f"report: {Path(result['config']['out']) / 'results.md'}")
