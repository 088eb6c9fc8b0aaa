"""Compare the hand-written ``custom_ddp`` strategy with Lightning's ``ddp``: step time, accuracy, collectives.

    python -m benchmarks.compare                              # about 25 minutes on 2 CPU cores
    python -m benchmarks.compare --quick --out /tmp/compare   # smoke run, about 5 minutes
    python -m benchmarks.compare --variants custom_ddp_localbn custom_ddp_localbn_gloo ddp_tuned --timing-only \
        --rounds 6 --out benchmarks/results/compare_localbn     # the step-time target alone, ~30 minutes

(2 rounds x 3 settings x 16 variants = 96 timed fits of 5-25 s, 11 collective counts of ~10 s, 2
accuracy fits of ~1 minute, up to 5 minutes of waiting for a quiet machine.) On the template net
and ResNet-18 (CIFAR stem), at accumulate 1, 2 and 4, each variant of :data:`compare_runs.VARIANTS` runs
``--rounds`` short fits, interleaved so that drifting load hits all alike: fresh ``python train.py
fit`` runs as a user types them, one epoch of warm-up + timed steps under ``BenchmarkMonitor``
(kept: the slowest rank's time of every step, the run's intra-op threads). On CPU
torch.nn.SyncBatchNorm cannot run, so ddp keeps local BatchNorm: custom_ddp (local BN) vs ddp tuned
is the like-for-like comparison of the gradient sync. Then custom_ddp and ddp_default train the
template net's full schedule on SYNTHETIC data (not CIFAR-100 accuracies), each tested by ONE
process, and every 2-process variant's collectives per optimizer step are counted by source.
Derived from the record alone (:func:`write`), with bootstrap 95 % CIs: step-time ratios naming
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

from benchmarks.compare_runs import (
    BASE_CONFIG,
    REPO_ROOT,
    VARIANTS,
    accuracy_run,
    collectives_run,
    run_settings,
    timing_run,
    variants_for,
)
from benchmarks.harness import (
    difference_ci,
    finish_run,
    fmt_bytes,
    fmt_value,
    headline_row,
    interleave,
    median_ci,
    parse,
    parser,
    plot_estimates,
    ratio_ci,
    report,
    share_ci,
    table,
    wait_for_quiet,
    write_record,
)

# Per net: batch per process, warm-up and timed optimizer steps of a timing run. ResNet-18's CIFAR
# stem keeps 32x32 maps in its first stage: ~0.2 s per 8-image micro-batch on one core.
NETS = {
    "template": {"batch_size": 32, "warmup_steps": 3, "steps": 16},
    "resnet18": {"batch_size": 8, "warmup_steps": 2, "steps": 8},
}
TITLE = "custom_ddp vs Lightning ddp, 2 CPU processes, synthetic data"
CURVES = ("train/loss_epoch", "train/acc1_epoch", "val/loss", "val/acc1", "test/loss", "test/acc1")  # loss, acc
# (numerator, denominator): every ratio names its anchor.
RATIOS = (
    ("custom_ddp", "ddp_default"),
    ("custom_ddp", "ddp_tuned"),
    ("custom_ddp_localbn", "ddp_tuned"),
    ("custom_ddp", "custom_ddp_localbn"),
    ("custom_ddp_bf16", "custom_ddp"),
    ("custom_ddp_compiled", "ddp_tuned"),
    ("custom_ddp_compiled", "custom_ddp"),
    ("custom_ddp_localbn_gloo", "ddp_tuned"),
    ("custom_ddp_localbn", "custom_ddp_localbn_gloo"),
)
# The SyncBN share of a step, 1 - step(local BN) / step(SyncBN): record key -> (SyncBN variant, its name in the text).
SYNCBN_SHARES = {
    "syncbn_share": ("custom_ddp", "custom_ddp"),
    "syncbn_share_compiled": ("custom_ddp_compiled", "custom_ddp (SyncBN, compiled)"),
}
BASELINES = {"single_matched": "thread-matched", "single": "all cores"}


# Analysis, headline, report and plots: from the record alone.
def analyse(timing: dict[str, Any], variants: dict[str, Any]) -> dict[str, Any]:
    """Per net and accumulation setting: step medians, threads, ratios, SyncBN share, exposed
    communication (thread-matched) and scaling efficiency against each 1-process baseline."""
    analysis: dict[str, Any] = {}
    for net, by_acc in timing.items():
        for acc, by_variant in by_acc.items():
            samples = {v: [run["step_s"] for run in runs] for v, runs in by_variant.items()}  # runs: resampled whole
            two = [v for v in samples if variants[v]["processes"] > 1]
            row = {
                "step_s": {v: asdict(median_ci(s)) for v, s in samples.items()},
                "threads": {v: sorted({run["threads"] for run in runs}) for v, runs in by_variant.items()},
                "ratios": {
                    f"{a}/{b}": asdict(ratio_ci(samples[a], samples[b]))
                    for a, b in RATIOS
                    if a in samples and b in samples
                },
                "exposed_comm_s": {
                    v: asdict(difference_ci(samples[v], samples["single_matched"]))
                    for v in two
                    if "single_matched" in samples
                },
                "scaling_efficiency": {
                    b: {v: asdict(ratio_ci(samples[b], samples[v])) for v in two} for b in BASELINES if b in samples
                },
            }
            for key, (variant, _) in SYNCBN_SHARES.items():
                if {variant, "custom_ddp_localbn"} <= set(samples):
                    row[key] = asdict(share_ci(samples["custom_ddp_localbn"], samples[variant]))
            analysis.setdefault(net, {})[acc] = row
    return analysis


def headline(record: dict[str, Any]) -> list[dict[str, Any]]:
    """Per net, one row per quantity with its value at every accumulation setting; bf16; accuracy."""
    rows, label = [], lambda v: record["variants"].get(v, {}).get("label", v)  # noqa: E731
    for net, by_acc in record["analysis"].items():
        at = f"{net} net, accumulate {' / '.join(by_acc)}"

        def add(what: str, get: Any, unit: str = "", by_acc: dict = by_acc, at: str = at) -> None:
            values = [get(row) for row in by_acc.values()]
            if any(v is not None for v in values):
                rows.append(headline_row(f"{what}, {at}", values, unit))

        for a, b in RATIOS[:1] + RATIOS[2:3] + RATIOS[4:]:  # vs ddp default, like for like, bf16 vs fp32
            add(f"{label(a)} / {label(b)}: step time", lambda r, a=a, b=b: r["ratios"].get(f"{a}/{b}"), "x")
        for key, (_, name) in SYNCBN_SHARES.items():
            add(f"SyncBN share of the {name} step (1 - local BN / SyncBN)", lambda r, key=key: r.get(key), "%")
        add(
            "custom_ddp (SyncBN): exposed communication vs 1 process, thread-matched",
            lambda r: r["exposed_comm_s"].get("custom_ddp"),
            "s",
        )
        for base, kind in BASELINES.items():
            add(
                f"custom_ddp (SyncBN): scaling efficiency vs 1 process, {kind}",
                lambda r, base=base: r["scaling_efficiency"].get(base, {}).get("custom_ddp"),
            )
    counted = record.get("collectives") or {"nets": {}}
    for net, runs in counted["nets"].items():
        if "custom_ddp_bf16" in runs:
            fp32, bf16 = (runs[v]["bytes"].get("grad_buckets", 0) for v in ("custom_ddp", "custom_ddp_bf16"))
            rows.append(
                headline_row(
                    f"custom_ddp gradient all-reduce bytes per optimizer step, fp32 -> bf16, {net} "
                    f"net, accumulate {counted['accumulate']}",
                    f"{fmt_bytes(fp32)} -> {fmt_bytes(bf16)} ({bf16 / fp32:.3g}x)",
                )
            )
    return rows + [
        headline_row(f"final test top-1 (%), {label(v)}, template net", a.get("test_acc1"))
        for v, a in record["accuracy"].items()
    ]


def read_scalars(log_dir: Path, tags: tuple[str, ...] = CURVES) -> dict[str, list[tuple[int, float]]]:
    """``(step, value)`` series of the wanted TensorBoard tags found in ``log_dir``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    events.Reload()
    present = set(events.Tags()["scalars"])
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in tags if tag in present}


