"""The gradient-sync vocabulary, in one place: modes, default bucket caps, and how a mode becomes a layout.

Every other module (the engine, the bucket builder, ZeRO-1, the Lightning strategy, configs and
benchmarks) takes these names from here instead of spelling them again. Pure torch; no Lightning.
"""

from __future__ import annotations

import math
from typing import Literal, get_args

import torch

__all__ = [
    "DEFAULT_BUCKET_CAP_MB",
    "DEFAULT_FIRST_BUCKET_CAP_MB",
    "GRAD_COMPRESSIONS",
    "MODES_LAUNCHED_FROM_HOOKS",
    "SYNC_MODES",
    "WIRE_DTYPES",
    "GradCompression",
    "SyncMode",
    "caps_for_mode",
    "check_sync_options",
]

SyncMode = Literal["bucketed", "flat", "per_param", "per_param_overlap"]
"""How gradients are all-reduced: see :mod:`parallel.grad_sync`."""

SYNC_MODES: tuple[str, ...] = get_args(SyncMode)

GradCompression = Literal["bf16", "fp16"]
"""Dtype fp32/fp64 gradient buckets travel in (``None``: their own), as torch DDP's
``bf16_compress_hook`` / ``fp16_compress_hook``: half the bytes on the wire. bf16 keeps fp32's
range with 8 significant bits (~2.4 digits); fp16 keeps 11 (~3.3 digits) within +-65504 (no loss
scaling: a pre-divided gradient beyond that becomes inf) and flushes magnitudes below ~6e-8 to 0."""

GRAD_COMPRESSIONS: tuple[str, ...] = get_args(GradCompression)
WIRE_DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16}

# Modes whose all-reduces start from gradient hooks during backward (the others start in finish()).
MODES_LAUNCHED_FROM_HOOKS: tuple[str, ...] = ("bucketed", "per_param_overlap")

# torch DDP's defaults: 25 MiB buckets, and a small first bucket so the first all-reduce starts
# early in backward. ZeRO-1 shares updated parameters in chunks of the same size.
DEFAULT_BUCKET_CAP_MB = 25.0
DEFAULT_FIRST_BUCKET_CAP_MB = 1.0


def caps_for_mode(mode: str, bucket_cap_mb: float, first_bucket_cap_mb: float) -> tuple[float, float]:
    """The ``(cap_mb, first_cap_mb)`` that turn a sync mode into a bucket layout.

    ``0`` puts each parameter in a bucket of its own, ``math.inf`` makes one bucket per
    (device, dtype); ``bucketed`` keeps the caps it is given.
    """
    if mode not in SYNC_MODES:
        raise ValueError(f"mode={mode!r} is not supported; choose one of {SYNC_MODES}")
    if mode in ("per_param", "per_param_overlap"):
        return 0.0, 0.0
    if mode == "flat":
        return math.inf, math.inf
    return bucket_cap_mb, first_bucket_cap_mb


def check_sync_options(
    mode: str, bucket_cap_mb: float, first_bucket_cap_mb: float, grad_compression: str | None
) -> None:
    """Raise ``ValueError`` naming the first bad gradient-sync option and its choices."""
    if mode not in SYNC_MODES:
        raise ValueError(f"mode={mode!r} is not supported; choose one of {SYNC_MODES}")
    caps = {"bucket_cap_mb": bucket_cap_mb, "first_bucket_cap_mb": first_bucket_cap_mb}
    for name, cap in caps.items():
        if not cap > 0:
            raise ValueError(
                f"{name}={cap} must be > 0 MiB (mode='per_param' puts each parameter alone)"
            )
    compressions = (None, *GRAD_COMPRESSIONS)
    if grad_compression not in compressions:
        raise ValueError(f"grad_compression={grad_compression!r} is not one of {compressions}")
