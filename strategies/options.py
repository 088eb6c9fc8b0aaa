"""Validation of ``CustomDDPStrategy``'s options: one error listing every bad value and its fix."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch

from parallel.sync_config import DEFAULT_BUCKET_CAP_MB, SYNC_MODES

__all__ = ["as_timedelta", "check_options", "is_mean_op"]


def check_options(sync_batchnorm: Any, sync_mode: Any, bucket_cap_mb: Any, zero1: Any, scatter_eval: Any) -> None:
    """Raise one error that lists every bad option with its fix."""
    problems = [
        f"{name}={value!r} must be a bool"
        for name, value in (("sync_batchnorm", sync_batchnorm), ("zero1", zero1), ("scatter_eval", scatter_eval))
        if not isinstance(value, bool)
    ]
    if sync_mode not in SYNC_MODES:
        problems.append(f"sync_mode={sync_mode!r} must be one of {SYNC_MODES}")
    if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)) or not bucket_cap_mb > 0:
        problems.append(f"bucket_cap_mb={bucket_cap_mb!r} must be a number > 0 (MiB; default {DEFAULT_BUCKET_CAP_MB})")
    if problems:
        raise ValueError("CustomDDPStrategy: " + "; ".join(problems))


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
