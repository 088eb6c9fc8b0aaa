"""Compare the hand-written ``custom_ddp`` strategy with Lightning's ``ddp``: step time, accuracy, collectives.

    python -m benchmarks.fits.compare                              # about 25 minutes on 2 CPU cores
    python -m benchmarks.fits.compare --quick --out /tmp/compare   # smoke run, about 5 minutes
    python -m benchmarks.fits.compare --variants custom_ddp_localbn custom_ddp_localbn_gloo ddp_tuned --timing-only \
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

import functools
import os
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchmarks.fits.compare_runs import (
    BASE_CONFIG,
    GPU,
    GPU_NETS,
    NETS,
    REPO_ROOT,
    VARIANTS,
    accuracy_run,
    collectives_run,
    fits_parser,
    interleaved_fits,
    run_settings,
    setting_title,
    step_rows,
    step_table,
    timing_run,
    variants_for,
)
from benchmarks.harness import parse, ratios, run_benchmark
from benchmarks.report import Panel, fmt_bytes, fmt_value, headline_row, plot_estimates, publish, table
from measure.stats import difference_ci, ratio_ci, share_ci

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
COMMUNICATION = [
    "exposed comm. vs 1 process, thread-matched",
    *(f"scaling eff. vs 1 process, {k}" for k in BASELINES.values()),
]


# Analysis, headline, report and plots: from the record alone.
def analyse(timing: dict[str, Any], variants: dict[str, Any]) -> dict[str, Any]:
    """Per net and accumulation setting: step medians, threads, ratios, SyncBN share, exposed
    communication (thread-matched) and scaling efficiency against each 1-process baseline."""

    def estimates(samples: dict[str, list], *_: Any) -> dict[str, Any]:
        two, local = [v for v in samples if variants[v]["processes"] > 1], samples.get("custom_ddp_localbn")
        matched = samples.get("single_matched")
        efficiency = {b: {v: asdict(ratio_ci(samples[b], samples[v])) for v in two} for b in BASELINES if b in samples}
        shares = {key: samples.get(variant) for key, (variant, _) in SYNCBN_SHARES.items()}
        return {
            "ratios": ratios(samples, RATIOS),
            "exposed_comm_s": {v: asdict(difference_ci(samples[v], matched)) for v in two if matched is not None},
            "scaling_efficiency": efficiency,
        } | {key: asdict(share_ci(local, s)) for key, s in shares.items() if s is not None and local is not None}

    return step_rows(timing, estimates)


def headline(record: dict[str, Any]) -> list[dict[str, Any]]:
    """Per net, one row per quantity with its value at every accumulation setting; bf16; accuracy."""
    rows, label = [], lambda v: record["variants"].get(v, {}).get("label", v)  # noqa: E731
    for net, by_acc in record["analysis"].items():
        at = f"{net} net, accumulate {' / '.join(by_acc)}"

        def add(what: str, get: Callable, unit: str = "", by_acc: dict = by_acc, at: str = at) -> None:
            values = [get(row) for row in by_acc.values()]
            if any(v is not None for v in values):
                rows.append(headline_row(f"{what}, {at}", values, unit))

        for a, b in RATIOS[:1] + RATIOS[2:3] + RATIOS[4:]:  # vs ddp default, like for like, bf16 vs fp32
            add(f"{label(a)} / {label(b)}: step time", lambda r, key=f"{a}/{b}": r["ratios"].get(key), "x")
        for key, (_, name) in SYNCBN_SHARES.items():
            add(f"SyncBN share of the {name} step (1 - local BN / SyncBN)", lambda r, key=key: r.get(key), "%")
        exposed = "custom_ddp (SyncBN): exposed communication vs 1 process, thread-matched"
        add(exposed, lambda r: r["exposed_comm_s"].get("custom_ddp"), "s")
        for base, kind in BASELINES.items():
            efficiency = lambda r, base=base: r["scaling_efficiency"].get(base, {}).get("custom_ddp")  # noqa: E731
            add(f"custom_ddp (SyncBN): scaling efficiency vs 1 process, {kind}", efficiency)
    counted = record.get("collectives") or {"nets": {}}
    for net, runs in counted["nets"].items():
        if "custom_ddp_bf16" in runs:
            fp32, bf16 = (runs[v]["bytes"].get("grad_buckets", 0) for v in ("custom_ddp", "custom_ddp_bf16"))
            what = "custom_ddp gradient all-reduce bytes per optimizer step, fp32 -> bf16"
            what += f", {net} net, accumulate {counted['accumulate']}"
            rows.append(headline_row(what, f"{fmt_bytes(fp32)} -> {fmt_bytes(bf16)} ({bf16 / fp32:.3g}x)"))
    accuracy = record["accuracy"].items()
    return rows + [
        headline_row(f"final test top-1 (%), {label(v)}, template net", a.get("test_acc1")) for v, a in accuracy
    ]


def read_scalars(log_dir: Path, tags: tuple[str, ...] = CURVES) -> dict[str, list[tuple[int, float]]]:
    """``(step, value)`` series of the wanted TensorBoard tags found in ``log_dir``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    events.Reload()
    present = set(events.Tags()["scalars"])
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in tags if tag in present}


