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

    python -m conformance.faults.matrix                  # every row (~3 min on 2 cores), the page's block
    python -m conformance.faults.matrix --rows sigterm_rank1_train --out /tmp/fm   # the page untouched

Writes ``results.json``, ``results.md`` and the block of ``docs/stopping-and-resuming.md``
(:mod:`conformance.faults.report`).
``tests/test_fault_matrix.py`` runs rows through :func:`run_row` and checks each row's expectations.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from collectives.launcher import without_launch_variables
from conformance.faults import report
from conformance.faults.messages import rank0_message
from conformance.faults.rows import DEADLINE_S, EPOCHS, HOLD_S, ROWS, ROWS_BY_NAME, STEPS_PER_EPOCH, Result, Row
from measure.run_info import environment

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUT = REPO_ROOT / "conformance" / "results" / "fault_matrix"
PAGE = report.PAGE  # the manual's page that holds the table


def _fit_command(out: Path, row: Row | None, ckpt_path: Path | None = None, accumulate: int = 1) -> list[str]:
    """The fit with ``row``'s faults (``None``: none; ``accumulate`` then sets ``accumulate_grad_batches``)."""
    accumulate = row.accumulate if row is not None else accumulate
    fit = [
        "-m",
        "conformance.faults.fit",
        "--out",
        str(out),
        "--max_epochs",
        str(EPOCHS),
        "--accumulate",
        str(accumulate),
    ]
    if row is not None and row.max_restarts is not None:  # torchrun's elastic agent restarts every rank
        launcher = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            f"--max-restarts={row.max_restarts}",
        ]
        return launcher + fit + ["--ckpt_path", "last"] + _fault_flags(row)
    command = [sys.executable] + fit
    if ckpt_path is not None:
        return command + ["--ckpt_path", str(ckpt_path)]
    return command + (_fault_flags(row) if row is not None else [])


def _fault_flags(row: Row) -> list[str]:
    command = ["--timeout", str(row.timeout_s), "--ckpt_every_n_epochs", str(row.ckpt_every_n_epochs)]
    command += ["--desync_check"] if row.desync_check else []
    if row.stall_timeout_s is not None:
        command += ["--stall_timeout", str(row.stall_timeout_s)]
    where = f"{row.rank}:{row.epoch}:{row.batch}"
    if row.phase == "train" and row.is_signal:
        command += ["--hold", f"{1 - row.rank}:{row.epoch}:{row.batch}:{HOLD_S}"]
    if row.phase == "ckpt":
        hold = 2 * row.stall_timeout_s if row.fault == "slow_save" and row.stall_timeout_s else HOLD_S
        command += ["--ckpt_hold", str(hold)] + (
            ["--ckpt_hold_rank", str(row.rank)] if row.fault == "slow_save" else []
        )
    flag = {
        "exception": "--raise_at",
        "exception_after_forward": "--raise_after_forward_at",
        "rank_collective": "--rank_collective_at",
        "loop": "--loop_at",
        "block_loader": "--block_loader_at",
    }.get(row.fault)
    return command + ([flag, where] if flag else [])


def _events(out: Path) -> list[dict[str, Any]]:
    events = []
    for path in sorted(out.glob("events_rank*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:  # a line cut short by SIGKILL
                continue
    return sorted(events, key=lambda e: e["t"])


def _trigger(row: Row, event: dict[str, Any]) -> float | None:
    """Seconds to wait before sending the row's signal, if ``event`` is its moment; else ``None``."""
    if event["rank"] != row.rank:
        return None
    if row.phase == "train" and event["event"] == "train_batch":
        if (event["epoch"], event["batch"]) == (row.epoch, row.batch):
            return 0.3  # by then the rank waits in the batch's SyncBN all_gather for its held-back peer
    if row.phase == "val" and event["event"] == "val_batch" and event["batch"] == 1:
        return 0.0
    if row.phase == "ckpt" and event["event"] == "ckpt_save":
        return 0.3  # inside the first save (conformance.faults.fit holds it HOLD_S)
    return None


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
    except (FileNotFoundError, ProcessLookupError):
        return False


def _shell_status(returncode: int | None) -> int | None:
    return None if returncode is None else (128 - returncode if returncode < 0 else returncode)


@dataclass
class FitRun:
    returncode: int
    pids: dict[int, int]  # rank -> process id
    fault_at: float | None  # time.time() of the fault (signal sent, or the rank's "fault" event)
    gone_at: float  # when the last rank process was seen gone (polled every 10 ms)
    killed: bool  # still running DEADLINE_S after the fault (or at the overall deadline): killed here


def _run_fit(command: list[str], out: Path, row: Row | None) -> FitRun:
    """Run one fit; send ``row``'s signal at its moment; poll until every rank process is gone."""
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "output.log", "w") as log:
        env = without_launch_variables(dict(os.environ))  # not an earlier in-process run's rendezvous
        proc = subprocess.Popen(
            command,
            cwd=REPO_ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**env, "PYTHONUNBUFFERED": "1"},
        )
        pids: dict[int, int] = {}
        fault_at, send_at, deadline, killed = None, None, time.time() + 2 * DEADLINE_S, True
        try:
            while time.time() < deadline and (fault_at is None or time.time() < fault_at + DEADLINE_S):
                events = _events(out)
                pids.update({e["rank"]: e["pid"] for e in events if e["event"] == "start"})
                if row is not None and fault_at is None:
                    fault_at, send_at = _inject(row, events, pids, send_at)
                if proc.poll() is not None and not any(_alive(pid) for pid in pids.values()):
                    killed = False
                    break
                time.sleep(0.01)
            gone_at = time.time()
        finally:
            os.killpg(proc.pid, signal.SIGKILL) if proc.poll() is None else None
            for pid in pids.values():
                _kill_quietly(pid)
            proc.wait()
    return FitRun(proc.returncode, pids, fault_at, gone_at, killed)


