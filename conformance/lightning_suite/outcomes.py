"""Per-test outcomes from pytest's JUnit XML, the ddp and custom_ddp modes compared, and their summary.

Outcomes: ``passed``, ``skipped``, ``xfailed``, ``failed``, ``error`` (collection, setup or teardown),
and ``timeout`` (set by the runner for the test a killed run was in). A test reported twice (a failed
call, then a teardown error) keeps the worse, with both messages. A test Lightning marks ``flaky`` is run
again after a failure (pytest-rerunfailures, as in Lightning's CI); JUnit keeps only its last try, so the
tries before it are counted from the ``RERUN`` lines of ``pytest -v`` and kept with the outcome, in the
record and its summary. Pure Python: no Lightning, no torch.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ElementTree
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

__all__ = ["CUSTOM_CLASS", "MODES", "compare", "launch_counts", "parse_junit", "parse_verbose_log", "render_markdown"]
__all__ += ["outcome_table", "with_reruns", "worse"]

MODES = ("ddp", "custom_ddp")
CUSTOM_CLASS = "CustomDDPStrategy"  # the class name the plugin logs for a custom_ddp launch
_SEVERITY = ("passed", "skipped", "xfailed", "failed", "error", "timeout")  # later is worse
_UNFINISHED = {"failed", "error", "timeout"}
_VERBOSE_LINE = re.compile(r"^(\S+::\S+)(?: (PASSED|FAILED|SKIPPED|XFAIL|XPASS|ERROR))?")
_RERUN_LINE = re.compile(r"^(\S+::\S+) RERUN\b")  # pytest-rerunfailures: a failed try, run again
_VERBOSE_OUTCOMES = dict(
    PASSED="passed", XPASS="passed", FAILED="failed", SKIPPED="skipped", XFAIL="xfailed", ERROR="error"
)


def _node_id(case: ElementTree.Element) -> str:
    """pytest's node id from an xunit1 testcase: ``file`` + the class path below the module + ``name``."""
    file, classname, name = case.get("file", ""), case.get("classname", ""), case.get("name", "")
    if not classname:  # a collection error: the module itself
        return file or name
    module = file.removesuffix(".py").replace("/", ".")
    classes = classname.removeprefix(module).strip(".")
    return "::".join(part for part in (file, *classes.split("."), name) if part)


def _first_line(element: ElementTree.Element) -> str:
    """The failure's message, first line; else the first ``E`` line of its traceback."""
    for line in (element.get("message") or "").splitlines():
        if line.strip():
            return line.strip()
    for line in (element.text or "").splitlines():
        if line.startswith("E "):
            return line[1:].strip()
    return ""


def _case_outcome(case: ElementTree.Element) -> dict[str, str]:
    for tag, outcome in (("error", "error"), ("failure", "failed")):
        found = case.find(tag)
        if found is not None:
            return {"outcome": outcome, "message": _first_line(found)}
    skipped = case.find("skipped")
    if skipped is not None:
        return {"outcome": "xfailed" if skipped.get("type") == "pytest.xfail" else "skipped"}
    return {"outcome": "passed"}


