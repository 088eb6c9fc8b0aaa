"""The job's default process group: its start bounded apart from its collectives, one store prefix per attempt.

Two bounds. torch's ``init_process_group`` bounds its rendezvous (every rank joining) and every later
collective with one ``timeout``. Ranks start seconds to minutes apart (each imports torch and Lightning,
a scheduler starts nodes one by one), so a collective timeout short enough to end a hung job soon
fails a healthy one at its start (``Timed out after 11 seconds waiting for clients. 1/2 clients
joined``). :func:`rendezvous_store` waits for every rank on the job's store up to ``startup_timeout``;
the process group is then created on that store with the collective ``timeout`` alone. A group made
first and shortened after (``dist.set_timeout``) would not do: torch's desync check (``desync_check``)
wraps it with a helper group that keeps the timeout it was created with.

One prefix per ``torchrun`` attempt. Under ``torchrun`` (torch 2.14) the elastic agent shares its TCP store
with the workers (``TORCHELASTIC_USE_AGENT_STORE=True``) and keeps the same store server across restarts,
but ``init_process_group``'s ``env://`` rendezvous puts no per-attempt prefix on its keys (its comment
assumes a new store per retry). After ``--max-restarts`` restarts the workers, gloo reads the dead
attempt's addresses and fails (``Gloo connectFullMesh failed ... Connection refused``): the restart never
trains. Keys go under the prefix torch itself used before (``/worker/attempt_<TORCHELASTIC_RESTART_COUNT>``);
elsewhere under ``default_pg``, as ``env://`` puts them.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch.distributed as dist
from torch.distributed.constants import default_pg_nccl_timeout, default_pg_timeout

__all__ = ["collective_bound", "rendezvous_store", "startup_bound", "uses_shared_agent_store"]

_JOINED, _ALL_JOINED = "custom_ddp/ranks_joined", "custom_ddp/all_ranks_joined"
_FIX = "start every rank, or give the slowest start more time with a longer startup_timeout"


def uses_shared_agent_store() -> bool:
    """Whether this worker was started by torchrun's agent with the agent's store to share."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and "TORCHELASTIC_RESTART_COUNT" in os.environ


def collective_bound(timeout: timedelta | None, backend: str) -> timedelta:
    """``timeout``, or torch's default for ``backend`` where it is ``None`` (NCCL 10 min, others 30 min)."""
    if timeout is not None:
        return timeout
    return default_pg_nccl_timeout if backend == "nccl" and default_pg_nccl_timeout is not None else default_pg_timeout


def startup_bound(startup_timeout: timedelta | None, timeout: timedelta | None, backend: str) -> timedelta:
    """``startup_timeout``; ``None``: the longer of the collective bound and torch's default 30 minutes."""
    return startup_timeout or max(collective_bound(timeout, backend), default_pg_timeout)


def rendezvous_store(
    address: str, port: int, rank: int, world_size: int, startup_timeout: timedelta, timeout: timedelta
) -> dist.Store:
    """The store to create the default process group on, returned once all ``world_size`` ranks joined it.

    Rank 0 hosts the store at ``address:port`` (the agent does under ``torchrun``). Each rank waits up
    to ``startup_timeout`` for the host, then for the other ranks; the store's operations are bounded
    by ``timeout`` after. Raises ``RuntimeError`` naming the address and the option when the wait ends.
    """
    agent = uses_shared_agent_store()
    try:
        server = dist.TCPStore(
            address, port, world_size, is_master=rank == 0 and not agent, timeout=startup_timeout,
            wait_for_workers=False, multi_tenant=True,
        )  # fmt: skip
    except (RuntimeError, OSError) as error:  # DistNetworkError, DistStoreError, TimeoutError
        host = "torchrun's agent" if agent else "rank 0"
        raise RuntimeError(
            f"custom_ddp: rank {rank} could not reach the job's store at {address}:{port} ({host} hosts it) "
            f"within startup_timeout={startup_timeout.total_seconds():g} s: {_FIX} ({error})"
        ) from error
    prefix = f"/worker/attempt_{os.environ['TORCHELASTIC_RESTART_COUNT']}" if agent else "default_pg"
    store = dist.PrefixStore(prefix, server)
    _wait_for_every_rank(store, rank, world_size, startup_timeout, f"{address}:{port}")
    store.set_timeout(timeout)
    return store


def _wait_for_every_rank(store: dist.Store, rank: int, world_size: int, wait: timedelta, where: str) -> None:
    if store.add(_JOINED, 1) == world_size:  # the last rank to join opens the way for all
        store.set(_ALL_JOINED, "1")
    try:
        store.wait([_ALL_JOINED], wait)
    except (RuntimeError, OSError) as error:
        joined = _joined_count(store)
        raise RuntimeError(
            f"custom_ddp: {joined} of {world_size} ranks joined the job's store at {where} within "
            f"startup_timeout={wait.total_seconds():g} s (rank {rank} waited): {_FIX} ({error})"
        ) from error


def _joined_count(store: dist.Store) -> str:
    try:
        return str(store.add(_JOINED, 0))
    except (RuntimeError, OSError):  # the host is gone too
        return "not all"
