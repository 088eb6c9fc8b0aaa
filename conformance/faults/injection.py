"""One fit of the fault matrix, run from outside: its command, its fault injected at the row's moment, and every
rank process watched until it is gone (or killed at the deadline).

- :func:`fit_command`: :mod:`conformance.faults.fit` with the row's fault flags (under ``torchrun`` for a
  restart row).
- :func:`run_fit`: runs it, sends a signal row's signal when the rank is where the row says (read from the
  ranks' event files, :func:`read_events`), polls every 10 ms until no rank process is left: a :class:`FitRun`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from collectives.launcher import without_launch_variables
from conformance.faults.rows import DEADLINE_S, EPOCHS, HOLD_S, Row

__all__ = ["FitRun", "fit_command", "read_events", "run_fit", "shell_status"]

REPO_ROOT = Path(__file__).resolve().parents[2]


def fit_command(out: Path, row: Row | None, ckpt_path: Path | None = None, accumulate: int = 1) -> list[str]:
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


def read_events(out: Path) -> list[dict[str, Any]]:
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


def shell_status(returncode: int | None) -> int | None:
    return None if returncode is None else (128 - returncode if returncode < 0 else returncode)


@dataclass
class FitRun:
    returncode: int
    pids: dict[int, int]  # rank -> process id
    fault_at: float | None  # time.time() of the fault (signal sent, or the rank's "fault" event)
    gone_at: float  # when the last rank process was seen gone (polled every 10 ms)
    killed: bool  # still running DEADLINE_S after the fault (or at the overall deadline): killed here


def run_fit(command: list[str], out: Path, row: Row | None) -> FitRun:
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
                events = read_events(out)
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
