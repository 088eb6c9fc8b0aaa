"""The step-time target with the host's drift paired out: Lightning fits back to back in ONE pair of ranks.

    python -m benchmarks.fits.paired_fits                              # ~70 minutes on 2 Zen 3 cores, ~20 on Zen 5
    python -m benchmarks.fits.paired_fits --nets template --pairs 40   # the template net alone: ~25 minutes on Zen 3
    python -m benchmarks.fits.paired_fits --nets template --accumulate 2 4 --pairs 120   # ~60 minutes on Zen 3
    python -m benchmarks.fits.paired_fits --quick --out /tmp/paired    # smoke run, under a minute

Why: ``benchmarks.fits.compare`` times every variant in fresh ``python train.py fit`` processes, round after
round. On a shared host whose speed drifts by tens of percent over tens of seconds, whole rounds
disagree, and 8 rounds leave the custom_ddp / ddp ratio an interval 20 % wide
(``results/compare_localbn_zen3``): the target (custom_ddp with local BN at most 1.00x ddp tuned,
95 % upper bound below 1.03) cannot be decided there. Here ``torchrun`` starts the 2 ranks once
(``cores // 2`` intra-op threads each, what Lightning's launcher gives each of 2 processes) and every
rank runs Lightning fits back to back, alternating the variants (A B, B A, A B, ...): the two fits of
a pair run seconds apart and share the host's state of those seconds. Each fit is built as
``python train.py fit`` builds it (``train.main(args, run=False)``, then ``trainer.fit``) with the
flags of compare's timed fits (:func:`benchmarks.fits.compare_runs.fit_flags`): its own model, data,
Trainer and strategy (DDP's reducer, custom_ddp's buckets and shared memory), warm-up steps, then
timed optimizer steps under ``BenchmarkMonitor`` (kept: the slowest rank's time of every step). What
differs from compare's fits: the process start, and the process group, created by the first fit and
kept by the next ones as in any script that calls ``fit`` twice.

The ratio judged is the geometric mean over pairs of each pair's ratio of median step times
(:func:`measure.stats.pair_ratio_ci`); its interval draws whole pairs, both sides of a drawn pair
together, then the steps inside each drawn run. The host's speed in a pair's minute, which both of
its fits share, cancels in that pair's ratio. Reported next to it: the ratio of the medians of all
pairs' steps pooled, with the same pairs drawn together (``paired_ratio_ci``: a pair run in a slow
minute moves both pooled medians, by different amounts, so its interval is wider), and the same runs
drawn apart (``ratio_ci``, as compare draws its rounds), to show what pairing changes. Verdicts on the
targets: custom_ddp with local BN at most 1.00x ddp tuned, upper bound below 1.03; custom_ddp with its
SyncBatchNorm (``--variants custom_ddp custom_ddp_localbn ddp_tuned``) at most 1.10x ddp tuned (upper bound
below 1.15) on ResNet-18 and 1.05x (below 1.10) on the template net, and SyncBN's share of its step
(1 - local BN / SyncBN, the whole interval) at most 10 %. Met when the ratio is at most its target and its
upper bound below the bound; missed when its lower bound is above the target.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchmarks.fits.compare_runs import (
    REPO_ROOT,
    call_logged,
    fit_flags,
    fits_parser,
    interleaved_fits,
    monitor_flags,
    read_monitor,
    run_settings,
    setting_title,
    short_fit_flags,
    step_rows,
    step_table,
)
from benchmarks.fits.variants import MATCHED_THREADS, VARIANTS
from benchmarks.fits.variants import NETS as COMPARE_NETS
from benchmarks.harness import medians, parse, ratios, run_benchmark, verdict
from benchmarks.report import fmt_value, publish, table
from measure.stats import pair_ratio_ci, paired_ratio_ci

# Per net: batch per process, warm-up and timed optimizer steps of one fit (compare's, with fewer timed
# ResNet-18 steps: more pairs of shorter fits pin the ratio down better than fewer long ones).
NETS = COMPARE_NETS | {"resnet18": COMPARE_NETS["resnet18"] | {"steps": 4}}
TITLE = "custom_ddp vs Lightning ddp, paired fits in one pair of CPU ranks, synthetic data"
DEFAULT_VARIANTS = ("custom_ddp_localbn", "ddp_tuned")
RATIOS = (
    ("custom_ddp_localbn", "ddp_tuned"),
    ("custom_ddp_localbn_gloo", "ddp_tuned"),
    ("custom_ddp_localbn", "custom_ddp_localbn_gloo"),
    ("custom_ddp", "ddp_tuned"),  # with its SyncBatchNorm, against ddp's local BN
    ("custom_ddp_localbn", "custom_ddp"),  # 1 - SyncBN's share of the custom_ddp step
)
# Targets judged, by ratio and net: (the ratio at most, its CI's upper bound below).
TARGETS = {
    ("custom_ddp_localbn", "ddp_tuned"): dict.fromkeys(NETS, (1.00, 1.03)),
    ("custom_ddp", "ddp_tuned"): {"template": (1.05, 1.10), "resnet18": (1.10, 1.15)},
}
MEASURE = "paired fits (geometric mean of the pairs' ratios), "  # how a headline row names what it measured
SYNCBN_SHARE = (("custom_ddp_localbn", "custom_ddp"), 0.10)  # the ratio it is 1 - of, its target (whole CI)
_TIMING_FILE = "timing.json"


# The worker: one of the 2 ranks torchrun starts.
def _timed_fit(cfg: dict[str, Any], net: str, variant: str, accumulate: int, pair: int) -> dict[str, Any] | None:
    """One Lightning fit of ``variant`` as ``train.py fit`` builds it; rank 0 returns its timing, the others None."""
    import train  # Lightning: the worker's import only, the parent stays light

    warmup, steps = cfg["nets"][net]["warmup_steps"], cfg["nets"][net]["steps"]
    run_dir = Path(cfg["out"], "work", f"{net}_{variant}_acc{accumulate}_pair{pair}")
    short_fit = short_fit_flags(run_dir, accumulate, warmup + steps)
    flags = fit_flags(cfg, net, variant, accumulate, short_fit, *monitor_flags(warmup))
    started = time.perf_counter()
    cli = train.main(args=flags, run=False)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    wall_s = time.perf_counter() - started
    if not cli.trainer.is_global_zero:
        return None
    return {"pair": pair, "wall_s": wall_s, **read_monitor(run_dir, micro_batches=True)}


def worker(config_path: Path) -> None:
    """Every net and accumulation setting: ``pairs`` pairs of fits, the variants' order alternating; rank 0
    writes the runs to ``out/work/timing.json``."""
    cfg = json.loads(config_path.read_text())
    del sys.argv[1:]  # LightningCLI warns when given args next to a command line: the fits' args are all there is
    timing = interleaved_fits(cfg, cfg["variants_by_net"], cfg["pairs"], functools.partial(_timed_fit, cfg))
    if int(os.environ.get("RANK", "0")) == 0:
        Path(cfg["out"], "work", _TIMING_FILE).write_text(json.dumps(timing))


def _run_workers(cfg: dict[str, Any]) -> dict[str, Any]:
    """Start the 2 ranks with torchrun and read rank 0's timing from ``out/work`` (with the ranks' output;
    :func:`main` removes it once the record is written, and keeps it when anything failed)."""
    work = Path(cfg["out"], "work")
    work.mkdir(parents=True, exist_ok=True)
    (work / "config.json").write_text(json.dumps(cfg))
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    command = [*torchrun, "-m", "benchmarks.fits.paired_fits", "--worker", str(work / "config.json")]
    call_logged(command, work / "paired_fits.txt", cfg["timeout_s"], MATCHED_THREADS)
    timing = json.loads((work / _TIMING_FILE).read_text())
    # Each fit's run description (strategy options, versions: the same in every pair) kept on the first
    # pair's runs only: hundreds of fits would repeat it hundreds of times.
    for by_variant in (by_variant for by_acc in timing.values() for by_variant in by_acc.values()):
        for run in (run for runs in by_variant.values() for run in runs if run["pair"] != 0):
            run.pop("recorded", None)
    return timing


# Analysis, headline and report: from the record alone.
def _target_verdict(estimate: dict[str, float], at_most: float, bound: float) -> str:
    if estimate["value"] <= at_most and estimate["high"] < bound:
        return "met"
    return "missed" if estimate["low"] > at_most else "undecided"


def _judged(pair: tuple[str, str], net: str, estimate: dict[str, float]) -> dict[str, str]:
    """The target and verdict of ``pair``'s ratio on ``net``, if it has one."""
    if net not in TARGETS.get(pair, {}):
        return {}
    at_most, bound = TARGETS[pair][net]
    return {"target": f"<= {at_most:.2f}, CI high < {bound:.2f}", "verdict": _target_verdict(estimate, at_most, bound)}


