"""Shared fixtures: one tiny synthetic CIFAR-100 per test session, and DataModules over it."""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
import torch
from filelock import FileLock

from collectives.launcher import LAUNCH_VARIABLES

if TYPE_CHECKING:  # imported where used: torchvision imports Triton (see pytest_configure)
    from lit_cifar.data import CIFAR100DataModule


def pytest_configure(config: pytest.Config) -> None:
    # Without a GPU, SyncBatchNorm's Triton kernels run in Triton's interpreter (tests/batchnorm/test_syncbn_fused.py).
    # Triton reads TRITON_INTERPRET when it is imported, and torchvision imports it: set it before any test module
    # loads.
    if not torch.cuda.is_available() and "triton" not in sys.modules:
        os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # pytest-xdist hands tests out in collection order: the long ones first (longest-first scheduling), so that
    # none starts near the end and finishes the run alone on one worker while the others are idle.
    items.sort(key=lambda item: item.get_closest_marker("long") is None)


# Small enough that a 1-epoch Lightning fit takes a few seconds on one CPU core.
TINY = {"synthetic_train_size": 400, "synthetic_test_size": 200, "val_size": 100, "batch_size": 64}


@pytest.fixture(autouse=True)
def _no_leaked_launch_variables() -> Iterator[None]:
    # Lightning's fork launcher leaves MASTER_PORT in this process's environment; a later test's
    # subprocess (train.py on 2 processes) would inherit a stale rendezvous port.
    before = {key: os.environ.get(key) for key in LAUNCH_VARIABLES}
    yield
    for key, value in before.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(scope="session", autouse=True)
def _temporary_files_under_pytests_folder(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    # torch and Lightning leave files in the system's temporary directory for good: torch.multiprocessing a
    # failed worker's error file, torchrun its log folder, Lightning's ddp_fork one empty folder per fit (49
    # entries in /tmp after one default run). Under pytest's own folder they go with it (pytest keeps the last 3
    # runs' folders). Subprocesses read TMPDIR; this process and its forked ranks read tempfile.tempdir, which the
    # first gettempdir() call has already set.
    folder = tmp_path_factory.mktemp("tmp", numbered=False)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TMPDIR", str(folder))
        patch.setattr(tempfile, "tempdir", str(folder))
        yield


@pytest.fixture(autouse=True)
def _nothing_written_where_pytest_runs() -> Iterator[None]:
    # Tests write under tmp_path. A Trainer left without default_root_dir saves its checkpoints (a stop's
    # preempted.ckpt) and logs into the working directory: in a checkout, next to the code.
    before = set(os.listdir())
    yield
    new = sorted(set(os.listdir()) - before - {".pytest_cache", "__pycache__"})
    assert not new, f"the test wrote {new} into {os.getcwd()}: give its Trainer default_root_dir=tmp_path"


@pytest.fixture
def python_sigint_handler() -> Iterator[None]:
    """Python's own SIGINT handler (KeyboardInterrupt) for the test, as an interactive run has it: a process started
    in the background by a shell (``pytest &``, ``nohup``) inherits SIGINT ignored, and Python then keeps it so."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


@pytest.fixture(autouse=True)
def _same_global_draws() -> None:
    # A test that draws from the global generators (its forked ranks inherit them) sees the same numbers whatever
    # ran before it in its pytest-xdist worker: a tolerance that one order of the tests meets, every order meets.
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _single_thread() -> None:
    # Several test processes and helpers share 2 cores; more intra-op threads only oversubscribe.
    torch.set_num_threads(1)


def once_per_run(tmp_path_factory: pytest.TempPathFactory, name: str, compute: Callable[[], Any]) -> Any:
    """``compute()``'s JSON-able result, computed once per test run: under pytest-xdist the first worker to ask
    computes it, the others read it (a file lock in the run's shared temporary folder)."""
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        return compute()
    shared = tmp_path_factory.getbasetemp().parent / f"once_per_run-{name}.json"
    with FileLock(f"{shared}.lock"):
        if not shared.is_file():
            shared.write_text(json.dumps(compute()))
        return json.loads(shared.read_text())


def run_forked(target: Callable[..., None], per_process_args: list[tuple], timeout_s: float = 60.0) -> list[int | None]:
    """``target(*args)`` in one forked process per ``args``, all started at once; their exit codes once each
    ended or ``timeout_s`` passed (``None``: still running, then killed, so a hung test leaves none behind)."""
    context = multiprocessing.get_context("fork")
    processes = [context.Process(target=target, args=args) for args in per_process_args]
    for process in processes:
        process.start()
    deadline = time.monotonic() + timeout_s
    for process in processes:
        process.join(timeout=max(deadline - time.monotonic(), 0.0))
    exitcodes = [process.exitcode for process in processes]
    for process in processes:
        if process.is_alive():
            process.kill()
            process.join()
    return exitcodes


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A data folder whose synthetic set (TINY sizes) is generated once and reused."""
    root = tmp_path_factory.mktemp("data")
    make_tiny_datamodule(root).prepare_data()
    return root


def make_tiny_datamodule(data_dir: Path, **overrides: Any) -> CIFAR100DataModule:
    from lit_cifar.data import CIFAR100DataModule

    kwargs = {"data_dir": str(data_dir), "dataset": "synthetic", **TINY, **overrides}
    return CIFAR100DataModule(**kwargs)


@pytest.fixture
def tiny_datamodule(data_dir: Path) -> Callable[..., CIFAR100DataModule]:
    """Factory: ``tiny_datamodule(**overrides)`` -> a synthetic DataModule over the session data."""
    return lambda **overrides: make_tiny_datamodule(data_dir, **overrides)
