"""A popen child of ``custom_ddp`` exits after local rank 0, so a coordinated stop keeps rank 0's exit status.

Under Lightning's popen launcher (``_SubprocessScriptLauncher``: ``python train.py`` with ``devices=N``) local
rank 0 is the process the user or the scheduler started, and it starts the other local ranks. A stop exits every
rank with ``128 + signum``; the child ranks wait here, at interpreter exit and bounded, until rank 0 is gone.
"""

from __future__ import annotations

import atexit
import os
import time
from typing import TYPE_CHECKING

from lightning.fabric.plugins.environments import ClusterEnvironment, LightningEnvironment

if TYPE_CHECKING:  # a type only; the launcher comes from the strategy
    from lightning.pytorch.strategies.launchers.launcher import _Launcher

__all__ = ["exit_after_parent", "is_popen_child"]

# How long a popen child waits at exit for local rank 0 to exit first: after a coordinated stop
# rank 0 exits within seconds; outside fit only this rank may have stopped, so wait little.
_PARENT_EXIT_WAIT_S = {True: 30.0, False: 3.0}


def is_popen_child(launcher: _Launcher | None, environment: ClusterEnvironment | None, local_rank: int) -> bool:
    """Whether this rank was started by Lightning's popen launcher from local rank 0 of its node."""
    # Private class: listed in strategies.lightning_seams, checked at setup.
    from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher

    return (
        isinstance(launcher, _SubprocessScriptLauncher) and type(environment) is LightningEnvironment and local_rank > 0
    )


def _wait_until_reparented(parent: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while os.getppid() == parent and time.monotonic() < deadline:
        time.sleep(0.02)


def exit_after_parent(popen_child: bool, fitting: bool) -> None:
    """In a popen child, let local rank 0 exit first (at interpreter exit, bounded).

    Local rank 0 of Lightning's popen launcher runs a watcher thread that, every 5 s, SIGKILLs all
    processes once a child exited with a non-zero status. A child exiting with 143 right after a
    coordinated stop could get rank 0 killed while it still finalises its loggers, and rank 0's
    status (the one a scheduler reads) would become 137.
    """
    if popen_child:
        atexit.register(_wait_until_reparented, os.getppid(), _PARENT_EXIT_WAIT_S[fitting])
