"""The fault matrix's message column: what rank 0 (or each rank) said when a fault ended the fit.

Read from a row's ``output.log``: custom_ddp's own lines (a stop, a desync, a stall report, a failed
peer named by a survivor, the last checkpoint), else each rank's last error line, shortened.
"""

from __future__ import annotations

import re
from pathlib import Path

__all__ = ["rank0_message"]

_ERROR_LINE = re.compile(r"^(?:\[rank(\d+)\]: )?((?:[\w.]+)(?:Error|Exception)\b.*)$")


def rank0_message(out: Path) -> str:
    """Rank 0's stop or desync message; otherwise each rank's last error line, shortened."""
    lines = (out / "output.log").read_text(errors="replace").replace(f"{out}/", "").splitlines()
    stall = next((i for i, line in enumerate(lines) if line.startswith("custom_ddp stall:")), None)
    if stall is not None:
        return _stall_message(lines[stall:])
    ours = [line.strip() for line in lines if (line.startswith("custom_ddp") and " received " not in line)]
    if any("desync check" in line for line in ours):  # rank 0's message: the header and one line per rank
        start = next(
            i
            for i in range(len(lines) - 1)
            if "desync check" in lines[i] and lines[i + 1].strip().startswith("rank 0:")
        )
        ours = [line.strip() for line in lines[start : start + 3]]
    if ours:
        return " / ".join(dict.fromkeys(ours))
    errors: dict[str, str] = {}
    for line in lines:
        match = _ERROR_LINE.match(line)
        if match:
            errors[match.group(1) or "?"] = match.group(2)
    return " / ".join(f"rank {rank}: {text[:160]}" for rank, text in sorted(errors.items()))


def _stall_message(report: list[str]) -> str:
    """The report's head, the stalled rank's line, its innermost frame (or why it could not answer), the checkpoint."""
    keep = [report[0].strip()]
    for i, line in enumerate(report[1:], 1):
        if not line.startswith("  "):
            break
        if line.startswith("  STALLED") or "no answer" in line or "checkpoint" in line:
            keep.append(line.strip())
        if line.strip().startswith("File ") and not report[i + 1].strip().startswith("File "):
            keep.append("innermost: " + line.strip())
    return " / ".join(keep)