def worse(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """The worse of two outcomes of one test, with both messages in order (a failed call's first: it is
    what the test checks, a teardown error after it is mostly its consequence)."""
    worst: dict[str, Any] = {"outcome": max(a["outcome"], b["outcome"], key=_SEVERITY.index)}
    messages = [result["message"] for result in (a, b) if result.get("message")]
    if messages:
        worst["message"] = "; then ".join(messages)
    reruns = a.get("reruns", 0) + b.get("reruns", 0)
    if reruns:
        worst["reruns"] = reruns
    return worst


def parse_junit(path: Path) -> dict[str, dict[str, str]]:
    """``{node id: {"outcome": ..., "message": first line (failures only)}}`` of a pytest ``--junitxml``
    report written with ``-o junit_family=xunit1`` (xunit2 drops the ``file`` a node id needs)."""
    results: dict[str, dict[str, str]] = {}
    for case in ElementTree.parse(path).getroot().iter("testcase"):
        test_id, outcome = _node_id(case), _case_outcome(case)
        results[test_id] = worse(results[test_id], outcome) if test_id in results else outcome
    return results


def parse_verbose_log(text: str, target: str, outcome: str, why: str) -> dict[str, dict[str, str]]:
    """Outcomes from the lines of ``pytest -v`` (a run that wrote no report): the test still running when
    the log ends, else ``target`` (a file, a node id), gets ``outcome`` with the message ``why``."""
    results: dict[str, dict[str, str]] = {}
    started: list[str] = []
    for line in text.splitlines():
        match = _VERBOSE_LINE.match(line)
        if match and match.group(2):
            results[match.group(1)] = {"outcome": _VERBOSE_OUTCOMES[match.group(2)]}
        elif match:
            started.append(match.group(1))
    running = next((test for test in reversed(started) if test not in results), target)
    results[running] = {"outcome": outcome, "message": why}
    return results


def with_reruns(results: dict[str, dict[str, Any]], log_text: str) -> dict[str, dict[str, Any]]:
    """``results`` with ``"reruns": n`` on each test that ``log_text`` (``pytest -v``) shows run again n times."""
    tries = Counter(match.group(1) for line in log_text.splitlines() if (match := _RERUN_LINE.match(line)))
    return {
        test_id: {**result, "reruns": tries[test_id]} if tries[test_id] else result
        for test_id, result in results.items()
    }


def launch_counts(launches: Iterable[dict[str, Any]], strategy: str | None = None) -> Counter[str]:
    """Launches of 2+ processes per test, of ``strategy``'s class only when given."""
    return Counter(
        launch["test"]
        for launch in launches
        if launch["num_processes"] >= 2 and launch["test"] and strategy in (None, launch["strategy"])
    )


def _launched(launches: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """How many tests really started 2+ processes in each mode, and under custom_ddp in the swapped one."""
    custom = launch_counts(launches["custom_ddp"], CUSTOM_CLASS)
    by_start = Counter(
        launch["start_method"]
        for launch in launches["custom_ddp"]
        if launch["strategy"] == CUSTOM_CLASS and launch["num_processes"] >= 2
    )
    return {
        "ddp": len(launch_counts(launches["ddp"])),
        "custom_ddp": len(custom),
        "custom_ddp_launches_by_start_method": dict(sorted(by_start.items())),
        "custom_ddp_tests": sorted(custom),
        # Launched under ddp, but never by custom_ddp when swapped: the swap did not reach these.
        "not_swapped": sorted(set(launch_counts(launches["ddp"])) - set(custom)),
    }


def outcome_table(
    outcomes: dict[str, dict[str, dict[str, Any]]], launches: dict[str, list[dict[str, Any]]], standalone: set[str]
) -> dict[str, dict[str, Any]]:
    """``{test id: {mode: outcome, "messages": {mode: first line}, "launches": {mode: n}, "reruns": {mode: n},
    "standalone": True}}``."""
    counts = {mode: launch_counts(launches[mode]) for mode in MODES}
    tests: dict[str, dict[str, Any]] = {}
    for test_id in sorted(set().union(*outcomes.values())):
        results = {mode: outcomes[mode][test_id] for mode in MODES if test_id in outcomes[mode]}
        entry: dict[str, Any] = {mode: result["outcome"] for mode, result in results.items()}
        messages = {mode: result["message"] for mode, result in results.items() if result.get("message")}
        launched = {mode: counts[mode][test_id] for mode in MODES if counts[mode][test_id]}
        reruns = {mode: result["reruns"] for mode, result in results.items() if result.get("reruns")}
        extras = (
            ("messages", messages),
            ("launches", launched),
            ("reruns", reruns),
            ("standalone", test_id in standalone),
        )
        for key, value in extras:
            if value:
                entry[key] = value
        tests[test_id] = entry
    return tests


def _per_mode(tests: dict[str, dict[str, Any]], mode: str) -> dict[str, int]:
    counts = Counter(test[mode] for test in tests.values() if mode in test)
    return {"ran": sum(n for outcome, n in counts.items() if outcome != "skipped"), **dict(sorted(counts.items()))}


def _differences(tests: dict[str, dict[str, Any]], expected: Callable[[str], str | None]) -> dict[str, Any]:
    ddp_only: dict[str, str] = {}
    expected_seen: dict[str, dict[str, str]] = {}
    custom_only: dict[str, str] = {}
    for test_id, test in sorted(tests.items()):
        ddp, custom, messages = test.get("ddp"), test.get("custom_ddp"), test.get("messages", {})
        if ddp == "passed" and custom != "passed":
            line = f"{custom}: {messages.get('custom_ddp', '')}".rstrip(": ")
            reason = expected(test_id)
            if reason:
                expected_seen[test_id] = {"why": reason, "custom_ddp": line}
            else:
                ddp_only[test_id] = line
        elif custom == "passed" and ddp != "passed":
            custom_only[test_id] = f"{ddp}: {messages.get('ddp', '')}".rstrip(": ")
    return {
        "passed_only_under_ddp": ddp_only,
        "expected_differences": expected_seen,
        "passed_only_under_custom_ddp": custom_only,
    }


def compare(
    tests: dict[str, dict[str, Any]],
    expected: Callable[[str], str | None],
    launches: dict[str, list[dict[str, Any]]],
) -> dict[str, Any]:
    """Summary of ``tests`` (``{test id: {"ddp": outcome, "custom_ddp": outcome, "messages": {mode: line}}}``)
    and of each mode's ``launches`` (the plugin's log lines).

    A test that passed under ddp only is an expected difference when ``expected(test id)`` gives a
    reason, else a finding; an expected difference that did not happen is listed as stale.
    """
    both = sorted(test_id for test_id, test in tests.items() if test.get("ddp") == test.get("custom_ddp") == "passed")
    return {
        "tests": len(tests),
        "per_mode": {mode: _per_mode(tests, mode) for mode in MODES},
        "passed_in_both": len(both),
        **_differences(tests, expected),
        "expected_but_passed_in_both": [test_id for test_id in both if expected(test_id)],
        "unfinished_in_both": sorted(
            test_id for test_id, test in tests.items() if {test.get(mode) for mode in MODES} <= _UNFINISHED
        ),
        "launched": _launched(launches),
        "reruns": {
            mode: {test_id: test["reruns"][mode] for test_id, test in tests.items() if mode in test.get("reruns", {})}
            for mode in MODES
        },
    }


def _escape(text: str) -> str:
    return text.replace("|", "\\|")


def _count_rows(summary: dict[str, Any]) -> list[str]:
    per_mode, launched = summary["per_mode"], summary["launched"]
    rows = ["| | ddp | custom_ddp |", "| --- | ---: | ---: |"]
    for outcome in ("ran", *_SEVERITY):
        if any(per_mode[mode].get(outcome) for mode in MODES):
            rows.append(f"| {outcome} | " + " | ".join(str(per_mode[mode].get(outcome, 0)) for mode in MODES) + " |")
    label = "tests that started 2+ processes (custom_ddp: CustomDDPStrategy did)"
    return [*rows, f"| {label} | {launched['ddp']} | {launched['custom_ddp']} |"]


def _grouped(rows: list[tuple[str, str, str, str]]) -> list[tuple[str, str, str, str]]:
    """The parametrizations of one test with one reason in one row: the first one's outcomes, their count."""
    groups: dict[tuple[str, str], list[tuple[str, str, str, str]]] = {}
    for row in rows:
        groups.setdefault((row[0].split("[", 1)[0], row[3]), []).append(row)
    return [
        (f"`{members[0][0]}`" if len(members) == 1 else f"`{base}` ({len(members)} parametrizations)", *members[0][1:])
        for (base, _), members in groups.items()
    ]


def _difference_rows(summary: dict[str, Any]) -> list[str]:
    rows = [(test, "passed", line, "**unexpected**") for test, line in summary["passed_only_under_ddp"].items()]
    rows += [(test, "passed", d["custom_ddp"], d["why"]) for test, d in summary["expected_differences"].items()]
    rows += [(test, line, "passed", "") for test, line in summary["passed_only_under_custom_ddp"].items()]
    if not rows:
        return []
    header = ["", "| test | ddp | custom_ddp | why |", "| --- | --- | --- | --- |"]
    return header + [f"| {test} | {_escape(a)} | {_escape(b)} | {_escape(why)} |" for test, a, b, why in _grouped(rows)]


def _reruns_sentence(summary: dict[str, Any]) -> str:
    """The tests run again under Lightning's ``flaky`` marks, per mode; nothing where none was."""
    reruns = summary.get("reruns", {})  # absent from a record made before reruns were counted
    if not any(reruns.values()):
        return ""
    parts = [
        f"{mode}: "
        + (", ".join(f"`{test}` ({n}x)" for test, n in reruns[mode].items()) if reruns.get(mode) else "none")
        for mode in MODES
    ]
    return (
        " Run again after a failure by Lightning's own `flaky` marks (pytest-rerunfailures, as in Lightning's CI; "
        "the outcomes above are the last tries): " + "; ".join(parts) + "."
    )


def render_markdown(record: dict[str, Any]) -> str:
    """A short Markdown summary of a results record: versions, counts, and the table of differences."""
    summary, env, selection = record["summary"], record["environment"], record["selection"]
    versions = env["versions"]
    head = (
        f"Lightning's own tests ({env['lightning_tests']['version']}: {summary['tests']} tests of "
        f"{len(selection['files'])} files, {len(selection['standalone'])} of them standalone) under torch "
        f"{versions['torch']}, lightning {versions['lightning']}, {env['cpu_count']} CPU cores, {env['date']}:"
    )
    tail = (
        f"Passed in both: {summary['passed_in_both']}. Passed under ddp only: "
        f"{len(summary['passed_only_under_ddp'])} unexpected, {len(summary['expected_differences'])} expected; "
        f"passed under custom_ddp only: {len(summary['passed_only_under_custom_ddp'])}."
    )
    not_swapped = summary["launched"]["not_swapped"]
    if not_swapped:
        tail += (
            f" Launched processes under ddp but not as custom_ddp ({len(not_swapped)}: the test builds its strategy "
            "itself, no registry name to swap): " + ", ".join(f"`{test}`" for test in not_swapped) + "."
        )
    tail += _reruns_sentence(summary)
    return "\n".join([head, "", *_count_rows(summary), "", tail, *_difference_rows(summary)]) + "\n"
