"""Lightning's own ddp tests, run under Lightning's ``ddp`` and with its ddp names resolved to ``custom_ddp``.

Each selected test file (:mod:`conformance.lightning_suite.selection`) runs in a pytest of its own,
once per mode, from Lightning's ``tests/`` folder; then each standalone test, alone, with
``PL_RUN_STANDALONE_TESTS=1`` (as Lightning's CI). Every run loads the plugin
:mod:`conformance.lightning_suite.swap`, writes JUnit XML and is killed after ``--timeout`` seconds
(a hang is a ``timeout`` outcome of the test it was in); what a run leaves in the tests folder (a
checkpoint of a fit that was to fail) is removed, so the next run meets the folder as it was
(:mod:`conformance.lightning_suite.pytest_run`). The outcomes per test and mode, the launches
of 2+ processes and the comparison go to ``conformance/results/lightning_suite/results.json`` and
``results.md``. Getting Lightning's tests and their extra dependencies, not in this project's venv::

    git clone --depth 1 --branch 2.6.5 https://github.com/Lightning-AI/pytorch-lightning /tmp/pl
    pip install --target /tmp/pl-extra cloudpickle scikit-learn pytest-rerunfailures
    PYTHONPATH=/tmp/pl-extra python -m conformance.lightning_suite.run --tests /tmp/pl/tests   # ~50 min, 2 cores
    python -m conformance.lightning_suite.run --tests /tmp/pl/tests --quick     # a smoke run, into a temp folder
    python -m conformance.lightning_suite.run --tests /tmp/pl/tests --work /tmp/ls   # killed? the same again resumes
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
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import lightning

from benchmarks.readme_block import replace_block
from conformance.lightning_suite import selection
from conformance.lightning_suite.outcomes import (
    MODES,
    compare,
    outcome_table,
    render_markdown,
    worse,
)
from conformance.lightning_suite.pytest_run import run_target
from measure.run_info import display_path, environment

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUT = REPO_ROOT / "conformance" / "results" / "lightning_suite"
BEGIN, END = "<!-- lightning-suite:begin -->", "<!-- lightning-suite:end -->"
PAGE = REPO_ROOT / "docs" / "training-conformance.md"  # the manual's page that holds the block
# module: package. pytest-rerunfailures: Lightning's CI has it, so its tests marked flaky run again after a failure
# (in both modes; the record counts the tries).
EXTRA_DEPENDENCIES = {
    "cloudpickle": "cloudpickle",
    "sklearn": "scikit-learn",
    "pytest_rerunfailures": "pytest-rerunfailures",
}


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


def run_suite(tests: Path, suite: dict[str, Any], quick: bool, timeout: float, work: Path) -> dict[str, Any]:
    """Every selected target under both modes, one after the other per target; the results record."""
    files, standalone = (
        (selection.QUICK_FILES, selection.QUICK_STANDALONE) if quick else (selection.FILES, selection.STANDALONE)
    )
    date, start = datetime.now(timezone.utc).isoformat(timespec="seconds"), time.monotonic()
    outcomes: dict[str, dict[str, dict[str, str]]] = {mode: {} for mode in MODES}
    launches: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
    runs = []
    targets = [(file, False) for file in files] + [(test, True) for test in standalone]
    for index, (target, alone) in enumerate(targets):
        for mode in MODES:  # the two modes back to back: they meet the same machine load
            done = run_target(tests, target, mode, alone, work / f"{mode}-{index:03d}", timeout)
            runs.append(done["run"])
            launches[mode] += done["launches"]
            for test_id, result in done["results"].items():
                # A standalone run replaces the file run's skip ("standalone only") of its test.
                known = outcomes[mode].get(test_id)
                outcomes[mode][test_id] = worse(known, result) if known and not alone else result
    table = outcome_table(outcomes, launches, set(standalone))
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
        "wall_s": round(time.monotonic() - start, 1),  # of this runner; a resumed one's is shorter
        "pytest_s": round(sum(run["seconds"] for run in runs), 1),
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
    parser.add_argument(
        "--work",
        type=Path,
        help="logs, JUnit reports, each run's record (default a new temporary folder); the folder of a killed "
        "runner, given again, goes on where it stopped",
    )
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
