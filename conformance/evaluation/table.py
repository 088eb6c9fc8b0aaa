"""Conformance table: each evaluation pattern under 1 process, Lightning's ``ddp`` and ``custom_ddp``.

Runs the patterns of :mod:`conformance.evaluation.patterns` on 11 samples (2 CPU ranks, fork + gloo,
batches of 4) and writes ``results.json`` + ``results.md`` and the block of ``docs/evaluation.md`` (``PAGE``)
between ``<!-- conformance:begin -->`` and ``<!-- conformance:end -->``. Values are what rank 0 logged.
A value of ``custom_ddp`` or ``ddp`` that differs from one process by more than 1e-6 is marked ≠::

    python -m conformance.evaluation.table                  # about a minute on 2 cores
    python -m conformance.evaluation.table --out /tmp/x     # elsewhere; the page untouched
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import DDPStrategy

from benchmarks.readme_block import replace_block
from conformance.evaluation.patterns import (
    CallbackAUROC,
    DropLastModule,
    IteratorStepsModule,
    PatternModule,
    TwoLoadersModule,
    ValidateInsideFit,
    VariableWidthGather,
)
from conformance.evaluation.uneven import UnevenShards
from measure.run_info import environment
from strategies.custom_ddp import CustomDDPStrategy

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUT = REPO_ROOT / "conformance" / "results" / "evaluation"
PAGE = REPO_ROOT / "docs" / "evaluation.md"  # the manual's page that holds the table
BEGIN, END = "<!-- conformance:begin -->", "<!-- conformance:end -->"
SETTINGS = ("one_process", "ddp", "custom_ddp")
# What each logged key is, for a reader; keys not listed are shown as they are.
LABELS = {
    "auroc": "BinaryAUROC logged in validation_step (list/cat states)",
    "ap": "BinaryAveragePrecision (cat states)",
    "auroc_cpu": "BinaryAUROC(compute_on_cpu=True)",
    "max": "MaxMetric",
    "min": "MinMetric",
    "mean_step_synced": "MeanMetric(dist_sync_on_step=True)",
    "local_acc": "BinaryAccuracy(sync_on_compute=False): local by design (rank 0's shard)",
    "mean_state": 'a metric with "mean" states: torchmetrics\' own sync (mean over ranks)',
    "running_mean": "RunningMean(window=2): windows of per-rank batches",
    "accuracy_plus_f1": "compositional: BinaryAccuracy() + BinaryF1Score()",
    "epoch_end_ap": "BinaryAveragePrecision computed in on_validation_epoch_end",
    "batch_end_auroc": "BinaryAUROC updated in on_validation_batch_end",
    "callback_auroc": "BinaryAUROC owned by a Callback",
    "sync_dist_mean": "self.log(mean, sync_dist=True)",
    "step_sync_dist_epoch": 'self.log(sum, on_step=True, sync_dist=True, reduce_fx="sum")',
    "all_gather_shape": "self.all_gather(per-sample scores) at epoch end: shape",
    "all_gather_samples_rows": "strategy.all_gather_samples(per-sample scores): rows",
    "dataloader_iter_count": "SumMetric of samples, dataloader_iter steps",
    "drop_last_index_sum": "a drop_last=True loader (11 samples, batches of 4): sum of the evaluated samples' indices",
    "list_loader_count": "trainer.test(model, [0, 1, 2]): SumMetric of steps",
    "variable_width_all_gather": "self.all_gather of (2, 2 + rank) tensors",
    "validate_inside_fit": "trainer.validate() from a callback during fit",
    "auroc_own_group": "BinaryAUROC with a process_group of its own",
    "retrieval_map": "RetrievalMAP (list states reduced by None)",
    "pearson": "PearsonCorrCoef (tensor states reduced by None: torchmetrics' own gather)",
    "uneven_map/accuracy": "uneven data, 7 + 4 samples per rank (DataLoader each): Accuracy",
    "uneven_map/loss": "uneven data, 7 + 4 samples per rank (DataLoader each): self.log(loss, sync_dist=True)",
    "uneven_iterable/accuracy": "uneven data, 7 + 4 samples per rank (IterableDataset): Accuracy",
    "uneven_iterable/loss": "uneven data, 7 + 4 samples per rank (IterableDataset): self.log(loss, sync_dist=True)",
}
PREFIX_LABELS = {  # metrics returning a dict, logged with log_dict at epoch end
    "minmax": "MinMaxMetric(BinaryAccuracy())",
    "collection": "MetricCollection(F1, AP), compute groups",
    "collection_nogroups": "MetricCollection(F1, AP, compute_groups=False)",
    "classwise": "ClasswiseWrapper(MulticlassAccuracy(average=None))",
    "multitask": "MultitaskWrapper(acc, mse)",
    "two_loaders": "two validation loaders (11 + 7 samples), metrics per loader by dataloader_idx",
}


def _label(key: str) -> str:
    prefix, _, name = key.partition("/")
    return f"{PREFIX_LABELS[prefix]}: {name}" if prefix in PREFIX_LABELS else LABELS.get(key, key)


def _strategy(setting: str) -> Any:
    if setting == "one_process":
        return "auto"
    kind = DDPStrategy if setting == "ddp" else CustomDDPStrategy
    return kind(start_method="fork", timeout=timedelta(seconds=30))


def _trainer(setting: str, **kwargs: Any) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        devices=1 if setting == "one_process" else 2,
        strategy=_strategy(setting),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        max_epochs=1,
        **kwargs,
    )


def outcome_of(run: Callable[[], Any]) -> Any:
    """The run's result, or the last line of the error it ended with (every rank's, via the launcher)."""
    try:
        return run()
    except Exception as err:  # noqa: BLE001 - recorded, not hidden: the table shows it
        lines = [line for line in str(err).strip().splitlines() if line.strip()]
        last = lines[-1].split(": ", 1)[-1] if lines else ""  # the message, without the module path
        last = re.sub(r"^\[[^\]]*\.(cc|cpp|h):\d+\] ", "", last)  # nor gloo's source line
        return f"error ({type(err).__name__}): {last}"[:240]


def _patterns(setting: str, work: Path) -> dict[str, Any]:
    out = work / setting
    out.mkdir(parents=True, exist_ok=True)
    values: dict[str, Any] = dict(
        _trainer(setting, callbacks=[CallbackAUROC()]).validate(PatternModule(out), verbose=False)[0]
    )
    gathered = json.loads((out / "gather.json").read_text())
    values["all_gather_shape"] = "x".join(map(str, gathered["all_gather_shape"]))
    values["all_gather_samples_rows"] = gathered.get("all_gather_samples_rows", "n/a")
    values["dataloader_iter_count"] = _trainer(setting).validate(IteratorStepsModule(), verbose=False)[0]["count"]
    values["drop_last_index_sum"] = _trainer(setting).validate(DropLastModule(), verbose=False)[0]["index_sum"]
    values["list_loader_count"] = _trainer(setting).test(IteratorStepsModule(), [0, 1, 2], verbose=False)[0]["count"]
    values["validate_inside_fit"] = outcome_of(
        lambda: (
            _trainer(setting, callbacks=[ValidateInsideFit()], num_sanity_val_steps=0).fit(IteratorStepsModule())
            or "ran"
        )
    )
    for kind in ("map", "iterable"):
        result = uneven_values(setting, iterable=kind == "iterable")
        for name in ("accuracy", "loss"):
            values[f"uneven_{kind}/{name}"] = result if isinstance(result, str) else result[name]
    for results in _trainer(setting).validate(TwoLoadersModule(), verbose=False):
        values.update({f"two_loaders/{key}": value for key, value in results.items()})
    values["variable_width_all_gather"] = outcome_of(
        lambda: _trainer(setting).validate(VariableWidthGather(out), verbose=False) and "gathered"
    )
    return {key: float(v) if isinstance(v, torch.Tensor) else v for key, v in values.items()}


def uneven_values(setting: str, iterable: bool) -> dict[str, Any] | str:
    """The uneven-data pattern's accuracy and epoch loss under ``setting``, or how the run ended."""
    trainer = _trainer(setting, use_distributed_sampler=False)
    outcome = outcome_of(lambda: trainer.validate(UnevenShards(iterable), verbose=False)[0])
    return outcome if isinstance(outcome, str) else {"accuracy": outcome["accuracy"], "loss": outcome["loss_epoch"]}


