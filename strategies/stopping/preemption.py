"""Preemption-safe stops for ``custom_ddp``: a signal on any rank stops every rank at one step.

Clusters stop jobs with SIGTERM (SLURM preemption and time limits, Kubernetes eviction, torchrun's
agent), people with Ctrl+C (SIGINT), SLURM's ``--signal`` with SIGUSR1. Lightning's own SIGTERM
handler broadcasts from INSIDE the handler (``trainer/connectors/signal_connector.py``): when the
signal reaches one rank while the others are in another collective (a SyncBN all_gather, a
gradient bucket), the collective order diverges and every rank waits for the process-group
timeout. ``custom_ddp`` replaces that handler while a stage runs (:class:`Preemption`, a callback
the strategy adds to the Trainer in ``setup`` and removes in ``teardown``).

During ``fit`` (sanity check and validation included):

1. The handler only records the signal (:class:`~stop_signals.SignalRecorder`);
   :class:`Preemption` owns the stop state: this rank's signal (:attr:`Preemption.local_status`)
   and, once agreed, every rank's.
2. Before each backward the strategy hands :attr:`~Preemption.local_status` to the gradient sync
   (``SyncedDataParallel.set_rank_status``); its all-reduce runs at every optimizer step on every
   rank, in the same order, and the strategy hands the result back (:meth:`Preemption.agree`):
   every rank sees the stop at the same optimizer step, whichever rank(s) got the signal. No
   collective is added: the value rides in the last gradient bucket.
3. At the end of that training batch (``on_train_batch_end``, where ``ModelCheckpoint``'s
   ``every_n_train_steps`` saves and from where Lightning resumes mid-epoch) every rank writes the
   checkpoint ``<ModelCheckpoint.dirpath>/last.ckpt`` (``<default_root_dir>/preempted.ckpt``
   without a ModelCheckpoint), rank 0 prints one line (signal, rank(s), step, checkpoint, exit
   status) and every rank raises :class:`~stop_signals.StopOnSignal`: the process exits
   with ``128 + signum`` (SIGTERM 143).

A signal during validation, a checkpoint save or the sanity check is acted on at the next
optimizer step: evaluation has no per-batch collective to carry it (ranks evaluate uneven shards).
One that arrives after the last optimizer step lets the fit finish as configured (exit status 0).

During ``validate``/``test``/``predict`` nothing is trained, so nothing is saved: the rank that got
the signal (rank 0 of Lightning's popen launcher also forwards it to the ranks it started, as
Lightning does) stops at the end of its current batch with the same exit status. A peer that did
not get the signal fails at its next collective ("Connection closed by peer") or is stopped by the
launcher's watcher.

Lightning's per-batch ``_broadcast_sigterm_tensor`` stays: it broadcasts rank 0's
``trainer.received_sigterm``, which only Lightning's (replaced) handler sets, so it carries 0 and
never stops one rank alone. Private Lightning behaviour this relies on (handler order, the popen
watcher, see :mod:`popen_exit`) is listed in :mod:`strategies.lightning_seams`, checked at setup.
"""

from __future__ import annotations

import logging
import os
import signal
from typing import TYPE_CHECKING, Any

import lightning
import lightning.pytorch as pl
from lightning.fabric.plugins.environments import ClusterEnvironment, SLURMEnvironment
from lightning.pytorch.callbacks import Callback, Checkpoint, ModelCheckpoint
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from strategies.stopping.popen_exit import exit_after_parent, is_popen_child
from strategies.stopping.stop_signals import SignalRecorder, StopOnSignal, exit_status, signal_name, write_stderr

if TYPE_CHECKING:  # a type only; the launcher comes from the strategy
    from lightning.pytorch.strategies.launchers.launcher import _Launcher

__all__ = ["Preemption", "stop_checkpoint_path"]

log = logging.getLogger(__name__)


def stop_checkpoint_path(trainer: pl.Trainer) -> str:
    """Where a stop saves: the ModelCheckpoint's ``last`` file, so ``ckpt_path="last"`` finds it."""
    callback = trainer.checkpoint_callback
    if isinstance(callback, ModelCheckpoint) and callback.dirpath:
        return os.path.join(callback.dirpath, callback.CHECKPOINT_NAME_LAST + callback.FILE_EXTENSION)
    return os.path.join(trainer.default_root_dir, "preempted.ckpt")


