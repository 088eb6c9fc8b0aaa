"""The shared benchmark layer: options, rounds, intervals, quietness, verdicts, the record and its writer."""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from benchmarks.harness import SCHEMA, Quietness, interleave, make_record, parse, parser, verdict
from benchmarks.report import fmt_value, headline_row, report, table, write_record
from measure import run_info, stats
from measure.run_info import environment
from measure.stats import difference_ci, in_runs, median_ci, pair_ratio_ci, paired_ratio_ci, ratio_ci, share_ci


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
    assert fmt_value(e.__dict__, "x").startswith("1.50 [") and fmt_value(e.__dict__, "%").endswith("] %")
    with pytest.raises(ValueError, match="both sides"):
        ratio_ci([1.0], [])


def _drifting_runs(rng: np.random.Generator, runs: int = 8, steps: int = 16) -> list[list[float]]:
    """Steps of ``runs`` runs on a host whose speed drifts from run to run (12 %) more than from step to
    step (5 %): what a shared 2-core VM gives (a fixed matmul loop there drifts by up to 45 % over tens of s)."""
    return [list(np.exp(rng.normal(0, 0.12)) * np.exp(rng.normal(0, 0.05, steps))) for _ in range(runs)]


def test_intervals_that_draw_whole_runs_cover_the_truth_where_step_draws_do_not():
    # 100 experiments, both sides the same process (true ratio 1): a 95 % interval should hold 1 in ~95.
    rng = np.random.default_rng(3)
    covered = {"runs": 0, "steps": 0}
    for _ in range(100):
        a, b = _drifting_runs(rng), _drifting_runs(rng)
        by_runs, by_steps = ratio_ci(a, b, resamples=500), ratio_ci(sum(a, []), sum(b, []), resamples=500)
        assert by_runs.value == by_steps.value and by_runs.n == by_steps.n == 128  # same pooled medians
        covered["runs"] += by_runs.low <= 1 <= by_runs.high
        covered["steps"] += by_steps.low <= 1 <= by_steps.high
    assert covered["runs"] >= 88 and covered["steps"] <= 60, covered


def test_paired_intervals_cancel_the_drift_a_pair_shares():
    # 100 experiments of 30 pairs: each pair's two runs share the host's speed of that minute (12 %),
    # the steps add their own noise (5 %); a true ratio of 0.98 must be covered ~95 times in 100, and
    # drawing the pairs together must give intervals far narrower than drawing each side's runs apart.
    rng = np.random.default_rng(5)
    covered, widths = 0, {"paired": [], "apart": []}
    for _ in range(100):
        drift = np.exp(rng.normal(0, 0.12, 30))
        a, b = ([list(d * scale * np.exp(rng.normal(0, 0.05, 16))) for d in drift] for scale in (0.98, 1.0))
        paired, apart = paired_ratio_ci(a, b, resamples=500), ratio_ci(a, b, resamples=500)
        assert paired.value == apart.value and paired.n == 480
        covered += paired.low <= 0.98 <= paired.high
        widths["paired"].append(paired.high - paired.low)
        widths["apart"].append(apart.high - apart.low)
    assert covered >= 88, covered
    assert np.median(widths["paired"]) < np.median(widths["apart"]) / 3, {k: np.median(w) for k, w in widths.items()}


def test_per_pair_ratios_cancel_the_speed_of_each_pairs_minute():
    # 100 experiments of 30 pairs on a host that runs each pair in a fast or a slow minute (1.0 or 1.4,
    # shared by the pair's two runs), each run drifting 6 % on its own and its steps 5 %: the per-pair
    # ratio covers a true 0.98 ~95 times in 100, with intervals narrower than pooling the pairs' steps.
    rng = np.random.default_rng(7)
    covered, widths = 0, {"per_pair": [], "pooled": []}
    for _ in range(100):
        minute = np.where(rng.random(30) < 0.5, 1.0, 1.4) * np.exp(rng.normal(0, 0.05, 30))
        a, b = (
            [list(m * scale * np.exp(rng.normal(0, 0.06)) * np.exp(rng.normal(0, 0.05, 16))) for m in minute]
            for scale in (0.98, 1.0)
        )
        per_pair, pooled = pair_ratio_ci(a, b, resamples=400), paired_ratio_ci(a, b, resamples=400)
        assert per_pair.n == 30 and per_pair.low <= per_pair.value <= per_pair.high
        covered += per_pair.low <= 0.98 <= per_pair.high
        widths["per_pair"].append(per_pair.high - per_pair.low)
        widths["pooled"].append(pooled.high - pooled.low)
    assert covered >= 88, covered
    median_widths = {k: np.median(w) for k, w in widths.items()}
    assert median_widths["per_pair"] < median_widths["pooled"] / 1.5, median_widths


