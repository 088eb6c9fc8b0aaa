"""What a benchmark number was measured on: hardware, software versions, run configuration.

Shared by the benchmark callback (written next to the numbers of every run) and by the
comparison report's header, so both describe a machine the same way.
"""

from __future__ import annotations

import math
import os
import platform
from importlib import metadata
from typing import Any

import torch

__all__ = ["environment", "strategy_options", "to_jsonable"]

_PACKAGES = ("torch", "lightning", "torchvision", "torchmetrics", "numpy")


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def environment() -> dict[str, Any]:
    """Hardware and software of this machine (no collectives; cheap)."""
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return {
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "gpus": gpus,
        "cuda": torch.version.cuda if gpus else None,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "versions": {name: _version(name) for name in _PACKAGES},
    }


def strategy_options(strategy: Any) -> dict[str, Any]:
    """The settings that decide how a (DDP-like) strategy communicates, for the record.

    Lightning keeps the keyword arguments meant for ``DistributedDataParallel`` (bucket size,
    ``gradient_as_bucket_view``, ``broadcast_buffers``) in ``_ddp_kwargs`` (unset ones take
    torch's defaults) and a ``sync_batchnorm=True`` Trainer flag as its ``_layer_sync`` plugin.
    """
    layer_sync = getattr(strategy, "_layer_sync", None)
    options: dict[str, Any] = {
        "class": f"{type(strategy).__module__}.{type(strategy).__qualname__}",
        "process_group_backend": getattr(strategy, "process_group_backend", None),
        "start_method": getattr(strategy, "_start_method", None),
        "layer_sync": type(layer_sync).__name__ if layer_sync is not None else None,
    }
    # A strategy that reports its own settings (custom_ddp's ``options``) is recorded as it says.
    options.update(getattr(strategy, "options", None) or {})
    options.update(getattr(strategy, "_ddp_kwargs", None) or {})
    return to_jsonable(options)


def to_jsonable(value: Any) -> Any:
    """``value`` as strict JSON: NaN/inf become ``None``, other objects (dtypes, paths) ``str``."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_jsonable(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)
