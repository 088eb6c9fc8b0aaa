"""Observation-only Lightning callbacks.

``BenchmarkMonitor`` measures per-rank training time and peak memory, gathers them once per epoch
and writes ``benchmark.json`` into the run directory; see :mod:`callbacks.benchmark`.
"""

from callbacks.benchmark import BenchmarkMonitor

__all__ = ["BenchmarkMonitor"]
