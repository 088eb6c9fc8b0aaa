"""``python -m benchmarks.fits.compare``: its analysis on known samples, its argument checks, a tiny end-to-end run."""

from __future__ import annotations

from dataclasses import asdict

import pytest
from entry_points import quick_benchmark_record
from train_cli_helpers import print_config

from benchmarks.fits.compare import analyse, headline, parse_config
from benchmarks.fits.compare_runs import fit_flags
from benchmarks.fits.variants import MATCHED_THREADS, VARIANTS, variants_for
from benchmarks.harness import SCHEMA, Quietness, make_record

_VARIANTS = {k: asdict(v) for k, v in VARIANTS.items()}


def _timing(scale: dict[str, float]) -> dict:
    """Two rounds per variant of per-step seconds (the slowest rank's) around 0.1 s x ``scale``."""
    base = [0.100, 0.102, 0.098, 0.101]
    return {
        "resnet18": {
            "2": {v: [{"step_s": [t * s for t in base], "threads": 1} for _ in range(2)] for v, s in scale.items()}
        }
    }


def _analysed_row() -> dict:
    """The analysis of timings whose medians stand in known ratios: resnet18, accumulate 2."""
    scale = {
        "custom_ddp": 1.5,
        "custom_ddp_localbn": 1.2,
        "ddp_default": 1.25,
        "ddp_tuned": 1.2,
        "custom_ddp_bf16": 1.35,
        "custom_ddp_compiled": 1.32,
        "single_matched": 1.0,
        "single": 0.6,
    }
    return analyse(_timing(scale), _VARIANTS)["resnet18"]["2"]


def test_analysis_anchors_ratios_share_exposure_and_both_efficiencies():
    row = _analysed_row()
    assert row["ratios"]["custom_ddp/ddp_tuned"]["value"] == pytest.approx(1.25)
    assert row["ratios"]["custom_ddp/ddp_default"]["value"] == pytest.approx(1.2)
    assert row["ratios"]["custom_ddp_localbn/ddp_tuned"]["value"] == pytest.approx(1.0)
    assert row["ratios"]["custom_ddp_bf16/custom_ddp"]["value"] == pytest.approx(0.9)
    for estimate in row["ratios"].values():
        assert estimate["low"] <= estimate["value"] <= estimate["high"] and estimate["n"] == 8
    assert row["syncbn_share"]["value"] == pytest.approx(1 - 1.2 / 1.5)
    assert row["ratios"]["custom_ddp_compiled/ddp_tuned"]["value"] == pytest.approx(1.1)
    assert row["ratios"]["custom_ddp_compiled/custom_ddp"]["value"] == pytest.approx(0.88)
    assert row["syncbn_share_compiled"]["value"] == pytest.approx(1 - 1.2 / 1.32)
    matched = row["step_s"]["single_matched"]["value"]
    # Exposed communication only against the thread-matched process; efficiency against both.
    assert row["exposed_comm_s"]["custom_ddp"]["value"] == pytest.approx(0.5 * matched)
    assert "single_matched" not in row["exposed_comm_s"]
    assert row["scaling_efficiency"]["single_matched"]["custom_ddp"]["value"] == pytest.approx(1 / 1.5)
    assert row["scaling_efficiency"]["single"]["custom_ddp"]["value"] == pytest.approx(0.6 / 1.5)
    assert row["threads"]["single"] == [1]


def test_headline_names_each_ratio_efficiency_and_accuracy():
    accuracy = {"custom_ddp": {"accumulate": 2, "test_acc1": 80.0}, "ddp_default": {"accumulate": 2, "test_acc1": 79.5}}
    collectives = {
        "accumulate": 2,
        "nets": {
            "resnet18": {
                "custom_ddp": {"counts": {"grad_buckets": 2}, "bytes": {"grad_buckets": 800}},
                "custom_ddp_bf16": {"counts": {"grad_buckets": 2}, "bytes": {"grad_buckets": 400}},
            }
        },
    }
    record = make_record(
        "compare",
        {},
        Quietness(threshold=0.5, waited_s=0.0, load_before=0.1),
        argv=[],
        analysis={"resnet18": {"2": _analysed_row()}},
        accuracy=accuracy,
        collectives=collectives,
        variants=_VARIANTS,
    )
    rows = {r["what"]: r for r in headline(record)}
    ratio = rows["custom_ddp (SyncBN) / ddp default (local BN): step time, resnet18 net, accumulate 2"]
    assert ratio["value"][0]["value"] == pytest.approx(1.2) and ratio["unit"] == "x"
    assert any("thread-matched" in what and "exposed communication" in what for what in rows)
    assert sum("scaling efficiency" in what for what in rows) == 2
    assert "(0.5x)" in next(r["value"] for what, r in rows.items() if "fp32 -> bf16" in what)
    assert rows["final test top-1 (%), custom_ddp (SyncBN), template net"]["value"] == 80.0
    compiled = rows["custom_ddp (SyncBN, compiled) / ddp tuned (local BN): step time, resnet18 net, accumulate 2"]
    assert compiled["value"][0]["value"] == pytest.approx(1.1)
    assert (
        "SyncBN share of the custom_ddp (SyncBN, compiled) step (1 - local BN / SyncBN), resnet18 net, "
        "accumulate 2" in rows
    )