def _inject(
    row: Row, events: list[dict[str, Any]], pids: dict[int, int], send_at: float | None
) -> tuple[float | None, float | None]:
    """``(fault time or None, when to send the signal or None)``; sends it once its time has come."""
    if not row.is_signal:
        return next((e["t"] for e in events if e["event"] == "fault"), None), None
    if send_at is None:
        send_at = next((e["t"] + d for e in events if (d := _trigger(row, e)) is not None), None)
    if send_at is not None and time.time() >= send_at and row.rank in pids:
        fault_at = time.time()
        os.kill(pids[row.rank], getattr(signal, row.fault))
        return fault_at, send_at
    return None, send_at


def _kill_quietly(pid: int) -> None:
    if _alive(pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


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
        _run_fit(_fit_command(reference, None, accumulate=accumulate), reference, None)
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
    result.resume_status = _shell_status(run.returncode)
    result.resumed_to_step = done[-1].get("step") if done else None
    if resumed_from and result.step_at_fault is not None:
        result.steps_lost = result.step_at_fault - min(resumed_from)
    result.notes.append(f"torchrun restarts: {len({e.get('restart') for e in events if e['event'] == 'start'}) - 1}")


def run_row(row: Row, out: Path, resume: bool = True) -> Result:
    """Run one row in ``out`` (a fresh folder) and measure it; ``resume``: also resume / compare weights."""
    run = _run_fit(_fit_command(out, row), out, row)
    if run.fault_at is None:
        tail = "\n".join((out / "output.log").read_text(errors="replace").splitlines()[-15:])
        raise RuntimeError(
            f"{row.name}: the fault was never injected (exit {run.returncode}); the fit's output ends with:\n{tail}"
        )
    events = _events(out)
    first = _attempt_pids(events, first=True)
    exits = {e["rank"]: e for e in events if e["event"] == "exit" and e["pid"] in first}
    # Rank 0's status is its process's (the one a scheduler sees under the popen launcher); the
    # others' come from their exit events (their parent, rank 0, reaps them). Under torchrun: the
    # first attempt's exit events, and the job's status in the resume column.
    status = {rank: exits[rank]["code"] if rank in exits else None for rank in sorted(run.pids)}
    if row.max_restarts is None:
        status[0] = _shell_status(run.returncode)
    before = [
        e["step"] for e in events if e["event"] == "train_batch" and e["rank"] == row.rank and e["t"] <= run.fault_at
    ]
    last = out / "checkpoints" / "last.ckpt"
    exited = round(max(e["t"] for e in exits.values()) - run.fault_at, 2) if len(exits) == len(run.pids) else None
    # The slow-save row's last.ckpt after its "fault" is the fit's own end-of-run checkpoint: no stop's.
    after = None if row.max_restarts is not None or row.fault == "slow_save" else _checkpoint_step(last, run.fault_at)
    result = Result(
        row.name,
        row.label,
        None if run.killed else round(run.gone_at - run.fault_at, 2),
        exited,
        status,
        rank0_message(out),
        after,
        max(before) if before else None,
        hung=run.killed,
        final_step=row.final_step,
    )
    result.notes += [f"rank {rank}: no exit event (killed)" for rank in run.pids if rank not in exits]
    if row.max_restarts is not None:
        _restart_outcome(result, events, run)
        if resume:
            result.same_weights = same_as_uninterrupted(last, out.parent, row.accumulate)
        return result
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
    again = _run_fit(_fit_command(resumed, None, checkpoint, accumulate), resumed, None)
    done = [e for e in _events(resumed) if e["event"] == "exit" and e["rank"] == 0]
    result.resume_status = _shell_status(again.returncode)
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
