"""benchmarks.grad_sync: the analysis on synthetic samples, and collective counting on a real profiled step."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from benchmarks import grad_sync, grad_sync_report
from benchmarks.harness import Quietness, make_record
from collectives.launcher import run_workers

# Median step seconds per variant: bucketed is 4 % faster than ddp_tuned, 20 ms above no_comm.
_MEDIANS = {"no_comm": 0.100, "ddp_tuned": 0.125, "ddp_default": 0.150, "bucketed_25mb": 0.120}


def _sample(median_s: float, rng: np.random.Generator, ddp: bool) -> dict[str, Any]:
    rounds = [list(median_s * rng.lognormal(0.0, 0.02, 8)) for _ in range(3)]
    return {"step_s_by_round": rounds, "finish_s_by_round": [[0.001] * 8 for _ in rounds],
            "peak_bytes": 100 * 2**20, "buckets": None if ddp else 3,
            "collectives": {"allreduce": {"count": 3, "bytes": 4 * 2**20}},
            "ddp_settings": {"gradient_as_bucket_view": True} if ddp else None}


def _record(quiet: Quietness) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    steps = {"resnet18": {v: _sample(m, rng, v.startswith("ddp")) for v, m in _MEDIANS.items()}}
    zero1 = [{"model": "resnet18", "world_size": 2, "param_bytes": 40, "unsharded_bytes": 80,
              "sharded_bytes_per_rank": [40, 40]}]
    config = grad_sync.QUICK | {"world_size": 2, "backend": "gloo", "device": "cpu", "threads_per_process": 1,
                                "optimizer": "SGD"}
    return grad_sync_report.analyse(make_record("grad_sync", config, quiet.finish(), wall_s=1.0, steps=steps,
                                                zero1=zero1))


@pytest.fixture(scope="module")
def quiet_record() -> dict[str, Any]:
    return _record(Quietness(threshold=0.5, waited_s=0.0, load_before=0.1))


def _assert_estimate(e: dict[str, float], expected: float, tolerance: float) -> None:
    assert e["low"] <= e["value"] <= e["high"] and e["n"] == 24
    assert e["value"] == pytest.approx(expected, abs=tolerance)


def test_headline_names_its_anchors_and_carries_intervals(quiet_record: dict[str, Any], tmp_path: Path) -> None:
    record = quiet_record
    headline = record["headline"]
    _assert_estimate(headline["resnet18_bucketed25_vs_ddp_tuned"], 0.120 / 0.125, 0.02)
    _assert_estimate(headline["resnet18_bucketed25_vs_ddp_default"], 0.120 / 0.150, 0.02)
    _assert_estimate(headline["resnet18_ddp_tuned_vs_ddp_default"], 0.125 / 0.150, 0.02)
    _assert_estimate(headline["resnet18_exposed_comm_ms_bucketed25"], 20.0, 2.0)
    _assert_estimate(headline["resnet18_exposed_comm_share_bucketed25"], 20 / 120, 0.02)
    assert headline["zero1_state_ratio_2ranks"] == 0.5 and headline["resnet18_allreduce_calls_bucketed25"] == 3
    # Every ratio is named after the anchor it divides by; no ratio without one.
    assert all("_vs_ddp_" in k for k in headline if "_vs_" in k)

    grad_sync_report.write(record, tmp_path)
    saved = json.loads((tmp_path / "results.json").read_text())  # strict JSON round trip
    assert saved["headline"] == json.loads(json.dumps(headline))
    assert saved["quietness"]["comparable"] is True and saved["quietness"]["load_before"] == 0.1
    markdown = (tmp_path / "results.md").read_text()
    assert "x ddp_tuned" in markdown and "x ddp_default" in markdown and "NOT COMPARABLE" not in markdown
    assert "0.96 [" in markdown  # bucketed_25mb / ddp_tuned with its interval
    assert (tmp_path / "grad_sync.png").stat().st_size > 0


def test_busy_machine_is_recorded_and_flagged(quiet_record: dict[str, Any], tmp_path: Path) -> None:
    busy = Quietness(threshold=0.5, waited_s=300.0, load_before=3.4).finish()
    grad_sync_report.write({**quiet_record, "quietness": busy.as_dict()}, tmp_path)
    assert json.loads((tmp_path / "results.json").read_text())["quietness"]["comparable"] is False
    assert "NOT COMPARABLE" in (tmp_path / "results.md").read_text().splitlines()[2]


def test_count_collectives_counts_calls_and_gloo_payload() -> None:
    def event(name: str, shapes: list[list[int]] = (), dtypes: list[str] = ()) -> SimpleNamespace:
        return SimpleNamespace(name=lambda: name, shapes=lambda: list(shapes), dtypes=lambda: list(dtypes))

    events = [event("c10d::allreduce_"), event("gloo:all_reduce", [[10, 10]], ["float"]),
              event("c10d::allreduce_"), event("gloo:all_reduce", [[8]], ["c10::BFloat16"]),
              event("c10d::broadcast_"), event("gloo:broadcast", [[4]], ["double"]), event("aten::add")]
    assert grad_sync.count_collectives(events) == {
        "allreduce": {"count": 2, "bytes": 400 + 16}, "broadcast": {"count": 1, "bytes": 32}}


@pytest.mark.distributed
def test_probe_counts_real_collectives_of_zero1() -> None:
    """One profiled step on 2 ranks: the engine's all-reduce and ZeRO-1's parameter broadcasts."""
    probes = run_workers(grad_sync.probe_worker, 2, args=("mlp", "bucketed_25mb_zero1", grad_sync.QUICK),
                         timeout_s=120)
    cfg = grad_sync.QUICK
    elements = cfg["mlp_depth"] * (cfg["mlp_width"] + 1) * cfg["mlp_width"] + (cfg["mlp_width"] + 1) * 100
    tensors = 2 * (cfg["mlp_depth"] + 1)
    for probe in probes:
        collectives = probe["collectives"]
        # One fp32 bucket: every gradient plus one "used" flag per parameter (parallel/buckets.py).
        assert collectives["allreduce"] == {"count": 1, "bytes": 4 * (elements + tensors)}
        # ZeRO-1: each rank broadcasts its updated shard; together, every parameter once.
        assert collectives["broadcast"]["count"] >= 2 and collectives["broadcast"]["bytes"] == 4 * elements
        assert probe["peak_bytes"] > 0 and probe["buckets"] == 1
