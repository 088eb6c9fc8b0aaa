"""Peak-memory probe of one rank over an interval (an epoch), without collectives.

- CUDA: the caching allocator's peak allocated and reserved bytes, reset at :meth:`start`.
- CPU: the peak resident set size (RSS) of this process. ``getrusage().ru_maxrss`` is a
  high-water mark of the whole process life and cannot be reset, so it would report the largest
  epoch of any earlier run in the same process. On Linux >= 4.0 writing ``5`` to
  ``/proc/self/clear_refs`` resets the kernel's own high-water mark (``VmHWM``), which is then
  exact and costs nothing while training (``method="kernel"``). Elsewhere a daemon thread samples
  the RSS with psutil every ``sample_interval_s`` (``method="sample"``): cheap, but it can miss a
  peak shorter than the interval. ``"auto"`` picks the kernel mark when it is available.

One call's tensors (:func:`allocated_peak`): the profiler's allocator events, every allocation and free of torch's
CPU allocator in time order (compiled code's buffers included), cumulated; unlike RSS it sees a few KiB as well as
a few MiB, and nothing but tensors.

DataLoader worker processes are not counted; run the benchmarks with ``num_workers=0`` or read
their memory separately.
"""

from __future__ import annotations

import ctypes
import math
import os
import threading
from collections.abc import Callable
from typing import Any, Literal, TypeVar

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

__all__ = ["PeakMemory", "allocated_peak", "kernel_peak_rss_available", "measure_peak", "return_freed_memory_above"]

_M_MMAP_THRESHOLD = -3  # mallopt parameter number (glibc malloc.h)
_CLEAR_REFS = "/proc/self/clear_refs"
_STATUS = "/proc/self/status"
CpuMethod = Literal["auto", "kernel", "sample"]
_T = TypeVar("_T")
_CPU = DeviceType.CPU


def kernel_peak_rss_available() -> bool:
    """Whether this process may reset and read the kernel's peak-RSS mark (Linux >= 4.0)."""
    return os.access(_CLEAR_REFS, os.W_OK) and os.path.exists(_STATUS)


def return_freed_memory_above(threshold_bytes: int) -> bool:
    """Serve allocations of at least ``threshold_bytes`` by mmap (glibc), so freeing them lowers RSS.

    glibc's dynamic mmap threshold grows to keep freed multi-MiB blocks in the heap, so the RSS
    would remember every transient tensor; a fixed threshold returns them to the kernel on free.
    For peak-memory measurements only: every large allocation then page-faults, which costs time.
    Returns whether the setting took effect (False where glibc's ``mallopt`` is unavailable).
    """
    try:
        return bool(ctypes.CDLL("libc.so.6").mallopt(_M_MMAP_THRESHOLD, threshold_bytes))
    except (OSError, AttributeError):
        return False


def _read_peak_rss_bytes() -> int:
    with open(_STATUS) as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024  # the kernel reports kB
    raise RuntimeError(f"no VmHWM line in {_STATUS}; use method='sample'")


def _current_rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as statm:  # pages: size, resident, ...
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        import psutil

        return psutil.Process().memory_info().rss


def _reset_peak_rss() -> None:
    with open(_CLEAR_REFS, "w") as clear_refs:
        clear_refs.write("5")


class _RssSampler:
    """Daemon thread that keeps the maximum RSS seen between ``start`` and ``stop``."""

    def __init__(self, interval_s: float) -> None:
        import psutil  # only this fallback needs it

        self._process = psutil.Process()
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.peak = 0

    def _sample(self) -> None:
        self.peak = max(self.peak, self._process.memory_info().rss)

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            self._sample()

    def start(self) -> None:
        self.stop()
        self.peak = 0
        self._sample()
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)
        self._thread.start()

    def stop(self) -> int:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
            self._sample()
        return self.peak


class PeakMemory:
    """Peak memory of this process on ``device`` between :meth:`start` and :meth:`stop`.

    Args:
        device: The training device; CUDA devices report allocator statistics, others RSS.
        method: CPU only: ``"kernel"`` (exact, Linux), ``"sample"`` (psutil thread) or
            ``"auto"``.
        sample_interval_s: Sampling period of the ``"sample"`` method.
    """

    def __init__(self, device: torch.device, method: CpuMethod = "auto", sample_interval_s: float = 0.005) -> None:
        if method not in ("auto", "kernel", "sample"):
            raise ValueError(f"method must be 'auto', 'kernel' or 'sample', got {method!r}")
        if sample_interval_s <= 0:
            raise ValueError(f"sample_interval_s must be > 0, got {sample_interval_s}")
        if method == "kernel" and not kernel_peak_rss_available():
            raise ValueError(
                f"method='kernel' needs a writable {_CLEAR_REFS} (Linux >= 4.0); use method='sample' or 'auto'"
            )
        self._device = device
        if device.type == "cuda":
            self.kind = "cuda_allocator"
        elif method == "sample" or not kernel_peak_rss_available():
            self.kind = "rss_sampled"
        else:
            self.kind = "rss_kernel_hwm"
        self._sampler = _RssSampler(sample_interval_s) if self.kind == "rss_sampled" else None

    def current(self) -> float:
        """Usage now in bytes: CUDA allocated bytes, or this process's RSS."""
        if self.kind == "cuda_allocator":
            return float(torch.cuda.memory_allocated(self._device))
        return float(_current_rss_bytes())

    def start(self) -> None:
        """Reset the peak to the current usage."""
        if self.kind == "cuda_allocator":
            torch.cuda.reset_peak_memory_stats(self._device)
        elif self._sampler is not None:
            self._sampler.start()
        else:
            _reset_peak_rss()

    def stop(self) -> dict[str, float]:
        """Peak since :meth:`start` in bytes: ``peak_bytes`` and ``peak_reserved_bytes``.

        ``peak_reserved_bytes`` is the CUDA caching allocator's reserved peak and NaN on CPU.
        """
        if self.kind == "cuda_allocator":
            return {
                "peak_bytes": float(torch.cuda.max_memory_allocated(self._device)),
                "peak_reserved_bytes": float(torch.cuda.max_memory_reserved(self._device)),
            }
        peak = self._sampler.stop() if self._sampler is not None else _read_peak_rss_bytes()
        return {"peak_bytes": float(peak), "peak_reserved_bytes": math.nan}


def measure_peak(fn: Callable[[], _T], device: Any = "cpu") -> tuple[_T, int]:
    """``fn()`` and the memory it needed beyond what was in use before it, in bytes (a
    :class:`PeakMemory` around one call: CPU peak RSS, CUDA allocator peak)."""
    memory = PeakMemory(torch.device(device))
    memory.start()
    before = memory.current()
    result = fn()
    return result, int(memory.stop()["peak_bytes"] - before)


def allocated_peak(fn: Callable[[], _T]) -> tuple[_T, int]:
    """``fn()`` and the most bytes of CPU tensors it held at once beyond those alive before it: the profiler's
    ``[memory]`` events (one per allocation, positive, and per free, negative) summed in time order."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    # kineto_results keeps each allocator event; prof.events() nets them per operator, losing the peak inside one.
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]" and e.device_type() == _CPU]
    held = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        held += event.nbytes()
        peak = max(peak, held)
    return result, peak
