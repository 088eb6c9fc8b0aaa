"""Generate the results blocks from the committed benchmark records, so they cannot drift.

Per ``benchmarks/results/<name>/results.json`` with a headline: the command, the machine (ratios
differ between CPUs), whether the run was comparable, and the rows of the benchmark's own
``headline(record)`` (what against what, value [95 % CI], verdict), between ``<!-- results:begin -->``
and ``<!-- results:end -->`` of ``docs/benchmarks.md`` (``PAGE``). README.md's headline, between
``<!-- headline:begin -->`` and ``<!-- headline:end -->``: the ``HEADLINE_WHAT`` rows of the
``HEADLINE_RECORDS`` (custom_ddp, with local BN and with its SyncBatchNorm, against Lightning's ddp tuned in
Lightning fits on CPU; on one GPU against ddp, and its SyncBatchNorm against torch's), one per machine and cell,
the one with the most samples where a cell was measured twice, paired fits rather than fits in fresh processes
where both measured it, a cell's accumulation settings side by side::

    python -m benchmarks.readme_results --write   # after committing new results: both blocks
    python -m benchmarks.readme_results           # exit 1 if either differs (the tests check them too)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

from benchmarks.fits.paired_fits import MEASURE as PAIRED
from benchmarks.harness import results_folder
from benchmarks.readme_block import replace_block
from benchmarks.report import foreign_shown, headline_table, machine
from measure.stats import INTERVALS

__all__ = ["render_block", "render_headline", "update_headline", "update_readme"]

ROOT = Path(__file__).resolve().parents[1]
RESULTS, README, PAGE = ROOT / "benchmarks" / "results", ROOT / "README.md", ROOT / "docs" / "benchmarks.md"
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"
HEADLINE_BEGIN, HEADLINE_END = "<!-- headline:begin -->", "<!-- headline:end -->"
HEADLINE_RECORDS = ("compare_localbn", "paired_fits", "compare_one_gpu", "syncbn_one_gpu")  # folders starting so
# The headline's ratios (row prefix -> the short label a README row starts with).
HEADLINE_WHAT = {
    "custom_ddp (local BN) / ddp tuned (local BN): step time, ": "local BN: ",
    "custom_ddp (SyncBN) / ddp tuned (local BN): step time, ": "SyncBN: ",
    "custom_ddp (SyncBN) / ddp default (local BN): step time, ": "one GPU, custom_ddp / ddp: ",
    "SyncBN / torch_syncbn (torch), 1 ranks": "one GPU, SyncBN / torch's SyncBatchNorm Function",
    "SyncBN peak memory / torch_syncbn, 1 ranks": "one GPU, SyncBN peak memory / torch's",
}
_SETTING = re.compile(r", accumulate \d+$")  # a cell's accumulation setting, joined with its others in one row
_SETTINGS = re.compile(r", accumulate \d+( / \d+)*$")  # one setting, or a record's own row of several
# Records whose raw samples were not kept cannot be re-derived (python -m benchmarks.rederive) until re-run.
_STEP_DRAWN = (
    " **Intervals too narrow:** written before intervals drew whole runs (they drew single steps, "
    "which are not independent); re-run it to refresh them."
)


def _drew_steps(record: dict[str, Any], rows: list[dict[str, Any]]) -> bool:
    """Whether the record's intervals predate whole-run draws (it has intervals but no ``intervals`` method)."""
    return record.get("intervals") != INTERVALS and any(isinstance(r["value"], dict) for r in rows)


def _module(name: str, record: dict[str, Any]) -> Any:
    """The record's benchmark module (``benchmarks.fits.compare`` for a record under ``results/compare_localbn``)."""
    benchmark = record.get("benchmark", name)
    spec = importlib.util.find_spec(f"benchmarks.{benchmark}")
    return importlib.import_module(f"benchmarks.{benchmark}") if spec else None


def _rows(module: Any, record: dict[str, Any]) -> list[dict[str, Any]]:
    """The module's ``headline(record)``; the stored rows of a benchmark without a module."""
    return module.headline(record) if module else record["headline"]


