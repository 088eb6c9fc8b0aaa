"""Compare the hand-written ``custom_ddp`` strategy with Lightning's ``ddp``: step time, accuracy, collectives.

    python -m benchmarks.fits.compare                              # 61 minutes on 2 Zen 3 cores, 25 on a faster host
    python -m benchmarks.fits.compare --quick --out /tmp/compare   # smoke run, about 12 minutes (32 fits)
    python -m benchmarks.fits.compare --variants custom_ddp_localbn custom_ddp_localbn_gloo ddp_tuned --timing-only \
        --rounds 6 --out benchmarks/results/compare_localbn     # the step-time target alone, ~30 minutes

(2 rounds x 3 settings x 16 variants = 96 timed fits of 5-25 s, 11 collective counts of ~10 s, 2
accuracy fits of ~1 minute, up to 5 minutes of waiting for a quiet machine.) On the template net
and ResNet-18 (CIFAR stem), at accumulate 1, 2 and 4, each variant of :data:`variants.VARIANTS` runs
``--rounds`` short fits, interleaved so that drifting load hits all alike: fresh ``python train.py
fit`` runs as a user types them, one epoch of warm-up + timed steps under ``BenchmarkMonitor``
(kept: the slowest rank's time of every step, the run's intra-op threads). On CPU
torch.nn.SyncBatchNorm cannot run, so ddp keeps local BatchNorm: custom_ddp (local BN) vs ddp tuned
is the like-for-like comparison of the gradient sync. Then custom_ddp and ddp_default train the
template net's full schedule on SYNTHETIC data (not CIFAR-100 accuracies), each tested by ONE
process, and every 2-process variant's collectives per optimizer step are counted by source.
Derived from the record alone (:mod:`benchmarks.fits.compare_report`), with bootstrap 95 % CIs: step-time ratios naming
their anchor; the SyncBN share of the step, ``1 - step(local BN) / step(SyncBN)``; exposed
communication, a 2-process step minus the 1-process step at the same per-process batch and each
rank's thread count (``cores // 2`` via ``OMP_NUM_THREADS``, what Lightning gives each of 2
processes); scaling efficiency, ``step(1 process) / step(2 processes)``, against that
thread-matched process (what communication costs) and one on all cores (what a user would run).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchmarks.fits.compare_report import TITLE, analyse, headline, title, write
from benchmarks.fits.compare_runs import (
    REPO_ROOT,
    accuracy_run,
    collectives_run,
    fits_parser,
    interleaved_fits,
    run_settings,
    timing_run,
)
from benchmarks.fits.variants import BASE_CONFIG, GPU, GPU_NETS, NETS, VARIANTS, variants_for
from benchmarks.harness import parse, run_benchmark

# The record's module: rederive and the results blocks load TITLE, headline and write from here.
__all__ = ["TITLE", "analyse", "headline", "main", "measure", "parse_config", "title", "write"]


def parse_config(argv: Sequence[str] | None = None) -> tuple[dict[str, Any], float]:
    """The runs' shared settings from the command line, and the quiet wait; ``--quick``: one round at
    accumulate 2 of 1 + 3 steps, tiny data, one accuracy epoch."""
    help_variants = "timed variants (default: all); ratios need both of their variants"
    p = fits_parser(
        "fits.compare", __doc__, NETS, {"choices": tuple(VARIANTS), "default": list(VARIANTS), "help": help_variants}
    )
    p.add_argument("--rounds", type=int, default=2, help="interleaved timed fits per variant and setting")
    p.add_argument("--accuracy-epochs", type=int, default=6)
    p.add_argument("--timing-only", action="store_true", help="skip the accuracy fits and the collective counts")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: one GPU, ResNet-18, bf16")
    args = parse(p, argv)
    gpu = args.device == "cuda"
    if gpu and (args.nets != ["resnet18"] or not args.timing_only):
        p.error("--device cuda times ResNet-18 fits on one GPU: add --nets resnet18 --timing-only")
    if min(*args.accumulates, args.rounds, args.accuracy_epochs) < 1:
        p.error(
            f"--accumulate, --rounds and --accuracy-epochs must be >= 1, got {args.accumulates}, {args.rounds}, "
            f"{args.accuracy_epochs}"
        )
    settings = run_settings(args, GPU_NETS if gpu else NETS, {"warmup_steps": 1, "steps": 3})
    if gpu:  # the GPU's flags; --quick: data for its few batches of 256
        settings = settings | GPU | ({"train_size": 4_000} if args.quick else {})
    return {
        **settings,
        "base_config": BASE_CONFIG,
        "accumulates": [2] if args.quick else sorted(set(args.accumulates)),
        "rounds": 1 if args.quick else args.rounds,
        "accuracy_epochs": 1 if args.quick else args.accuracy_epochs,
        "run_timeout_s": 1800.0,
        "variants": args.variants,
        "timing_only": args.timing_only,
    }, args.max_wait_s


def measure(cfg: dict[str, Any]) -> dict[str, Any]:
    """The timed fits, interleaved per net and setting; then, unless ``timing_only``, the accuracy fits and
    the collective counts."""
    timed = {net: [v for v in variants_for(net) if v in cfg["variants"]] for net in cfg["nets"]}
    timing = interleaved_fits(cfg, timed, cfg["rounds"], lambda net, v, acc, _: timing_run(cfg, net, v, acc))
    accumulate = 2 if 2 in cfg["accumulates"] else cfg["accumulates"][0]
    extras, most = not cfg["timing_only"], max(cfg["accumulates"])
    accuracy = {variant: accuracy_run(cfg, variant, accumulate) for variant in ("custom_ddp", "ddp_default") if extras}
    counted = {
        net: {v: collectives_run(cfg, net, v, most) for v in timed[net] if VARIANTS[v].processes > 1}
        for net in cfg["nets"]
        if extras
    }
    return {
        "timing": timing,
        "accuracy": accuracy,
        "collectives": {"accumulate": most, "nets": counted},
        "variants": {k: asdict(v) for k, v in VARIANTS.items()},
    }


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the comparison and write its record and report; returns the record."""
    cfg, max_wait_s = parse_config(argv)
    os.chdir(REPO_ROOT)  # train.py, its data/ folder and the relative paths of the recorded commands
    return run_benchmark(
        "fits.compare", cfg, argv, write, lambda: measure(cfg), Path(cfg["out"]), max_wait_s, timed=False
    )


if __name__ == "__main__":
    main()
