"""Re-derive committed benchmark records from the raw samples they keep, with today's analysis.

    python -m benchmarks.rederive                   # every record under benchmarks/results/
    python -m benchmarks.rederive compare_localbn   # the named folders only
    python -m benchmarks.readme_results --write     # then refresh the README's results block

A record's estimates, headline, report and plots come from its benchmark module's ``write(record, out)``,
which derives them from the samples the record keeps; the measurements, machine and command stay as
recorded. Records whose module has no ``write`` (their raw samples were not kept) are listed and left
alone: only a re-run refreshes them.
"""

from __future__ import annotations

import argparse
import importlib
import json
from collections.abc import Sequence
from pathlib import Path

from benchmarks.harness import RESULTS

__all__ = ["main", "rederive"]


def rederive(folder: Path) -> bool:
    """Re-write ``folder``'s record with its benchmark's ``write``; False when that benchmark has none."""
    record = json.loads((folder / "results.json").read_text())
    write = getattr(importlib.import_module(f"benchmarks.{record['benchmark']}"), "write", None)
    if write is None:
        return False
    write(record, folder)
    return True


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.rederive", description=__doc__.split("\n\n")[0])
    p.add_argument("names", nargs="*", help="folders under benchmarks/results/ (default: all)")
    args = p.parse_args(argv)
    folders = [RESULTS / name for name in args.names] or sorted(path.parent for path in RESULTS.glob("*/results.json"))
    missing = [str(folder) for folder in folders if not (folder / "results.json").is_file()]
    if missing:
        p.error(f"no results.json in {', '.join(missing)}; name folders under {RESULTS}")
    kept = [folder.name for folder in folders if not rederive(folder)]
    if kept:
        print(f"left as recorded (their benchmark cannot re-derive them; re-run to refresh): {', '.join(kept)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