def _tables(record: dict[str, Any]) -> list[str]:
    """Step time per net and setting; then the collectives per optimizer step by source."""
    lines, label, collectives = [], lambda v: record["variants"][v]["label"], record["collectives"]  # noqa: E731
    for net, by_acc in record["analysis"].items():
        for acc, row in by_acc.items():
            cells = [
                [
                    label(v),
                    ", ".join(map(str, row["threads"][v])),
                    fmt_value(step, "s"),
                    step["n"],
                    fmt_value(row["exposed_comm_s"].get(v), "s"),
                    *(fmt_value(row["scaling_efficiency"].get(b, {}).get(v)) for b in BASELINES),
                ]
                for v, step in row["step_s"].items()
            ]
            lines += [
                f"### {net} net (batch {record['config']['nets'][net]['batch_size']} per process), accumulate {acc}",
                "",
                *table(
                    [
                        "variant",
                        "threads",
                        "step",
                        "steps",
                        "exposed comm. vs 1 process, thread-matched",
                        *(f"scaling eff. vs 1 process, {k}" for k in BASELINES.values()),
                    ],
                    cells,
                ),
                "",
                *table(
                    ["ratio of median step times", "value [95 % CI]"],
                    [[k, fmt_value(e)] for k, e in row["ratios"].items()],
                ),
                "",
                *(
                    f"SyncBN share of the {name} step: {fmt_value(row[key], '%')}."
                    for key, (_, name) in SYNCBN_SHARES.items()
                    if key in row
                ),
                "",
            ]
    if not collectives["nets"]:
        return lines  # --timing-only
    lines += [
        f"## Collectives per optimizer step at accumulate {collectives['accumulate']}, by source",
        "",
        "Counted by the profiler on rank 0 (`measure.collective_count`), the last of 3 steps; bytes are this "
        "rank's payload. `lightning_sigterm` is Lightning's own per-batch broadcast, paid by every strategy.",
        "",
    ]
    for net, runs in collectives["nets"].items():
        sources = sorted({s for run in runs.values() for s in run["counts"]})
        cells = [
            [
                source,
                *(
                    f"{run['counts'].get(source, 0)} / {fmt_bytes(run['bytes'].get(source, 0))}"
                    for run in runs.values()
                ),
            ]
            for source in sources
        ]
        cells.append(
            [
                "**total**",
                *(f"{sum(run['counts'].values())} / {fmt_bytes(sum(run['bytes'].values()))}" for run in runs.values()),
            ]
        )
        lines += [f"### {net}", "", *table(["source", *map(label, runs)], cells), ""]
    return lines


