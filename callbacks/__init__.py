"""Observation-only Lightning callbacks.

``BenchmarkMonitor`` measures per-rank training time and peak memory, gathers them once per epoch
and writes ``benchmark.json`` into the run directory; see :mod:`callbacks.benchmark`.
``CollectiveCounter`` profiles every collective of each training micro-batch and attributes it to
its source (Lightning, SyncBN, gradient buckets, DDP); see :mod:`callbacks.collective_counter`.
``PredictionWriter`` saves the outputs of ``trainer.predict`` (merged over ranks, or one file per
rank) into the run directory; see :mod:`callbacks.prediction_writer`.
``RunHparams`` writes each run's hyperparameters (strategy and its options, world size, data used)
as TensorBoard HPARAMS; see :mod:`callbacks.run_hparams`.

The measurements they take live in :mod:`measure` (Lightning-free, shared with the benchmarks).
This package's ``__init__`` imports nothing: the callbacks above load (with Lightning) on first
access.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["BenchmarkMonitor", "CollectiveCounter", "PredictionWriter", "RunHparams"]

_HOMES = {
    "BenchmarkMonitor": "callbacks.benchmark",
    "CollectiveCounter": "callbacks.collective_counter",
    "PredictionWriter": "callbacks.prediction_writer",
    "RunHparams": "callbacks.run_hparams",
}


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        return getattr(importlib.import_module(_HOMES[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
