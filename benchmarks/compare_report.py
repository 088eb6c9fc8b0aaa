"""Analysis, headline, report and plots of ``python -m benchmarks.compare`` (method and definitions: that
module), from its record only."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchmarks.harness import (
    difference_ci, fmt_bytes, fmt_value, headline_row, median_ci, plot_estimates, ratio_ci, report,
    share_ci, table, write_record)

TITLE = "custom_ddp vs Lightning ddp, 2 CPU processes, synthetic data"
CURVES = ("train/loss_epoch", "train/acc1_epoch", "val/loss", "val/acc1", "test/loss", "test/acc1")  # loss, acc
# (numerator, denominator): every ratio names its anchor.
RATIOS = (("custom_ddp", "ddp_default"), ("custom_ddp", "ddp_tuned"), ("custom_ddp_localbn", "ddp_tuned"),
          ("custom_ddp", "custom_ddp_localbn"), ("custom_ddp_bf16", "custom_ddp"))
BASELINES = {"single_matched": "thread-matched", "single": "all cores"}


def analyse(timing: dict[str, Any], variants: dict[str, Any]) -> dict[str, Any]:
    """Per net and accumulation setting: step medians, threads, ratios, SyncBN share, exposed
    communication (thread-matched) and scaling efficiency against each 1-process baseline."""
    analysis: dict[str, Any] = {}
    for net, by_acc in timing.items():
        for acc, by_variant in by_acc.items():
            samples = {v: [s for run in runs for s in run["step_s"]] for v, runs in by_variant.items()}
            two = [v for v in samples if variants[v]["processes"] > 1]
            row = {"step_s": {v: asdict(median_ci(s)) for v, s in samples.items()},
                   "threads": {v: sorted({run["threads"] for run in runs}) for v, runs in by_variant.items()},
                   "ratios": {f"{a}/{b}": asdict(ratio_ci(samples[a], samples[b])) for a, b in RATIOS
                              if a in samples and b in samples},
                   "exposed_comm_s": {v: asdict(difference_ci(samples[v], samples["single_matched"])) for v in two
                                      if "single_matched" in samples},
                   "scaling_efficiency": {b: {v: asdict(ratio_ci(samples[b], samples[v])) for v in two}
                                          for b in BASELINES if b in samples}}
            if {"custom_ddp", "custom_ddp_localbn"} <= set(samples):
                row["syncbn_share"] = asdict(share_ci(samples["custom_ddp_localbn"], samples["custom_ddp"]))
            analysis.setdefault(net, {})[acc] = row
    return analysis


def _analysis(record: dict[str, Any]) -> dict[str, Any]:
    """The analysis by net; a record from before issue 16 (one net, one 1-process baseline at torch's
    default threads, whose exposed communication was not thread-matched) in today's layout."""
    analysis = record["analysis"]
    if "step_s" not in next(iter(analysis.values()), {}):
        return analysis
    return {record["config"]["net"]: {acc: {**row, "exposed_comm_s": {},
                                            "scaling_efficiency": {"single": row.get("scaling_efficiency", {})}}
                                      for acc, row in analysis.items()}}


