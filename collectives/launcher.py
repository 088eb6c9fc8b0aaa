"""Run a function on ``world_size`` local processes joined in one process group.

Used by the tests, the conformance tables and the benchmarks (which is why it lives beside the
collectives, not in any of them): the fork start method with gloo and a ``file://`` store
brings up a 2-rank group in ~0.05 s on CPU (spawn needs ~3 s because every child re-imports
torch). Pure torch; no Lightning import.

Example:
    >>> def work(rank, world_size, scale):
    ...     t = torch.full((2,), float(rank * scale))
    ...     dist.all_reduce(t)
    ...     return t
    >>> run_workers(work, world_size=2, args=(3,))  # doctest: +SKIP
    [tensor([3., 3.]), tensor([3., 3.])]
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import shutil
import tempfile
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["LAUNCH_VARIABLES", "WorkerError", "run_workers", "without_launch_variables"]

# Rendezvous variables a launcher exports; Lightning's fork/spawn launcher leaves MASTER_PORT in the
# parent's environment. Inherited by a later process, they make it reuse a stale port or believe it is
# a launched child.
LAUNCH_VARIABLES = tuple(
    "MASTER_ADDR MASTER_PORT WORLD_SIZE RANK LOCAL_RANK NODE_RANK GROUP_RANK LOCAL_WORLD_SIZE PL_GLOBAL_SEED "
    "PL_SEED_WORKERS".split()
)


def without_launch_variables(environ: dict[str, str]) -> dict[str, str]:
    """``environ`` without :data:`LAUNCH_VARIABLES`: the environment for a fresh, self-launching run."""
    return {key: value for key, value in environ.items() if key not in LAUNCH_VARIABLES}


class WorkerError(RuntimeError):
    """A worker process raised; the message carries its rank and traceback."""


def _worker(rank: int, fn: Callable[..., Any], args: Sequence[Any], group: dict, threads: int, results: Any) -> None:
    # One intra-op thread per rank: on a 2-core machine more only oversubscribes the cores.
    torch.set_num_threads(threads)
    try:
        dist.init_process_group(rank=rank, **group)
        try:
            out = fn(rank, group["world_size"], *args)
        finally:
            dist.destroy_process_group()
        # Plain pickle copies tensors by value. The queue's own pickler would share their
        # storage through file descriptors that vanish when this process exits first.
        results.put((rank, True, pickle.dumps(out)))
    except BaseException:  # noqa: BLE001 - every failure must reach the parent, never a hang
        results.put((rank, False, traceback.format_exc()))


def run_workers(
    fn: Callable[..., Any],
    world_size: int,
    *,
    args: Sequence[Any] = (),
    init_file: str | os.PathLike[str] | None = None,
    backend: str = "gloo",
    timeout_s: float = 60.0,
    start_method: str = "fork",
    threads: int = 1,
    deadline_margin_s: float = 30.0,
) -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` processes and return results by rank.

    Args:
        fn: Top-level (picklable under spawn) function run inside an initialised process group.
        world_size: Number of processes, ``>= 1``.
        args: Extra positional arguments passed to ``fn`` after ``rank, world_size``.
        init_file: Path for the ``file://`` rendezvous store; must not exist yet. A fresh
            temporary path is used when ``None``.
        backend: ``torch.distributed`` backend (``"gloo"`` on CPU).
        timeout_s: Collective timeout inside the group and the deadline for the whole run; a
            dead or stuck peer ends in :class:`TimeoutError`, never a silent hang.
        start_method: ``"fork"`` (fast, default) or ``"spawn"``.
        threads: ``torch.set_num_threads`` value inside each worker.
        deadline_margin_s: Extra seconds on top of ``timeout_s`` for process start-up before the
            parent gives up on the workers.

    Returns:
        The return values of ``fn``, indexed by rank.

    Raises:
        ValueError: ``world_size < 1``, ``init_file`` already exists, or a fork after CUDA was initialised.
        WorkerError: a worker raised; the message holds its rank and traceback.
        TimeoutError: not all workers reported within ``timeout_s + deadline_margin_s``.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if start_method == "fork" and torch.cuda.is_initialized():
        raise ValueError(
            "run_workers(start_method='fork') after this process initialised CUDA: a forked child cannot use CUDA "
            "('Cannot re-initialize CUDA in forked subprocess'); pass start_method='spawn'"
        )
    own_folder = tempfile.mkdtemp(prefix="lit_cifar_pg_") if init_file is None else None
    init_file = os.path.join(own_folder, "store") if own_folder else init_file
    if os.path.exists(init_file):
        raise ValueError(f"init_file {os.fspath(init_file)!r} already exists; pass a fresh path")
    ctx = mp.get_context(start_method)
    results = ctx.Queue()
    group = {
        "backend": backend,
        "init_method": f"file://{os.path.abspath(init_file)}",
        "world_size": world_size,
        "timeout": timedelta(seconds=timeout_s),
    }
    worker_args = [(rank, fn, args, group, threads, results) for rank in range(world_size)]
    procs = [ctx.Process(target=_worker, args=a, daemon=True) for a in worker_args]
    for proc in procs:
        proc.start()
    grace_s = 0.0  # after a failure, peers still blocked in a collective are killed at once
    try:
        outputs = _collect(results, procs, timeout_s + deadline_margin_s)
        grace_s = 10.0
        return outputs
    finally:
        _stop(procs, grace_s)
        if own_folder:  # the store's file outlives ranks that were killed: remove the folder it lives in
            shutil.rmtree(own_folder, ignore_errors=True)


def _stop(procs: list[Any], grace_s: float) -> None:
    """Join every worker within ``grace_s``; kill those still running."""
    for proc in procs:
        proc.join(timeout=grace_s)
        if proc.is_alive():
            proc.kill()
            proc.join()


def _collect(results: Any, procs: list[Any], deadline_s: float) -> list[Any]:
    """Read one report per rank; raise on the first failure, a dead worker, or the deadline."""
    outputs: dict[int, Any] = {}
    failures: list[str] = []
    remaining = deadline_s
    while len(outputs) + len(failures) < len(procs):
        try:
            rank, ok, payload = results.get(timeout=min(remaining, 1.0))
        except queue.Empty:
            remaining -= 1.0
            dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if dead:
                codes = {i: procs[i].exitcode for i in dead}
                raise WorkerError(f"worker(s) died without reporting: exit codes {codes}") from None
            if remaining <= 0:
                if failures:
                    break
                raise TimeoutError(f"workers did not finish within {deadline_s:.0f} s") from None
            continue
        if ok:
            outputs[rank] = pickle.loads(payload)
        else:
            failures.append(f"rank {rank}:\n{payload}")
            # Peers of a failed rank fail soon after (gloo sees the closed connection) or block
            # until the group timeout: give them a short grace so the root cause is reported too.
            remaining = min(remaining, 3.0)
    if failures:
        raise WorkerError("\n".join(failures))
    return [outputs[rank] for rank in range(len(procs))]
