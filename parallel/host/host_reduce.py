"""All-reduce through shared memory, for gradient buckets of CPU ranks on one host.

Over gloo, two ranks on one machine sum a bucket through TCP loopback: every byte is copied into
the kernel and out again, and the cores doing it are the ones running backward (43 MiB of
ResNet-18 gradients: ~30 ms, see ``benchmarks/results/grad_sync``). Here every rank's bucket
buffers live in a file under ``/dev/shm`` that every rank of the group maps, and the sum is
computed in place, each rank reading its peers' memory directly::

    1. barrier: every rank's buffer holds its contribution
    2. rank r adds chunk r of every peer's buffer into chunk r of its own   (reduce-scatter)
    3. barrier: every chunk is summed
    4. rank r copies chunk k of rank k's buffer into its own, for k != r    (all-gather)
    5. barrier: no rank reads rank r's buffer any more; it may be written again

Each chunk is summed once, by one rank, in a fixed order: every rank holds the same bits, run
after run, and two ranks get exactly gloo's ``a + b`` (addition of two terms commutes exactly).
The barriers are futex waits on words in shared memory (:mod:`parallel.host.shm_barrier`: no round trip
through gloo's threads; a dead peer raises within 0.1 s, a silent one after ``timeout``); where those
cannot apply (not x86-64, peers not visible in ``/proc``) they are barriers of a gloo group of our
own, whose system calls order memory between ranks. A gloo group of our own also runs the allocations, so they never
interleave with the default group's collectives. One worker thread per process issues every barrier
(sums and allocations, in call order), so backward goes on meanwhile, as it does beside gloo's own
threads. Shared files are unlinked once every rank mapped them (or the allocation failed): only a
process killed inside an allocation leaves its file in ``/dev/shm``.

Used by :class:`parallel.gradients.grad_sync.SyncedDataParallel` (``grad_transport``). Pure torch; no Lightning.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import queue
import re
import threading
import uuid
import weakref
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.profiler import record_function

from parallel.host.shm_barrier import FutexBarrier, ProcessIdentity, local_problem, own_identity
from parallel.sync_config import GRAD_TRANSPORTS

__all__ = ["SharedMemoryAllReduce", "open_shared_memory_all_reduce", "parse_launch_label"]

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
_ALIGN = 64  # bytes: every buffer starts on a cache line, and any dtype's view of it is aligned
# Profiler labels. The launch label (caller's thread) names the buffer, so CollectiveCounter counts
# one all-reduce per launch; the worker label marks the barriers it runs, which are not collectives
# of their own.
_LAUNCH = "SyncedDataParallel.shared_memory_all_reduce"
WORKER_LABEL = "SharedMemoryAllReduce.worker"
_LAUNCH_RE = re.compile(re.escape(_LAUNCH) + r"\((\w+)\[(\d+)\]\)$")


def parse_launch_label(name: str) -> tuple[str, int] | None:
    """``(dtype, numel)`` of the buffer a launch label names, or ``None`` for any other event name."""
    match = _LAUNCH_RE.match(name)
    return (match.group(1), int(match.group(2))) if match else None


def _local_problem(devices: Sequence[torch.device], grad_compression: str | None) -> str | None:
    if any(device.type != "cpu" for device in devices):
        return "gradients live on an accelerator (its own backend, e.g. NCCL, reduces them)"
    if grad_compression is not None:
        return f"grad_compression={grad_compression!r} reduces a converted copy of each bucket"
    if not (os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK)):
        return f"{SHM_DIR} is missing or not writable"
    return None


def _problem(
    process_group: dist.ProcessGroup | None, devices: Sequence[torch.device], grad_compression: str | None
) -> str | None:
    """Why the group cannot sum through shared memory (the same answer on every rank), or ``None``.
    Collective over the default group: one ``broadcast_object_list``, one ``all_gather_object``."""
    if process_group not in (None, dist.group.WORLD):
        return "the group is a subgroup (its barrier group would need every rank of the world)"
    if dist.get_backend() != "gloo":
        return f"the backend is {dist.get_backend()!r}, not gloo"
    # Whether every rank sees the same /dev/shm: rank 0 leaves a file there and the others look for it.
    # (A host name or boot id cannot tell: containers on one machine may share both, not /dev/shm.)
    rank, name = dist.get_rank(), [f"lit_cifar-probe-{uuid.uuid4().hex}"]  # the name only: each rank's own /dev/shm
    own = _local_problem(devices, grad_compression)
    if rank == 0 and own is None:
        open(os.path.join(SHM_DIR, name[0]), "x").close()
    dist.broadcast_object_list(name, src=0)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, (own, os.path.exists(os.path.join(SHM_DIR, name[0]))))
    if rank == 0 and own is None:
        os.unlink(os.path.join(SHM_DIR, name[0]))
    problems = [f"rank {r}: {p}" for r, (p, _) in enumerate(every) if p]
    problems += [
        f"rank {r} does not see rank 0's {SHM_DIR} (another host or container)"
        for r, (p, sees) in enumerate(every)
        if not (p or sees or every[0][0])
    ]
    return "; ".join(problems) or None


def open_shared_memory_all_reduce(
    transport: str,
    process_group: dist.ProcessGroup | None,
    devices: Sequence[torch.device],
    grad_compression: str | None,
    timeout: timedelta | None = None,
) -> SharedMemoryAllReduce | None:
    """A :class:`SharedMemoryAllReduce` when ``transport`` asks for it and it applies, else ``None``.

    Every rank of the group calls this at the same point (it communicates). ``"shared_memory"``
    where it cannot apply raises ``ValueError`` on every rank, naming the reason and the fix.
    """
    if transport not in GRAD_TRANSPORTS:
        raise ValueError(f"grad_transport={transport!r} must be one of {GRAD_TRANSPORTS}")
    if transport == "process_group":
        return None
    problem = _problem(process_group, devices, grad_compression)
    if problem is None:
        return SharedMemoryAllReduce(timeout)
    if transport == "shared_memory":
        raise ValueError(
            f"grad_transport='shared_memory' cannot apply: {problem}. Use grad_transport='auto' "
            "(falls back to the process group) or 'process_group'."
        )
    log.info("gradient buckets all-reduce through the process group: %s", problem)
    return None


def _map(path: str, nbytes: int) -> torch.Tensor:
    """Map a rank's existing file (``torch.from_file`` alone would create a missing one, silently private)."""
    if not os.path.exists(path) or os.stat(path).st_size < nbytes:
        raise RuntimeError(f"shared gradient buffer {path} is missing or short: the ranks do not share {SHM_DIR}")
    return torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)