def write(record: dict[str, Any], out: Path) -> None:
    """Read the accuracy runs' logs under ``out/tb``, analyse, write results.json/.md and the plots."""
    cfg, variants = record["config"], record["variants"]
    curves = {
        v: {**read_scalars(out / "tb" / v / "fit"), **read_scalars(out / "tb" / v / "test")} for v in record["accuracy"]
    }
    for v, log in curves.items():
        record["accuracy"][v] |= {"test_acc1": 100 * log["test/acc1"][-1][1], "test_loss": log["test/loss"][-1][1]}
    record["analysis"] = analyse(record["timing"], variants)
    record["headline"] = headline(record)
    timed = cfg.get("variants", list(variants))  # records before --variants timed every variant
    body = [
        "## Variants",
        "",
        *[f"- **{v['label']}** (`{k}`): {v['description']}" for k, v in variants.items() if k in timed],
        "",
        f"Timing: {cfg['rounds']} rounds per setting; {'; '.join(f'{n}: {s}' for n, s in cfg['nets'].items())}.",
        "",
        "## Step time",
        "",
        *_tables(record),
    ]
    body += (
        [
            "## Accuracy (same seed, data and schedule; SYNTHETIC data)",
            "",
            *table(
                ["variant", "epochs", "accumulate", "final test top-1 (%)", "final test loss"],
                [
                    [
                        variants[v]["label"],
                        cfg["accuracy_epochs"],
                        a["accumulate"],
                        f"{a['test_acc1']:.1f}",
                        f"{a['test_loss']:.3f}",
                    ]
                    for v, a in record["accuracy"].items()
                ],
            ),
            "",
            f"![step time](step_time.png) ![curves](curves.png) `tensorboard --logdir {cfg['out']}/tb` shows the "
            "accuracy runs side by side.",
        ]
        if record["accuracy"]
        else ["![step time](step_time.png)"]
    )
    write_record(out, record, report(record, TITLE, body))
    panels = [
        {
            "title": f"{net} net",
            "ylabel": "optimizer step, ms (median)",
            "scale": 1e3,
            "groups": [f"accumulate {acc}" for acc in by_acc],
            "series": {v["label"]: [row["step_s"].get(k) for row in by_acc.values()] for k, v in variants.items()},
        }
        for net, by_acc in record["analysis"].items()
    ]
    plot_estimates(
        out / "step_time.png",
        panels,
        "step time; 2 CPU processes, ddp with local BN on CPU",
        record["quietness"]["comparable"],
    )
    if not curves:
        return  # --timing-only
    epochs = max((len(series.get("val/loss", [])) for series in curves.values()), default=1)
    panels = [
        {
            "title": f"{title}: SYNTHETIC stand-in data, not CIFAR-100",
            "ylabel": title,
            "scale": scale,
            "groups": [f"epoch {e}" for e in range(1, epochs + 1)],
            "series": {
                f"{variants[v]['label']} {tag.split('/')[0]}": [None] * (epochs - len(points))
                + [value for _, value in points]
                for v, series in curves.items()
                for tag in tags
                for points in [series.get(tag, [])]
            },
        }
        for title, scale, tags in (("loss", 1.0, CURVES[0::2]), ("top-1 accuracy (%)", 100.0, CURVES[1::2]))
    ]
    plot_estimates(out / "curves.png", panels, "accuracy runs (last epoch: the one-process test)")