def _report(name: str, page: Path) -> str:
    """The link from ``page`` to the record's ``results.md``."""
    return Path(os.path.relpath(RESULTS / name / "results.md", page.parent)).as_posix()


def _section(name: str, record: dict[str, Any], page: Path = PAGE) -> list[str]:
    """Rows from the record's benchmark module's ``headline(record)``, its report linked from ``page``."""
    benchmark, module = record.get("benchmark", name), _module(name, record)
    titled = getattr(module, "title", lambda _: getattr(module, "TITLE", benchmark))  # a title by record, if any
    title = titled(record) + ("" if name == results_folder(benchmark) else f" ({name})")
    quiet, share = record["quietness"], foreign_shown(record["quietness"])
    status = "comparable" if quiet["comparable"] else "**NOT comparable (busy machine)**"
    rows = _rows(module, record)
    return [
        f"**{title}** ([report]({_report(name, page)})): `{record['command'].strip()}`; "
        f"{machine(record['environment'])}; {status}: 1-min load {quiet['load_before']:.2f} before, other "
        f"processes {share} during.{_STEP_DRAWN if _drew_steps(record, rows) else ''}",
        "",
        *headline_table(rows),
        "",
    ]


def render_block(results: Path = RESULTS, page: Path = PAGE) -> str:
    """The Markdown between the markers, from every record with a headline under ``results``, links from ``page``."""
    lines = [
        BEGIN,
        "",
        "_Generated by `python -m benchmarks.readme_results --write` from the committed "
        "`benchmarks/results/*/results.json`; do not edit by hand._",
        "",
    ]
    for name, record in _records(results):
        lines += _section(name, record, page)
    return "\n".join(lines + [END])


def _records(results: Path) -> list[tuple[str, dict[str, Any]]]:
    """``(folder name, record)`` of every record with a headline under ``results``, by name."""
    records = [(path.parent.name, json.loads(path.read_text())) for path in sorted(results.glob("*/results.json"))]
    return [(name, record) for name, record in records if "headline" in record and "quietness" in record]


def _samples(value: Any) -> int:
    """How many samples (runs, pairs) an estimate or a list of them drew on (the fewest of a list)."""
    values = value if isinstance(value, list) else [value]
    return min((v.get("n", 0) if isinstance(v, dict) else 0) for v in values)


def _best_cells(results: Path) -> dict[tuple[str, str], tuple[int, dict[str, Any], str]]:
    """``(machine, cell) -> (samples, row, record name)`` of the ``HEADLINE_WHAT`` rows of the comparable
    ``HEADLINE_RECORDS``, the row with the most samples where a cell was measured twice on one machine."""
    cells: dict[tuple[str, str], tuple[int, dict[str, Any], str]] = {}
    for name, record in _records(results):
        if not name.startswith(HEADLINE_RECORDS) or not record["quietness"]["comparable"]:
            continue  # a busy machine's numbers are not quoted as ratios (its report says so)
        for row in _rows(_module(name, record), record):
            prefix = next((p for p in HEADLINE_WHAT if row["what"].startswith(p)), None)
            if prefix is None:
                continue
            key = (machine(record["environment"]), HEADLINE_WHAT[prefix] + row["what"].removeprefix(prefix))
            torch_version = record["environment"]["versions"]["torch"]
            if key not in cells or _samples(row["value"]) > cells[key][0]:
                cells[key] = (_samples(row["value"]), {**row, "torch": torch_version}, name)
    return cells