def test_variants_and_threads():
    assert variants_for("template") == [
        "custom_ddp",
        "custom_ddp_compiled",
        "custom_ddp_localbn",
        "custom_ddp_localbn_gloo",
        "ddp_default",
        "ddp_tuned",
        "single_matched",
        "single",
    ]
    assert "custom_ddp_bf16" in variants_for("resnet18")
    assert VARIANTS["single_matched"].threads == MATCHED_THREADS and VARIANTS["single"].threads is None


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_variants_strategy_flags_parse_on_this_torch(capsys, variant):
    """As train.py parses them: torch 2.11's DDP has ``broadcast_buffers`` where 2.14's has ``forward_sync_buffers``
    (the lent GPU's torch rejected the new name; .ci/run runs this file on the oldest supported torch too)."""
    strategy = [f for f in VARIANTS[variant].flags if f.startswith("--trainer.strategy")]
    parsed = print_config(capsys, "cifar100_template_net.yaml", extra=tuple(strategy))["trainer"]["strategy"]
    options = dict(f.removeprefix("--trainer.strategy.").split("=", 1) for f in strategy[1:])
    assert {k: str(v).lower() for k, v in (parsed.get("init_args", {}) if options else {}).items() if k in options} == (
        options
    )


def test_compare_arguments(capsys):
    cfg, max_wait_s = parse_config(["--quick", "--out", "/tmp/compare_quick", "--nets", "resnet18"])
    assert cfg["accumulates"] == [2] and cfg["rounds"] == 1 and max_wait_s == 0.0
    assert list(cfg["nets"]) == ["resnet18"] and cfg["nets"]["resnet18"]["steps"] == 3
    assert "--data.data_dir=/tmp/compare_quick/data" in fit_flags(cfg, "resnet18", "ddp_tuned", 2, {})
    full, max_wait_s = parse_config(["--accumulate", "4", "1", "4"])
    assert full["accumulates"] == [1, 4] and full["out"] == "benchmarks/results/compare" and max_wait_s == 300.0
    assert not any(flag.startswith("--data.data_dir") for flag in fit_flags(full, "resnet18", "ddp_tuned", 2, {}))
    with pytest.raises(SystemExit):  # a smoke run never writes into the committed results
        parse_config(["--quick", "--out", "benchmarks/results/compare"])
    assert "--quick never writes into the committed results" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_config(["--accumulate", "0"])
    assert "--accumulate, --rounds and --accuracy-epochs must be >= 1, got [0]" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.distributed
def test_compare_end_to_end_quick(tmp_path):
    out = tmp_path / "compare"
    # 32 fits: 12 minutes alone on 2 cores; beside the other slow tests on 3 workers, over 20 (it ran past 1200 s)
    record = quick_benchmark_record("fits.compare", out, timeout=2700)
    assert record["schema"] == SCHEMA and "comparable" in record["quietness"]
    for net in ("template", "resnet18"):
        runs = record["timing"][net]["2"]
        assert set(runs) == set(variants_for(net))
        assert runs["single_matched"][0]["threads"] == MATCHED_THREADS
        assert runs["custom_ddp"][0]["recorded"]["strategy"]["sync_batchnorm"] is True
        assert runs["custom_ddp_compiled"][0]["recorded"]["strategy"]["syncbn_compile"] is True
    bf16 = record["collectives"]["nets"]["resnet18"]
    assert bf16["custom_ddp_bf16"]["bytes"]["grad_buckets"] * 2 == bf16["custom_ddp"]["bytes"]["grad_buckets"]
    assert record["timing"]["resnet18"]["2"]["custom_ddp_bf16"][0]["recorded"]["strategy"]["grad_compression"] == "bf16"
    for name in ("results.md", "step_time.png", "curves.png"):
        assert (out / name).stat().st_size > 0, name
