"""Lightning's own ddp tests, run under Lightning's ``ddp`` and with its ddp names resolved to ``custom_ddp``.

Each selected test file (:mod:`conformance.lightning_suite.selection`) runs in a pytest of its own,
once per mode, from Lightning's ``tests/`` folder; then each standalone test, alone, with
``PL_RUN_STANDALONE_TESTS=1`` (as Lightning's CI). Every run loads the plugin
:mod:`conformance.lightning_suite.swap`, writes JUnit XML and is killed after ``--timeout`` seconds
(a hang is a ``timeout`` outcome of the test it was in). The outcomes per test and mode, the launches
of 2+ processes and the comparison go to ``conformance/results/lightning_suite/results.json`` and
``results.md``. Getting Lightning's tests and their extra dependencies, not in this project's venv::

    git clone --depth 1 --branch 2.6.5 https://github.com/Lightning-AI/pytorch-lightning /tmp/pl
    pip install --target /tmp/pl-extra cloudpickle scikit-learn
    PYTHONPATH=/tmp/pl-extra python -m conformance.lightning_suite.run --tests /tmp/pl/tests   # ~50 min, 2 cores
    python -m conformance.lightning_suite.run --tests /tmp/pl/tests --quick     # a smoke run, into a temp folder
    python -m conformance.lightning_suite.run --write-docs docs/training-conformance.md

Without ``--tests`` nothing runs: the summary of the recorded ``results.json`` is derived again (after a
change of the expected differences) and the results, and the page of ``--write-docs``, rewritten.

The tests must be of the installed Lightning's minor series (2.6.x for 2.6.6); an extracted ``tests/``
folder without ``src/version.info`` or git above it names its release with ``--tests-version``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import lightning

from benchmarks.readme_block import replace_block
from collectives.launcher import without_launch_variables
from conformance.lightning_suite import selection
from conformance.lightning_suite.outcomes import (
    MODES,
    compare,
    launch_counts,
    parse_junit,
    parse_verbose_log,
    render_markdown,
    worse,
)
from conformance.lightning_suite.swap import LAUNCH_LOG_ENV, SWAP_ENV
from measure.run_info import display_path, environment

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUT = REPO_ROOT / "conformance" / "results" / "lightning_suite"
BEGIN, END = "<!-- lightning-suite:begin -->", "<!-- lightning-suite:end -->"
PAGE = REPO_ROOT / "docs" / "training-conformance.md"  # the manual's page that holds the block
PLUGIN = "conformance.lightning_suite.swap"
EXTRA_DEPENDENCIES = {"cloudpickle": "cloudpickle", "sklearn": "scikit-learn"}  # module: package


def _git(folder: Path, *args: str) -> str | None:
    done = subprocess.run(["git", "-C", str(folder), *args], capture_output=True, text=True, check=False)
    return (done.stdout.strip() or None) if done.returncode == 0 else None


def lightning_tests(tests: Path, given_version: str | None) -> dict[str, str | None]:
    """Where Lightning's tests are and which release they are of; exits on another minor series than the
    installed Lightning's, or on a release it cannot tell."""
    if not (tests / "tests_pytorch").is_dir():
        raise SystemExit(
            f"--tests {tests}: no tests_pytorch/ in it; pass the tests/ folder of a pytorch-lightning clone"
        )
    root = tests.resolve().parent
    version_file = root / "src" / "version.info"
    found = version_file.read_text().strip() if version_file.is_file() else None
    in_git = (root / ".git").exists()
    tag = _git(root, "describe", "--tags", "--exact-match") if in_git else None
    if found and given_version and found != given_version:
        raise SystemExit(f"--tests-version {given_version}, but {version_file} says {found}: drop --tests-version")
    version = found or given_version
    if version is None:
        raise SystemExit(
            f"{tests}: no src/version.info above it: name the Lightning release these tests are from with "
            "--tests-version (e.g. --tests-version 2.6.5)"
        )
    if version.split(".")[:2] != lightning.__version__.split(".")[:2]:
        raise SystemExit(
            f"Lightning's tests at {tests} are {version}, the installed lightning is {lightning.__version__}: use "
            f"the tests of {lightning.__version__} (git clone --branch {lightning.__version__} ...)"
        )
    return {
        "path": display_path(str(tests)),
        "version": version,
        "version_from": "src/version.info" if found else "--tests-version",
        "tag": tag or (None if in_git else f"{version} (given)"),
        "commit": _git(root, "rev-parse", "HEAD") if in_git else None,
    }


