"""README.md's results block is generated from the committed benchmark records and must match them."""

from __future__ import annotations

import json
import shutil

import pytest

from benchmarks import rederive
from benchmarks.harness import RESULTS
from benchmarks.readme_results import BEGIN, END, render_block, update_readme


def test_readme_numbers_match_the_committed_results():
    current, fresh = update_readme()
    assert current == fresh, "README.md is stale: run python -m benchmarks.readme_results --write"


def test_block_renders_headline_rows_and_quietness(tmp_path):
    """A benchmark without an analysis module of its own is shown from its stored headline rows."""
    folder = tmp_path / "demo"
    folder.mkdir()
    rows = [
        {
            "what": "a / b: step time",
            "value": {"value": 1.025, "low": 0.99, "high": 1.06, "n": 40},
            "unit": "x",
            "target": "<= 1.2",
            "verdict": "met",
        },
        {"what": "calls", "value": 3, "unit": ""},
    ]
    record = {
        "command": "python -m benchmarks.demo",
        "headline": rows,
        "environment": {"cpu": "Demo CPU", "cpu_id": "GenuineDemo family 6 model 1 stepping 0", "cpu_count": 2},
        "quietness": {"comparable": False, "load_before": 1.5, "foreign_share": 0.3},
    }
    (folder / "results.json").write_text(json.dumps(record))
    (tmp_path / "unshown").mkdir()  # a record without a headline is not shown
    (tmp_path / "unshown" / "results.json").write_text(json.dumps({"rows": []}))
    block = render_block(tmp_path)
    assert block.startswith(BEGIN) and block.endswith(END)
    assert "| a / b: step time | 1.02 [0.990, 1.06] | met, target <= 1.2 |" in block and "| calls | 3 | – |" in block
    assert "NOT comparable" in block and "30.0 %" in block and "unshown" not in block
    assert "Intervals too narrow" in block  # intervals, and no word that they drew whole runs
    record["intervals"] = "runs"
    (folder / "results.json").write_text(json.dumps(record))
    assert "Intervals too narrow" not in render_block(tmp_path)
    assert "Demo CPU [GenuineDemo family 6 model 1 stepping 0] (2 cores)" in block  # ratios differ between CPUs


def test_each_benchmark_heads_its_section_with_human_labels():
    """The committed records, through each benchmark's own headline(): no raw record keys in the block."""
    block = render_block()
    for title in ("custom_ddp vs Lightning ddp", "Gradient synchronisation", "SyncBatchNorm", "All-reduce"):
        assert f"**{title}" in block, title
    assert "step_ratio_" not in block and "_vs_" not in block


def test_missing_markers_are_a_clear_error(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("# no block\n")
    with pytest.raises(ValueError, match="results:begin"):
        update_readme(readme, tmp_path)


def test_readme_conformance_table_matches_its_record():
    from conformance.table import DEFAULT_OUT, update_readme

    current, fresh = update_readme(json.loads((DEFAULT_OUT / "results.json").read_text()))
    assert current == fresh, "README.md's conformance table is stale: run python -m conformance.table"


def test_readme_training_conformance_table_matches_its_record():
    from conformance.table import update_readme
    from conformance.training_table import BEGIN, DEFAULT_OUT, END, render

    current, fresh = update_readme(
        json.loads((DEFAULT_OUT / "results.json").read_text()), render_record=render, begin=BEGIN, end=END
    )
    assert current == fresh, "README.md's training table is stale: run python -m conformance.training_table"


@pytest.mark.parametrize(
    "name", ["compare_localbn", "syncbn", "paired_fits_template_zen3", "paired_fits_resnet18_acc4_zen3"]
)
def test_committed_records_are_derived_by_todays_analysis(tmp_path, name):
    """Re-deriving a committed record from its raw samples changes nothing: its estimates are today's."""
    folder = tmp_path / name
    shutil.copytree(RESULTS / name, folder, ignore=shutil.ignore_patterns("*.png", "logs", "work"))
    assert rederive.rederive(folder)
    rederived, committed = (json.loads((f / "results.json").read_text()) for f in (folder, RESULTS / name))
    assert rederived == committed
    with pytest.raises(SystemExit):  # a folder that holds no record
        rederive.main(["no_such_benchmark"])