@pytest.mark.parametrize("paired_ci", [paired_ratio_ci, pair_ratio_ci])
def test_paired_intervals_need_one_run_per_pair_on_both_sides(paired_ci):
    with pytest.raises(ValueError, match=r"same number of non-empty runs.*\[2, 1\] and \[2\]"):
        paired_ci([[1.0, 1.0], [2.0]], [[1.0, 1.0]])
    with pytest.raises(ValueError, match="non-empty"):
        paired_ci([[1.0], []], [[1.0], [1.0]])


def test_flat_samples_are_runs_of_one_and_ragged_runs_are_drawn_whole():
    rng = np.random.default_rng(4)
    a, b = rng.lognormal(0, 0.1, 60), rng.lognormal(0.1, 0.1, 40)
    assert ratio_ci([[x] for x in a], [[y] for y in b]) == ratio_ci(a, b)
    ragged = [[1.0, 1.1, 0.9], [2.0], [], [1.5, 1.4]]  # an empty round (a rank without samples) draws nothing
    e = median_ci(ragged)
    assert e.value == pytest.approx(1.25) and e.n == 6 and 0.9 <= e.low <= e.value <= e.high <= 2.0
    assert difference_ci(ragged, [[1.0, 1.0]]).value == pytest.approx(0.25)
    assert share_ci([[1.0]], [[2.0], [2.0]]).value == pytest.approx(0.5)
    with pytest.raises(ValueError, match="not a mix"):
        median_ci([1.0, [2.0, 3.0]])
    assert in_runs([1, 2, 3, 4, 5], 2) == [[1, 2], [3, 4], [5]]
    with pytest.raises(ValueError, match="run_length >= 1, got 0"):
        in_runs([1.0], 0)


def test_intervals_sharing_a_side_give_the_numbers_each_gives_drawn_afresh():
    """A side drawn with the same generator state is drawn once (measure.stats keeps its medians): every estimate
    equals the one drawn with nothing kept, in any order, and the kept draws are the distinct ones."""
    rng = np.random.default_rng(1)
    a, b, c = ([list(rng.normal(mean, 0.1, 5)) for _ in range(4)] for mean in (1.0, 2.0, 3.0))
    calls = [lambda: ratio_ci(a, b), lambda: ratio_ci(a, c), lambda: median_ci(a), lambda: difference_ci(c, b)]
    fresh = []
    for call in calls:
        stats._medians.clear()
        fresh.append(call())
    stats._medians.clear()
    assert [call() for call in calls] == fresh
    assert [call() for call in reversed(calls)] == fresh[::-1]
    # a and c first (the seed's state); b and c second: after a side of 4 runs of 5, whichever it was
    assert len(stats._medians) == 4


def test_busy_machine_is_marked_not_comparable(tmp_path):
    quiet = Quietness(threshold=0.5, waited_s=0.0, load_before=0.2, foreign_share=0.02)
    assert quiet.comparable
    assert not Quietness(threshold=0.5, waited_s=300.0, load_before=1.7).comparable  # busy before
    busy = Quietness(threshold=0.5, waited_s=0.0, load_before=0.2, load_after=1.9, foreign_share=0.4)
    assert not busy.comparable  # others took 40 % of the machine during the run
    record = make_record("demo", {"x": 1}, busy, value=float("nan"))
    header = report(record, "Demo", [])
    assert "NOT COMPARABLE" in header[2] and "40.0 %" in header[2]
    write_record(tmp_path, record, header + table(["a"], [[1]]))
    saved = json.loads((tmp_path / "results.json").read_text())  # strict JSON: NaN became null
    assert saved["value"] is None and saved["quietness"]["comparable"] is False
    assert saved["schema"] == SCHEMA and "cpu" in saved["environment"]
    assert "| a |" in (tmp_path / "results.md").read_text()
    stolen = Quietness(threshold=0.5, waited_s=0.0, load_before=0.2, foreign_share=0.13, steal_share=0.12)
    assert "13.0 % (the hypervisor's steal: 12.0 %) of the machine" in report(make_record("d", {}, stolen), "D", [])[2]


def test_foreign_cpu_time_is_accounted():
    # A busy loop in THIS process is our own work, not another process's: the share stays small.
    quiet = Quietness(threshold=100.0, waited_s=0.0, load_before=0.0).begin()
    end = time.monotonic() + 0.3
    while time.monotonic() < end:
        pass
    quiet.finish()
    assert quiet.foreign_share is not None and 0.0 <= quiet.foreign_share <= 1.0
    assert quiet.load_after is not None


