"""Lightning's launchers, refusing a trainer call that starts while another one runs; the popen one
also gives rank 0 time to write its last checkpoint when a child fails (:class:`_ObserverSparingRank0`).

A ``trainer.validate``/``test``/``fit``/``predict`` called from a hook or a callback while another
stage runs would re-launch the processes from inside a rank: Lightning's fork launcher then fails
with an unrelated CUDA message and one process with an empty ``AssertionError``. Every rank makes
the same call at the same point, so every rank raises one clear error there instead.

The guard is a launcher subclass, not a wrapper assigned to ``launcher.launch``: the spawn and
forkserver start methods pickle the trainer with its strategy and launcher into each new process,
and a closure does not pickle (``custom_ddp_spawn`` failed before training with
``Can't pickle local object``).

Lightning's launcher classes are private (``lightning.pytorch.strategies.launchers``); their
constructor signatures are listed in :mod:`strategies.lightning_seams`, checked at setup.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch.distributed as dist
from lightning.fabric.plugins import ClusterEnvironment
from lightning.fabric.strategies.launchers.subprocess_script import _ChildProcessObserver
from lightning.fabric.utilities.distributed import _set_num_threads_if_needed
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.strategies.launchers.multiprocessing import (
    _disable_module_memory_sharing,
    _MultiProcessingLauncher,
)
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.trainer.states import TrainerFn
from torch.multiprocessing import ProcessExitedException

from strategies.stopping import SignalForwarding, StopOnSignal, restore_in_worker

if TYPE_CHECKING:
    from lightning.pytorch.strategies.launchers.launcher import _Launcher

__all__ = ["RANK0_GRACE_S", "OneStageMultiProcessingLauncher", "OneStageSubprocessScriptLauncher", "one_stage_launcher"]

log = logging.getLogger(__name__)

RANK0_GRACE_S = 10.0  # a popen job's rank 0 may end by itself this long after a child failed


class _OneStageAtATime:
    """Mixin for a Lightning launcher: ``launch`` raises while the strategy runs another stage.

    The strategy reports its running stage through ``running_stage`` (``None`` between stages).
    """

    _strategy: Any

    def launch(self, function: Callable, *args: Any, trainer: pl.Trainer | None = None, **kwargs: Any) -> Any:
        self._refuse_a_nested_stage(trainer)
        return super().launch(function, *args, trainer=trainer, **kwargs)  # type: ignore[misc]

    def _refuse_a_nested_stage(self, trainer: pl.Trainer | None) -> None:
        running: TrainerFn | None = self._strategy.running_stage
        if running is not None:
            called = trainer.state.fn.value if trainer is not None else "<stage>"
            raise RuntimeError(
                f"custom_ddp: trainer.{called}() was called while trainer.{running.value}() is running (from a "
                "hook or callback). Lightning runs one stage at a time: call it after the running one returns, "
                "e.g. after trainer.fit(...) in your script."
            )


class _ObserverSparingRank0(_ChildProcessObserver):
    """Lightning's observer of the popen children, with a grace period for rank 0 (its own process).

    When a child fails, Lightning's observer (it polls every 5 s) SIGKILLs the other children and rank 0
    at once. Rank 0 may then be writing the checkpoint of the last completed step from its exception
    path (:mod:`strategies.fault_tolerance.last_checkpoint`, ~0.3 s): a poll inside that window killed it first and the
    checkpoint was lost (fault matrix row "SIGKILL of rank 1", 1 run of 2 after a timing change). The
    other children still go at once; rank 0, whose collective fails as soon as the peer is gone, ends
    by itself within seconds, and is killed only after ``RANK0_GRACE_S``.
    """

    def _terminate_all(self) -> None:
        for child in self._child_processes:
            child.send_signal(self._termination_signal)
        time.sleep(RANK0_GRACE_S)  # a daemon thread: it ends with rank 0 if rank 0 exits first
        os.kill(self._main_pid, self._termination_signal)


class OneStageSubprocessScriptLauncher(_OneStageAtATime, _SubprocessScriptLauncher):
    """The popen launcher (re-runs the script per rank), one stage at a time, sparing rank 0 a while
    when a child fails (:class:`_ObserverSparingRank0`)."""

    def __init__(
        self, strategy: Any, cluster_environment: ClusterEnvironment, num_processes: int, num_nodes: int
    ) -> None:
        super().__init__(cluster_environment, num_processes, num_nodes)
        self._strategy = strategy

    def launch(self, function: Callable, *args: Any, trainer: pl.Trainer | None = None, **kwargs: Any) -> Any:
        # _SubprocessScriptLauncher.launch with its observer replaced (the names: strategies.lightning_seams).
        self._refuse_a_nested_stage(trainer)
        self.cluster_environment.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
        if not self.cluster_environment.creates_processes_externally:
            self._call_children_scripts()
            _ObserverSparingRank0(main_pid=os.getpid(), child_processes=self.procs).start()
        _set_num_threads_if_needed(num_processes=self.num_processes)
        return function(*args, **kwargs)

    def __getstate__(self) -> dict[str, Any]:
        # The started children's Popen objects hold locks: rank 0's strategy pickles without them, as
        # Lightning's multiprocessing launcher drops its processes (Lightning's ddp does not pickle here).
        state = self.__dict__.copy()
        state["procs"] = []
        return state


class OneStageMultiProcessingLauncher(_OneStageAtATime, _MultiProcessingLauncher):
    """The fork/spawn/forkserver launcher, one stage at a time (it already holds the strategy).

    Under forkserver on CPU each worker first gives the module it received its own memory.
    ``torch.multiprocessing`` moves every CPU tensor it pickles into shared memory, so the module's
    parameters would be ONE storage in the main process and in every rank, and every rank's optimizer
    step would also update the other ranks' weights, a race whose result depends on timing. Lightning
    unshares (``_disable_module_memory_sharing``, called here too) for spawn only; its ``ddp`` with
    forkserver keeps the race (its forkserver fits differed from run to run by 0.02 in a full test run;
    ``tests/launching/test_start_methods.py``).

    A worker that finished its stage destroys its process group before it exits: a spawned worker
    exits through interpreter finalization, where gloo's threads, still alive without
    ``destroy_process_group()``, sometimes abort the process ("terminate called without an active
    exception", SIGABRT) after the stage succeeded (seen with Lightning's ``ddp_spawn``, 2 of 9 runs
    on a loaded 2-core machine). Only after a normal return: on an error path a destroy could wait on
    a dead peer's collective.

    A worker that fails runs the strategy's ``on_worker_exception`` before its error travels to the
    launching process: Lightning's interrupt path (``on_exception``) runs there only, in a process
    that is no rank, so without it a fork/spawn job lost the lost peer's diagnosis, rank 0's last
    checkpoint and the desync report that a popen job has.

    Rank 0's last weights come back through a file in a new ``tempfile.mkdtemp()`` folder; Lightning
    removes the file, not the folder, so each fork/spawn fit of its ``ddp`` leaves an empty folder in
    the system's temporary directory for good. This launcher removes it.
    """

    def launch(self, function: Callable, *args: Any, trainer: pl.Trainer | None = None, **kwargs: Any) -> Any:
        forwarding = SignalForwarding(lambda: getattr(self, "procs", []))
        forwarding.install()
        try:
            return super().launch(function, *args, trainer=trainer, **kwargs)
        except ProcessExitedException as error:
            signum = forwarding.stopped_by(error.exit_code)
            if signum:  # every worker stopped on a signal at one step, checkpoint written: their line says where
                raise StopOnSignal(signum, ranks=(), checkpoint=None) from error
            raise
        finally:
            forwarding.restore()

    def _wrapping_function(
        self, process_idx: int, trainer: pl.Trainer | None, function: Callable, args: Any, kwargs: Any, *rest: Any
    ) -> None:
        restore_in_worker()  # a forked worker: the handlers the launching process had before forwarding
        if self._start_method == "forkserver" and isinstance(self._strategy.accelerator, CPUAccelerator):
            args, kwargs = _disable_module_memory_sharing((args, kwargs))
        try:
            super()._wrapping_function(process_idx, trainer, function, args, kwargs, *rest)
        except BaseException as exception:
            if trainer is not None:  # the worker's own exception path (Lightning runs none in a worker)
                try:
                    self._strategy.on_worker_exception(trainer, exception)
                except Exception as report_error:  # noqa: BLE001 - the worker's own error is the one to raise
                    log.warning("custom_ddp: the exception path of worker %d failed: %r", process_idx, report_error)
            raise
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()

    def _recover_results_in_main_process(self, worker_output: Any, trainer: pl.Trainer) -> None:
        super()._recover_results_in_main_process(worker_output, trainer)
        if worker_output.weights_path is not None:
            with contextlib.suppress(OSError):  # not empty (something else was put there) or already gone: keep it
                os.rmdir(os.path.dirname(worker_output.weights_path))


def one_stage_launcher(strategy: Any, start_method: str) -> _Launcher:
    """The guarded launcher ``DDPStrategy._configure_launcher`` would pick for ``start_method``."""
    if start_method == "popen":
        return OneStageSubprocessScriptLauncher(
            strategy, strategy.cluster_environment, strategy.num_processes, strategy.num_nodes
        )
    return OneStageMultiProcessingLauncher(strategy, start_method=start_method)
