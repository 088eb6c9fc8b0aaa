"""benchmarks.collectives.grad_sync: the analysis on synthetic samples, and the collectives of a real profiled step."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from benchmarks.collectives import grad_sync, grad_sync_report
from benchmarks.harness import Quietness, make_record
from collectives.launcher import run_workers

# Median step seconds per variant: bucketed is 4 % faster than ddp_tuned, 20 ms above no_comm;
# one process on all cores takes 0.090 s for one rank's batch.
_MEDIANS = {
    "no_comm": 0.100,
    "single_all_cores": 0.090,
    "ddp_tuned": 0.125,
    "ddp_default": 0.150,
    "bucketed_25mb": 0.120,
}


def _sample(median_s: float, rng: np.random.Generator, ddp: bool) -> dict[str, Any]:
    rounds = [list(median_s * rng.lognormal(0.0, 0.02, 8)) for _ in range(3)]
    return {
        "step_s_by_round": rounds,
        "finish_s_by_round": [[0.001] * 8 for _ in rounds],
        "threads": 1,
        "peak_bytes": 100 * 2**20,
        "buckets": None if ddp else 3,
        "collectives": {"counts": {"grad_buckets": 3}, "bytes": {"grad_buckets": 4 * 2**20}},
        "ddp_settings": {"gradient_as_bucket_view": True} if ddp else None,
    }


def _record(quiet: Quietness) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    steps = {"resnet18": {v: _sample(m, rng, v.startswith("ddp")) for v, m in _MEDIANS.items()}}
    zero1 = [
        {
            "model": "resnet18",
            "world_size": 2,
            "param_bytes": 40,
            "unsharded_bytes": 80,
            "sharded_bytes_per_rank": [40, 40],
        }
    ]
    config = grad_sync.QUICK | {"world_size": 2, "backend": "gloo", "device": "cpu", "optimizer": "SGD"}
    return make_record("grad_sync", config, quiet.finish(), wall_s=1.0, steps=steps, zero1=zero1)


@pytest.fixture(scope="module")
def quiet_record() -> dict[str, Any]:
    return _record(Quietness(threshold=0.5, waited_s=0.0, load_before=0.1))


def _assert_estimate(e: dict[str, float], expected: float, tolerance: float) -> None:
    assert e["low"] <= e["value"] <= e["high"] and e["n"] == 24
    assert e["value"] == pytest.approx(expected, abs=tolerance)


def test_analysis_and_headline_name_their_anchors(quiet_record: dict[str, Any], tmp_path: Path) -> None:
    rows = {r["variant"]: r for r in grad_sync_report.analyse(quiet_record)["resnet18"]}
    bucketed = rows["bucketed_25mb"]
    _assert_estimate(bucketed["vs_ddp_tuned"], 0.120 / 0.125, 0.02)
    _assert_estimate(bucketed["vs_ddp_default"], 0.120 / 0.150, 0.02)
    _assert_estimate(bucketed["exposed_s"], 0.020, 0.002)  # seconds, like every time in a record
    _assert_estimate(bucketed["exposed_share"], 20 / 120, 0.02)
    _assert_estimate(bucketed["speedup_vs_single_all_cores"], 2 * 0.090 / 0.120, 0.05)
    assert rows["no_comm"]["exposed_s"] is None and rows["single_all_cores"]["speedup_vs_single_all_cores"] is None

    headline = {r["what"]: r for r in grad_sync_report.headline(quiet_record)}
    _assert_estimate(headline["bucketed 25 MiB / ddp tuned: step time, resnet18"]["value"], 0.120 / 0.125, 0.02)
    _assert_estimate(
        headline["bucketed 25 MiB, 2 ranks / 1 process on all cores: images per second, resnet18"]["value"],
        2 * 0.090 / 0.120,
        0.05,
    )
    assert headline["ZeRO-1: AdamW state of the largest rank / unsharded, 2 ranks (ideal 0.5)"]["value"] == 0.5
    assert all(" / ddp " in what for what in headline if "step time" in what)  # every ratio names its anchor

    grad_sync_report.write(quiet_record, tmp_path)
    saved = json.loads((tmp_path / "results.json").read_text())  # strict JSON round trip
    assert saved["headline"] == json.loads(json.dumps(list(headline.values())))
    assert saved["quietness"]["comparable"] is True and saved["quietness"]["load_before"] == 0.1
    markdown = (tmp_path / "results.md").read_text()
    assert "x ddp_tuned" in markdown and "x ddp_default" in markdown and "NOT COMPARABLE" not in markdown
    assert "0.956 [" in markdown and "grad_buckets 3 (4 MiB)" in markdown  # bucketed / ddp_tuned, its CI
    assert (tmp_path / "grad_sync.png").stat().st_size > 0


def test_busy_machine_is_recorded_and_flagged(quiet_record: dict[str, Any], tmp_path: Path) -> None:
    busy = Quietness(threshold=0.5, waited_s=300.0, load_before=3.4).finish()
    grad_sync_report.write({**quiet_record, "quietness": busy.as_dict()}, tmp_path)
    assert json.loads((tmp_path / "results.json").read_text())["quietness"]["comparable"] is False
    assert "NOT COMPARABLE" in (tmp_path / "results.md").read_text().splitlines()[2]


@pytest.mark.distributed
def test_probe_counts_real_collectives_of_zero1() -> None:
    """One profiled step on 2 ranks: the engine's all-reduce and ZeRO-1's parameter broadcasts."""
    probes = run_workers(grad_sync.probe_worker, 2, args=("mlp", "bucketed_25mb_zero1", grad_sync.QUICK), timeout_s=120)
    cfg = grad_sync.QUICK
    elements = cfg["mlp_depth"] * (cfg["mlp_width"] + 1) * cfg["mlp_width"] + (cfg["mlp_width"] + 1) * 100
    tensors = 2 * (cfg["mlp_depth"] + 1)
    for probe in probes:
        counts, payload = probe["collectives"]["counts"], probe["collectives"]["bytes"]
        # One fp32 bucket: every gradient plus one "used" flag per parameter (parallel/gradients/buckets.py).
        assert counts["grad_buckets"] == 1 and payload["grad_buckets"] == 4 * (elements + tensors)
        # ZeRO-1: each rank broadcasts its updated shard; together, every parameter once.
        assert counts["other"] >= 2 and payload["other"] == 4 * elements
        assert probe["peak_bytes"] > 0 and probe["buckets"] == 1
