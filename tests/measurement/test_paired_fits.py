"""benchmarks.fits.paired_fits: verdicts on the target, paired vs apart intervals, options, and a real run."""

from __future__ import annotations

import numpy as np
import pytest
from entry_points import quick_benchmark_record

from benchmarks.fits.paired_fits import _target_verdict, analyse, headline, parse_config
from benchmarks.fits.variants import MATCHED_THREADS
from benchmarks.harness import SCHEMA


def _timing(ratio: float, pairs: int = 20, seed: int = 0) -> dict:
    """``pairs`` pairs of 16-step runs; each pair shares the host's speed of its minute (15 % apart from
    pair to pair), custom_ddp's steps ``ratio`` x ddp's."""
    rng = np.random.default_rng(seed)
    runs: dict[str, list] = {"custom_ddp_localbn": [], "ddp_tuned": []}
    for pair, drift in enumerate(np.exp(rng.normal(0, 0.15, pairs))):
        for variant, scale in (("custom_ddp_localbn", ratio), ("ddp_tuned", 1.0)):
            steps = 0.1 * drift * scale * np.exp(rng.normal(0, 0.03, 16))
            runs[variant].append({"pair": pair, "step_s": steps.tolist(), "threads": 1})
    return {"template": {"1": runs}}


def test_pairs_drawn_together_decide_what_runs_drawn_apart_cannot():
    row = analyse(_timing(0.97))["template"]["1"]
    per_pair, paired, apart = (row[k]["custom_ddp_localbn/ddp_tuned"] for k in ("per_pair", "paired", "apart"))
    assert paired["value"] == apart["value"] == pytest.approx(0.97, abs=0.01)
    assert per_pair["value"] == pytest.approx(0.97, abs=0.01) and per_pair["n"] == 20  # pairs
    assert per_pair["high"] < 1.0 < apart["high"]  # the drift between pairs widens only the unpaired interval
    assert per_pair["high"] - per_pair["low"] < paired["high"] - paired["low"]
    assert _target_verdict(per_pair, 1.00, 1.03) == "met" and _target_verdict(apart, 1.00, 1.03) == "undecided"
    rows = headline({"analysis": {"template": {"1": row}}})
    assert [r["verdict"] for r in rows] == ["met"] and rows[0]["target"] == "<= 1.00, CI high < 1.03"
    assert rows[0]["value"] == per_pair  # the verdict judges the per-pair ratio
    assert "paired fits (geometric mean of the pairs' ratios), template net, accumulate 1" in rows[0]["what"]


def test_micro_batches_split_into_the_syncing_one_and_the_accumulating_ones():
    # accumulate 2: the accumulating micro-batch is the same on both sides, the syncing one 20 % faster.
    rng = np.random.default_rng(1)
    runs: dict[str, list] = {"custom_ddp_localbn": [], "ddp_tuned": []}
    for pair in range(10):
        for variant, syncing in (("custom_ddp_localbn", 0.8), ("ddp_tuned", 1.0)):
            micro = [t * rng.uniform(0.99, 1.01) for _ in range(8) for t in (0.1, 0.1 * syncing)]
            step = [micro[i] + micro[i + 1] for i in range(0, 16, 2)]
            runs[variant].append({"pair": pair, "step_s": step, "micro_batch_s": micro, "threads": 1})
    row = analyse({"template": {"2": runs}})["template"]["2"]
    split = row["micro_batch_per_pair"]["custom_ddp_localbn/ddp_tuned"]
    assert split["syncing"]["value"] == pytest.approx(0.8, abs=0.01) and split["syncing"]["n"] == 10
    assert split["accumulating"]["value"] == pytest.approx(1.0, abs=0.01)
    assert row["paired"]["custom_ddp_localbn/ddp_tuned"]["value"] == pytest.approx(0.9, abs=0.01)
    assert row["micro_batch_s"]["ddp_tuned"]["syncing"]["value"] == pytest.approx(0.1, abs=0.002)
    del runs["ddp_tuned"][0]["micro_batch_s"]  # a record from before micro-batches were kept: steps only
    assert "micro_batch_per_pair" not in analyse({"template": {"2": runs}})["template"]["2"]


def test_target_verdicts():
    assert _target_verdict({"value": 1.01, "low": 0.99, "high": 1.02}, 1.00, 1.03) == "undecided"  # point above
    assert _target_verdict({"value": 0.99, "low": 0.95, "high": 1.04}, 1.00, 1.03) == "undecided"  # bound not below
    assert _target_verdict({"value": 1.05, "low": 1.01, "high": 1.08}, 1.00, 1.03) == "missed"
    per_pair = analyse(_timing(1.08))["template"]["1"]["per_pair"]["custom_ddp_localbn/ddp_tuned"]
    assert _target_verdict(per_pair, 1.00, 1.03) == "missed"


