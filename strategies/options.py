"""Validation of ``CustomDDPStrategy``'s options: one error listing every bad value and its fix."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch

from parallel.sync_config import DEFAULT_BUCKET_CAP_MB, DEFAULT_FIRST_BUCKET_CAP_MB, GRAD_COMPRESSIONS, SYNC_MODES

__all__ = ["as_timedelta", "check_options", "check_syncbn_group_size", "is_mean_op"]


def check_options(
    sync_batchnorm: Any, sync_mode: Any, bucket_cap_mb: Any, zero1: Any, scatter_eval: Any, *,
    first_bucket_cap_mb: Any = DEFAULT_FIRST_BUCKET_CAP_MB, grad_compression: Any = None, syncbn_group_size: Any = None,
    broadcast_buffers: Any = True,
    syncbn_compile: Any = False,
) -> None:
    """Raise one error that lists every bad option with its fix."""
    problems = [
        f"{name}={value!r} must be a bool"
        for name, value in (("sync_batchnorm", sync_batchnorm), ("zero1", zero1), ("scatter_eval", scatter_eval),
                            ("broadcast_buffers", broadcast_buffers), ("syncbn_compile", syncbn_compile))
        if not isinstance(value, bool)
    ]
    if syncbn_compile is True and sync_batchnorm is False:
        problems.append("syncbn_compile=True needs sync_batchnorm=True (it compiles the SyncBatchNorm kernel); drop it "
                        "or set sync_batchnorm=True")
    if sync_mode not in SYNC_MODES:
        problems.append(f"sync_mode={sync_mode!r} must be one of {SYNC_MODES}")
    for name, cap, default in (("bucket_cap_mb", bucket_cap_mb, DEFAULT_BUCKET_CAP_MB),
                               ("first_bucket_cap_mb", first_bucket_cap_mb, DEFAULT_FIRST_BUCKET_CAP_MB)):
        if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not cap > 0:
            problems.append(f"{name}={cap!r} must be a number > 0 (MiB; default {default})")
    if grad_compression is not None and grad_compression not in GRAD_COMPRESSIONS:
        problems.append(f"grad_compression={grad_compression!r} must be None or one of {GRAD_COMPRESSIONS}")
    problems += _syncbn_group_problems(syncbn_group_size, sync_batchnorm)
    if problems:
        raise ValueError("CustomDDPStrategy: " + "; ".join(problems))


def _syncbn_group_problems(syncbn_group_size: Any, sync_batchnorm: Any) -> list[str]:
    """What is wrong with ``syncbn_group_size`` before the world size is known (see :func:`check_syncbn_group_size`)."""
    if syncbn_group_size is None:
        return []
    if isinstance(syncbn_group_size, bool) or not isinstance(syncbn_group_size, int) or syncbn_group_size < 1:
        return [f"syncbn_group_size={syncbn_group_size!r} must be None (all ranks) or an int >= 1 that divides the "
                "world size, e.g. 2"]
    if sync_batchnorm is False:
        return [f"syncbn_group_size={syncbn_group_size} needs sync_batchnorm=True (it groups the SyncBatchNorm "
                "statistics); drop it or set sync_batchnorm=True"]
    return []


def check_syncbn_group_size(syncbn_group_size: int, world_size: int) -> None:
    """At setup, once the world size is known: ``syncbn_group_size`` must divide it (same error on every rank)."""
    if world_size % syncbn_group_size:
        divisors = [k for k in range(1, world_size + 1) if world_size % k == 0]
        raise ValueError(f"CustomDDPStrategy: syncbn_group_size={syncbn_group_size} must divide the world size "
                         f"{world_size} (SyncBatchNorm groups of consecutive ranks); use one of {divisors}")


def as_timedelta(timeout: float | timedelta | None) -> timedelta | None:
    """``timeout`` as a ``timedelta``: a number counts seconds (YAML and flags need no ``h:m:s``)."""
    if timeout is None:
        return None  # torch's default process-group timeout
    if isinstance(timeout, bool) or not isinstance(timeout, (timedelta, int, float)):
        raise TypeError(f"CustomDDPStrategy: timeout={timeout!r} must be a number of seconds or a timedelta, "
                        "e.g. timeout=1800 or timeout=timedelta(minutes=30).")
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
    if not seconds > 0:  # also rejects NaN
        raise ValueError(f"CustomDDPStrategy: timeout={timeout!r} must be > 0 seconds (a collective waits that long "
                         "for a dead peer), e.g. timeout=1800.")
    return timeout if isinstance(timeout, timedelta) else timedelta(seconds=seconds)


def is_mean_op(reduce_op: Any) -> bool:
    """Whether a Lightning/torch reduce op (``"mean"``, ``"avg"``, ``ReduceOp.AVG``) averages."""
    if isinstance(reduce_op, str):
        return reduce_op.lower() in ("mean", "avg")
    return reduce_op == torch.distributed.ReduceOp.AVG
