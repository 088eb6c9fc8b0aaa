"""The Lightning test-suite runner's parts without Lightning's tests: the name swap, the launch log, the
JUnit reading and comparison, the reruns of flaky tests, the docs block, a hung run's end
(conformance/lightning_suite/)."""

from __future__ import annotations

import copy
import json
import multiprocessing
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher
from lightning.pytorch.trainer import call

from conformance.lightning_suite import pytest_run, run, swap
from conformance.lightning_suite.outcomes import (
    compare,
    outcome_table,
    parse_junit,
    parse_verbose_log,
    render_markdown,
    with_reruns,
    worse,
)
from conformance.lightning_suite.selection import expected_difference
from strategies import CustomDDPStrategy

UNUSED = "tests_pytorch/strategies/test_ddp_integration.py::test_find_unused_parameters_ddp_exception"


@pytest.fixture
def registry() -> Iterator[_StrategyRegistry]:
    """Lightning's global registry, restored entry by entry afterwards."""
    saved = dict(StrategyRegistry)
    yield StrategyRegistry
    StrategyRegistry.clear()
    StrategyRegistry.update(saved)
    assert StrategyRegistry["ddp"]["strategy"] is DDPStrategy


@pytest.mark.parametrize(
    ("name", "start_method"),
    [
        ("ddp", "popen"),
        ("ddp_spawn", "spawn"),
        ("ddp_fork", "fork"),
        ("ddp_notebook", "fork"),
        ("ddp_spawn_find_unused_parameters_true", "spawn"),
        ("ddp_find_unused_parameters_false", "popen"),
    ],
)
def test_swap_builds_custom_ddp_with_the_names_start_method(registry: Any, name: str, start_method: str) -> None:
    replaced = swap.swap_ddp_names(registry)
    strategy = registry.get(name)
    assert type(strategy) is CustomDDPStrategy
    assert strategy._start_method == start_method
    assert replaced[name]["strategy"] is DDPStrategy
    assert registry["custom_ddp"]["strategy"] is CustomDDPStrategy  # other entries untouched
    registry.update(replaced)
    assert type(registry.get(name)) is DDPStrategy


def test_swap_refuses_a_ddp_parameter_it_cannot_map() -> None:
    own = _StrategyRegistry()
    own.register("ddp_buckets", DDPStrategy, start_method="spawn", bucket_cap_mb=10)
    with pytest.raises(TypeError, match=r"'ddp_buckets'.*\['bucket_cap_mb'\]"):
        swap.swap_ddp_names(own)