def test_syncbn_rows_judge_its_ratio_to_ddp_and_its_share_of_the_step():
    """custom_ddp with its SyncBatchNorm 1.06x ddp tuned and 1.04x itself with local BN: on ResNet-18 the ratio
    meets <= 1.10 (CI high < 1.15); the SyncBN share, 1 - 1/1.04 ~ 4 %, meets <= 10 % on its whole interval."""
    timing = _timing(1.0, pairs=20)["template"]["1"]
    base = timing["ddp_tuned"]
    scaled = lambda factor: [{**run, "step_s": [t * factor for t in run["step_s"]]} for run in base]  # noqa: E731
    runs = {"ddp_tuned": base, "custom_ddp": scaled(1.06), "custom_ddp_localbn": scaled(1.06 / 1.04)}
    rows = headline({"analysis": analyse({"resnet18": {"1": runs}})})
    by_pair = {r["what"].split(":")[0]: r for r in rows}
    syncbn = next(r for what, r in by_pair.items() if what.startswith("custom_ddp (SyncBN") and "ddp tuned" in what)
    assert syncbn["target"] == "<= 1.10, CI high < 1.15" and syncbn["verdict"] == "met"
    assert syncbn["value"]["value"] == pytest.approx(1.06)
    (share,) = [r for r in rows if r["what"].startswith("SyncBN share")]
    assert share["value"]["value"] == pytest.approx(1 - 1 / 1.04) and share["verdict"] == "met"
    assert share["target"] == "<= 10%" and "resnet18 net, accumulate 1" in share["what"]


def test_paired_fits_arguments(capsys):
    cfg, max_wait_s = parse_config(["--quick", "--out", "/tmp/paired_quick"])
    assert cfg["pairs"] == 1 and cfg["accumulates"] == [2] and list(cfg["nets"]) == ["template"] and max_wait_s == 0
    full, _ = parse_config(["--variants", "custom_ddp_localbn", "custom_ddp_localbn_gloo", "ddp_tuned"])
    assert full["variants_by_net"]["resnet18"] == ["custom_ddp_localbn", "custom_ddp_localbn_gloo", "ddp_tuned"]
    assert full["out"] == "benchmarks/results/paired_fits" and full["pairs"] == 30
    for bad, said in ((["--pairs", "0"], "got [1, 2, 4], 0"), (["--variants", "ddp_tuned"], "name 2 or more")):
        with pytest.raises(SystemExit):
            parse_config(bad)
        assert said in capsys.readouterr().err
    with pytest.raises(SystemExit):  # one process: nothing to pair with a 2-rank fit
        parse_config(["--variants", "single", "ddp_tuned"])


@pytest.mark.slow  # a benchmark's whole path (torchrun, Lightning fits), slow like compare's; its pairing,
@pytest.mark.distributed  # intervals, verdicts and report are tested above on made-up timings
def test_paired_fits_end_to_end_quick(tmp_path):
    # Both strategies fit in turn in the same 2 ranks: custom_ddp after ddp and ddp after custom_ddp
    # in one process group, as a script calling fit twice would.
    out = tmp_path / "paired"
    record = quick_benchmark_record("fits.paired_fits", out, "--pairs", "2", timeout=600)
    assert record["schema"] == SCHEMA and record["config"]["pairs"] == 1  # --quick: one pair
    runs = record["timing"]["template"]["2"]
    assert set(runs) == {"custom_ddp_localbn", "ddp_tuned"}
    for variant, [run] in runs.items():
        assert run["pair"] == 0 and len(run["step_s"]) == 2 and run["threads"] == MATCHED_THREADS, variant
    custom, ddp = (runs[v][0]["recorded"]["strategy"] for v in ("custom_ddp_localbn", "ddp_tuned"))
    assert custom["class"].endswith("CustomDDPStrategy") and custom["sync_batchnorm"] is False
    assert ddp["class"].endswith(".DDPStrategy") and ddp["gradient_as_bucket_view"] is True
    assert [len(run["micro_batch_s"]) for [run] in runs.values()] == [4, 4]  # 2 steps of 2 micro-batches
    assert set(record["analysis"]["template"]["2"]["micro_batch_per_pair"]["custom_ddp_localbn/ddp_tuned"]) == {
        "syncing",
        "accumulating",
    }
    assert record["headline"][0]["verdict"] in ("met", "missed", "undecided")
    assert "pairs drawn together" in (out / "results.md").read_text()
    assert (out / "data" / "synthetic").is_dir()  # the smoke run's data stay in its folder, not the checkout's
