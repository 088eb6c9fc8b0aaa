"""One pytest run of Lightning's tests: a test file (or a standalone test) in one mode, as its own process
group, killed after a timeout, with what it left in the tests folder removed; its outcomes, launches and run
record are kept beside its log, so a killed runner's work folder given again goes on where it stopped."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from collectives.launcher import without_launch_variables
from conformance.lightning_suite import selection, swap
from conformance.lightning_suite.outcomes import parse_junit, parse_verbose_log, with_reruns
from measure.run_info import display_path

__all__ = ["files_under", "pytest_env", "remove_left_behind", "run_process", "run_target"]

REPO_ROOT = Path(__file__).resolve().parents[2]
PLUGIN = swap.__name__  # loaded into each pytest with -p


def pytest_env(tests: Path, mode: str, launch_log: Path, standalone: bool) -> dict[str, str]:
    # No rendezvous variables of an outer launch (a run inheriting LOCAL_RANK would act as a popen rank),
    # no switch or pytest option of the caller's own test run.
    env = without_launch_variables(dict(os.environ))
    for name in (swap.SWAP_ENV, "PL_RUN_STANDALONE_TESTS", "PYTEST_CURRENT_TEST", "PYTEST_ADDOPTS"):
        env.pop(name, None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), str(tests), env.get("PYTHONPATH")) if p)
    env[swap.LAUNCH_LOG_ENV] = str(launch_log)
    if mode == "custom_ddp":
        env[swap.SWAP_ENV] = "1"
    if standalone:
        env["PL_RUN_STANDALONE_TESTS"] = "1"
    env["PYTHONHASHSEED"] = "0"  # a message that prints a set (left artifacts) reads the same in every run
    return env


def run_process(command: list[str], env: dict[str, str], cwd: Path, log: Path, timeout: float) -> int | None:
    """The exit status, or ``None`` when killed after ``timeout`` seconds. The run gets a session of its own:
    its whole process group goes at the end, with any rank or worker left behind."""
    with log.open("w") as output:
        process = subprocess.Popen(
            command, cwd=cwd, env=env, stdout=output, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            status: int | None = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            status = None
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass  # the group is gone: nothing left behind
        process.wait()
    return status


def files_under(tests: Path) -> set[Path]:
    return {path for path in tests.rglob("*") if "__pycache__" not in path.parts}


def remove_left_behind(tests: Path, before: set[Path]) -> list[Path]:
    """Remove what a run added under ``tests`` (newest first, so folders are empty when their turn comes).
    A test that fails after a fit leaves its checkpoints there; the next run would save beside them
    under other names (``-v1.ckpt``, ...) and report other failure messages."""
    added = sorted(files_under(tests) - before, key=lambda path: len(path.parts), reverse=True)
    for path in added:
        shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()  # with its __pycache__
    return added


def run_target(tests: Path, target: str, mode: str, standalone: bool, name: Path, timeout: float) -> dict[str, Any]:
    """One pytest of ``target`` (a file, or a standalone test's node id) in ``mode``: its run record, outcomes
    and launches, also kept in ``name``.json; a target whose ``name``.json exists (a killed runner's work
    folder, given again) is not run again."""
    done = name.with_suffix(".json")
    if done.is_file():
        print(f"{mode:>10} recorded earlier: {target}", flush=True)
        return json.loads(done.read_text())
    junit, log, launch_log = name.with_suffix(".xml"), name.with_suffix(".log"), name.with_suffix(".launches.jsonl")
    launch_log.unlink(missing_ok=True)  # from a run killed with the runner
    command = [sys.executable, "-m", "pytest", "-p", PLUGIN, "-p", "no:cacheprovider", "-v", f"--rootdir={tests}"]
    command += ["-o", "junit_family=xunit1", f"--junitxml={junit}", target]
    if not standalone:
        command += ["-k", selection.k_expression(target)]
    start, before = time.monotonic(), files_under(tests)
    status = run_process(command, pytest_env(tests, mode, launch_log, standalone), tests, log, timeout)
    remove_left_behind(tests, before)
    text = log.read_text(errors="replace")
    if status is None:
        why = f"no result after {timeout:.0f} s: the run was killed"
        results = parse_verbose_log(text, target, "timeout", why)
    elif not junit.is_file():
        why = f"pytest ended with status {status} and no report: see its log"
        results = parse_verbose_log(text, target, "error", why)
    else:
        results = parse_junit(junit)
    results = with_reruns(results, text)
    run = {"target": target, "mode": mode, "status": status, "seconds": round(time.monotonic() - start, 1)}
    print(f"{mode:>10} {run['seconds']:6.1f} s status {status} {target} ({display_path(str(log))})", flush=True)
    launches = [json.loads(line) for line in launch_log.read_text().splitlines()] if launch_log.is_file() else []
    record = {"run": run, "results": results, "launches": launches}
    done.write_text(json.dumps(record))
    return record