def test_hypervisor_steal_is_kept_apart_as_part_of_the_foreign_share(monkeypatch):
    """On a virtual machine the CPU time its host gave other guests is foreign too, and named apart: 16 busy
    CPU seconds of the machine's 20 in 10 s on 2 CPUs, 10 of them ours, 4 stolen."""
    machine = iter([(50.0, 5.0), (66.0, 9.0)])  # (busy, stolen) CPU seconds since boot, at begin and finish
    own, clock = iter([10.0, 20.0]), iter([100.0, 110.0])
    monkeypatch.setattr(run_info, "_machine_cpu_seconds", lambda: next(machine))
    monkeypatch.setattr(run_info, "_own_cpu_seconds", lambda: next(own))
    monkeypatch.setattr(run_info, "time", SimpleNamespace(monotonic=lambda: next(clock)))
    monkeypatch.setattr(run_info.os, "cpu_count", lambda: 2)
    quiet = Quietness(threshold=100.0, waited_s=0.0, load_before=0.0).begin().finish()
    assert quiet.foreign_share == pytest.approx(0.3) and quiet.steal_share == pytest.approx(0.2)
    assert not quiet.comparable and quiet.as_dict()["steal_share"] == pytest.approx(0.2)


def test_difference_ci_of_a_known_shift():
    rng = np.random.default_rng(3)
    base = rng.normal(100, 1, 400)
    e = difference_ci(base + 7, rng.permutation(base))
    assert e.value == pytest.approx(7) and e.low < 7 < e.high


def test_share_of_a_known_part():
    rng = np.random.default_rng(4)
    whole = rng.normal(100, 1, 400)
    e = share_ci(whole * 0.75, whole)  # the part missing from "without" takes a quarter of the whole
    assert e.value == pytest.approx(0.25) and e.low < 0.25 < e.high


def test_verdicts_are_values_judged_on_the_whole_interval():
    assert verdict({"value": 1.0, "low": 0.9, "high": 1.1}, 1.2) == "met"
    assert verdict({"value": 1.3, "low": 1.25, "high": 1.4}, 1.2) == "missed"
    assert verdict({"value": 1.2, "low": 1.1, "high": 1.3}, 1.2) == "undecided"
    assert verdict({"value": 5.0, "low": 4.0, "high": 6.0}, 3.0, at_most=False) == "met"
    assert verdict(2e-7, 1e-6) == "met"  # a plain number is its own interval
    row = headline_row("a / b", {"value": 1.3, "low": 1.25, "high": 1.4, "n": 9}, "x", target=1.2)
    assert row["verdict"] == "missed" and row["target"] == "<= 1.2"
    assert fmt_value({"value": 0.0123, "low": 0.011, "high": 0.014}, "s") == "12.3 [11.0, 14.0] ms"
    assert fmt_value(3 * 2**20, "B") == "3 MiB" and fmt_value([1.0, None], "x") == "1.00 / –"
    assert fmt_value({"value": 1.004, "low": 0.96, "high": 1.05}) == "1.00 [0.960, 1.05]"  # never "1": not exactly 1
    assert fmt_value(1234.4) == "1234" and fmt_value(3) == "3"  # a count stays a count


def test_quick_never_writes_into_the_committed_results(tmp_path):
    p = parser("demo", "Demo.")
    quick = parse(p, ["--quick"])
    assert not quick.out.resolve().is_relative_to(Path(__file__).resolve().parents[2] / "benchmarks" / "results")
    assert quick.max_wait_s == 0.0 and parse(p, []).max_wait_s == 300.0
    assert parse(p, []).out == Path("benchmarks/results/demo")
    with pytest.raises(SystemExit):
        parse(p, ["--quick", "--out", "benchmarks/results/demo"])


def test_records_tell_cpu_generations_apart(tmp_path):
    """A hypervisor may name every EPYC generation "AMD EPYC": the record keeps family, model and stepping."""
    env = environment()
    if not os.path.exists("/proc/cpuinfo"):
        pytest.skip("no /proc/cpuinfo on this system")
    assert re.fullmatch(r"\S+ family \d+ model \d+ stepping \d+", env["cpu_id"]), env["cpu_id"]
    record = make_record("demo", {}, Quietness(threshold=0.5, waited_s=0.0, load_before=0.2))
    assert any(f"Machine: {env['cpu']} [{env['cpu_id']}] (" in line for line in report(record, "Demo", []))
    del record["environment"]["cpu_id"]  # a record made before cpu_id was kept still reports
    assert any(f"Machine: {env['cpu']} (" in line for line in report(record, "Demo", []))
