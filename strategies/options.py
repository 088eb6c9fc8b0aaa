"""``CustomDDPStrategy``'s options as one frozen, validated object, and the checks that need more context."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from datetime import timedelta
from typing import Any, Literal

import torch

from parallel.sync_config import (
    DEFAULT_BUCKET_CAP_MB,
    GradCompression,
    GradSyncConfig,
    GradTransport,
    SyncMode,
    sync_option_problems,
)

__all__ = [
    "DDP_FLAGS",
    "DEFAULT_STALL_TIMEOUT_S",
    "UNEVEN_DATA",
    "CustomDDPOptions",
    "UnevenData",
    "as_timedelta",
    "check_init_args",
    "ddp_flags_given",
    "check_syncbn_group_size",
    "is_mean_op",
]


# Longer than any healthy silence of a main thread outside a collective and outside a declared slow
# phase: one training or evaluation batch, an epoch-end hook, the first fetch of a DataLoader with
# many workers. Those take seconds to a minute; 5 minutes leaves a wide margin and still ends a
# stalled job 6 times sooner than torch's default 30-minute collective timeout.
DEFAULT_STALL_TIMEOUT_S = 300.0

UnevenData = Literal["join", "refuse"]
UNEVEN_DATA: tuple[str, ...] = ("join", "refuse")

# torch DDP's flags that Lightning's DDPStrategy passes on, by what custom_ddp does in their place. A ddp
# configuration that sets them runs unchanged under custom_ddp, where they have no effect: it does what each
# asks for either way (docs/strategy.md#coming-from-ddp).
DDP_FLAGS: dict[str, str] = {
    "find_unused_parameters": "a parameter with no gradient on a rank is synchronised anyway, as zeros flagged unused",
    "static_graph": "the bucket layout is rebuilt only when the parameters' requires_grad flags change",
    "gradient_as_bucket_view": "gradients always live as views into the buckets",
}

_BOOLS = (
    "sync_batchnorm",
    "syncbn_compile",
    "zero1",
    "scatter_eval",
    "desync_check",
    "broadcast_buffers",
    "exact_resume",
)


@dataclass(frozen=True)
class CustomDDPOptions:
    """``CustomDDPStrategy``'s own options, validated once at construction: one ``ValueError`` lists
    every bad value with its fix. Adding an option: a field here (+ its check), and in
    ``strategies/custom_ddp.py`` a parameter of the strategy (one docstring line) and its use.
    The fields' meanings are in the strategy's docstring and docs/strategy.md#options."""

    sync_batchnorm: bool = True
    syncbn_group_size: int | None = None
    syncbn_compile: bool = False
    sync_mode: SyncMode = "bucketed"
    bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB
    first_bucket_cap_mb: float | None = None  # by backend: parallel.sync_config.first_bucket_cap_for
    grad_compression: GradCompression | None = None
    grad_transport: GradTransport = "auto"
    zero1: bool = False
    scatter_eval: bool = True
    desync_check: bool = False
    broadcast_buffers: bool = True
    stall_timeout: float | None = DEFAULT_STALL_TIMEOUT_S
    exact_resume: bool = True
    uneven_data: UnevenData = "join"

    def __post_init__(self) -> None:
        problems = [
            f"{name}={getattr(self, name)!r} must be a bool"
            for name in _BOOLS
            if not isinstance(getattr(self, name), bool)
        ]
        problems += sync_option_problems(
            self.sync_mode,
            self.bucket_cap_mb,
            self.first_bucket_cap_mb,
            self.grad_compression,
            self.grad_transport,
            mode_name="sync_mode",
        )
        problems += _syncbn_problems(self.syncbn_group_size, self.syncbn_compile, self.sync_batchnorm)
        if self.desync_check is True and self.grad_transport == "shared_memory":
            problems.append(
                "desync_check=True checks the process group's collectives, and grad_transport="
                "'shared_memory' sums the gradient buckets outside them, where a desync goes unseen: "
                "use grad_transport='auto' (the process group while desync_check is on) or 'process_group'"
            )
        if self.uneven_data not in UNEVEN_DATA:
            problems.append(
                f"uneven_data={self.uneven_data!r} must be 'join' (a rank whose training data ends first runs "
                "empty batches until every rank's has) or 'refuse' (an error naming each rank's batch count)"
            )
        if not _is_stall_timeout(self.stall_timeout):
            problems.append(
                f"stall_timeout={self.stall_timeout!r} must be a number of seconds > 0 (default "
                f"{DEFAULT_STALL_TIMEOUT_S:g}) or None to never end a job on a stall"
            )
        if problems:
            raise ValueError("CustomDDPStrategy: " + "; ".join(problems))
        object.__setattr__(self, "bucket_cap_mb", float(self.bucket_cap_mb))
        if self.first_bucket_cap_mb is not None:
            object.__setattr__(self, "first_bucket_cap_mb", float(self.first_bucket_cap_mb))

    @property
    def grad_sync(self) -> GradSyncConfig:
        """The core's gradient-sync config (:class:`parallel.gradients.grad_sync.SyncedDataParallel`'s arguments).
        Under ``desync_check`` ``"auto"`` is the process group: torch's fingerprint check sees its
        collectives only, and buckets summed in shared memory would pair across steps unchecked."""
        transport = "process_group" if self.desync_check and self.grad_transport == "auto" else self.grad_transport
        return GradSyncConfig(
            self.sync_mode, self.bucket_cap_mb, self.first_bucket_cap_mb, self.grad_compression, transport
        )

    @classmethod
    def pick(cls, arguments: Mapping[str, Any]) -> CustomDDPOptions:
        """The options among ``arguments`` (the strategy's ``locals()``, a parsed config); others are ignored."""
        return cls(**{f.name: arguments[f.name] for f in fields(cls) if f.name in arguments})

    def as_dict(self) -> dict[str, Any]:
        """Every option by name, for logs, hyperparameters and benchmark records."""
        return asdict(self)


