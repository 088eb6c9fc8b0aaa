"""The step-time target with the host's drift paired out: Lightning fits back to back in ONE pair of ranks.

    python -m benchmarks.paired_fits                              # ~70 minutes on 2 Zen 3 cores, ~20 on Zen 5
    python -m benchmarks.paired_fits --nets template --pairs 40   # the template net alone: ~25 minutes on Zen 3
    python -m benchmarks.paired_fits --nets template --accumulate 2 4 --pairs 120   # ~60 minutes on Zen 3
    python -m benchmarks.paired_fits --quick --out /tmp/paired    # smoke run, under a minute

Why: ``benchmarks.compare`` times every variant in fresh ``python train.py fit`` processes, round after
round. On a shared host whose speed drifts by tens of percent over tens of seconds, whole rounds
disagree, and 8 rounds leave the custom_ddp / ddp ratio an interval 20 % wide
(``results/compare_localbn_zen3``): the target (custom_ddp with local BN at most 1.00x ddp tuned,
95 % upper bound below 1.03) cannot be decided there. Here ``torchrun`` starts the 2 ranks once
(``cores // 2`` intra-op threads each, what Lightning's launcher gives each of 2 processes) and every
rank runs Lightning fits back to back, alternating the variants (A B, B A, A B, ...): the two fits of
a pair run seconds apart and share the host's state of those seconds. Each fit is built as
``python train.py fit`` builds it (``train.main(args, run=False)``, then ``trainer.fit``) with the
flags of compare's timed fits (:func:`benchmarks.compare_runs.fit_flags`): its own model, data,
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
drawn apart (``ratio_ci``, as compare draws its rounds), to show what pairing changes. Verdict on the
target: met when the ratio is at most 1.00 and its upper bound below 1.03; missed when its lower
bound is above 1.00.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchmarks.compare_runs import (
    MATCHED_THREADS,
    REPO_ROOT,
    VARIANTS,
    call_logged,
    fit_flags,
    monitor_flags,
    read_monitor,
    run_settings,
    short_fit_flags,
)
from benchmarks.harness import (
    finish_run,
    fmt_value,
    interleave,
    median_ci,
    pair_ratio_ci,
    paired_ratio_ci,
    parse,
    parser,
    ratio_ci,
    report,
    table,
    wait_for_quiet,
    write_record,
)

# Per net: batch per process, warm-up and timed optimizer steps of one fit (compare's, with fewer timed
# ResNet-18 steps: more pairs of shorter fits pin the ratio down better than fewer long ones).
NETS = {
    "template": {"batch_size": 32, "warmup_steps": 3, "steps": 16},
    "resnet18": {"batch_size": 8, "warmup_steps": 2, "steps": 4},
}
TITLE = "custom_ddp vs Lightning ddp, paired fits in one pair of CPU ranks, synthetic data"
DEFAULT_VARIANTS = ("custom_ddp_localbn", "ddp_tuned")
RATIOS = (
    ("custom_ddp_localbn", "ddp_tuned"),
    ("custom_ddp_localbn_gloo", "ddp_tuned"),
    ("custom_ddp_localbn", "custom_ddp_localbn_gloo"),
)
TARGET = {"at_most": 1.00, "upper_bound_below": 1.03}
_TIMING_FILE = "timing.json"


# The worker: one of the 2 ranks torchrun starts.
def _timed_fit(cfg: dict[str, Any], net: str, variant: str, accumulate: int, pair: int) -> dict[str, Any] | None:
    """One Lightning fit of ``variant`` as ``train.py fit`` builds it; rank 0 returns its timing, the others None."""
    import train  # Lightning: the worker's import only, the parent stays light

    setting = cfg["nets"][net]
    run_dir = Path(cfg["out"], "work", f"{net}_{variant}_acc{accumulate}_pair{pair}")
    flags = fit_flags(
        cfg,
        net,
        variant,
        accumulate,
        short_fit_flags(run_dir, accumulate, setting["warmup_steps"] + setting["steps"]),
        *monitor_flags(setting["warmup_steps"]),
    )
    started = time.perf_counter()
    cli = train.main(args=flags, run=False)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    wall_s = time.perf_counter() - started
    return (
        {"pair": pair, "wall_s": wall_s, **read_monitor(run_dir, micro_batches=True)}
        if cli.trainer.is_global_zero
        else None
    )


def worker(config_path: Path) -> None:
    """Every net and accumulation setting: ``pairs`` pairs of fits, the variants' order alternating; rank 0
    writes the runs to ``out/work/timing.json``."""
    cfg = json.loads(config_path.read_text())
    del sys.argv[1:]  # LightningCLI warns when given args next to a command line: the fits' args are all there is
    timing = {
        net: {
            str(acc): interleave(
                cfg["variants_by_net"][net],
                cfg["pairs"],
                lambda v, i, net=net, acc=acc: _timed_fit(cfg, net, v, acc, i),
            )
            for acc in cfg["accumulates"]
        }
        for net in cfg["nets"]
    }
    if int(os.environ.get("RANK", "0")) == 0:
        Path(cfg["out"], "work", _TIMING_FILE).write_text(json.dumps(timing))


def _run_workers(cfg: dict[str, Any]) -> dict[str, Any]:
    """Start the 2 ranks with torchrun and read rank 0's timing from ``out/work`` (with the ranks' output;
    :func:`main` removes it once the record is written, and keeps it when anything failed)."""
    work = Path(cfg["out"], "work")
    log = work / "paired_fits.txt"
    work.mkdir(parents=True, exist_ok=True)
    (work / "config.json").write_text(json.dumps(cfg))
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        "-m",
        "benchmarks.paired_fits",
        "--worker",
        str(work / "config.json"),
    ]
    call_logged(command, log, cfg["timeout_s"], MATCHED_THREADS)
    return _without_repeats(json.loads((work / _TIMING_FILE).read_text()))


def _without_repeats(timing: dict[str, Any]) -> dict[str, Any]:
    """The runs, each fit's run description (strategy options, versions: the same in every pair) kept on
    the first pair's runs only: hundreds of fits would repeat it hundreds of times."""
    return {
        net: {
            acc: {
                v: [run if run["pair"] == 0 else {k: x for k, x in run.items() if k != "recorded"} for run in runs]
                for v, runs in by_variant.items()
            }
            for acc, by_variant in by_acc.items()
        }
        for net, by_acc in timing.items()
    }


