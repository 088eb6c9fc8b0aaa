"""Training-time probe: micro-batch, optimizer-step, data-wait and epoch times of one rank.

Pure Python/torch (no Lightning): :class:`~callbacks.benchmark.BenchmarkMonitor` drives it from
the Trainer's hooks. What each number covers:

- **micro-batch**: from the start of a training batch (after it was fetched and moved to the
  device) to its end: forward, backward, the strategy's gradient sync and, on the last
  micro-batch of an accumulation window, clipping and the optimizer step.
- **step**: the micro-batches of one accumulation window summed, i.e. the training work of one
  optimizer step without data loading. Only complete windows count (Lightning also steps on a
  short window at the end of an epoch) and the first ``warmup_steps`` steps of the fit are
  left out (lazy initialisation, allocator growth, DDP's bucket rebuild after iteration 1).
- **data wait**: host time between the end of one batch and the start of the next: fetching,
  host-to-device copy, ``on_after_batch_transfer`` augmentation and the Trainer's per-batch
  bookkeeping, summed per step. Validation that runs inside the epoch is subtracted.
- **epoch**: from epoch start to the end of its last training batch, validation excluded.

For the benchmarks, which time a call on every rank of a process group: :func:`aligned_seconds`
(one call started right after a barrier) and :func:`slowest_rank` (a data-parallel step is as slow
as its slowest rank, the rule the callback's cross-rank maximum follows too).

On CUDA the device times come from CUDA events recorded on the current stream and are read
once, with one ``synchronize``, when the epoch ends: no per-batch synchronisation perturbs the
overlap of communication with backward. On CPU, ``time.perf_counter`` already measures the work.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["EpochTiming", "StepTimer", "aligned_seconds", "slowest_rank"]

# The host clock, one name for every host-side reading (tests substitute a fake clock).
_now = time.perf_counter


class _HostClock:
    """Wall clock of the host; the work it times has finished when the hook returns."""

    def mark(self) -> float:
        return _now()

    def seconds(self, start: float, end: float) -> float:
        return end - start

    def synchronize(self) -> None:
        pass


class _CudaClock:
    """CUDA events on the current stream, resolved after one synchronise at epoch end."""

    def __init__(self, device: torch.device) -> None:
        self._device = device

    def mark(self) -> Any:
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self._device))
        return event

    def seconds(self, start: Any, end: Any) -> float:
        return start.elapsed_time(end) / 1e3

    def synchronize(self) -> None:
        torch.cuda.synchronize(self._device)


@dataclass
class EpochTiming:
    """Per-step samples of one epoch on one rank (warm-up and short windows left out).

    Attributes:
        step_s: Training time of each counted optimizer step.
        micro_batch_s: Time of each micro-batch of the counted steps.
        data_wait_s: Data wait of each counted step (summed over its micro-batches).
        step_samples: Samples of each counted step on this rank.
        epoch_s: Training time of the whole epoch (warm-up included, validation excluded).
        epoch_samples: Samples this rank trained on in the epoch.
    """

    step_s: list[float] = field(default_factory=list)
    micro_batch_s: list[float] = field(default_factory=list)
    data_wait_s: list[float] = field(default_factory=list)
    step_samples: list[int] = field(default_factory=list)
    epoch_s: float = 0.0
    epoch_samples: int = 0


@dataclass
class _MicroBatch:
    start: Any
    end: Any
    data_wait_s: float
    samples: int
    stepped: bool


class StepTimer:
    """Records one rank's training marks during an epoch; turns them into times at its end.

    Args:
        device: Device that trains; CUDA devices are timed with CUDA events.
        warmup_steps: Optimizer steps at the start of the fit left out of the step statistics.
        accumulate_grad_batches: Micro-batches of a complete accumulation window.
    """

    def __init__(self, device: torch.device, warmup_steps: int, accumulate_grad_batches: int) -> None:
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
        if accumulate_grad_batches < 1:
            raise ValueError(f"accumulate_grad_batches must be >= 1, got {accumulate_grad_batches}")
        self._clock = _CudaClock(device) if device.type == "cuda" else _HostClock()
        self._warmup_steps = warmup_steps
        self._window = accumulate_grad_batches
        self._steps_seen = 0
        self._reset_epoch()

    def _reset_epoch(self) -> None:
        self._batches: list[_MicroBatch] = []
        self._pauses: list[tuple[Any, Any]] = []  # validation inside the epoch (device clock)
        self._pending_pauses: list[tuple[Any, Any]] = []
        self._epoch_start: Any = None
        self._gap_start = 0.0
        self._gap_paused_s = 0.0
        self._open: tuple[Any, float, int] | None = None
        self._pause_start: tuple[Any, float] | None = None

    def epoch_start(self) -> None:
        self._reset_epoch()
        self._epoch_start = self._clock.mark()
        self._gap_start = _now()

    def batch_start(self, samples: int) -> None:
        now = _now()
        # Validation seen since the last batch ran inside the epoch: it is not training time.
        self._pauses.extend(self._pending_pauses)
        self._pending_pauses.clear()
        data_wait_s = now - self._gap_start - self._gap_paused_s
        self._open = (self._clock.mark(), data_wait_s, samples)

    def batch_end(self, stepped: bool) -> None:
        if self._open is None:  # a batch skipped by `on_train_batch_start` returning -1
            return
        start, data_wait_s, samples = self._open
        self._batches.append(_MicroBatch(start, self._clock.mark(), data_wait_s, samples, stepped))
        self._open = None
        self._gap_start = _now()
        self._gap_paused_s = 0.0

    def pause(self) -> None:
        """Validation starts: stop counting until :meth:`resume`."""
        if self._epoch_start is not None:
            self._pause_start = (self._clock.mark(), _now())

    def resume(self) -> None:
        if self._pause_start is None:
            return
        device_start, host_start = self._pause_start
        self._pending_pauses.append((device_start, self._clock.mark()))
        self._gap_paused_s += _now() - host_start
        self._pause_start = None

    def epoch_end(self) -> EpochTiming:
        """Resolve the epoch's marks (one device synchronise) into an :class:`EpochTiming`."""
        self._clock.synchronize()
        timing = EpochTiming()
        if self._batches:
            seconds = self._clock.seconds
            paused = sum(seconds(a, b) for a, b in self._pauses)
            timing.epoch_s = seconds(self._epoch_start, self._batches[-1].end) - paused
            timing.epoch_samples = sum(b.samples for b in self._batches)
            self._collect_steps(timing)
        self._reset_epoch()
        return timing

    def _collect_steps(self, timing: EpochTiming) -> None:
        window: list[_MicroBatch] = []
        for batch in self._batches:
            window.append(batch)
            if not batch.stepped:
                continue
            self._steps_seen += 1
            if self._steps_seen > self._warmup_steps and len(window) == self._window:
                micro = [self._clock.seconds(b.start, b.end) for b in window]
                timing.micro_batch_s.extend(micro)
                timing.step_s.append(sum(micro))
                timing.data_wait_s.append(sum(b.data_wait_s for b in window))
                timing.step_samples.append(sum(b.samples for b in window))
            window = []


def aligned_seconds(fn: Callable[[], Any], device: Any = None) -> float:
    """Seconds of one call of ``fn`` on this rank, started right after a barrier so all ranks start
    together (CUDA: events around the call, after a synchronize)."""
    if device is not None and torch.device(device).type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(device)
        dist.barrier()
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    dist.barrier()
    start_s = time.perf_counter()
    fn()
    return time.perf_counter() - start_s


def slowest_rank(per_rank: Sequence[Sequence[float]]) -> list[float]:
    """Per-iteration samples: the slowest rank's time of each barrier-aligned iteration (a
    data-parallel step is as slow as its slowest rank)."""
    return [max(iteration) for iteration in zip(*per_rank, strict=True)]