def _configure(monkeypatch: pytest.MonkeyPatch, **env: str) -> SimpleNamespace:
    for name in (swap.SWAP_ENV, swap.LAUNCH_LOG_ENV, "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    config = SimpleNamespace(option=SimpleNamespace(xmlpath="report.xml"))
    swap.pytest_configure(config)  # type: ignore[arg-type]
    return config


def test_the_plugin_swaps_only_when_asked(registry: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    config = _configure(monkeypatch)
    assert registry["ddp_spawn"]["strategy"] is DDPStrategy
    assert config.option.xmlpath == "report.xml"
    _configure(monkeypatch, **{swap.SWAP_ENV: "1"})
    assert registry["ddp_spawn"]["strategy"] is CustomDDPStrategy


def test_a_popen_rank_writes_no_junit_report(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _configure(monkeypatch, LOCAL_RANK="1").option.xmlpath is None
    assert _configure(monkeypatch, LOCAL_RANK="0").option.xmlpath == "report.xml"


def test_launch_log_counts_started_processes_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()

    def children(self: Any) -> None:
        self.procs = copy.copy(self.started)  # a new list per launch, as Lightning's

    def launch(self: Any, function: Any, *args: Any, **kwargs: Any) -> Any:
        self.procs = copy.copy(self.started)
        return function()

    def trainer_call(trainer: Any, function: Any) -> Any:
        return function()

    # Fakes in place of the real ones, so the wrappers start nothing; monkeypatch restores the real ones.
    monkeypatch.setattr(call, "_call_and_handle_interrupt", trainer_call)
    monkeypatch.setattr(_SubprocessScriptLauncher, "_call_children_scripts", children)
    monkeypatch.setattr(_MultiProcessingLauncher, "launch", launch)
    monkeypatch.setenv("PYTEST_CURRENT_TEST", "tests_x.py::test_y[ddp] (call)")  # outside the plugin's hooks
    log = tmp_path / "launches.jsonl"
    swap.install_launch_log(str(log))

    popen = SimpleNamespace(procs=[], started=[child])
    trainer = SimpleNamespace(strategy=DDPStrategy())
    call._call_and_handle_interrupt(trainer, lambda: _SubprocessScriptLauncher._call_children_scripts(popen))
    fork = SimpleNamespace(procs=[], started=[multiprocessing.Process()] * 2, _strategy=0, _start_method="fork")
    assert _MultiProcessingLauncher.launch(fork, lambda: 7) == 7
    mocked = SimpleNamespace(procs=[], started=object(), _strategy=0, _start_method="spawn")  # a mocked starter
    _MultiProcessingLauncher.launch(mocked, lambda: None)
    swap.pytest_runtest_logstart("tests_x.py::test_z", ("tests_x.py", 1, "test_z"))
    monkeypatch.delenv("PYTEST_CURRENT_TEST")  # as a test that clears os.environ
    _MultiProcessingLauncher.launch(fork, lambda: None)
    swap.pytest_runtest_logfinish("tests_x.py::test_z", ("tests_x.py", 1, "test_z"))

    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert lines == [
        {"test": "tests_x.py::test_y[ddp]", "strategy": "DDPStrategy", "start_method": "popen", "num_processes": 2},
        {"test": "tests_x.py::test_y[ddp]", "strategy": "int", "start_method": "fork", "num_processes": 2},
        {"test": "tests_x.py::test_z", "strategy": "int", "start_method": "fork", "num_processes": 2},
    ]
    assert swap._current_test() is None


JUNIT_DDP = """<testsuites><testsuite>
<testcase classname="tests_pytorch.m.test_a" name="test_both" file="tests_pytorch/m/test_a.py" line="1" />
<testcase classname="tests_pytorch.m.test_a.TestK" name="test_m[ddp]" file="tests_pytorch/m/test_a.py" line="2" />
<testcase classname="tests_pytorch.m.test_a" name="test_skip" file="tests_pytorch/m/test_a.py" line="3">
<skipped type="pytest.skip" message="no GPU" /></testcase>
<testcase classname="tests_pytorch.m.test_a" name="test_xf" file="tests_pytorch/m/test_a.py" line="4">
<skipped type="pytest.xfail" message="" /></testcase>
<testcase classname="" name="tests_pytorch.m.test_b" file="tests_pytorch/m/test_b.py">
<error message="collection failure">E   ModuleNotFoundError: No module named 'x'</error></testcase>
<testcase classname="tests_pytorch.strategies.test_ddp_integration" name="test_find_unused_parameters_ddp_exception"
 file="tests_pytorch/strategies/test_ddp_integration.py" line="5" />
</testsuite></testsuites>"""

JUNIT_CUSTOM = """<testsuites><testsuite>
<testcase classname="tests_pytorch.m.test_a" name="test_both" file="tests_pytorch/m/test_a.py" line="1" />
<testcase classname="tests_pytorch.m.test_a.TestK" name="test_m[ddp]" file="tests_pytorch/m/test_a.py" line="2">
<failure message="AssertionError: wrong | sum&#10;second line">trace</failure></testcase>
<testcase classname="tests_pytorch.m.test_a.TestK" name="test_m[ddp]" file="tests_pytorch/m/test_a.py" line="2">
<error message="">teardown
E   RuntimeError: leaked a port</error></testcase>
<testcase classname="tests_pytorch.strategies.test_ddp_integration" name="test_find_unused_parameters_ddp_exception"
 file="tests_pytorch/strategies/test_ddp_integration.py" line="5">
<failure message="Failed: DID NOT RAISE &lt;class 'RuntimeError'&gt;">trace</failure></testcase>
</testsuite></testsuites>"""


def _junit(tmp_path: Path, name: str, text: str) -> dict[str, dict[str, str]]:
    (tmp_path / name).write_text(text)
    return parse_junit(tmp_path / name)


def test_junit_reports_become_outcomes_per_node_id(tmp_path: Path) -> None:
    ddp, custom = _junit(tmp_path, "ddp.xml", JUNIT_DDP), _junit(tmp_path, "custom.xml", JUNIT_CUSTOM)
    assert ddp["tests_pytorch/m/test_a.py::test_both"] == {"outcome": "passed"}
    assert ddp["tests_pytorch/m/test_a.py::TestK::test_m[ddp]"] == {"outcome": "passed"}
    assert ddp["tests_pytorch/m/test_a.py::test_skip"] == {"outcome": "skipped"}
    assert ddp["tests_pytorch/m/test_a.py::test_xf"] == {"outcome": "xfailed"}
    assert ddp["tests_pytorch/m/test_b.py"] == {"outcome": "error", "message": "collection failure"}
    # A failed call, then a teardown error: the worse (error), the call's message first.
    assert custom["tests_pytorch/m/test_a.py::TestK::test_m[ddp]"] == {
        "outcome": "error",
        "message": "AssertionError: wrong | sum; then RuntimeError: leaked a port",
    }


def _record(tmp_path: Path, custom_log: str = "") -> dict[str, Any]:
    """A record of the two JUnit reports; ``custom_log``: the custom_ddp run's ``pytest -v`` output."""
    custom = with_reruns(_junit(tmp_path, "c.xml", JUNIT_CUSTOM), custom_log)
    outcomes = {"ddp": _junit(tmp_path, "ddp.xml", JUNIT_DDP), "custom_ddp": custom}
    launch = {"test": "tests_pytorch/m/test_a.py::test_both", "start_method": "spawn", "num_processes": 2}
    launches = {
        "ddp": [{**launch, "strategy": "DDPStrategy"}, {**launch, "test": UNUSED, "strategy": "DDPStrategy"}],
        "custom_ddp": [
            {**launch, "strategy": "CustomDDPStrategy"},
            {**launch, "strategy": "CustomDDPStrategy", "num_processes": 1},
        ],
    }
    table = outcome_table(outcomes, launches, standalone={UNUSED})
    summary = compare(table, expected_difference, launches)
    environment = {"versions": {"torch": "2.x", "lightning": "2.6.6"}, "cpu_count": 2, "date": "today"}
    environment["lightning_tests"] = {"version": "2.6.5"}
    return {"summary": summary, "environment": environment, "selection": {"files": ["a"], "standalone": ["b"]}}


def test_the_comparison_separates_findings_from_expected_differences(tmp_path: Path) -> None:
    summary = _record(tmp_path)["summary"]
    assert summary["passed_in_both"] == 1
    finding = "error: AssertionError: wrong | sum; then RuntimeError: leaked a port"
    assert summary["passed_only_under_ddp"] == {"tests_pytorch/m/test_a.py::TestK::test_m[ddp]": finding}
    assert list(summary["expected_differences"]) == [UNUSED]
    assert summary["expected_differences"][UNUSED]["custom_ddp"].startswith("failed: Failed: DID NOT RAISE")
    assert summary["per_mode"]["ddp"]["ran"] == 5  # skipped tests did not run
    launched = summary["launched"]
    assert (launched["ddp"], launched["custom_ddp"], launched["not_swapped"]) == (2, 1, [UNUSED])


def test_a_page_without_markers_is_left_unchanged(tmp_path: Path) -> None:
    record = _record(tmp_path)
    page = tmp_path / "page.md"
    page.write_text("# Conformance\n\nno block here\n")
    assert not run.write_docs(page, record)
    assert page.read_text() == "# Conformance\n\nno block here\n"
    page.write_text(f"before\n{run.BEGIN}\nold\n{run.END}\nafter\n")
    assert run.write_docs(page, record)
    text = page.read_text()
    assert "old" not in text and text.startswith("before\n") and text.endswith("after\n")
    assert "| ran | 5 | 3 |" in text
    assert "**unexpected**" in text and "wrong \\| sum; then RuntimeError" in text  # a table cell: | escaped
    assert "Run again" not in text  # no test was


# pytest-rerunfailures' lines: test_both failed twice, then passed; its JUnit report holds the pass only.
RERUN_LOG = """tests_pytorch/m/test_a.py::test_both RERUN                                  [ 50%]
tests_pytorch/m/test_a.py::test_both RERUN                                  [ 50%]
tests_pytorch/m/test_a.py::test_both PASSED                                 [ 50%]
tests_pytorch/m/test_a.py::TestK::test_m[ddp] FAILED                        [100%]
"""


def test_the_failed_tries_of_a_flaky_test_are_counted_and_shown(tmp_path: Path) -> None:
    record = _record(tmp_path, custom_log=RERUN_LOG)
    summary = record["summary"]
    both = "tests_pytorch/m/test_a.py::test_both"
    assert summary["reruns"] == {"ddp": {}, "custom_ddp": {both: 2}}
    assert summary["passed_in_both"] == 1  # the last try is the outcome
    text = render_markdown(record)
    assert "`flaky` marks" in text and f"ddp: none; custom_ddp: `{both}` (2x)." in text
    # A test reported twice (a call, then its teardown) keeps its tries.
    merged = worse({"outcome": "failed", "reruns": 1}, {"outcome": "error", "message": "teardown"})
    assert merged == {"outcome": "error", "message": "teardown", "reruns": 1}


def _state(pid: int) -> str:
    """A process's state letter, or "gone" (a killed process not yet reaped is "Z")."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return "gone"


@pytest.mark.long
def test_a_hung_run_is_killed_with_its_processes_and_its_running_test_times_out(tmp_path: Path) -> None:
    hang = (
        "import subprocess, sys, time; rank = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
        "print(rank.pid); print('tests_pytorch/a.py::test_ok PASSED [ 50%]'); print('tests_pytorch/a.py::test_hang ', "
        "flush=True); time.sleep(60)"
    )
    log = tmp_path / "run.log"
    started = time.monotonic()
    # 10 s: room for the child to start and print on a loaded 2-core machine before it is killed.
    assert pytest_run.run_process([sys.executable, "-c", hang], dict(os.environ), tmp_path, log, timeout=10) is None
    assert time.monotonic() - started < 40
    text = log.read_text()
    rank, deadline = int(text.split()[0]), time.monotonic() + 10
    while _state(rank) not in ("gone", "Z") and time.monotonic() < deadline:  # SIGKILL lands when it is scheduled
        time.sleep(0.05)
    assert _state(rank) in ("gone", "Z")  # the rank it started went with it
    assert parse_verbose_log(text, "tests_pytorch/a.py", "timeout", "killed") == {
        "tests_pytorch/a.py::test_ok": {"outcome": "passed"},
        "tests_pytorch/a.py::test_hang": {"outcome": "timeout", "message": "killed"},
    }


def test_what_a_run_left_in_the_tests_folder_is_removed_and_nothing_else(tmp_path: Path) -> None:
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "kept.ckpt").write_text("before")
    before = pytest_run.files_under(tmp_path)
    (tmp_path / "checkpoints" / "epoch=0-step=2.ckpt").write_text("left")
    (tmp_path / "lightning_logs" / "version_0" / "__pycache__").mkdir(parents=True)
    (tmp_path / "lightning_logs" / "version_0" / "hparams.yaml").write_text("left")
    removed = pytest_run.remove_left_behind(tmp_path, before)
    assert {path.relative_to(tmp_path).as_posix() for path in removed} == {
        "checkpoints/epoch=0-step=2.ckpt",
        "lightning_logs",
        "lightning_logs/version_0",
        "lightning_logs/version_0/hparams.yaml",
    }
    assert pytest_run.files_under(tmp_path) == before


def test_the_manuals_block_matches_the_committed_record() -> None:
    from benchmarks.readme_block import replace_block
    from conformance.lightning_suite.run import BEGIN, DEFAULT_OUT, END, PAGE, docs_block

    record = json.loads((DEFAULT_OUT / "results.json").read_text())
    current, fresh = replace_block(PAGE, BEGIN, END, docs_block(record))
    stale = f"{PAGE.name} is stale: run python -m conformance.lightning_suite.run --write-docs {PAGE}"
    assert current == fresh, stale