# Analysis, headline and report: from the record alone.
def _target_verdict(estimate: dict[str, float]) -> str:
    if estimate["value"] <= TARGET["at_most"] and estimate["high"] < TARGET["upper_bound_below"]:
        return "met"
    return "missed" if estimate["low"] > TARGET["at_most"] else "undecided"


def _micro_batches(runs: list[dict[str, Any]], accumulate: int) -> dict[str, list[list[float]]]:
    """Each run's micro-batches in two kinds: the last of each step (it syncs the gradients and steps) and
    the others (they accumulate: no communication on either side)."""
    last = accumulate - 1
    return {
        "syncing": [run["micro_batch_s"][last::accumulate] for run in runs],
        "accumulating": [[t for i, t in enumerate(run["micro_batch_s"]) if i % accumulate != last] for run in runs],
    }


def _analyse_setting(by_variant: dict[str, list[dict[str, Any]]], accumulate: int) -> dict[str, Any]:
    samples = {v: [run["step_s"] for run in runs] for v, runs in by_variant.items()}
    pairs = [(a, b) for a, b in RATIOS if a in samples and b in samples]
    row = {
        "step_s": {v: asdict(median_ci(s)) for v, s in samples.items()},
        "threads": {v: sorted({run["threads"] for run in runs}) for v, runs in by_variant.items()},
        "per_pair": {f"{a}/{b}": asdict(pair_ratio_ci(samples[a], samples[b])) for a, b in pairs},
        "paired": {f"{a}/{b}": asdict(paired_ratio_ci(samples[a], samples[b])) for a, b in pairs},
        "apart": {f"{a}/{b}": asdict(ratio_ci(samples[a], samples[b])) for a, b in pairs},
    }
    if accumulate > 1 and all("micro_batch_s" in run for runs in by_variant.values() for run in runs):
        kinds = {v: _micro_batches(runs, accumulate) for v, runs in by_variant.items()}
        row["micro_batch_s"] = {
            v: {k: asdict(median_ci(s)) for k, s in by_kind.items()} for v, by_kind in kinds.items()
        }
        row["micro_batch_per_pair"] = {
            f"{a}/{b}": {k: asdict(pair_ratio_ci(kinds[a][k], kinds[b][k])) for k in kinds[a]} for a, b in pairs
        }
    return row


def analyse(timing: dict[str, Any]) -> dict[str, Any]:
    """Per net and setting: step medians per variant, every ratio per pair, pooled with pairs drawn together
    and drawn apart, and (when accumulating) the syncing and the accumulating micro-batches' medians and
    per-pair ratios."""
    return {
        net: {acc: _analyse_setting(by_variant, int(acc)) for acc, by_variant in by_acc.items()}
        for net, by_acc in timing.items()
    }


