"""``python -m benchmarks.compare``: a tiny end-to-end comparison and its argument checks.

Both tests run the real entry point in a subprocess from the repository root, as CI and users do.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
# One epoch, no accumulation sweep: two 2-process fits and two one-process tests (the sweep
# runs are the same fits at other settings; keeping them out halves the test's time).
SMOKE = ["--epochs", "1", "--sweep", "--synthetic-train-size", "320", "--synthetic-test-size", "64",
         "--warmup-steps", "1"]


def _compare(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "benchmarks.compare", *args], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.distributed
def test_compare_end_to_end_on_tiny_synthetic_data(tmp_path):
    out = tmp_path / "compare"
    proc = _compare("--out", str(out), *SMOKE)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]

    for name in ("report.md", "compare.json", "curves.png", "time_memory.png"):
        assert (out / name).stat().st_size > 0, name
    result = json.loads((out / "compare.json").read_text())
    # On CPU a third run, custom_ddp with local BatchNorm, is the like-for-like anchor for ddp.
    assert set(result["runs"]) == {"custom_ddp_acc2", "ddp_acc2", "custom_ddp_localbn_acc2"}
    assert result["runs"]["custom_ddp_localbn_acc2"]["recorded"]["strategy"]["sync_batchnorm"] is False
    assert result["local_bn"]["step_s"] > 0

    # Both runs' TensorBoard logs under one root; the main runs also have their test scalars.
    for run in ("custom_ddp_acc2", "ddp_acc2"):
        assert (out / "tb" / run / "fit" / "benchmark.json").is_file()
        assert list((out / "tb" / run / "test").glob("events.out.tfevents.*"))
        assert not (out / "tb" / run / "fit" / "checkpoints").exists()

    # What each run recorded about itself: the strategies and their communication options.
    custom = result["runs"]["custom_ddp_acc2"]["recorded"]
    ddp = result["runs"]["ddp_acc2"]["recorded"]
    assert custom["strategy"]["class"].endswith("CustomDDPStrategy") and custom["strategy"]["sync_batchnorm"]
    assert ddp["strategy"]["gradient_as_bucket_view"] is True and ddp["strategy"]["bucket_cap_mb"] == 25.0
    assert ddp["strategy"]["layer_sync"] is None  # CPU: local BatchNorm, as the report states
    assert custom["world_size"] == ddp["world_size"] == 2 and custom["dataset"] == "synthetic"
    assert ddp["accumulate_grad_batches"] == custom["accumulate_grad_batches"] == 2

    main = result["main"]
    for headline in main.values():
        assert headline["step_s"] > 0 and headline["peak_memory_mb"] > 0
        assert 0 <= headline["test_acc1"] <= 100 and headline["test_loss"] > 0
    step, memory, accuracy = result["targets"]
    assert step["measured"] == pytest.approx(main["custom_ddp"]["step_s"] / main["ddp"]["step_s"])
    assert memory["measured"] == pytest.approx(
        main["custom_ddp"]["peak_memory_mb"] / main["ddp"]["peak_memory_mb"])
    assert accuracy["measured"] == pytest.approx(
        abs(main["custom_ddp"]["test_acc1"] - main["ddp"]["test_acc1"]))
    for target in result["targets"]:
        assert target["met"] == (target["measured"] <= target["limit"])
        missed_by = 0.0 if target["met"] else target["measured"] - target["limit"]
        assert math.isclose(target["missed_by"], missed_by)

    report = (out / "report.md").read_text()
    for text in ("## Infrastructure", "python -m benchmarks.compare --out", "LOCAL BatchNorm",
                 "| optimizer step time (median)", "## Targets", "tensorboard --logdir",
                 "## Like-for-like on CPU: both with local BatchNorm"):
        assert text in report, text


def test_compare_rejects_a_single_process(tmp_path):
    proc = _compare("--out", str(tmp_path), "--devices", "1", timeout=120)
    assert proc.returncode == 2 and "--devices must be >= 2" in proc.stderr