class SharedMemoryAllReduce:
    """Buffers every rank of the default group maps, and an in-place sum over them (module docstring).

    Construct it on every rank at the same point (it creates a process group whose barriers wait at
    most ``timeout`` for a peer that is alive but silent; a dead peer raises at once). :meth:`allocate` is
    collective too; :meth:`all_reduce` must be called on every rank for the same buffer, in the same
    order, as any collective.
    """

    def __init__(self, timeout: timedelta | None = None) -> None:
        # Barriers only, never interleaved with other collectives; timeout None: torch's default.
        self._group = dist.new_group(backend="gloo", timeout=timeout)
        self._rank, self._world_size = dist.get_rank(), dist.get_world_size()
        every = [None] * self._world_size  # (rank 0's file name prefix, each rank's process)
        name = f"lit_cifar-{uuid.uuid4().hex}" if self._rank == 0 else None
        dist.all_gather_object(every, (name, own_identity()), group=self._group)
        self._prefix = os.path.join(SHM_DIR, every[0][0])
        self._arenas = 0
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        # A daemon thread: a process that exits while a peer is gone must not wait for it. It holds
        # no reference to this object, so dropping it (without close()) ends the thread too.
        self._worker = threading.Thread(
            target=_serve,
            args=(self._jobs, self._group, self._rank, self._world_size),
            name="shm-all-reduce",
            daemon=True,
        )
        self._worker.start()
        self._stop = weakref.finalize(self, self._jobs.put, None)
        self._peers = [identity for _, identity in every]
        self._timeout = timeout
        self._barrier_kind, self._barrier = self._open_barrier(self._peers, timeout)
        log.debug(
            "SharedMemoryAllReduce: %d ranks on this host, files %s-*, %s barriers",
            self._world_size,
            self._prefix,
            self.barrier_kind,
        )

    def _open_barrier(self, peers: list[ProcessIdentity], timeout: timedelta | None) -> tuple[str, Callable[[], Any]]:
        """``("futex", wait)`` of a :class:`FutexBarrier` where every rank can use one, else ``("gloo", the
        group's barrier)``. Collective."""
        verdicts: list[str | None] = [None] * self._world_size
        dist.all_gather_object(verdicts, local_problem(peers), group=self._group)
        problems = [f"rank {rank}: {problem}" for rank, problem in enumerate(verdicts) if problem]
        if problems:
            log.info("shared-memory sums keep gloo barriers: %s", "; ".join(problems))
            return "gloo", functools.partial(dist.barrier, group=self._group)
        (words,) = self.allocate([(_ALIGN // 4, torch.int32)])  # one word per rank, on its own cache line
        return "futex", FutexBarrier(words, self._rank, peers, timeout).wait

    @property
    def barrier_kind(self) -> str:
        """``"futex"`` (shared-memory words) or ``"gloo"`` (the group's barrier): see
        :mod:`parallel.host.shm_barrier`."""
        return self._barrier_kind

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def peers(self) -> list[ProcessIdentity]:
        """Every rank's process, by rank (for liveness checks of barriers of one's own)."""
        return list(self._peers)

    @property
    def timeout(self) -> timedelta | None:
        """How long a barrier waits for a peer that is alive but silent (``None``: torch's default)."""
        return self._timeout

    @property
    def world_size(self) -> int:
        return self._world_size

    def allocate(self, sizes: Sequence[tuple[int, torch.dtype]]) -> list[list[torch.Tensor]]:
        """Zeroed shared buffers of ``(numel, dtype)`` each: ``result[i][k]`` is rank k's buffer ``i``
        (``result[i][rank]`` is this rank's own to write). Collective; waits for the sums queued before
        it (the worker thread issues every barrier of the group, in call order)."""
        path = f"{self._prefix}-{self._arenas}-r%d"
        self._arenas += 1
        return self._submit(functools.partial(_allocate, path, sizes), label=None).wait()

    def all_reduce(self, buffers: Sequence[torch.Tensor]) -> torch.futures.Future:
        """Start summing every rank's ``buffers[k]`` into each of them; the future's ``wait()`` waits
        (and raises what the worker met, e.g. a peer that died)."""
        mine = buffers[self._rank]
        return self._submit(
            functools.partial(_sum_in_place, buffers, self._barrier),
            label=f"{_LAUNCH}({str(mine.dtype).removeprefix('torch.')}[{mine.numel()}])",
        )

    def _submit(self, job: Any, label: str | None) -> torch.futures.Future:
        future: torch.futures.Future = torch.futures.Future()
        with record_function(label) if label else contextlib.nullcontext():
            self._jobs.put((job, future))
        return future

    def close(self) -> None:
        """Stop the worker thread once the queued all-reduces are done (the buffers stay valid)."""
        self._stop()  # queues the end once, here or when this object is collected
        self._worker.join(timeout=5.0)


def _serve(jobs: queue.SimpleQueue, group: dist.ProcessGroup, rank: int, world_size: int) -> None:
    """The worker thread: runs the queued jobs (sums, allocations) in call order until ``None`` arrives.
    Only this thread uses ``group``: its barriers can never interleave differently on two ranks."""
    while (item := jobs.get()) is not None:
        job, future = item
        try:
            with record_function(WORKER_LABEL):
                result = job(group, rank, world_size)
        except Exception as error:  # handed to the waiting thread
            future.set_exception(error)
        else:
            future.set_result(result)


def _allocate(
    path: str, sizes: Sequence[tuple[int, torch.dtype]], group: dist.ProcessGroup, rank: int, world_size: int
) -> list[list[torch.Tensor]]:
    offsets, total = [], 0
    for numel, dtype in sizes:
        offsets.append(total)
        total += -(-numel * dtype.itemsize // _ALIGN) * _ALIGN
    fd = os.open(path % rank, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:  # reserve the pages now: a full /dev/shm fails here, not with SIGBUS mid-backward
        os.posix_fallocate(fd, 0, max(total, 1))
    finally:
        os.close(fd)
    try:
        dist.barrier(group=group)  # every rank's file exists
        arenas = [_map(path % k, max(total, 1)) for k in range(world_size)]
        dist.barrier(group=group)  # every rank mapped every file: the names can go
    finally:  # also when a peer failed: nothing stays in /dev/shm
        os.unlink(path % rank)
    return [
        [arena[offset : offset + numel * dtype.itemsize].view(dtype) for arena in arenas]
        for offset, (numel, dtype) in zip(offsets, sizes, strict=True)
    ]


def _sum_in_place(
    buffers: Sequence[torch.Tensor], barrier: Callable[[], Any], group: dist.ProcessGroup, rank: int, world_size: int
) -> None:
    numel = buffers[rank].numel()
    bounds = [k * numel // world_size for k in range(world_size + 1)]
    chunks = [[buffer[bounds[k] : bounds[k + 1]] for buffer in buffers] for k in range(world_size)]
    barrier()  # every rank's contribution is in place
    own = chunks[rank][rank]
    for k in range(world_size):  # the same order on every run: bitwise repeatable
        if k != rank:
            own.add_(chunks[rank][k])
    barrier()  # every chunk is summed, each in its owner's buffer
    for k in range(world_size):
        if k != rank:
            chunks[k][rank].copy_(chunks[k][k])
    barrier()  # nobody reads this rank's buffer any more
