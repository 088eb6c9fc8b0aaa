"""The architecture the tree promises: a pure-torch core that never loads Lightning, adapters that register."""

from __future__ import annotations

import pkgutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import collectives
import measure
import parallel

_ROOT = Path(__file__).resolve().parents[1]
_LIGHTNING_PACKAGES = ("lightning", "pytorch_lightning", "lightning_fabric")


def _modules(package) -> list[str]:
    return sorted(f"{package.__name__}.{info.name}" for info in pkgutil.iter_modules(package.__path__))


def _run_fresh(code: str) -> str:
    """Run ``code`` in a fresh interpreter at the repository root; return its stdout."""
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], cwd=_ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_core_has_the_modules_the_readme_lists():
    assert _modules(parallel) == [
        "parallel.buckets",
        "parallel.buffer_sync",
        "parallel.dist_utils",
        "parallel.eval_sharding",
        "parallel.grad_sync",
        "parallel.host_reduce",
        "parallel.metric_sync",
        "parallel.reducer",
        "parallel.resume_sampler",
        "parallel.rng_state",
        "parallel.shm_barrier",
        "parallel.sparse_grads",
        "parallel.sync_config",
        "parallel.syncbn",
        "parallel.syncbn_function",
        "parallel.syncbn_kernels",
        "parallel.uneven_gather",
        "parallel.zero",
    ]


# The measurement modules the callbacks and the benchmarks share, and the benchmarks that need no Trainer.
_MEASUREMENT = [
    "callbacks",
    "measure",
    *_modules(measure),
    "benchmarks.launcher",
    "benchmarks.harness",
    "benchmarks.readme_results",
    "benchmarks.grad_sync",
    "benchmarks.grad_sync_report",
    "benchmarks.syncbn",
    "benchmarks.allreduce",
    "benchmarks.compare",
    "benchmarks.compare_runs",
]


@pytest.mark.parametrize(
    "modules", [_modules(parallel), _modules(collectives), _MEASUREMENT], ids=["parallel", "collectives", "measurement"]
)
def test_package_imports_without_lightning(modules):
    """Every module imports in a fresh interpreter where Lightning cannot be imported at all."""
    out = _run_fresh(f"""
        import sys
        for name in {_LIGHTNING_PACKAGES!r}:
            sys.modules[name] = None  # any `import lightning...` now raises ImportError
        import importlib
        for module in {modules!r}:
            importlib.import_module(module)
        print(sorted(m for m in sys.modules if m.split('.')[0] in {_LIGHTNING_PACKAGES!r} and sys.modules[m]))
    """)
    assert out.strip() == "[]"


def test_strategies_package_registers_custom_ddp():
    out = _run_fresh("""
        import strategies
        from lightning.pytorch.strategies import StrategyRegistry
        print(sorted(name for name in StrategyRegistry if name.startswith('custom_ddp')))
    """)
    assert out.strip() == "['custom_ddp', 'custom_ddp_fork', 'custom_ddp_spawn']"


def test_callbacks_load_lazily_by_their_public_names():
    out = _run_fresh("""
        import sys
        import callbacks
        before = 'lightning' in sys.modules
        from callbacks import BenchmarkMonitor, CollectiveCounter
        print(before, BenchmarkMonitor.__module__, CollectiveCounter.__module__)
    """)
    assert out.split() == ["False", "callbacks.benchmark", "callbacks.collective_counter"]
