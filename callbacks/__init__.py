"""Observation-only Lightning callbacks.

``BenchmarkMonitor`` measures per-rank training time and peak memory, gathers them once per epoch
and writes ``benchmark.json`` into the run directory; see :mod:`callbacks.benchmark`.
``CollectiveCounter`` profiles every collective of each training micro-batch and attributes it to
its source (Lightning, SyncBN, gradient buckets, DDP); see :mod:`callbacks.collective_count`.
``PredictionWriter`` saves the outputs of ``trainer.predict`` (merged over ranks, or one file per
rank) into the run directory; see :mod:`callbacks.prediction_writer`.
``RunHparams`` writes each run's hyperparameters (strategy and its options, world size, data used)
as TensorBoard HPARAMS; see :mod:`callbacks.run_hparams`.
"""

from callbacks.benchmark import BenchmarkMonitor
from callbacks.collective_count import CollectiveCounter
from callbacks.prediction_writer import PredictionWriter
from callbacks.run_hparams import RunHparams

__all__ = ["BenchmarkMonitor", "CollectiveCounter", "PredictionWriter", "RunHparams"]