def _check_extra_dependencies() -> None:
    missing = [package for module, package in EXTRA_DEPENDENCIES.items() if importlib.util.find_spec(module) is None]
    if missing:
        raise SystemExit(
            f"Lightning's tests import {', '.join(missing)}, not installed here: "
            f"pip install --target DIR {' '.join(missing)} and put DIR at the end of PYTHONPATH"
        )


def _pytest_env(tests: Path, mode: str, launch_log: Path, standalone: bool) -> dict[str, str]:
    # No rendezvous variables of an outer launch (a run inheriting LOCAL_RANK would act as a popen rank),
    # no switch or pytest option of the caller's own test run.
    env = without_launch_variables(dict(os.environ))
    for name in (SWAP_ENV, "PL_RUN_STANDALONE_TESTS", "PYTEST_CURRENT_TEST", "PYTEST_ADDOPTS"):
        env.pop(name, None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), str(tests), env.get("PYTHONPATH")) if p)
    env[LAUNCH_LOG_ENV] = str(launch_log)
    if mode == "custom_ddp":
        env[SWAP_ENV] = "1"
    if standalone:
        env["PL_RUN_STANDALONE_TESTS"] = "1"
    return env


def _run_process(command: list[str], env: dict[str, str], cwd: Path, log: Path, timeout: float) -> int | None:
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


def run_target(tests: Path, target: str, mode: str, standalone: bool, work: Path, timeout: float) -> dict[str, Any]:
    """One pytest of ``target`` (a file, or a standalone test's node id) in ``mode``: its outcomes and run record."""
    name = f"{mode}-{len(list(work.glob(f'{mode}-*.log'))):03d}"
    junit, log = work / f"{name}.xml", work / f"{name}.log"
    command = [sys.executable, "-m", "pytest", "-p", PLUGIN, "-p", "no:cacheprovider", "-v", f"--rootdir={tests}"]
    command += ["-o", "junit_family=xunit1", f"--junitxml={junit}", target]
    if not standalone:
        command += ["-k", selection.k_expression(target)]
    start = time.monotonic()
    env = _pytest_env(tests, mode, work / f"launches-{mode}.jsonl", standalone)
    status = _run_process(command, env, tests, log, timeout)
    if status is None:
        why = f"no result after {timeout:.0f} s: the run was killed"
        results = parse_verbose_log(log.read_text(errors="replace"), target, "timeout", why)
    elif not junit.is_file():
        why = f"pytest ended with status {status} and no report: see its log"
        results = parse_verbose_log(log.read_text(errors="replace"), target, "error", why)
    else:
        results = parse_junit(junit)
    run = {"target": target, "mode": mode, "status": status, "seconds": round(time.monotonic() - start, 1)}
    print(f"{mode:>10} {run['seconds']:6.1f} s status {status} {target} ({display_path(str(log))})", flush=True)
    return {"run": run, "results": results}