def headline(record: dict[str, Any]) -> list[dict[str, Any]]:
    """Per net, one row per quantity with its value at every accumulation setting; bf16; accuracy."""
    rows, label = [], lambda v: record["variants"].get(v, {}).get("label", v)  # noqa: E731
    for net, by_acc in _analysis(record).items():
        at = f"{net} net, accumulate {' / '.join(by_acc)}"

        def add(what: str, get: Any, unit: str = "") -> None:
            values = [get(row) for row in by_acc.values()]
            if any(v is not None for v in values):
                rows.append(headline_row(f"{what}, {at}", values, unit))

        for a, b in RATIOS[:1] + RATIOS[2:3] + RATIOS[4:]:  # vs ddp default, like for like, bf16 vs fp32
            add(f"{label(a)} / {label(b)}: step time", lambda r: r["ratios"].get(f"{a}/{b}"), "x")
        add("SyncBN share of the custom_ddp step (1 - local BN / SyncBN)", lambda r: r.get("syncbn_share"), "%")
        add("custom_ddp (SyncBN): exposed communication vs 1 process, thread-matched",
            lambda r: r["exposed_comm_s"].get("custom_ddp"), "s")
        for base, kind in BASELINES.items():
            add(f"custom_ddp (SyncBN): scaling efficiency vs 1 process, {kind}",
                lambda r: r["scaling_efficiency"].get(base, {}).get("custom_ddp"))
    counted = record.get("collectives") or {"nets": {}}
    for net, runs in counted["nets"].items():
        if "custom_ddp_bf16" in runs:
            fp32, bf16 = (runs[v]["bytes"].get("grad_buckets", 0) for v in ("custom_ddp", "custom_ddp_bf16"))
            rows.append(headline_row(f"custom_ddp gradient all-reduce bytes per optimizer step, fp32 -> bf16, {net} "
                                     f"net, accumulate {counted['accumulate']}",
                                     f"{fmt_bytes(fp32)} -> {fmt_bytes(bf16)} ({bf16 / fp32:.3g}x)"))
    return rows + [headline_row(f"final test top-1 (%), {label(v)}, template net", a.get("test_acc1"))
                   for v, a in record["accuracy"].items()]


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
            cells = [[label(v), ", ".join(map(str, row["threads"][v])), fmt_value(step, "s"), step["n"],
                      fmt_value(row["exposed_comm_s"].get(v), "s"),
                      *(fmt_value(row["scaling_efficiency"].get(b, {}).get(v)) for b in BASELINES)]
                     for v, step in row["step_s"].items()]
            lines += [f"### {net} net (batch {record['config']['nets'][net]['batch_size']} per process), accumulate "
                      f"{acc}", "", *table(["variant", "threads", "step", "steps", "exposed comm. vs 1 process, "
                                            "thread-matched", *(f"scaling eff. vs 1 process, {k}" for k in
                                                                BASELINES.values())], cells), "",
                      *table(["ratio of median step times", "value [95 % CI]"],
                             [[k, fmt_value(e)] for k, e in row["ratios"].items()]), "",
                      f"SyncBN share of the custom_ddp step: {fmt_value(row.get('syncbn_share'), '%')}.", ""]
    lines += [f"## Collectives per optimizer step at accumulate {collectives['accumulate']}, by source", "",
              "Counted by the profiler on rank 0 (`callbacks.collective_count`), the last of 3 steps; bytes are this "
              "rank's payload. `lightning_sigterm` is Lightning's own per-batch broadcast, paid by every strategy.", ""]
    for net, runs in collectives["nets"].items():
        sources = sorted({s for run in runs.values() for s in run["counts"]})
        cells = [[source, *(f"{run['counts'].get(source, 0)} / {fmt_bytes(run['bytes'].get(source, 0))}"
                            for run in runs.values())] for source in sources]
        cells.append(["**total**", *(f"{sum(run['counts'].values())} / {fmt_bytes(sum(run['bytes'].values()))}"
                                     for run in runs.values())])
        lines += [f"### {net}", "", *table(["source", *map(label, runs)], cells), ""]
    return lines


def write(record: dict[str, Any], out: Path) -> None:
    """Read the accuracy runs' logs under ``out/tb``, analyse, write results.json/.md and the plots."""
    cfg, variants = record["config"], record["variants"]
    curves = {v: {**read_scalars(out / "tb" / v / "fit"), **read_scalars(out / "tb" / v / "test")}
              for v in record["accuracy"]}
    for v, series in curves.items():
        record["accuracy"][v] |= {"test_acc1": 100 * series["test/acc1"][-1][1],
                                  "test_loss": series["test/loss"][-1][1]}
    record["analysis"] = analyse(record["timing"], variants)
    record["headline"] = headline(record)
    body = ["## Variants", "", *[f"- **{v['label']}** (`{k}`): {v['description']}" for k, v in variants.items()], "",
            f"Timing: {cfg['rounds']} rounds per setting; {'; '.join(f'{n}: {s}' for n, s in cfg['nets'].items())}.",
            "",
            "## Step time", "", *_tables(record), "## Accuracy (same seed, data and schedule; SYNTHETIC data)", "",
            *table(["variant", "epochs", "accumulate", "final test top-1 (%)", "final test loss"],
                   [[variants[v]["label"], cfg["accuracy_epochs"], a["accumulate"], f"{a['test_acc1']:.1f}",
                     f"{a['test_loss']:.3f}"] for v, a in record["accuracy"].items()]), "",
            f"![step time](step_time.png) ![curves](curves.png) `tensorboard --logdir {cfg['out']}/tb` shows the "
            "accuracy runs side by side."]
    write_record(out, record, report(record, TITLE, body))
    panels = [{"title": f"{net} net", "ylabel": "optimizer step, ms (median)", "scale": 1e3,
               "groups": [f"accumulate {acc}" for acc in by_acc],
               "series": {v["label"]: [row["step_s"].get(k) for row in by_acc.values()] for k, v in variants.items()}}
              for net, by_acc in record["analysis"].items()]
    plot_estimates(out / "step_time.png", panels, "step time; 2 CPU processes, ddp with local BN on CPU",
                   record["quietness"]["comparable"])
    epochs = max((len(series.get("val/loss", [])) for series in curves.values()), default=1)
    panels = [{"title": f"{title}: SYNTHETIC stand-in data, not CIFAR-100", "ylabel": title, "scale": scale,
               "groups": [f"epoch {e}" for e in range(1, epochs + 1)],
               "series": {f"{variants[v]['label']} {tag.split('/')[0]}": [None] * (epochs - len(points)) + [
                   value for _, value in points] for v, series in curves.items() for tag in tags
                   for points in [series.get(tag, [])]}}
              for title, scale, tags in (("loss", 1.0, CURVES[0::2]), ("top-1 accuracy (%)", 100.0, CURVES[1::2]))]
    plot_estimates(out / "curves.png", panels, "accuracy runs (last epoch: the one-process test)")
