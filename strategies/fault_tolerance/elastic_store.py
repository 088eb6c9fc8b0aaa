"""One process group per ``torchrun`` attempt: restarted workers must not read the failed attempt's keys.

Under ``torchrun`` (torch 2.14) the elastic agent shares its TCP store with the workers
(``TORCHELASTIC_USE_AGENT_STORE=True``) and keeps the same store server across restarts, but
``init_process_group``'s ``env://`` rendezvous puts no per-attempt prefix on its keys (its comment
assumes a new store per retry). After ``--max-restarts`` restarts the workers, gloo reads the dead
attempt's addresses and fails (``Gloo connectFullMesh failed ... Connection refused``): the
restart never trains. :func:`init_attempt_process_group` creates the process group on the same
store under the prefix torch itself used before (``/worker/attempt_<TORCHELASTIC_RESTART_COUNT>``);
Lightning's own initialisation then finds it initialised and keeps it.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch.distributed as dist

__all__ = ["init_attempt_process_group", "uses_shared_agent_store"]


def uses_shared_agent_store() -> bool:
    """Whether this worker was started by torchrun's agent with the agent's store to share."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and "TORCHELASTIC_RESTART_COUNT" in os.environ


def init_attempt_process_group(backend: str, rank: int, world_size: int, timeout: timedelta | None) -> None:
    """``init_process_group`` on the agent's store, keys under this attempt's prefix."""
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    store = dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout or timedelta(minutes=30))
    attempt = dist.PrefixStore(f"/worker/attempt_{os.environ['TORCHELASTIC_RESTART_COUNT']}", store)
    kwargs = {} if timeout is None else {"timeout": timeout}
    dist.init_process_group(backend, store=attempt, rank=rank, world_size=world_size, **kwargs)
