"""The shared benchmark measurement layer: rounds, intervals, quietness, the record and its writer."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

from benchmarks.harness import (
    Quietness,
    difference_ci,
    fmt_estimate,
    interleave,
    make_record,
    markdown_header,
    median_ci,
    ratio_ci,
    table,
    write_record,
)


def test_interleave_alternates_the_order():
    calls = []
    result = interleave(["a", "b", "c"], rounds=3, run=lambda name, r: calls.append((name, r)) or f"{name}{r}")
    assert [name for name, _ in calls] == ["a", "b", "c", "c", "b", "a", "a", "b", "c"]
    assert result == {"a": ["a0", "a1", "a2"], "b": ["b0", "b1", "b2"], "c": ["c0", "c1", "c2"]}


def test_median_ci_brackets_the_median_and_narrows_with_more_samples():
    rng = np.random.default_rng(1)
    small, large = median_ci(rng.normal(10, 1, 20)), median_ci(rng.normal(10, 1, 2000))
    for e in (small, large):
        assert e.low <= e.value <= e.high
    assert (large.high - large.low) < (small.high - small.low) / 3
    assert large.low < 10 < large.high
    with pytest.raises(ValueError, match="at least one"):
        median_ci([])


def test_ratio_ci_of_a_known_ratio():
    rng = np.random.default_rng(2)
    base = rng.lognormal(0, 0.1, 500)
    e = ratio_ci(base * 1.5, rng.permutation(base))
    assert e.value == pytest.approx(1.5) and e.low < 1.5 < e.high
    assert fmt_estimate(e, digits=2).startswith("1.50 [")
    with pytest.raises(ValueError, match="both sides"):
        ratio_ci([1.0], [])


def test_busy_machine_is_marked_not_comparable(tmp_path):
    quiet = Quietness(threshold=0.5, waited_s=0.0, load_before=0.2, foreign_share=0.02)
    assert quiet.comparable
    assert not Quietness(threshold=0.5, waited_s=300.0, load_before=1.7).comparable  # busy before
    busy = Quietness(threshold=0.5, waited_s=0.0, load_before=0.2, load_after=1.9, foreign_share=0.4)
    assert not busy.comparable  # others took 40 % of the machine during the run
    record = make_record("demo", {"x": 1}, busy, value=float("nan"))
    header = markdown_header(record, "Demo")
    assert "NOT COMPARABLE" in header[2] and "40.0 %" in header[2]
    write_record(tmp_path, record, header + table(["a"], [[1]]))
    saved = json.loads((tmp_path / "results.json").read_text())  # strict JSON: NaN became null
    assert saved["value"] is None and saved["quietness"]["comparable"] is False
    assert saved["schema"] == "lit_cifar.bench/v2" and "cpu" in saved["environment"]
    assert "| a |" in (tmp_path / "results.md").read_text()


def test_foreign_cpu_time_is_accounted():
    # A busy loop in THIS process is our own work, not another process's: the share stays small.
    quiet = Quietness(threshold=100.0, waited_s=0.0, load_before=0.0).begin()
    end = time.monotonic() + 0.3
    while time.monotonic() < end:
        pass
    quiet.finish()
    assert quiet.foreign_share is not None and 0.0 <= quiet.foreign_share <= 1.0
    assert quiet.load_after is not None


def test_difference_ci_of_a_known_shift():
    rng = np.random.default_rng(3)
    base = rng.normal(100, 1, 400)
    e = difference_ci(base + 7, rng.permutation(base))
    assert e.value == pytest.approx(7) and e.low < 7 < e.high