def parse_config(argv: Sequence[str] | None = None) -> tuple[dict[str, Any], float]:
    """The runs' shared settings from the command line, and the quiet wait; ``--quick``: one round at
    accumulate 2 of 1 + 3 steps, tiny data, one accuracy epoch."""
    p = parser("compare", __doc__)
    p.add_argument("--nets", nargs="+", choices=tuple(NETS), default=list(NETS))
    p.add_argument("--accumulate", type=int, nargs="+", default=[1, 2, 4], dest="accumulates")
    p.add_argument("--rounds", type=int, default=2, help="interleaved timed fits per variant and setting")
    p.add_argument("--accuracy-epochs", type=int, default=6)
    p.add_argument(
        "--variants",
        nargs="+",
        choices=tuple(VARIANTS),
        default=list(VARIANTS),
        help="timed variants (default: all); ratios need both of their variants",
    )
    p.add_argument("--timing-only", action="store_true", help="skip the accuracy fits and the collective counts")
    args = parse(p, argv)
    if min(*args.accumulates, args.rounds, args.accuracy_epochs) < 1:
        p.error(
            f"--accumulate, --rounds and --accuracy-epochs must be >= 1, got {args.accumulates}, {args.rounds}, "
            f"{args.accuracy_epochs}"
        )
    quick = {"warmup_steps": 1, "steps": 3} if args.quick else {}
    return {
        **run_settings(args.out, args.quick),
        "nets": {net: NETS[net] | quick for net in args.nets},
        "base_config": BASE_CONFIG,
        "accumulates": [2] if args.quick else sorted(set(args.accumulates)),
        "rounds": 1 if args.quick else args.rounds,
        "accuracy_epochs": 1 if args.quick else args.accuracy_epochs,
        "run_timeout_s": 1800.0,
        "variants": args.variants,
        "timing_only": args.timing_only,
    }, args.max_wait_s


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the comparison and write its record and report; returns the record."""
    cfg, max_wait_s = parse_config(argv)
    os.chdir(REPO_ROOT)  # train.py, its data/ folder and the relative paths of the recorded commands
    quiet = wait_for_quiet(max_wait_s=max_wait_s)
    timed = {net: [v for v in variants_for(net) if v in cfg["variants"]] for net in cfg["nets"]}
    timing = {
        net: {
            str(acc): interleave(timed[net], cfg["rounds"], lambda v, _, net=net, acc=acc: timing_run(cfg, net, v, acc))
            for acc in cfg["accumulates"]
        }
        for net in cfg["nets"]
    }
    accumulate = 2 if 2 in cfg["accumulates"] else cfg["accumulates"][0]
    extras = not cfg["timing_only"]
    accuracy = {variant: accuracy_run(cfg, variant, accumulate) for variant in ("custom_ddp", "ddp_default") if extras}
    counted = {
        net: {v: collectives_run(cfg, net, v, max(cfg["accumulates"])) for v in timed[net] if VARIANTS[v].processes > 1}
        for net in cfg["nets"]
        if extras
    }
    return finish_run(
        "compare",
        cfg,
        quiet,
        argv,
        write,
        Path(cfg["out"]),
        timing=timing,
        accuracy=accuracy,
        collectives={"accumulate": max(cfg["accumulates"]), "nets": counted},
        variants={k: asdict(v) for k, v in VARIANTS.items()},
    )


if __name__ == "__main__":
    main()
