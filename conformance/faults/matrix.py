"""Fault matrix: signals, a killed rank, a one-rank exception, a rank-only collective, stalls and restarts.

Each row starts :mod:`conformance.faults.fit` (2 CPU ranks, Lightning's popen launcher, collective
timeout 30 s), injects one fault at a chosen moment and measures, from outside: the time from the
fault to every rank process gone, each rank's exit status, rank 0's message, whether a checkpoint
was written after the fault (and at which step), and whether ``fit --ckpt_path`` resumes from it
to the end of training. Signals come from this process (``os.kill`` on one rank's pid, taken from
the rank's event file) while the rank is where the row says: blocked in the SyncBN all_gather of a
training batch (its peer held back 1.5 s), in a validation batch, or inside a checkpoint save.
Stall rows (``stall_timeout`` 20 s) stop rank 1 or rank 0 (the store's host) with SIGSTOP, loop
forever in rank 1's ``training_step`` or block its DataLoader; one holds rank 0's checkpoint save for 2 x
``stall_timeout`` (must not fire). Restart rows run the fit under ``torchrun --max-restarts=1`` with
``--ckpt_path last``: the job must finish (exit 0). A resumed fit's final weights (a restart row's, or
``fit --ckpt_path`` from the checkpoint written after the fault) are compared with an uninterrupted run's. "Steps lost"
counts the optimizer steps done before the fault that a resume re-does (from the checkpoint written
after the fault, else the newest one before it)::

    python -m conformance.faults.matrix                  # every row (13 min on 2 Zen 3 cores), the page's block
    python -m conformance.faults.matrix --rows sigterm_rank1_train --out /tmp/fm   # the page untouched

Writes ``results.json``, ``results.md`` and the block of ``docs/stopping-and-resuming.md``
(:mod:`conformance.faults.report`).
``tests/fault_tolerance/test_fault_matrix.py`` runs rows through :func:`run_row` and checks each row's expectations.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from conformance.faults import report
from conformance.faults.injection import FitRun, fit_command, read_events, run_fit, shell_status
from conformance.faults.messages import rank0_message
from conformance.faults.rows import EPOCHS, ROWS, ROWS_BY_NAME, STEPS_PER_EPOCH, Result, Row
from measure.run_info import environment

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUT = REPO_ROOT / "conformance" / "results" / "fault_matrix"
PAGE = report.PAGE  # the manual's page that holds the table


def _checkpoint_step(path: Path, after: float) -> int | None:
    if not path.exists() or path.stat().st_mtime < after:
        return None
    return int(torch.load(path, map_location="cpu", weights_only=False)["global_step"])


def _state(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, map_location="cpu", weights_only=False)["state_dict"]


def same_as_uninterrupted(final: Path, work: Path, accumulate: int = 1) -> bool | None:
    """Whether ``final``'s weights equal bitwise those of an uninterrupted fit with ``accumulate_grad_batches``
    ``accumulate`` (run once per ``work`` folder)."""
    reference = work / ("uninterrupted" if accumulate == 1 else f"uninterrupted_accumulate{accumulate}")
    if not (reference / "checkpoints" / "last.ckpt").exists():
        run_fit(fit_command(reference, None, accumulate=accumulate), reference, None)
    if not final.exists() or not (reference / "checkpoints" / "last.ckpt").exists():
        return None
    ours, theirs = _state(final), _state(reference / "checkpoints" / "last.ckpt")
    return ours.keys() == theirs.keys() and all(torch.equal(ours[key], theirs[key]) for key in ours)


def _attempt_pids(events: list[dict[str, Any]], first: bool) -> set[int]:
    return {e["pid"] for e in events if e["event"] == "start" and (e.get("restart", 0) == 0) == first}


def _restart_outcome(result: Result, events: list[dict[str, Any]], run: FitRun) -> None:
    """Restart rows: the job's status, the step it resumed from, the final step (``run_row`` fills the rest)."""
    later = _attempt_pids(events, first=False)
    resumed_from = [e["step"] for e in events if e["event"] == "train_batch" and e["pid"] in later]
    done = [e for e in events if e["event"] == "exit" and e["rank"] == 0 and e["pid"] in later]
    result.resume_status = shell_status(run.returncode)
    result.resumed_to_step = done[-1].get("step") if done else None
    if resumed_from and result.step_at_fault is not None:
        result.steps_lost = result.step_at_fault - min(resumed_from)
    result.notes.append(f"torchrun restarts: {len({e.get('restart') for e in events if e['event'] == 'start'}) - 1}")