def _joined_settings(where: str, label: str, cells: list[tuple[str, dict[str, Any], str]], page: Path) -> dict:
    """One headline row of a machine's cells that differ only in their accumulation setting (``cells``:
    ``(setting, row, record name)``, in order): values, verdicts and records side by side."""
    rows = [row for _, row, _ in cells]
    versions = " / ".join(dict.fromkeys(row["torch"] for row in rows))
    links = ", ".join(f"[{name}]({_report(name, page)})" for name in dict.fromkeys(name for *_, name in cells))
    settings = " / ".join(setting for setting, *_ in cells)
    what = f"{label}{f', accumulate {settings}' if settings else ''}; {where}, torch {versions}, {links}"
    if len(rows) == 1:
        return {**rows[0], "what": what}
    joined = {"what": what, "value": [row["value"] for row in rows], "unit": rows[0].get("unit", "")}
    if "target" in rows[0]:  # grouped by target: every cell of the row has the same
        joined |= {"target": rows[0]["target"], "verdict": [row["verdict"] for row in rows]}
    return joined


def _paired_too(where: str, label: str, labels: set[tuple[str, str]]) -> bool:
    """Whether paired fits measured ``label``'s cell on machine ``where`` as well: fresh-process fits of a
    cell leave the headline then, since paired fits decide where a host's drift leaves fresh processes
    undecided (both stay in docs/benchmarks.md)."""
    cell = _SETTINGS.sub("", label)
    short = next((s for s in HEADLINE_WHAT.values() if cell.startswith(s)), "")
    return PAIRED not in cell and (where, short + PAIRED + cell.removeprefix(short)) in labels


def render_headline(results: Path = RESULTS, page: Path = README) -> str:
    """README's headline block: the ``HEADLINE_WHAT`` rows of the ``HEADLINE_RECORDS``, one per machine and cell
    (the one with the most samples), a machine's accumulation settings of one cell side by side in one row, each
    naming its machine and linking its records' reports from ``page``."""
    groups: dict[tuple[str, str, str | None], list[tuple[str, dict[str, Any], str]]] = {}
    for (where, cell), (_, row, name) in _best_cells(results).items():
        label, _, setting = cell.rpartition(", accumulate ") if _SETTING.search(cell) else (cell, "", "")
        groups.setdefault((where, label, row.get("target")), []).append((setting, row, name))
    machines = list(dict.fromkeys(where for where, *_ in groups))  # in the records' order
    labels = {(where, _SETTINGS.sub("", label)) for where, label, _ in groups}
    shown = [key for key in groups if not _paired_too(*key[:2], labels)]
    ordered = sorted(shown, key=lambda key: (machines.index(key[0]), key[1]))
    rows = [
        _joined_settings(where, label, sorted(groups[where, label, target], key=lambda c: int(c[0] or 0)), page)
        for where, label, target in ordered
    ]
    benchmarks = Path(os.path.relpath(PAGE, page.parent)).as_posix()
    return "\n".join(
        [
            HEADLINE_BEGIN,
            "",
            "_Generated by `python -m benchmarks.readme_results --write` from the committed records named in each "
            f"row; every result: [Benchmarks]({benchmarks}#results)._",
            "",
            *headline_table(rows),
            "",
            HEADLINE_END,
        ]
    )


def update_readme(readme: Path = PAGE, results: Path = RESULTS) -> tuple[str, str]:
    """``(page text now, page text with a fresh results block)`` of the Markdown page ``readme`` (default
    ``docs/benchmarks.md``); raises if the markers are missing."""
    return replace_block(readme, BEGIN, END, render_block(results, readme))


def update_headline(readme: Path = README, results: Path = RESULTS) -> tuple[str, str]:
    """``(README text now, README text with a fresh headline block)``; raises if the markers are missing."""
    return replace_block(readme, HEADLINE_BEGIN, HEADLINE_END, render_headline(results, readme))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--write",
        action="store_true",
        help="rewrite docs/benchmarks.md's results block and README.md's headline (default: check them)",
    )
    write, stale = parser.parse_args(argv).write, []
    for page, (current, fresh) in ((PAGE, update_readme()), (README, update_headline())):
        if write:
            page.write_text(fresh)
        elif current != fresh:
            stale.append(page.relative_to(ROOT).as_posix())
    if stale:
        print(
            f"{' and '.join(stale)}: the generated results differ from benchmarks/results/*/results.json: run "
            "python -m benchmarks.readme_results --write",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
