"""What a benchmark number was measured on: hardware, software versions, run configuration, and
how busy the machine was meanwhile.

Shared by the benchmark callback (written next to the numbers of every run) and by the
benchmarks' records (:mod:`benchmarks.harness`), so both describe a machine the same way.
Quietness: a number measured while the machine was busy (1-minute load above ``threshold``
before the run, after waiting for it to calm down, or other processes taking more than
``max_foreign_share`` of the machine during it) is not comparable. No Lightning import.
"""

from __future__ import annotations

import ctypes
import math
import os
import platform
import time
from dataclasses import dataclass
from importlib import metadata
from typing import Any

import torch

__all__ = ["Quietness", "display_path", "environment", "strategy_options", "to_jsonable", "wait_for_quiet"]

_PACKAGES = ("torch", "lightning", "torchvision", "torchmetrics", "numpy")


def display_path(path: str) -> str:
    """``path`` relative to the working directory when it lies below it (what a reader types), else absolute."""
    relative = os.path.relpath(path)
    return path if relative.startswith("..") else relative


def _first_cpu_fields() -> dict[str, str]:
    """The first processor's ``key: value`` lines of ``/proc/cpuinfo`` (empty where there is none)."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if not line.strip():
                    break
                key, _, value = line.partition(":")
                fields[key.strip()] = value.strip()
    except OSError:
        pass
    return fields


def _cpu_model() -> str:
    return _first_cpu_fields().get("model name") or platform.processor() or platform.machine()


def _cpu_id() -> str | None:
    """Vendor, family, model and stepping: a hypervisor may show every generation as plain "AMD EPYC",
    and ratios differ between CPU generations, so a record must tell them apart."""
    fields = _first_cpu_fields()
    keys = ("vendor_id", "cpu family", "model", "stepping")
    if not all(key in fields for key in keys):
        return None
    return "{} family {} model {} stepping {}".format(*(fields[key] for key in keys))


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
        "cpu_id": _cpu_id(),
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
    # A strategy that reports its own settings (custom_ddp's ``options.as_dict()``) is recorded as it says.
    own = getattr(strategy, "options", None)
    options.update(own.as_dict() if hasattr(own, "as_dict") else own or {})
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


_PR_SET_CHILD_SUBREAPER = 36  # prctl option (linux/prctl.h)


def _machine_cpu_seconds() -> tuple[float, float] | None:
    """``(busy, stolen)``: CPU seconds the whole machine spent busy since boot, and of those the ones a
    hypervisor gave to other guests while this one's CPUs wanted to run (``/proc/stat``); ``None`` off Linux."""
    try:
        with open("/proc/stat") as stat:
            fields = [int(v) for v in stat.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    steal = fields[7] if len(fields) > 7 else 0
    tick = os.sysconf("SC_CLK_TCK")
    return (sum(fields[:8]) - idle) / tick, steal / tick


def _own_cpu_seconds() -> float:
    """CPU seconds of this process and of its finished (waited-for) children."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def _adopt_orphans() -> None:
    """Become the subreaper of our process tree (Linux): a grandchild whose parent exits first (a
    popen-launched rank 1 outliving rank 0) is re-parented to us, so its CPU time can be counted."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _reap_orphans() -> None:
    """Wait for adopted processes that have exited: their CPU time joins ``os.times().children_*``."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


@dataclass
class Quietness:
    """How busy the machine was around a measurement, and whether the result is comparable.

    The 1-minute load before the run must be at most ``threshold``; during the run, other
    processes (busy CPU time of the machine minus this process tree's own, a hypervisor's steal included:
    time its CPUs wanted to run and were given to other guests, kept apart as ``steal_share``) may use at
    most ``max_foreign_share`` of the machine. The load after the run is recorded but not judged:
    the benchmark's own processes raise it.
    """

    threshold: float
    waited_s: float
    load_before: float
    max_foreign_share: float = 0.10
    load_after: float | None = None
    foreign_share: float | None = None
    steal_share: float | None = None  # the part of foreign_share a hypervisor took (other guests of its host)
    _start: tuple[float, tuple[float, float] | None, float] | None = None

    @property
    def comparable(self) -> bool:
        foreign_ok = self.foreign_share is None or self.foreign_share <= self.max_foreign_share
        return self.load_before <= self.threshold and foreign_ok

    def begin(self) -> Quietness:
        """Start accounting the CPU time of other processes; returns self."""
        _adopt_orphans()
        self._start = (time.monotonic(), _machine_cpu_seconds(), _own_cpu_seconds())
        return self

    def finish(self) -> Quietness:
        """Record the load after the run, the share of the machine other processes used and the part of it
        the hypervisor took (steal)."""
        self.load_after = os.getloadavg()[0]
        _reap_orphans()
        machine_now = _machine_cpu_seconds()
        if self._start is not None and self._start[1] is not None and machine_now is not None:
            start, (busy, stolen), own = self._start
            capacity = (time.monotonic() - start) * (os.cpu_count() or 1)  # CPU seconds the machine had
            self.foreign_share = max(0.0, machine_now[0] - busy - (_own_cpu_seconds() - own)) / capacity
            self.steal_share = max(0.0, machine_now[1] - stolen) / capacity
        return self

    def as_dict(self) -> dict[str, Any]:
        return {
            "threshold": self.threshold,
            "waited_s": self.waited_s,
            "load_before": self.load_before,
            "load_after": self.load_after,
            "foreign_share": self.foreign_share,
            "max_foreign_share": self.max_foreign_share,
            "steal_share": self.steal_share,
            "comparable": self.comparable,
        }


def wait_for_quiet(threshold: float | None = None, max_wait_s: float = 300.0, poll_s: float = 5.0) -> Quietness:
    """Wait until the 1-minute load is at most ``threshold`` (default: a quarter of the cores), up to
    ``max_wait_s``; then start accounting other processes' CPU time (see :class:`Quietness`)."""
    threshold = (os.cpu_count() or 1) / 4 if threshold is None else threshold
    start = time.monotonic()
    while os.getloadavg()[0] > threshold and time.monotonic() - start < max_wait_s:
        time.sleep(poll_s)
    return Quietness(threshold, time.monotonic() - start, os.getloadavg()[0]).begin()