def _first_attempt(row: Row, run: FitRun, events: list[dict[str, Any]], out: Path) -> Result:
    """What the first attempt's ranks did about the fault: when they were gone, their statuses, rank 0's
    message, the checkpoint written after it and the step the faulted rank had reached."""
    first = _attempt_pids(events, first=True)
    exits = {e["rank"]: e for e in events if e["event"] == "exit" and e["pid"] in first}
    # Rank 0's status is its process's (the one a scheduler sees under the popen launcher); the
    # others' come from their exit events (their parent, rank 0, reaps them). Under torchrun: the
    # first attempt's exit events, and the job's status in the resume column.
    status = {rank: exits[rank]["code"] if rank in exits else None for rank in sorted(run.pids)}
    if row.max_restarts is None:
        status[0] = shell_status(run.returncode)
    faulted = [e for e in events if e["event"] == "train_batch" and e["rank"] == row.rank]
    before = [e["step"] for e in faulted if e["t"] <= run.fault_at]
    exited = round(max(e["t"] for e in exits.values()) - run.fault_at, 2) if len(exits) == len(run.pids) else None
    # The slow-save row's last.ckpt after its "fault" is the fit's own end-of-run checkpoint: no stop's.
    no_stop_checkpoint = row.max_restarts is not None or row.fault == "slow_save"
    after = None if no_stop_checkpoint else _checkpoint_step(out / "checkpoints" / "last.ckpt", run.fault_at)
    gone = None if run.killed else round(run.gone_at - run.fault_at, 2)
    message, at_fault = rank0_message(out), max(before, default=None)
    result = Result(row.name, row.label, gone, exited, status, message, after, at_fault, hung=run.killed)
    result.final_step = row.final_step
    result.notes += [f"rank {rank}: no exit event (killed)" for rank in run.pids if rank not in exits]
    return result


def run_row(row: Row, out: Path, resume: bool = True) -> Result:
    """Run one row in ``out`` (a fresh folder) and measure it; ``resume``: also resume / compare weights."""
    run = run_fit(fit_command(out, row), out, row)
    if run.fault_at is None:
        tail = "\n".join((out / "output.log").read_text(errors="replace").splitlines()[-15:])
        raise RuntimeError(
            f"{row.name}: the fault was never injected (exit {run.returncode}); the fit's output ends with:\n{tail}"
        )
    events, last = read_events(out), out / "checkpoints" / "last.ckpt"
    result = _first_attempt(row, run, events, out)
    if row.max_restarts is not None:
        _restart_outcome(result, events, run)
        if resume:
            result.same_weights = same_as_uninterrupted(last, out.parent, row.accumulate)
        return result
    after = result.checkpoint_step
    newest = after if after is not None else _checkpoint_step(last, 0.0)
    if newest is not None and result.step_at_fault is not None and row.fault != "slow_save":
        result.steps_lost = max(0, result.step_at_fault - newest)
    if row.fault == "slow_save":
        done = [e for e in events if e["event"] == "exit" and e["rank"] == 0]
        result.resumed_to_step = done[-1].get("step") if done else None  # the fit itself went on to the end
    elif resume and after is not None:
        _resume_outcome(result, last, out, row.accumulate)
    return result


def _resume_outcome(result: Result, checkpoint: Path, out: Path, accumulate: int) -> None:
    """``fit --ckpt_path`` from the checkpoint written after the fault: its status, final step and weights."""
    resumed = out / "resume"
    again = run_fit(fit_command(resumed, None, checkpoint, accumulate), resumed, None)
    done = [e for e in read_events(resumed) if e["event"] == "exit" and e["rank"] == 0]
    result.resume_status = shell_status(again.returncode)
    result.resumed_to_step = done[0].get("step") if done else None
    result.same_weights = same_as_uninterrupted(resumed / "checkpoints" / "last.ckpt", out.parent, accumulate)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="*", choices=sorted(ROWS_BY_NAME), help="default: every row")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    rows = [ROWS_BY_NAME[name] for name in args.rows] if args.rows else list(ROWS)
    load_before = os.getloadavg()[0]
    results = []
    with tempfile.TemporaryDirectory(prefix="fault_matrix_") as work:
        for row in rows:
            results.append(run_row(row, Path(work) / row.name))
            print(json.dumps(asdict(results[-1])), flush=True)
    record = {
        "benchmark": "fault_matrix",
        "date": time.strftime("%Y-%m-%d"),
        "environment": environment(),
        "load_before": load_before,
        "final_step": STEPS_PER_EPOCH * EPOCHS,
        "rows": [asdict(r) for r in results],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(record, indent=1) + "\n")
    (args.out / "results.md").write_text("# Fault matrix\n\n" + report.render_block(record) + "\n")
    if args.out == DEFAULT_OUT and not args.rows:
        PAGE.write_text(report.update_readme(record)[1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