def _cell(value: Any, reference: Any) -> str:
    if isinstance(value, float):
        differs = isinstance(reference, float) and abs(value - reference) > 1e-6
        return f"{value:.4f}" + (" ≠" if differs else "")
    return str(value)


def render(record: dict[str, Any]) -> list[str]:
    versions = record["environment"]["versions"]
    lines = [
        f"_Generated by `{record['command']}` (torch {versions.get('torch')}, Lightning "
        f"{versions.get('lightning')}, torchmetrics {versions.get('torchmetrics')}); 11 samples, 2 CPU ranks; "
        "≠: differs from one process by more than 1e-6._",
        "",
        "| pattern | 1 process | ddp | custom_ddp |",
        "|---|---|---|---|",
    ]
    for row in record["rows"]:
        reference = row["one_process"]
        lines.append(
            f"| {row['pattern']} | {_cell(reference, None)} | {_cell(row['ddp'], reference)} | "
            f"{_cell(row['custom_ddp'], reference)} |"
        )
    return lines


def update_readme(
    record: dict[str, Any],
    readme: Path = PAGE,
    render_record: Callable[[dict[str, Any]], list[str]] | None = None,
    begin: str = BEGIN,
    end: str = END,
) -> tuple[str, str]:
    """``(page text, page text with a fresh block)`` of the Markdown page ``readme``; raises if the markers are
    missing.

    ``render_record``, ``begin`` and ``end``: another table's renderer and markers (default: this one's).
    """
    lines = (render_record or render)(record)
    return replace_block(readme, begin, end, "\n".join([begin, "", *lines, "", end]))


def write_tables(
    record: dict[str, Any],
    out: Path | None,
    default_out: Path,
    title: str,
    render_record: Callable[[dict[str, Any]], list[str]] = render,
    begin: str = BEGIN,
    end: str = END,
    page: Path = PAGE,
) -> None:
    """``results.json`` + ``results.md`` in ``out``; with ``out=None`` in ``default_out`` and ``page``'s block too."""
    folder = out or default_out
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "results.json").write_text(json.dumps(record, indent=2) + "\n")
    (folder / "results.md").write_text("\n".join([f"# {title}", "", *render_record(record)]) + "\n")
    if out is None:
        page.write_text(update_readme(record, page, render_record, begin, end)[1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=Path, default=None, help=f"results folder (default {DEFAULT_OUT}, and {PAGE.name})"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as work:
        runs = {setting: _patterns(setting, Path(work)) for setting in SETTINGS}
    keys = list(runs["one_process"])
    rows = [{"key": key, "pattern": _label(key), **{s: runs[s].get(key) for s in SETTINGS}} for key in keys]
    record = {"command": "python -m conformance.evaluation.table", "environment": environment(), "rows": rows}
    write_tables(record, args.out, DEFAULT_OUT, "Evaluation conformance")
    return 0


if __name__ == "__main__":
    sys.exit(main())
