"""README.md is a front page and docs/ the manual: links that lead somewhere, a README that stays short, the two
commands CI runs, and every generated block in the page its generator writes (the blocks' staleness tests are in
tests/measurement/test_readme_results.py and tests/fault_tolerance/test_fault_matrix.py)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
MAX_README_LINES = 250
# .ci/run runs exactly these; the README shows them verbatim, each as a code block of its own.
COMMANDS = [
    "python3 -m venv .venv && . .venv/bin/activate && pip install -c constraints.txt -e '.[dev]' && "
    "python train.py fit --config configs/quickstart.yaml",
    'pytest -m "not slow and not gpu"',
]

_FENCE = re.compile(r"^(```|~~~)")
_CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")
_LINK = re.compile(r"\]\(([^()\s]+)\)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def _prose(text: str) -> list[str]:
    """The lines outside fenced code blocks, inline code spans removed."""
    lines, fenced = [], False
    for line in text.splitlines():
        if _FENCE.match(line.strip()):
            fenced = not fenced
        elif not fenced:
            lines.append(_CODE_SPAN.sub("", line))
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: inline markup's punctuation dropped, lower case, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading anchors on its text
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading's anchor in ``page``; a repeated one gets -1, -2, ... as on GitHub."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    for line in _prose(page.read_text()):
        match = _HEADING.match(line)
        if match:
            base = slug(match.group(2))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
    return found


def relative_links(page: Path) -> list[str]:
    """The targets of ``page``'s Markdown links that are no URL (``http:``, ``mailto:``, ...)."""
    targets = [target for line in _prose(page.read_text()) for target in _LINK.findall(line)]
    return [target for target in targets if not re.match(r"[a-zA-Z][a-zA-Z0-9+.-]*:", target)]


def broken_links(page: Path) -> list[str]:
    """``target: why`` for every relative link of ``page`` that leads to no file, or to no heading of it."""
    broken = []
    for target in relative_links(page):
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no such file")
        elif anchor and (file.suffix != ".md" or anchor not in anchors(file)):
            broken.append(f"{target}: no heading #{anchor} in {path or page.name}")
    return broken


def test_slug_follows_githubs_rules():
    assert slug("Exact evaluation: every metric, every gather") == "exact-evaluation-every-metric-every-gather"
    assert slug("The custom_ddp strategy") == "the-custom_ddp-strategy"
    assert slug("Signals during `fit`") == "signals-during-fit"
    assert slug("Restarts that resume: torchrun and SLURM") == "restarts-that-resume-torchrun-and-slurm"


@pytest.mark.parametrize("page", PAGES, ids=[str(page.relative_to(ROOT)) for page in PAGES])
def test_every_relative_link_leads_to_a_file_and_heading(page):
    assert relative_links(page), f"{page.relative_to(ROOT)} links nowhere"
    assert broken_links(page) == []


def test_a_broken_link_or_anchor_is_caught(tmp_path):
    (tmp_path / "other.md").write_text("# Other page\n\n## A section: here\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\n[fine](other.md#a-section-here) [fine too](#page) [web](https://example.com)\n"
        "[gone](missing.md) [no heading](other.md#nowhere) [not here](#other-page)\n"
        "```\n[in code](missing-too.md)\n```\n`[in a span](missing-three.md)`\n"
    )
    assert broken_links(page) == [
        "missing.md: no such file",
        "other.md#nowhere: no heading #nowhere in other.md",
        "#other-page: no heading #other-page in page.md",
    ]


def test_readme_is_a_front_page():
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines: move text into docs/"


def test_readme_shows_the_two_commands_verbatim():
    """``.ci/run`` runs the README's two commands: each stays a code block of its own, as typed."""
    text = README.read_text()
    for command in COMMANDS:
        assert f"```bash\n{command}\n```" in text, command


def test_every_docs_page_links_back_to_the_index_and_the_readme():
    for page in PAGES[1:]:
        targets = {target.partition("#")[0] for target in relative_links(page)}
        assert "../README.md" in targets, page.name
        if page.name != "README.md":
            assert "README.md" in targets, page.name


def _blocks() -> list[tuple[Path, str, str]]:
    from benchmarks import readme_results
    from conformance.evaluation import table as evaluation_table
    from conformance.faults import report as fault_report
    from conformance.lightning_suite import run as lightning_suite
    from conformance.training import table as training_table

    return [
        (readme_results.PAGE, readme_results.BEGIN, readme_results.END),
        (readme_results.README, readme_results.HEADLINE_BEGIN, readme_results.HEADLINE_END),
        (evaluation_table.PAGE, evaluation_table.BEGIN, evaluation_table.END),
        (training_table.PAGE, training_table.BEGIN, training_table.END),
        (fault_report.PAGE, fault_report.BEGIN, fault_report.END),
        (lightning_suite.PAGE, lightning_suite.BEGIN, lightning_suite.END),
    ]


def test_every_generated_block_is_in_its_generators_page_once():
    """Each generator's markers appear once, in the page it writes, and in no other page."""
    for page, begin, end in _blocks():
        for other in PAGES:
            text = other.read_text()
            expected = 1 if other == page else 0
            assert (text.count(begin), text.count(end)) == (expected, expected), (other.name, begin)
        text = page.read_text()
        assert text.index(begin) < text.index(end)


def _pins(constraints: str) -> list[tuple[str, str]]:
    """``(package, version)`` of each ``package==version`` line of ``constraints`` (a file at the repository's root)."""
    return re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)$", (ROOT / constraints).read_text(), flags=re.MULTILINE)


def _pinned(constraints: str, package: str) -> str:
    """The version ``constraints`` pins ``package`` to."""
    (version,) = [version for name, version in _pins(constraints) if name == package]
    return version


def test_constraints_floor_pins_every_floor_pyproject_states():
    """CI's oldest set is the floors pyproject.toml promises: a raised (or lowered) floor moves the pin with it."""
    # The [project] dependencies array, read without tomllib (Python 3.11+; pyproject.toml admits 3.10).
    (block,) = re.findall(r"^dependencies = \[$(.*?)^\]$", (ROOT / "pyproject.toml").read_text(), re.M | re.S)
    floors = {}
    for requirement in re.findall(r'"([^"]+)"', block):
        match = re.fullmatch(r"([A-Za-z0-9_.-]+)(?:\[[^]]*\])?>=([0-9.]+)(?:,.*)?", requirement)
        if match:
            floors[match[1].lower()] = Version(match[2])
    pinned = {name.lower(): Version(version) for name, version in _pins("constraints-floor.txt")}
    assert "torch" in floors and "lightning" in floors, floors
    assert pinned == floors


def test_readme_names_the_torch_each_constraints_file_pins():
    """The versions line names both ends CI tests (the newest torch, every oldest pin): an upgrade of either
    constraints file updates the README too."""
    text = " ".join(README.read_text().split())
    newest = _pinned("constraints.txt", "torch")
    oldest = _pins("constraints-floor.txt")
    assert f"`constraints.txt` pins the set these commands install (torch {newest}, the newest release)" in text
    assert f"`constraints-floor.txt` the oldest ({', '.join(f'{name} {version}' for name, version in oldest)})" in text