def _read_launches(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def tests_table(
    outcomes: dict[str, dict[str, dict[str, str]]], launches: dict[str, list[dict[str, Any]]], standalone: set[str]
) -> dict[str, dict[str, Any]]:
    """``{test id: {mode: outcome, "messages": {mode: first line}, "launches": {mode: n}, "standalone": True}}``."""
    counts = {mode: launch_counts(launches[mode]) for mode in MODES}
    tests: dict[str, dict[str, Any]] = {}
    for test_id in sorted(set().union(*outcomes.values())):
        results = {mode: outcomes[mode][test_id] for mode in MODES if test_id in outcomes[mode]}
        entry: dict[str, Any] = {mode: result["outcome"] for mode, result in results.items()}
        messages = {mode: result["message"] for mode, result in results.items() if result.get("message")}
        launched = {mode: counts[mode][test_id] for mode in MODES if counts[mode][test_id]}
        for key, value in (("messages", messages), ("launches", launched), ("standalone", test_id in standalone)):
            if value:
                entry[key] = value
        tests[test_id] = entry
    return tests


def run_suite(tests: Path, suite: dict[str, Any], quick: bool, timeout: float, work: Path) -> dict[str, Any]:
    """Every selected target under both modes, one after the other per target; the results record."""
    files, standalone = (
        (selection.QUICK_FILES, selection.QUICK_STANDALONE) if quick else (selection.FILES, selection.STANDALONE)
    )
    date, start = datetime.now(timezone.utc).isoformat(timespec="seconds"), time.monotonic()
    outcomes: dict[str, dict[str, dict[str, str]]] = {mode: {} for mode in MODES}
    runs = []
    for target, alone in [(file, False) for file in files] + [(test, True) for test in standalone]:
        for mode in MODES:  # the two modes back to back: they meet the same machine load
            done = run_target(tests, target, mode, alone, work, timeout)
            runs.append(done["run"])
            for test_id, result in done["results"].items():
                # A standalone run replaces the file run's skip ("standalone only") of its test.
                known = outcomes[mode].get(test_id)
                outcomes[mode][test_id] = worse(known, result) if known and not alone else result
    launches = {mode: _read_launches(work / f"launches-{mode}.jsonl") for mode in MODES}
    table = tests_table(outcomes, launches, set(standalone))
    return {
        "environment": {**environment(), "date": date, "lightning_tests": suite},
        "selection": {
            "files": list(files),
            "k_expression": selection.K_EXPRESSION,
            "named_in_source": {f: list(names) for f, names in selection.NAMED_IN_SOURCE.items() if f in files},
            "standalone": list(standalone),
            "quick": quick,
            "timeout_s": timeout,
        },
        "wall_s": round(time.monotonic() - start, 1),
        "summary": compare(table, selection.expected_difference, launches),
        "tests": table,
        "launches": launches,
        "runs": runs,
    }


def docs_block(record: dict[str, Any]) -> str:
    """The manual's generated block for ``record``, markers included."""
    return "\n".join([BEGIN, "", render_markdown(record).rstrip(), "", END])


def write_docs(page: Path, record: dict[str, Any]) -> bool:
    """Replace the block between :data:`BEGIN` and :data:`END` in ``page`` with the record's summary;
    a page without both markers is left as it is (``False``)."""
    block = docs_block(record)
    try:
        before, after = replace_block(page, BEGIN, END, block)
    except ValueError:
        print(f"{display_path(str(page))} has no {BEGIN} ... {END} block: left unchanged", file=sys.stderr)
        return False
    if after != before:
        page.write_text(after)
    return True


def _write_record(out: Path, record: dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(record, indent=1) + "\n")
    (out / "results.md").write_text(render_markdown(record))
    print(render_markdown(record))
    print(f"written: {display_path(str(out / 'results.json'))}, results.md")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tests", type=Path, help="the tests/ folder of a pytorch-lightning clone")
    parser.add_argument("--tests-version", help="the Lightning release of --tests where it has no src/version.info")
    parser.add_argument("--quick", action="store_true", help="a few files and standalone tests (a smoke run)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds a pytest run may take (default 900)")
    parser.add_argument(
        "--out",
        type=Path,
        help=f"results folder (default {display_path(str(DEFAULT_OUT))}; with --quick a temporary one)",
    )
    parser.add_argument("--work", type=Path, help="logs and JUnit reports (default a new temporary folder)")
    parser.add_argument("--write-docs", type=Path, metavar="PAGE", help=f"replace the {BEGIN} block of PAGE")
    args = parser.parse_args(argv)
    if args.tests is None and (args.quick or args.work or args.tests_version):
        parser.error("--quick, --work and --tests-version are for a run of the suite: give --tests too")
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.tests is None:  # outcomes as recorded; the expected differences as they are now
        out = args.out or DEFAULT_OUT
        record = json.loads((out / "results.json").read_text())
        record["summary"] = compare(record["tests"], selection.expected_difference, record["launches"])
    else:
        suite = lightning_tests(args.tests, args.tests_version)
        _check_extra_dependencies()
        work = args.work or Path(tempfile.mkdtemp(prefix="lightning-suite-"))
        work.mkdir(parents=True, exist_ok=True)
        out = args.out or (work if args.quick else DEFAULT_OUT)
        print(f"logs and reports: {work}", flush=True)
        record = {"command": "python -m conformance.lightning_suite.run " + " ".join(argv or sys.argv[1:])}
        record |= run_suite(args.tests.resolve(), suite, args.quick, args.timeout, work)
    _write_record(out, record)
    if args.write_docs is not None:
        write_docs(args.write_docs, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