def _communication(row: dict[str, Any], variant: str) -> list[str]:
    """A variant's exposed communication and scaling efficiency against each 1-process baseline."""
    efficiency = (fmt_value(row["scaling_efficiency"].get(b, {}).get(variant)) for b in BASELINES)
    return [fmt_value(row["exposed_comm_s"].get(variant), "s"), *efficiency]


def _step_tables(record: dict[str, Any]) -> list[str]:
    """Per net and setting: the step time per variant, the ratios, the SyncBN share."""
    lines, label = [], lambda v: record["variants"][v]["label"]  # noqa: E731
    for net, by_acc in record["analysis"].items():
        for acc, row in by_acc.items():
            cells = functools.partial(_communication, row)
            tables = step_table(label, row, COMMUNICATION, cells)
            shares = [
                f"SyncBN share of the {name} step: {fmt_value(row[key], '%')}."
                for key, (_, name) in SYNCBN_SHARES.items()
                if key in row
            ]
            ratio_rows = [[k, fmt_value(e)] for k, e in row["ratios"].items()]
            lines += [setting_title(record["config"], net, acc), "", *tables, ""]
            lines += [*table("ratio of median step times | value [95 % CI]", ratio_rows), "", *shares, ""]
    return lines


def _collective_tables(record: dict[str, Any]) -> list[str]:
    """The collectives per optimizer step by source, per net, a column per variant."""
    collectives = record["collectives"]
    lines = [
        f"## Collectives per optimizer step at accumulate {collectives['accumulate']}, by source",
        "",
        "Counted by the profiler on rank 0 (`measure.collective_count`), the last of 3 steps; bytes are this "
        "rank's payload. `lightning_sigterm` is Lightning's own per-batch broadcast, paid by every strategy.",
        "",
    ]
    for net, runs in collectives["nets"].items():
        sources = sorted({s for run in runs.values() for s in run["counts"]})
        per_source = {s: [(run["counts"].get(s, 0), run["bytes"].get(s, 0)) for run in runs.values()] for s in sources}
        per_source["**total**"] = [(sum(run["counts"].values()), sum(run["bytes"].values())) for run in runs.values()]
        cells = [[source, *(f"{n} / {fmt_bytes(b)}" for n, b in counts)] for source, counts in per_source.items()]
        lines += [f"### {net}", "", *table(["source", *(record["variants"][v]["label"] for v in runs)], cells), ""]
    return lines


def _accuracy(record: dict[str, Any]) -> list[str]:
    cfg, variants = record["config"], record["variants"]
    cells = [
        [
            variants[v]["label"],
            cfg["accuracy_epochs"],
            a["accumulate"],
            f"{a['test_acc1']:.1f}",
            f"{a['test_loss']:.3f}",
        ]
        for v, a in record["accuracy"].items()
    ]
    return [
        "## Accuracy (same seed, data and schedule; SYNTHETIC data)",
        "",
        *table("variant | epochs | accumulate | final test top-1 (%) | final test loss", cells),
        "",
        f"![step time](step_time.png) ![curves](curves.png) `tensorboard --logdir {cfg['out']}/tb` shows the "
        "accuracy runs side by side.",
    ]


def _curve_panels(curves: dict[str, dict[str, list]], variants: dict[str, Any]) -> list[Panel]:
    """Loss and top-1 accuracy per epoch of each accuracy run, train, validation and test."""
    epochs = max((len(series.get("val/loss", [])) for series in curves.values()), default=1)
    groups = [f"epoch {e}" for e in range(1, epochs + 1)]
    panels = []
    for title, scale, tags in (("loss", 1.0, CURVES[0::2]), ("top-1 accuracy (%)", 100.0, CURVES[1::2])):
        series = {
            f"{variants[v]['label']} {tag.split('/')[0]}": [None] * (epochs - len(points))
            + [value for _, value in points]
            for v, by_tag in curves.items()
            for tag in tags
            for points in [by_tag.get(tag, [])]
        }
        panels.append(Panel(f"{title}: SYNTHETIC stand-in data, not CIFAR-100", title, groups, series, scale))
    return panels


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
        *_step_tables(record),
        *(_collective_tables(record) if record["collectives"]["nets"] else []),  # none with --timing-only
        *(_accuracy(record) if record["accuracy"] else ["![step time](step_time.png)"]),
    ]
    panels = []
    for net, by_acc in record["analysis"].items():
        series = {v["label"]: [row["step_s"].get(k) for row in by_acc.values()] for k, v in variants.items()}
        groups = [f"accumulate {acc}" for acc in by_acc]
        panels.append(Panel(f"{net} net", "optimizer step, ms (median)", groups, series, scale=1e3))
    processes, detail = "2 CPU processes", "ddp with local BN on CPU"
    if cfg.get("accelerator") == "gpu":  # compare --device cuda
        processes, detail = f"{cfg['devices']} GPU", cfg["precision"]
    step_time = (f"step time; {processes}, {detail}", panels)
    publish(out, record, TITLE.replace("2 CPU processes", processes), body, {"step_time.png": step_time})
    if curves:  # none with --timing-only
        title = "accuracy runs (last epoch: the one-process test)"
        plot_estimates(out / "curves.png", _curve_panels(curves, variants), title)


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
