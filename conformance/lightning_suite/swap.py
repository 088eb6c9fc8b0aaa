"""pytest plugin for Lightning's test suite: its ``ddp`` names build ``custom_ddp``; launches are logged.

Loaded with ``-p conformance.lightning_suite.swap`` (the repository root on ``PYTHONPATH``) by
:mod:`conformance.lightning_suite.run`. Two switches, read from the environment at ``pytest_configure``
(before Lightning's test modules are imported); popen ranks re-run the same pytest command with the
same environment, so they load the plugin too:

- ``LIT_CIFAR_SWAP_DDP=1``: every ``StrategyRegistry`` entry that builds Lightning's ``DDPStrategy``
  (``ddp``, ``ddp_spawn``, ``ddp_fork``, ``ddp_notebook`` and their ``*_find_unused_parameters_*``
  variants) builds ``CustomDDPStrategy`` with the entry's start method instead. Names only: a test
  that constructs ``DDPStrategy(...)`` itself still gets Lightning's.
- ``LIT_CIFAR_LAUNCH_LOG=FILE``: each launch that really starts processes appends one JSON line to
  FILE: the test's node id, the strategy's class, the start method, the number of processes. Logged
  in the process that starts the others; a launch whose process starter a test mocked is not logged.

A popen rank (``LOCAL_RANK`` 1 and up when pytest starts) writes no JUnit XML: it re-runs the whole
command, ``--junitxml`` included, and would overwrite the report of the process that launched it.
"""

from __future__ import annotations

import functools
import json
import multiprocessing.process
import os
import subprocess
from collections.abc import Callable
from typing import Any

import pytest
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher
from lightning.pytorch.trainer import call

__all__ = ["LAUNCH_LOG_ENV", "SWAP_ENV", "install_launch_log", "swap_ddp_names"]

SWAP_ENV = "LIT_CIFAR_SWAP_DDP"
LAUNCH_LOG_ENV = "LIT_CIFAR_LAUNCH_LOG"

# The strategy of the trainer call in progress: Lightning's popen launcher holds no strategy.
_trainer_call_strategy: Any = None
# The test running, from pytest's hooks: a test may clear os.environ and PYTEST_CURRENT_TEST with it
# (Lightning's test_lr_finder_with_ddp does).
_running_test: str | None = None


def swap_ddp_names(registry: _StrategyRegistry = StrategyRegistry) -> dict[str, dict[str, Any]]:
    """Point every entry of ``registry`` that builds ``DDPStrategy`` at ``CustomDDPStrategy``, keeping
    its start method. Returns the replaced entries by name (``registry.update(...)`` restores them)."""
    from strategies import CustomDDPStrategy  # here: a plain ddp run never imports the project's strategy

    replaced: dict[str, dict[str, Any]] = {}
    for name, entry in list(registry.items()):
        if entry["strategy"] is not DDPStrategy:
            continue
        params = dict(entry["init_params"])
        # find_unused_parameters is dropped: custom_ddp accepts it but does not wrap the module in torch's
        # DDP. Its gradient sync sends zeros flagged unused for a parameter without a gradient (docs/strategy.md),
        # so both values behave as ddp's True, and False raises no "parameters that were not used" error.
        params.pop("find_unused_parameters", None)
        start_method = params.pop("start_method", "popen")
        if params:
            raise TypeError(
                f"StrategyRegistry[{name!r}] passes {sorted(params)} to DDPStrategy, which the swap does not "
                "map to CustomDDPStrategy: say in swap_ddp_names what each becomes, or skip the name"
            )
        registry[name] = {
            **entry,
            "strategy": CustomDDPStrategy,
            "init_params": {"start_method": start_method},
            "description": f"custom_ddp in place of Lightning's {name} (start method {start_method})",
        }
        replaced[name] = entry
    return replaced


def _current_test() -> str | None:
    """The node id of the running test; outside pytest's hooks, ``PYTEST_CURRENT_TEST`` without its phase."""
    current = os.environ.get("PYTEST_CURRENT_TEST")
    return _running_test or (current.rsplit(" ", 1)[0] if current else None)


def _append_launch(path: str, strategy: Any, start_method: str, num_processes: int) -> None:
    record = {
        "test": _current_test(),
        "strategy": type(strategy).__name__ if strategy is not None else None,
        "start_method": start_method,
        "num_processes": num_processes,
    }
    with open(path, "a") as log:  # one short write per line: launches of parallel runs do not interleave
        log.write(json.dumps(record) + "\n")


def _real(processes: Any, kind: type) -> bool:
    """Processes really started (a test that mocks the starter leaves mocks or nothing)."""
    return isinstance(processes, list) and bool(processes) and all(isinstance(p, kind) for p in processes)


def install_launch_log(path: str) -> None:
    """Wrap Lightning's launchers so that each launch that starts processes appends a line to ``path``.

    The popen side wraps ``_call_children_scripts``, not ``launch``: custom_ddp's popen launcher replaces
    Lightning's ``launch`` without calling it, but both call ``_call_children_scripts``, and only in the
    process that starts the others.
    """
    original_call, original_children, original_launch = (
        call._call_and_handle_interrupt,
        _SubprocessScriptLauncher._call_children_scripts,
        _MultiProcessingLauncher.launch,
    )

    @functools.wraps(original_call)
    def trainer_call(trainer: Any, *args: Any, **kwargs: Any) -> Any:
        global _trainer_call_strategy
        outer, _trainer_call_strategy = _trainer_call_strategy, trainer.strategy
        try:
            return original_call(trainer, *args, **kwargs)
        finally:
            _trainer_call_strategy = outer

    @functools.wraps(original_children)
    def call_children_scripts(self: Any) -> None:
        original_children(self)
        if _real(self.procs, subprocess.Popen):
            strategy = getattr(self, "_strategy", _trainer_call_strategy)
            _append_launch(path, strategy, "popen", len(self.procs) + 1)  # + this process, rank 0

    @functools.wraps(original_launch)
    def launch(self: Any, function: Callable, *args: Any, **kwargs: Any) -> Any:
        before = self.procs
        try:
            return original_launch(self, function, *args, **kwargs)
        finally:  # also after a failed run: the processes were started
            if self.procs is not before and _real(self.procs, multiprocessing.process.BaseProcess):
                _append_launch(path, self._strategy, self._start_method, len(self.procs))

    call._call_and_handle_interrupt = trainer_call
    _SubprocessScriptLauncher._call_children_scripts = call_children_scripts
    _MultiProcessingLauncher.launch = launch


@pytest.hookimpl(tryfirst=True)  # before the junitxml plugin reads --junitxml
def pytest_configure(config: pytest.Config) -> None:
    if int(os.environ.get("LOCAL_RANK") or 0) > 0:
        config.option.xmlpath = None
    if os.environ.get(SWAP_ENV) == "1":
        swap_ddp_names()
    if os.environ.get(LAUNCH_LOG_ENV):
        install_launch_log(os.environ[LAUNCH_LOG_ENV])


def pytest_runtest_logstart(nodeid: str, location: tuple[str, int | None, str]) -> None:
    global _running_test
    _running_test = nodeid


def pytest_runtest_logfinish(nodeid: str, location: tuple[str, int | None, str]) -> None:
    global _running_test
    _running_test = None
