"""The gradient-sync vocabulary, in one place: modes, default bucket caps, and how a mode becomes a layout.

Every other module (the engine, the bucket builder, ZeRO-1, the Lightning strategy, configs and
benchmarks) takes these names from here instead of spelling them again. Pure torch; no Lightning.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, get_args

import torch

__all__ = [
    "DEFAULT_BUCKET_CAP_MB",
    "DEFAULT_FIRST_BUCKET_CAP_MB",
    "GRAD_COMPRESSIONS",
    "GRAD_TRANSPORTS",
    "MODES_LAUNCHED_FROM_HOOKS",
    "SYNC_MODES",
    "WIRE_DTYPES",
    "GradCompression",
    "GradSyncConfig",
    "GradTransport",
    "SyncMode",
    "first_bucket_cap_for",
    "sync_option_problems",
]

SyncMode = Literal["bucketed", "flat", "per_param", "per_param_overlap"]
"""How gradients are all-reduced: see :mod:`parallel.gradients.grad_sync`."""

SYNC_MODES: tuple[str, ...] = get_args(SyncMode)

GradCompression = Literal["bf16", "fp16"]
"""Dtype fp32/fp64 gradient buckets travel in (``None``: their own), as torch DDP's
``bf16_compress_hook`` / ``fp16_compress_hook``: half the bytes on the wire. bf16 keeps fp32's
range with 8 significant bits (~2.4 digits); fp16 keeps 11 (~3.3 digits) within +-65504 (no loss
scaling: a pre-divided gradient beyond that becomes inf) and flushes magnitudes below ~6e-8 to 0."""

GRAD_COMPRESSIONS: tuple[str, ...] = get_args(GradCompression)

GradTransport = Literal["auto", "process_group", "shared_memory"]
"""How gradient buckets are summed: ``process_group`` (``dist.all_reduce``), ``shared_memory``
(:mod:`parallel.host.host_reduce`: CPU ranks of the default gloo group on one host, buffers every rank
maps), ``auto`` (shared memory where it applies, else the process group)."""

GRAD_TRANSPORTS: tuple[str, ...] = get_args(GradTransport)
WIRE_DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16}

# Modes whose all-reduces start from gradient hooks during backward (the others start in finish()).
MODES_LAUNCHED_FROM_HOOKS: tuple[str, ...] = ("bucketed", "per_param_overlap")

# torch DDP's defaults: 25 MiB buckets, and a small first bucket so the first all-reduce starts
# early in backward. ZeRO-1 shares updated parameters in chunks of the same size.
DEFAULT_BUCKET_CAP_MB = 25.0
DEFAULT_FIRST_BUCKET_CAP_MB = 1.0
# Backends whose reductions run on the CPU cores that also run backward (gloo's threads): starting
# the first all-reduce early hides nothing there, and a small first bucket is one more collective
# to pay for. With first_bucket_cap_mb=None they get a first bucket as large as the others. The
# measured effect is small and mixed (benchmarks/results/grad_sync, bucketed_25mb vs bucketed_25mb_first1mb).
_CPU_REDUCTION_BACKENDS = ("gloo",)


def first_bucket_cap_for(backend: str, bucket_cap_mb: float) -> float:
    """The first bucket's cap when none is given: ``bucket_cap_mb`` where the reduction competes with
    backward for CPU cores (gloo), torch DDP's small :data:`DEFAULT_FIRST_BUCKET_CAP_MB` elsewhere (NCCL)."""
    return bucket_cap_mb if backend in _CPU_REDUCTION_BACKENDS else DEFAULT_FIRST_BUCKET_CAP_MB


def sync_option_problems(
    mode: object,
    bucket_cap_mb: object,
    first_bucket_cap_mb: object,
    grad_compression: object,
    grad_transport: object = "auto",
    *,
    mode_name: str = "mode",
) -> list[str]:
    """Every bad gradient-sync option with its fix, one string each (``mode_name``: what the caller's
    users call the mode, e.g. the strategy's ``sync_mode``)."""
    problems = []
    if mode not in SYNC_MODES:
        problems.append(f"{mode_name}={mode!r} must be one of {SYNC_MODES}")
    for name, cap, default in (
        ("bucket_cap_mb", bucket_cap_mb, DEFAULT_BUCKET_CAP_MB),
        ("first_bucket_cap_mb", first_bucket_cap_mb, None),
    ):
        if cap is None and default is None:
            continue  # no default: chosen by backend (first_bucket_cap_for)
        if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not cap > 0:
            problems.append(
                f"{name}={cap!r} must be a number > 0 (MiB; default {default}"
                f"{' (by backend)' if default is None else ''}; {mode_name}='per_param' puts each "
                "parameter alone)"
            )
    if grad_compression is not None and grad_compression not in GRAD_COMPRESSIONS:
        problems.append(f"grad_compression={grad_compression!r} must be None or one of {GRAD_COMPRESSIONS}")
    if grad_transport not in GRAD_TRANSPORTS:
        problems.append(f"grad_transport={grad_transport!r} must be one of {GRAD_TRANSPORTS} (default 'auto')")
    elif grad_transport == "shared_memory" and grad_compression is not None:
        problems.append(
            f"grad_transport='shared_memory' sums the buckets themselves, so grad_compression="
            f"{grad_compression!r} cannot apply: use grad_transport='process_group' to compress"
        )
    return problems


@dataclass(frozen=True)
class GradSyncConfig:
    """How gradients are all-reduced, validated once at construction (one error naming every bad value).

    ``SyncedDataParallel`` builds one from its arguments; the Lightning strategy's options hold one.
    """

    mode: SyncMode = "bucketed"
    bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB
    first_bucket_cap_mb: float | None = None  # None: by backend (first_bucket_cap_for)
    grad_compression: GradCompression | None = None
    grad_transport: GradTransport = "auto"

    def __post_init__(self) -> None:
        problems = sync_option_problems(
            self.mode, self.bucket_cap_mb, self.first_bucket_cap_mb, self.grad_compression, self.grad_transport
        )
        if problems:
            raise ValueError("; ".join(problems))
        object.__setattr__(self, "bucket_cap_mb", float(self.bucket_cap_mb))
        if self.first_bucket_cap_mb is not None:
            object.__setattr__(self, "first_bucket_cap_mb", float(self.first_bucket_cap_mb))

    def caps(self, backend: str = "gloo") -> tuple[float, float]:
        """The ``(cap_mb, first_cap_mb)`` that turn the mode into a bucket layout on ``backend``: ``0``
        puts each parameter in a bucket of its own, ``math.inf`` makes one bucket per (device, dtype);
        ``bucketed`` keeps the caps it is given (the first one by backend when it is ``None``)."""
        if self.mode in ("per_param", "per_param_overlap"):
            return 0.0, 0.0
        if self.mode == "flat":
            return math.inf, math.inf
        first = self.first_bucket_cap_mb
        return self.bucket_cap_mb, first_bucket_cap_for(backend, self.bucket_cap_mb) if first is None else first

    @property
    def launched_from_hooks(self) -> bool:
        """Whether bucket all-reduces start from gradient hooks during backward (else in ``finish``)."""
        return self.mode in MODES_LAUNCHED_FROM_HOOKS
