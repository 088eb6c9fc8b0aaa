"""The architecture the tree promises: a pure-torch core that never loads Lightning, adapters that register."""

from __future__ import annotations

import ast
import json
import os
import pkgutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from conftest import once_per_run

import collectives
import measure
import parallel

_ROOT = Path(__file__).resolve().parents[1]
_LIGHTNING_PACKAGES = ("lightning", "pytorch_lightning", "lightning_fabric")


def _modules(package) -> list[str]:
    """Every module of ``package``, its sub-packages' modules included (not the sub-packages themselves)."""
    infos = pkgutil.walk_packages(package.__path__, f"{package.__name__}.")
    return sorted(info.name for info in infos if not info.ispkg)


def _run_fresh(code: str) -> str:
    """Run ``code`` in a fresh interpreter at the repository root; return its stdout."""
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], cwd=_ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_core_has_the_modules_the_readme_lists():
    assert _modules(parallel) == [
        "parallel.batchnorm.syncbn",
        "parallel.batchnorm.syncbn_convert",
        "parallel.batchnorm.syncbn_function",
        "parallel.batchnorm.syncbn_fused",
        "parallel.batchnorm.syncbn_kernels",
        "parallel.batchnorm.triton_kernels",
        "parallel.dist_utils",
        "parallel.evaluation.eval_sharding",
        "parallel.evaluation.metric_sync",
        "parallel.evaluation.uneven_gather",
        "parallel.gradients.buckets",
        "parallel.gradients.buffer_sync",
        "parallel.gradients.grad_sync",
        "parallel.gradients.reducer",
        "parallel.gradients.sparse_grads",
        "parallel.gradients.zero",
        "parallel.host.host_exchange",
        "parallel.host.host_reduce",
        "parallel.host.shm_barrier",
        "parallel.resume.resume_sampler",
        "parallel.resume.rng_state",
        "parallel.sync_config",
        "parallel.torch_compat",
        "parallel.uneven.joined_loader",
    ]


# The measurement modules the callbacks and the benchmarks share, and the benchmarks that need no Trainer.
_MEASUREMENT = [
    "callbacks",
    "measure",
    *_modules(measure),
    "benchmarks.harness",
    "benchmarks.report",
    "benchmarks.readme_results",
    "benchmarks.collectives.grad_sync",
    "benchmarks.collectives.grad_sync_report",
    "benchmarks.batchnorm.syncbn",
    "benchmarks.batchnorm.syncbn_report",
    "benchmarks.collectives.allreduce",
    "benchmarks.collectives.allreduce_report",
    "benchmarks.fits.compare",
    "benchmarks.fits.compare_runs",
    "benchmarks.fits.compare_report",
    "benchmarks.fits.variants",
]


_GROUPS = {"parallel": _modules(parallel), "collectives": _modules(collectives), "measurement": _MEASUREMENT}


@pytest.fixture(scope="session")
def fresh_interpreter(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """ONE fresh interpreter (each costs seconds of imports): first, where Lightning cannot be imported at all, per
    group the modules that failed to import (module -> error) and the Lightning modules loaded at the end (key
    ``"lightning loaded"``); then, Lightning importable again, whether ``import callbacks`` loaded it, the modules of
    the callbacks' public names (key ``"callbacks"``), and the ``custom_ddp`` names ``import strategies`` registers."""
    code = f"""
        import importlib, json, sys
        for name in {_LIGHTNING_PACKAGES!r}:
            sys.modules[name] = None  # any `import lightning...` now raises ImportError
        failed = {{}}
        for group, modules in {_GROUPS!r}.items():
            failed[group] = {{}}
            for module in modules:
                try:
                    importlib.import_module(module)
                except Exception as error:
                    failed[group][module] = repr(error)
        loaded = sorted(m for m in sys.modules if m.split('.')[0] in {_LIGHTNING_PACKAGES!r} and sys.modules[m])
        for name in {_LIGHTNING_PACKAGES!r}:
            del sys.modules[name]
        import callbacks
        lightning_after_callbacks = 'lightning' in sys.modules
        from callbacks import BenchmarkMonitor, CollectiveCounter
        import strategies
        from lightning.pytorch.strategies import StrategyRegistry
        print(json.dumps({{
            **failed,
            "lightning loaded": loaded,
            "callbacks": [lightning_after_callbacks, BenchmarkMonitor.__module__, CollectiveCounter.__module__],
            "custom_ddp names": sorted(name for name in StrategyRegistry if name.startswith('custom_ddp')),
        }}))
    """
    return once_per_run(tmp_path_factory, "fresh_interpreter", lambda: json.loads(_run_fresh(code)))


@pytest.mark.long
@pytest.mark.parametrize("group", list(_GROUPS))
def test_package_imports_without_lightning(group, fresh_interpreter):
    """Every module of the group imports where Lightning cannot be imported at all (one interpreter for the
    three groups: a module of one group that imported Lightning would fail there as well)."""
    assert fresh_interpreter[group] == {}
    assert fresh_interpreter["lightning loaded"] == []


def test_strategies_package_registers_custom_ddp(fresh_interpreter):
    assert fresh_interpreter["custom_ddp names"] == ["custom_ddp", "custom_ddp_fork", "custom_ddp_spawn"]


def test_callbacks_load_lazily_by_their_public_names(fresh_interpreter):
    assert fresh_interpreter["callbacks"] == [False, "callbacks.benchmark", "callbacks.collective_counter"]


_ROOMS = ("training", "evaluation", "resume", "stopping", "fault_tolerance")


def _imported_modules(path: Path) -> list[str]:
    """Every module ``path`` imports by name (``import a.b``, ``from a.b import c``: ``a.b`` and ``a.b.c``)."""
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names += [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
    return names


def _project_sources() -> list[Path]:
    """The project's Python files but the tests (unit tests test a room's modules themselves). The walk never
    enters .venv, .venv-floor, .git or build/: they hold no project module, and the two virtualenvs ~18,000 files
    (a glob of the whole tree took 10 s of the suite)."""
    sources = []
    for folder, subfolders, files in os.walk(_ROOT):
        skipped = ("tests", "build") if Path(folder) == _ROOT else ()
        subfolders[:] = sorted(d for d in subfolders if not d.startswith(".") and d not in skipped)
        sources += [Path(folder, name) for name in sorted(files) if name.endswith(".py")]
    return sources


def test_strategy_rooms_are_entered_through_their_init():
    """No module outside ``strategies/<room>/`` imports one of that room's modules: only the room's own names."""
    room_modules = {room: {p.stem for p in (_ROOT / "strategies" / room).glob("*.py")} for room in _ROOMS}
    reached_into = []
    for path in _project_sources():
        relative = path.relative_to(_ROOT)
        for name in _imported_modules(path):
            parts = name.split(".")
            room = parts[1] if len(parts) > 2 and parts[0] == "strategies" else None
            if room in room_modules and relative.parts[:2] != ("strategies", room) and parts[2] in room_modules[room]:
                reached_into.append(f"{relative}: {name}")
    assert not reached_into, reached_into


def test_each_strategy_room_says_what_it_owns_and_may_import():
    for room in _ROOMS:
        doc = ast.get_docstring(ast.parse((_ROOT / "strategies" / room / "__init__.py").read_text()))
        assert doc and "May import:" in doc, room
        modules = {p.stem for p in (_ROOT / "strategies" / room).glob("*.py")} - {"__init__"}
        assert all(f"``{module}``" in doc for module in modules), (room, modules)