def _stop_signals(environment: ClusterEnvironment | None) -> list[int]:
    """SIGTERM always; SIGINT while it raises KeyboardInterrupt; SIGUSR1 (SLURM's requeue signal)
    where it would kill the process or Lightning's requeue handler (which saves a checkpoint, with
    a barrier, inside the handler) would take it. Handlers a user installed stay."""
    signums = [signal.SIGTERM]
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signums.append(signal.SIGINT)
    env = environment
    if isinstance(env, SLURMEnvironment) and env.auto_requeue and env.requeue_signal is not None:
        signums.append(env.requeue_signal)
        rank_zero_info(
            f"custom_ddp: {signal_name(env.requeue_signal)} stops every rank with a checkpoint; Lightning's "
            "SLURM auto-requeue handler is not used: requeue from the batch script with --ckpt_path"
        )
    elif hasattr(signal, "SIGUSR1") and signal.getsignal(signal.SIGUSR1) in (signal.SIG_DFL, None):
        signums.append(signal.SIGUSR1)
    return signums


class Preemption(Callback):
    """Signals stop every rank at the same optimizer step with a checkpoint (see the module docstring).

    Used by ``CustomDDPStrategy``: :meth:`attach` in ``setup``, :attr:`local_status` in
    ``pre_backward``, :meth:`agree` in ``post_backward``, :meth:`detach` in ``teardown``. The
    strategy hands in what this needs (cluster environment, launcher) and the gradient sync's
    result; nothing here reads the strategy or its model back. Stateless in checkpoints.
    """

    def __init__(self) -> None:
        self._recorder = SignalRecorder()
        self._fitting = False
        self._stop: tuple[int, ...] | None = None  # every rank's signal, agreed at one step
        self._checked = False  # handler verified in place at the first batch of the stage
        self._trainer: pl.Trainer | None = None
        self._environment: ClusterEnvironment | None = None
        self._launcher: _Launcher | None = None

    # ------------------------------------------------------------- strategy side

    def attach(self, trainer: pl.Trainer, environment: ClusterEnvironment | None, launcher: _Launcher | None) -> None:
        """Join ``trainer``'s callbacks, ahead of the checkpoint callbacks (Lightning keeps those last)."""
        self._stop, self._checked, self._trainer = None, False, trainer
        self._environment, self._launcher = environment, launcher
        if self not in trainer.callbacks:
            first_checkpoint = next(
                (i for i, cb in enumerate(trainer.callbacks) if isinstance(cb, Checkpoint)), len(trainer.callbacks)
            )
            trainer.callbacks.insert(first_checkpoint, self)

    @property
    def local_status(self) -> int:
        """This rank's value for the next gradient all-reduce: the signal it got while fitting, else 0."""
        return self._recorder.signum if self._fitting else 0

    def agree(self, status: tuple[int, ...] | None) -> None:
        """Every rank's :attr:`local_status` as the step's all-reduce delivered it: the same on every rank."""
        if self._fitting and status is not None and any(status):
            self._stop = status

    def detach(self) -> None:
        """Restore the replaced handlers and leave the callbacks (Lightning then restores its originals)."""
        trainer, self._trainer = self._trainer, None
        self._environment, self._launcher = None, None
        if trainer is None:
            return
        signum = self._recorder.signum
        if signum and self._stop is None:
            # torchrun's agent sends SIGTERM to the survivors of a failed rank: they are already ending on the error.
            ending = (
                "was already ending on an error"
                if trainer.state.status == TrainerStatus.INTERRUPTED
                else "finished normally"
            )
            log.warning(
                "custom_ddp: %s on rank %d arrived after the last point where the ranks could stop together; the %s %s",
                signal_name(signum),
                trainer.global_rank,
                trainer.state.fn.value,
                ending,
            )
        self._recorder.restore()
        if self in trainer.callbacks:
            trainer.callbacks.remove(self)

    # ------------------------------------------------------------- handler installation

    def _install(self, trainer: pl.Trainer) -> None:
        # Lightning registered its handlers before the stage began; replacing them here keeps ours
        # for the rest of the stage, and Lightning's teardown restores the originals afterwards.
        if self._recorder.installed:
            return
        self._fitting = trainer.state.fn == TrainerFn.FITTING
        rank, launcher = trainer.global_rank, self._launcher

        def on_first(signum: int) -> None:
            if self._fitting:  # the strategy hands local_status to the next gradient all-reduce
                write_stderr(
                    f"custom_ddp: rank {rank} received {signal_name(signum)}: every rank stops after the "
                    "next optimizer step and saves a checkpoint"
                )
                return
            write_stderr(
                f"custom_ddp: rank {rank} received {signal_name(signum)} during {trainer.state.fn.value}: "
                "stopping after this batch"
            )
            if launcher is not None:
                launcher.kill(signum)  # the ranks this process started (popen rank 0); a local call

        self._recorder.install(_stop_signals(self._environment), on_first)

    def _check_installed(self, trainer: pl.Trainer) -> None:
        if self._checked:
            return
        self._checked = True
        if self._recorder.installed and not self._recorder.is_current():
            raise RuntimeError(
                f"custom_ddp: a signal handler replaced custom_ddp's during {trainer.state.fn.value} (Lightning "
                f"{lightning.__version__} re-registering its own, or user code): a signal could now desynchronise "
                "the ranks. Install custom handlers before Trainer.fit, or check strategies/preemption.py "
                "against this Lightning version."
            )

    @override
    def on_sanity_check_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._install(trainer)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._install(trainer)

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._install(trainer)

    @override
    def on_test_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._install(trainer)

    @override
    def on_predict_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._install(trainer)

    # ------------------------------------------------------------- stopping

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._check_installed(trainer)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._stop is not None:
            self._stop_fit(trainer, batch_idx)

    def _stop_fit(self, trainer: pl.Trainer, batch_idx: int) -> None:
        ranks = [rank for rank, value in enumerate(self._stop or ()) if value]
        signum = self._stop[ranks[0]]
        path = stop_checkpoint_path(trainer)
        if trainer.is_global_zero and os.path.islink(path):
            os.remove(path)  # save_last="link": write a file, not through the link into another checkpoint
        trainer.save_checkpoint(path)  # every rank: optimizer-state consolidation and the barrier are collective
        if trainer.is_global_zero:
            got = ", ".join(f"{signal_name(self._stop[r])} on rank {r}" for r in ranks)
            log.warning(
                "custom_ddp: %s: all %d ranks stopped after optimizer step %d (epoch %d, batch %d); "
                "checkpoint %s (resume: --ckpt_path %s); exit status %d",
                got,
                trainer.world_size,
                trainer.global_step,
                trainer.current_epoch,
                batch_idx,
                path,
                path,
                exit_status(signum),
            )
        exit_after_parent(self._popen_child(trainer), fitting=True)
        raise StopOnSignal(signum, ranks, path)

    def _popen_child(self, trainer: pl.Trainer) -> bool:
        return is_popen_child(self._launcher, self._environment, trainer.local_rank)

    def _stop_evaluation(self, trainer: pl.Trainer) -> None:
        self._check_installed(trainer)
        signum = self._recorder.signum
        if self._fitting or not signum:
            return
        log.warning(
            "custom_ddp: %s on rank %d during %s: stopped without a checkpoint (only fit has state to "
            "save); exit status %d",
            signal_name(signum),
            trainer.global_rank,
            trainer.state.fn.value,
            exit_status(signum),
        )
        self._stop = (signum,)
        exit_after_parent(self._popen_child(trainer), fitting=False)
        raise StopOnSignal(signum, [trainer.global_rank], None)

    @override
    def on_validation_batch_end(self, trainer: pl.Trainer, *args: Any, **kwargs: Any) -> None:
        self._stop_evaluation(trainer)

    @override
    def on_test_batch_end(self, trainer: pl.Trainer, *args: Any, **kwargs: Any) -> None:
        self._stop_evaluation(trainer)

    @override
    def on_predict_batch_end(self, trainer: pl.Trainer, *args: Any, **kwargs: Any) -> None:
        self._stop_evaluation(trainer)

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._stop_evaluation(trainer)

    @override
    def on_test_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._stop_evaluation(trainer)

    @override
    def on_predict_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._stop_evaluation(trainer)