def _share_row(estimate: dict[str, float], net: str, acc: str) -> dict[str, Any]:
    """SyncBN's share of the custom_ddp step, 1 - local BN / SyncBN, judged on its whole interval."""
    share = {"value": 1 - estimate["value"], "low": 1 - estimate["high"], "high": 1 - estimate["low"]}
    share["n"] = estimate["n"]
    what = f"SyncBN share of the custom_ddp step (1 - local BN / SyncBN), paired fits, {net} net, accumulate {acc}"
    target = SYNCBN_SHARE[1]
    return {"what": what, "value": share, "unit": "%", "target": f"<= {target:.0%}", "verdict": verdict(share, target)}


def _micro_batches(runs: list[dict[str, Any]], accumulate: int) -> dict[str, list[list[float]]]:
    """Each run's micro-batches in two kinds: the last of each step (it syncs the gradients and steps) and
    the others (they accumulate: no communication on either side)."""
    last = accumulate - 1
    return {
        "syncing": [run["micro_batch_s"][last::accumulate] for run in runs],
        "accumulating": [[t for i, t in enumerate(run["micro_batch_s"]) if i % accumulate != last] for run in runs],
    }


def _pair_estimates(samples: dict[str, list], by_variant: dict[str, list], accumulate: int) -> dict[str, Any]:
    """Every ratio per pair, pooled with the pairs drawn together and drawn apart; when accumulating, the
    syncing and the accumulating micro-batches' medians and per-pair ratios."""
    row = {
        "per_pair": ratios(samples, RATIOS, pair_ratio_ci),
        "paired": ratios(samples, RATIOS, paired_ratio_ci),
        "apart": ratios(samples, RATIOS),
    }
    if accumulate > 1 and all("micro_batch_s" in run for runs in by_variant.values() for run in runs):
        kinds = {v: _micro_batches(runs, accumulate) for v, runs in by_variant.items()}
        pairs = [(a, b) for a, b in RATIOS if a in kinds and b in kinds]
        row["micro_batch_s"] = {v: medians(by_kind) for v, by_kind in kinds.items()}
        row["micro_batch_per_pair"] = {
            f"{a}/{b}": {k: asdict(pair_ratio_ci(kinds[a][k], kinds[b][k])) for k in kinds[a]} for a, b in pairs
        }
    return row


