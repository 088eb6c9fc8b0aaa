"""One generated block of a Markdown page (README.md, docs/*.md): the text between a begin and an end marker,
replaced whole.

The benchmark results and README's headline (:mod:`benchmarks.readme_results`), the conformance tables
(:mod:`conformance.evaluation.table`, :mod:`conformance.training.table`) and the fault matrix
(:mod:`conformance.faults.report`) each own one such block. Pure Python.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["replace_block"]


def replace_block(readme: Path, begin: str, end: str, block: str) -> tuple[str, str]:
    """``(page text now, page text with block in place of begin ... end)``; ``block`` holds both
    markers. Raises ``ValueError`` naming the file and the markers when either is missing."""
    text = readme.read_text()
    if begin not in text or end not in text:
        raise ValueError(f"{readme} has no {begin} ... {end} block: add both markers where the block goes")
    head, rest = text.split(begin, 1)
    return text, head + block + rest.split(end, 1)[1]
