"""The syncbn, allreduce and data_pipeline benchmarks on tiny settings: they run through the shared
harness and their records carry quietness, CIs for every ratio, and a headline."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from benchmarks import allreduce, allreduce_report, data_pipeline, syncbn
from benchmarks.harness import Quietness, make_record

ESTIMATE_KEYS = {"value", "low", "high", "n"}


def _is_estimate(value: object) -> bool:
    return isinstance(value, dict) and set(value) == ESTIMATE_KEYS and value["low"] <= value["value"] <= value["high"]


def _check_saved(out: Path, ratios: list[dict]) -> dict:
    saved = json.loads((out / "results.json").read_text())
    assert {"comparable", "load_before", "threshold"} <= set(saved["quietness"])
    assert ratios and all(_is_estimate(r) for r in ratios)
    assert saved["headline"] and all(_is_estimate(v) or isinstance(v, (int, float)) for v in saved["headline"].values())
    assert (out / "results.md").read_text().startswith("# ")
    return saved


@pytest.mark.distributed
def test_syncbn_quick_run(tmp_path: Path) -> None:
    record = syncbn.main(["--quick", "--shapes", "8x16", "--rounds", "2", "--iters", "2", "--out", str(tmp_path)])
    saved = _check_saved(tmp_path, [e for row in record["rows"] for e in row["ratios"].values()])
    row = saved["rows"][0]
    assert set(row["ratios"]) == {"custom/floor", "custom/local"}
    assert len(row["samples_s"]["custom"]) == 4  # 2 rounds x 2 iterations, max over the ranks
    assert {"custom_vs_floor_8x16", "custom_vs_local_worst", "custom_vs_floor_shapes_ci_includes_1"} <= set(
        saved["headline"])
    assert saved["command"].startswith("python -m benchmarks.syncbn --quick")
    assert (tmp_path / "syncbn.png").exists()
    # The kernel alone on one rank: custom vs native BatchNorm, against the (N, C) target.
    (one_rank,) = saved["one_rank_rows"]
    assert set(one_rank["ratios"]) == {"custom/local"} and len(one_rank["samples_s"]["custom"]) == 4
    assert {"custom_vs_native_1rank_8x16", "custom_vs_native_1rank_worst_nc"} <= set(saved["headline"])
    assert "custom vs torch's BatchNorm" in (tmp_path / "results.md").read_text()


def test_syncbn_takes_the_slowest_rank_per_iteration() -> None:
    assert syncbn.slowest_rank([[1.0, 5.0, 2.0], [3.0, 1.0, 2.5]]) == [3.0, 5.0, 2.5]
    with pytest.raises(ValueError):  # ranks that ran different iteration counts are a bug, not data
        syncbn.slowest_rank([[1.0], [1.0, 2.0]])


def _synthetic_compare_rows(rng: np.random.Generator, cores: int) -> list[dict]:
    rows = []
    for world_size in (2, 4):
        per_rank = [{1000: {"samples": {m: list(rng.lognormal(0, 0.1, 12) * (2 if m == "ring" else 1))
                                        for m in allreduce.METHODS},
                            "accuracy": {m: {"identical": True, "max_abs_err": 1e-7, "rel_err": 5e-8}
                                         for m in allreduce.METHODS},
                            "memory": {m: {"torch_alloc_bytes": 4, "extra_peak_rss_kib": 0}
                                       for m in allreduce.METHODS}}}
                    for _ in range(world_size)]
        rows.append(allreduce.compare_row(world_size, 1000, per_rank, cores))
    return rows


def test_allreduce_analysis_report_and_plots(tmp_path: Path) -> None:
    rows = _synthetic_compare_rows(np.random.default_rng(0), cores=2)
    assert [r["oversubscribed"] for r in rows] == [False, True]
    assert 1.6 < rows[0]["ratios"]["ring/all_reduce"]["value"] < 2.4
    bandwidth = [{"world_size": 2, "bytes": 1 << 20, "backend": "gloo", "oversubscribed": False, "status": "ok",
                  "median_s": {"value": 1e-3, "low": 9e-4, "high": 1.2e-3, "n": 30},
                  "algbw_GBps": {"value": 1.0, "low": 0.9, "high": 1.1, "n": 30},
                  "busbw_GBps": {"value": 1.0, "low": 0.9, "high": 1.1, "n": 30}}]
    quiet = Quietness(threshold=0.5, waited_s=0.0, load_before=0.1).finish()
    cfg = {**allreduce.QUICK, "cores": 2, "seed": 0, "device": "cpu"}
    record = make_record("allreduce", cfg, quiet, headline=allreduce.headline(rows, bandwidth), compare=rows,
                         bandwidth=bandwidth, wall_s=1.0)
    allreduce_report.write(record, tmp_path)
    saved = _check_saved(tmp_path, [e for r in rows for e in r["ratios"].values()])
    assert {"ring_vs_torch_2ranks_1k", "butterfly_vs_torch_4ranks_1k", "ring_max_rel_err",
            "allreduce_peak_busbw_GBps"} <= set(saved["headline"])
    assert "time-shared" in (tmp_path / "results.md").read_text()
    assert (tmp_path / "time_vs_world_size.png").exists() and (tmp_path / "bandwidth.png").exists()


@pytest.mark.distributed
def test_allreduce_compare_on_two_ranks(tmp_path: Path) -> None:
    cfg = {**allreduce.QUICK, "compare_world_sizes": [2], "compare_numels": [256], "warmup": 1, "rounds": 2,
           "iters": 2}
    (row,) = allreduce.run_compare(cfg, seed=0, tmp=tmp_path, cores=2)
    assert len(row["samples_s"]["ring"]) == 4
    assert row["accuracy"]["ring"]["rel_err"] <= allreduce_report.REL_ERR_TARGET
    assert all(row["accuracy"][m]["identical"] for m in allreduce.METHODS)
    assert _is_estimate(row["ratios"]["butterfly/all_reduce"])


def test_data_pipeline_quick_run(tmp_path: Path) -> None:
    record = data_pipeline.main(["--quick", "--images", "256", "--rounds", "2", "--out", str(tmp_path)])
    saved = _check_saved(tmp_path, list(record["speedups"].values()))
    assert {"batched_vs_pil_main", "batched_vs_pil_2workers", "images_per_s_batched"} <= set(saved["headline"])
    assert saved["images_per_s"]["pil_transform"]["n"] == data_pipeline.QUICK["kernel_rounds"]
    assert (tmp_path / "throughput.png").exists()