def analyse(timing: dict[str, Any]) -> dict[str, Any]:
    """Per net and setting: step medians per variant, every ratio per pair, pooled with pairs drawn together
    and drawn apart, and (when accumulating) the syncing and the accumulating micro-batches' medians and
    per-pair ratios."""
    return step_rows(timing, _pair_estimates)


def headline(record: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per net, setting and ratio (a verdict where the ratio has a target), and SyncBN's share."""
    rows = []
    for net, by_acc in record["analysis"].items():
        for acc, row in by_acc.items():
            for key, estimate in row["per_pair"].items():
                a, b = key.split("/")
                what = f"{VARIANTS[a].label} / {VARIANTS[b].label}: step time, {MEASURE}{net} net, accumulate {acc}"
                rows.append({"what": what, "value": estimate, "unit": "x", **_judged((a, b), net, estimate)})
            share = row["per_pair"].get("/".join(SYNCBN_SHARE[0]))
            rows += [_share_row(share, net, acc)] if share else []
    return rows


def _setting_tables(row: dict[str, Any]) -> list[str]:
    """Step medians per variant, the ratios paired and apart; when accumulating, the micro-batches' split."""
    micro, kinds = row.get("micro_batch_s", {}), ("syncing", "accumulating")
    micro_headers = [f"{k} micro-batch" for k in kinds] if micro else []
    micro_cells = lambda v: [fmt_value(micro[v][k], "s") for k in kinds] if micro else []  # noqa: E731
    headers = "ratio of median step times | per pair, geometric mean [95 % CI] | pooled, pairs drawn together"
    headers += " | pooled, runs drawn apart"
    cells = [
        [k, fmt_value(e), fmt_value(row["paired"][k]), fmt_value(row["apart"][k])] for k, e in row["per_pair"].items()
    ]
    lines = [*step_table(lambda v: VARIANTS[v].label, row, micro_headers, micro_cells), "", *table(headers, cells)]
    if micro:
        split = [[k, *(fmt_value(e[kind]) for kind in kinds)] for k, e in row["micro_batch_per_pair"].items()]
        lines += ["", *table(["ratio of median micro-batch times, per pair, geometric mean", *kinds], split), ""]
        lines += [
            "The syncing micro-batch is the last of each step: its backward syncs the gradients and the "
            "optimizer steps after it; the accumulating ones communicate on neither side."
        ]
    return lines


def write(record: dict[str, Any], out: Path) -> None:
    """Analyse the kept runs, then write results.json and results.md."""
    cfg = record["config"]
    record["analysis"] = analyse(record["timing"])
    record["headline"] = headline(record)
    variants = "; ".join(f"**{VARIANTS[v].label}** (`{v}`): {VARIANTS[v].description}" for v in cfg["variants"])
    nets = "; ".join(f"{n}: {s}" for n, s in cfg["nets"].items())
    body = [f"Pairs of fits per setting: {cfg['pairs']}; {nets}. Variants: {variants}.", ""]
    for net, by_acc in record["analysis"].items():
        for acc, row in by_acc.items():
            body += [setting_title(cfg, net, acc), "", *_setting_tables(row), ""]
    publish(out, record, TITLE, body)


def parse_config(argv: Sequence[str] | None = None) -> tuple[dict[str, Any], float]:
    """The runs' settings from the command line, and the quiet wait; ``--quick``: 1 pair of 1 + 2 steps on
    the template net at accumulate 2, tiny data."""
    two_process = [name for name, v in VARIANTS.items() if v.processes == 2]
    help_variants = "variants fitted in turn (2-process ones); ratios need both of their variants"
    p = fits_parser(
        "fits.paired_fits",
        __doc__,
        NETS,
        {"choices": two_process, "default": list(DEFAULT_VARIANTS), "help": help_variants},
    )
    p.add_argument("--pairs", type=int, default=30, help="pairs of fits per net and accumulation setting")
    args = parse(p, argv)
    if min(*args.accumulates, args.pairs) < 1 or len(set(args.variants)) < 2:
        p.error(
            f"--accumulate and --pairs must be >= 1 and --variants name 2 or more variants, got "
            f"{args.accumulates}, {args.pairs}, {args.variants}"
        )
    args.nets = ["template"] if args.quick else args.nets  # --quick: the template net alone
    return {
        **run_settings(args, NETS, {"warmup_steps": 1, "steps": 2}),
        "accumulates": [2] if args.quick else sorted(set(args.accumulates)),
        "pairs": 1 if args.quick else args.pairs,
        "variants": args.variants,
        "timeout_s": 4 * 3600.0,
        "variants_by_net": {net: [v for v in args.variants if net in VARIANTS[v].nets] for net in args.nets},
    }, args.max_wait_s


def main(argv: Sequence[str] | None = None) -> dict[str, Any] | None:
    """Run the paired fits and write their record and report; returns the record (None in a worker)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["--worker"]:  # one of the ranks _run_workers starts
        os.chdir(REPO_ROOT)
        worker(Path(args[1]))
        return None
    cfg, max_wait_s = parse_config(argv)
    os.chdir(REPO_ROOT)  # train.py's data/ folder and the recorded relative paths
    record = run_benchmark(
        "fits.paired_fits", cfg, argv, write, lambda: {"timing": _run_workers(cfg)}, cfg["out"], max_wait_s
    )
    shutil.rmtree(Path(cfg["out"], "work"))  # only now: a failure in the analysis keeps the runs' timing.json
    return record


if __name__ == "__main__":
    main()
