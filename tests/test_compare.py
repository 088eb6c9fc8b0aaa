"""``python -m benchmarks.compare``: its analysis on known samples, its argument checks, a tiny end-to-end run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.compare_report import analyse, headline, render_markdown, step_samples
from benchmarks.harness import Quietness, make_record

REPO_ROOT = Path(__file__).resolve().parents[1]


def _run(per_rank: list[list[float]]) -> dict:
    return {"benchmark": {"step_s_per_rank": per_rank}}


def _timing(scale: dict[str, float]) -> dict:
    """Two rounds per variant; rank 1 is slower on every step, so it sets the step time."""
    base = [0.100, 0.102, 0.098, 0.101]
    return {"2": {v: [_run([[t * s for t in base], [t * s * 1.1 for t in base]]) for _ in range(2)]
                  for v, s in scale.items()}}


def test_a_step_is_as_slow_as_its_slowest_rank():
    assert step_samples([_run([[1.0, 3.0], [2.0, 1.0]]), _run([[5.0], [4.0]])]) == [2.0, 3.0, 5.0]


def test_analysis_anchors_ratios_exposed_comm_and_efficiency():
    scale = {"custom_ddp": 1.5, "custom_ddp_localbn": 1.2, "ddp_default": 1.25, "ddp_tuned": 1.2, "single": 1.0}
    analysis = analyse(_timing(scale))["2"]
    assert analysis["ratios"]["custom_ddp/ddp_tuned"]["value"] == pytest.approx(1.25)
    assert analysis["ratios"]["custom_ddp/ddp_default"]["value"] == pytest.approx(1.2)
    assert analysis["ratios"]["custom_ddp_localbn/ddp_tuned"]["value"] == pytest.approx(1.0)
    for estimate in analysis["ratios"].values():
        assert estimate["low"] <= estimate["value"] <= estimate["high"] and estimate["n"] == 8
    single = analysis["step_s"]["single"]["value"]
    assert analysis["exposed_comm_s"]["custom_ddp"]["value"] == pytest.approx(0.5 * single)
    assert analysis["scaling_efficiency"]["custom_ddp"]["value"] == pytest.approx(1 / 1.5)

    accuracy = {"custom_ddp": {"accumulate": 2, "test_acc1": 80.0, "test_loss": 0.7},
                "ddp_default": {"accumulate": 2, "test_acc1": 79.5, "test_loss": 0.71}}
    quiet = Quietness(threshold=0.5, waited_s=0.0, load_before=0.1, foreign_share=0.01)
    top = headline({"2": analysis}, accuracy)
    assert top["step_ratio_custom_ddp_vs_ddp_tuned_acc2"]["value"] == pytest.approx(1.25)
    assert top["test_acc1_custom_ddp"] == 80.0
    config = {"net": "template", "rounds": 2, "warmup_steps": 3, "steps": 4, "batch_size": 32,
              "accuracy_epochs": 6, "out": "x"}
    record = make_record("compare", config, quiet, analysis={"2": analysis}, accuracy=accuracy)
    report = render_markdown(record)
    for text in ("SYNTHETIC", "LOCAL BatchNorm", "custom_ddp/ddp_tuned", "ddp default (local BN)", "1 process"):
        assert text in report, text
    assert "NOT COMPARABLE" not in report


def test_compare_rejects_bad_arguments(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "benchmarks.compare", "--out", str(tmp_path), "--warmup-steps",
                           "-1"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--warmup-steps must be >= 0" in proc.stderr


@pytest.mark.slow
@pytest.mark.distributed
def test_compare_end_to_end_quick(tmp_path):
    out = tmp_path / "compare"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.compare", "--out", str(out), "--quick",
                           "--max-wait-s", "0"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    record = json.loads((out / "results.json").read_text())
    assert record["schema"] == "lit_cifar.bench/v2" and "comparable" in record["quietness"]
    runs = record["runs"]["2"]
    assert set(runs) == {"custom_ddp", "custom_ddp_localbn", "ddp_default", "ddp_tuned", "single"}
    assert runs["custom_ddp"][0]["recorded"]["strategy"]["sync_batchnorm"] is True
    assert runs["ddp_tuned"][0]["recorded"]["strategy"]["gradient_as_bucket_view"] is True
    assert runs["single"][0]["recorded"]["world_size"] == 1
    for name in ("results.md", "step_time.png", "curves.png"):
        assert (out / name).stat().st_size > 0, name