def ddp_flags_given(arguments: Mapping[str, Any]) -> dict[str, bool]:
    """The :data:`DDP_FLAGS` among ``arguments`` that are set (not ``None``); one that is not a bool is an error."""
    given = {name: arguments[name] for name in DDP_FLAGS if arguments.get(name) is not None}
    problems = [
        f"{name}={value!r} must be a bool or None (torch DDP's flag, accepted from a ddp configuration with no "
        f"effect: {DDP_FLAGS[name]})"
        for name, value in given.items()
        if not isinstance(value, bool)
    ]
    if problems:
        raise ValueError("CustomDDPStrategy: " + "; ".join(problems))
    return given


def check_init_args(init_args: Mapping[str, Any]) -> None:
    """The strategy constructor's option checks on its arguments, without building it (``train.py``
    runs them on the parsed config, where jsonargparse would bury the error in a report of a Union)."""
    CustomDDPOptions.pick(init_args)
    ddp_flags_given(init_args)
    for name in ("timeout", "startup_timeout"):
        if name in init_args:
            as_timedelta(init_args[name], name)


def _is_stall_timeout(value: Any) -> bool:
    return value is None or (
        not isinstance(value, bool) and isinstance(value, (int, float)) and value > 0 and math.isfinite(value)
    )


def _syncbn_problems(syncbn_group_size: Any, syncbn_compile: Any, sync_batchnorm: Any) -> list[str]:
    """What is wrong with the SyncBN options before the world size is known (see :func:`check_syncbn_group_size`)."""
    problems = []
    if syncbn_compile is True and sync_batchnorm is False:
        problems.append(
            "syncbn_compile=True needs sync_batchnorm=True (it compiles the SyncBatchNorm kernel); drop it "
            "or set sync_batchnorm=True"
        )
    if syncbn_group_size is None:
        return problems
    if isinstance(syncbn_group_size, bool) or not isinstance(syncbn_group_size, int) or syncbn_group_size < 1:
        return problems + [
            f"syncbn_group_size={syncbn_group_size!r} must be None (all ranks) or an int >= 1 that "
            "divides the world size, e.g. 2"
        ]
    if sync_batchnorm is False:
        problems.append(
            f"syncbn_group_size={syncbn_group_size} needs sync_batchnorm=True (it groups the SyncBatchNorm "
            "statistics); drop it or set sync_batchnorm=True"
        )
    return problems


def check_syncbn_group_size(syncbn_group_size: int, world_size: int) -> None:
    """At setup, once the world size is known: ``syncbn_group_size`` must divide it (same error on every rank)."""
    if world_size % syncbn_group_size:
        divisors = [k for k in range(1, world_size + 1) if world_size % k == 0]
        raise ValueError(
            f"CustomDDPStrategy: syncbn_group_size={syncbn_group_size} must divide the world size "
            f"{world_size} (SyncBatchNorm groups of consecutive ranks); use one of {divisors}"
        )


# What each timeout bounds, for its error message.
_WAITS_FOR = {
    "timeout": "a collective waits that long for a dead peer",
    "startup_timeout": "the start waits that long for every rank",
}


def as_timedelta(value: float | timedelta | None, name: str = "timeout") -> timedelta | None:
    """The option ``name`` as a ``timedelta``: a number counts seconds (YAML and flags need no ``h:m:s``)."""
    if value is None:
        return None  # the option's default: torch's process-group timeout, or see startup_bound
    if isinstance(value, bool) or not isinstance(value, (timedelta, int, float)):
        raise TypeError(
            f"CustomDDPStrategy: {name}={value!r} must be a number of seconds or a timedelta, "
            f"e.g. {name}=1800 or {name}=timedelta(minutes=30)."
        )
    seconds = value.total_seconds() if isinstance(value, timedelta) else float(value)
    if not (seconds > 0 and math.isfinite(seconds)):  # also rejects NaN
        raise ValueError(
            f"CustomDDPStrategy: {name}={value!r} must be > 0 seconds and finite ({_WAITS_FOR[name]}), "
            f"e.g. {name}=1800."
        )
    return value if isinstance(value, timedelta) else timedelta(seconds=seconds)


def is_mean_op(reduce_op: Any) -> bool:
    """Whether a Lightning/torch reduce op (``"mean"``, ``"avg"``, ``ReduceOp.AVG``) averages."""
    if isinstance(reduce_op, str):
        return reduce_op.lower() in ("mean", "avg")
    return reduce_op == torch.distributed.ReduceOp.AVG
