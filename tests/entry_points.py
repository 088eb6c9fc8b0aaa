"""The repository's entry points run as a user runs them: ``python train.py ...`` or ``python -m benchmarks.<name> ...``
in a fresh process, from the repository root; each must exit 0."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def run_python(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """``python <args>`` in the repository root; asserts exit status 0 (the output's tails say why not)."""
    done = subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return done


def train_py(*args: str) -> str:
    """``python train.py <args>``: what it printed, stdout then stderr."""
    done = run_python("train.py", *args)
    return done.stdout + done.stderr


def train_py_on_two_processes(*args: str) -> str:
    """``python train.py <args>`` for a 2-process run started by the popen launcher: rank 1 must have run too."""
    output = train_py(*args)
    assert "GLOBAL_RANK: 1, MEMBER: 2/2" in output  # the popen launcher started rank 1, which re-ran the CLI
    return output


def quick_benchmark_record(name: str, out: Path, *args: str, timeout: float) -> dict[str, Any]:
    """``python -m benchmarks.<name> --out <out> --quick <args>``: the record it wrote (``<out>/results.json``)."""
    run_python("-m", f"benchmarks.{name}", "--out", str(out), "--quick", *args, timeout=timeout)
    return json.loads((out / "results.json").read_text())