def headline(record: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per net and setting for the target's ratio (its verdict), the other ratios without one."""
    rows, label = [], lambda v: VARIANTS[v].label  # noqa: E731
    target = f"<= {TARGET['at_most']:.2f}, CI high < {TARGET['upper_bound_below']:.2f}"
    for net, by_acc in record["analysis"].items():
        for acc, row in by_acc.items():
            for key, estimate in row["per_pair"].items():
                a, b = key.split("/")
                judged = (a, b) == RATIOS[0]
                rows.append(
                    {
                        "what": f"{label(a)} / {label(b)}: step time, paired fits (geometric mean of the pairs' "
                        f"ratios), {net} net, accumulate {acc}",
                        "value": estimate,
                        "unit": "x",
                        **({"target": target, "verdict": _target_verdict(estimate)} if judged else {}),
                    }
                )
    return rows


def write(record: dict[str, Any], out: Path) -> None:
    """Analyse the kept runs, then write results.json and results.md."""
    cfg = record["config"]
    record["analysis"] = analyse(record["timing"])
    record["headline"] = headline(record)
    body = [
        f"Pairs of fits per setting: {cfg['pairs']}; {'; '.join(f'{n}: {s}' for n, s in cfg['nets'].items())}. "
        "Variants: "
        + "; ".join(f"**{VARIANTS[v].label}** (`{v}`): {VARIANTS[v].description}" for v in cfg["variants"])
        + ".",
        "",
    ]
    for net, by_acc in record["analysis"].items():
        for acc, row in by_acc.items():
            body += [
                f"### {net} net (batch {cfg['nets'][net]['batch_size']} per process), accumulate {acc}",
                "",
                *_setting_tables(row),
                "",
            ]
    write_record(out, record, report(record, TITLE, body))


def _setting_tables(row: dict[str, Any]) -> list[str]:
    """Step medians per variant, the ratios paired and apart; when accumulating, the micro-batches' split."""
    micro, kinds = row.get("micro_batch_s", {}), ("syncing", "accumulating")
    lines = [
        *table(
            ["variant", "threads", "step", "steps", *(f"{k} micro-batch" for k in kinds if micro)],
            [
                [
                    VARIANTS[v].label,
                    ", ".join(map(str, row["threads"][v])),
                    fmt_value(e, "s"),
                    e["n"],
                    *(fmt_value(micro[v][k], "s") for k in kinds if micro),
                ]
                for v, e in row["step_s"].items()
            ],
        ),
        "",
        *table(
            [
                "ratio of median step times",
                "per pair, geometric mean [95 % CI]",
                "pooled, pairs drawn together",
                "pooled, runs drawn apart",
            ],
            [
                [k, fmt_value(e), fmt_value(row["paired"][k]), fmt_value(row["apart"][k])]
                for k, e in row["per_pair"].items()
            ],
        ),
    ]
    if micro:
        lines += [
            "",
            *table(
                ["ratio of median micro-batch times, per pair, geometric mean", *kinds],
                [[k, *(fmt_value(e[kind]) for kind in kinds)] for k, e in row["micro_batch_per_pair"].items()],
            ),
            "",
            "The syncing micro-batch is the last of each step: its backward syncs the gradients and the "
            "optimizer steps after it; the accumulating ones communicate on neither side.",
        ]
    return lines


def parse_config(argv: Sequence[str] | None = None) -> tuple[dict[str, Any], float]:
    """The runs' settings from the command line, and the quiet wait; ``--quick``: 1 pair of 1 + 2 steps on
    the template net at accumulate 2, tiny data."""
    p = parser("paired_fits", __doc__)
    p.add_argument("--nets", nargs="+", choices=tuple(NETS), default=list(NETS))
    p.add_argument("--accumulate", type=int, nargs="+", default=[1, 2, 4], dest="accumulates")
    p.add_argument("--pairs", type=int, default=30, help="pairs of fits per net and accumulation setting")
    two_process = [name for name, v in VARIANTS.items() if v.processes == 2]
    p.add_argument(
        "--variants",
        nargs="+",
        choices=two_process,
        default=list(DEFAULT_VARIANTS),
        help="variants fitted in turn (2-process ones); ratios need both of their variants",
    )
    args = parse(p, argv)
    if min(*args.accumulates, args.pairs) < 1 or len(set(args.variants)) < 2:
        p.error(
            f"--accumulate and --pairs must be >= 1 and --variants name 2 or more variants, got "
            f"{args.accumulates}, {args.pairs}, {args.variants}"
        )
    nets = ["template"] if args.quick else args.nets
    cfg = {
        **run_settings(args.out, args.quick),
        "nets": {net: NETS[net] | ({"warmup_steps": 1, "steps": 2} if args.quick else {}) for net in nets},
        "accumulates": [2] if args.quick else sorted(set(args.accumulates)),
        "pairs": 1 if args.quick else args.pairs,
        "variants": args.variants,
        "timeout_s": 4 * 3600.0,
        "variants_by_net": {net: [v for v in args.variants if net in VARIANTS[v].nets] for net in nets},
    }
    return cfg, args.max_wait_s


def main(argv: Sequence[str] | None = None) -> dict[str, Any] | None:
    """Run the paired fits and write their record and report; returns the record (None in a worker)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["--worker"]:  # one of the ranks _run_workers starts
        os.chdir(REPO_ROOT)
        worker(Path(args[1]))
        return None
    cfg, max_wait_s = parse_config(argv)
    os.chdir(REPO_ROOT)  # train.py's data/ folder and the recorded relative paths
    quiet = wait_for_quiet(max_wait_s=max_wait_s)
    started = time.monotonic()
    timing = _run_workers(cfg)
    record = finish_run("paired_fits", cfg, quiet, argv, write, Path(cfg["out"]), started, timing=timing)
    shutil.rmtree(Path(cfg["out"], "work"))  # only now: a failure in the analysis keeps the runs' timing.json
    return record


if __name__ == "__main__":
    main()
