"""``custom_ddp``'s watchdog: progress markers from Lightning's hooks, stall detection, exit causes.

A callback the strategy adds in ``setup`` and removes in ``teardown`` (like
:class:`~strategies.stopping.preemption.Preemption`); the strategy hands it the cluster environment and
whether optimizer state is sharded, and it never reads the strategy back. While a stage runs on
2+ ranks it

- starts this rank's :class:`~heartbeat.Heartbeat` thread on a new client connection
  to the job's TCP store (``cluster_environment.main_address:main_port``: the rendezvous store of
  Lightning's launchers, torchrun's agent store), keys under ``custom_ddp/<restart>/<stage n>/``;
- marks progress at every batch start and end (train, validation, test, predict, sanity check)
  and optimizer step: the markers :mod:`stall_watch` reads;
- on an exception, writes this rank's exit cause (:mod:`exit_causes`) and, when the
  exception is a peer loss (gloo's ``Connection closed by peer``), names the peer that ended first;
- on rank 0 (on rank 1 when rank 0 is the rank lost), writes the checkpoint of the last completed
  optimizer step when a stall or a peer's failure ends the job (:mod:`last_checkpoint`);
  while fitting with ``exact_resume``, every rank keeps its random generators at each point where an
  accumulation window may begin, in the store, for that checkpoint (:mod:`window_generators`).

``stall_timeout=None`` keeps the heartbeat (exit causes need it) but never ends the job.
"""

from __future__ import annotations

import json
import logging
import math
import os
from typing import Any

import lightning.pytorch as pl
import torch.distributed as dist
from lightning.fabric.plugins.environments import ClusterEnvironment
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from parallel.resume.rng_state import RngState
from strategies.fault_tolerance.exit_causes import is_peer_loss, peer_causes, write_exit_record
from strategies.fault_tolerance.heartbeat import Heartbeat, Progress
from strategies.fault_tolerance.job_store import connect_store
from strategies.fault_tolerance.last_checkpoint import LastCheckpoint
from strategies.fault_tolerance.process_group import uses_shared_agent_store
from strategies.fault_tolerance.stall_watch import StallWatch
from strategies.fault_tolerance.window_generators import WindowGenerators
from strategies.options import DEFAULT_STALL_TIMEOUT_S

__all__ = ["Watchdog"]

log = logging.getLogger(__name__)


def _batches_processed(trainer: pl.Trainer) -> int:
    return trainer.fit_loop.epoch_loop.batch_progress.total.processed


class Watchdog(Callback):
    """Heartbeat, progress markers, stall detection and exit causes for one stage at a time."""

    def __init__(self, stall_timeout: float | None = DEFAULT_STALL_TIMEOUT_S) -> None:
        self.stall_timeout = stall_timeout
        self.progress = Progress()
        self._heartbeat: Heartbeat | None = None
        self._watch: StallWatch | None = None
        self._trainer: pl.Trainer | None = None
        self._environment: ClusterEnvironment | None = None
        self._generators: WindowGenerators | None = None  # fitting with exact_resume on 2+ ranks only
        self._stages = 0
        self.last_checkpoint = LastCheckpoint()  # what rank 0 (or 1) writes when a stall or a failure ends the job

    @property
    def writing_last_checkpoint(self) -> bool:
        """This rank is writing the last checkpoint (on rank 1, rank 0 being lost, the strategy's save must write)."""
        return self.last_checkpoint.writing

    @property
    def ending(self) -> bool:
        """A last checkpoint is being written: the strategy's barrier must not communicate."""
        return self.last_checkpoint.ending

    def __getstate__(self) -> dict[str, Any]:
        # The strategy pickles (spawn and forkserver send it to each new process, a user may pickle it
        # after setup): the running heartbeat thread, its store client and the trainer stay here.
        state = self.__dict__.copy()
        state.update(_heartbeat=None, _watch=None, _trainer=None, _environment=None, _generators=None)
        return state

    # ------------------------------------------------------------- strategy side

    def attach(
        self, trainer: pl.Trainer, environment: ClusterEnvironment | None, zero1: bool, keep_generators: bool = False
    ) -> None:
        """Join the callbacks and start the heartbeat (2+ ranks only); ``keep_generators``: the strategy's
        ``exact_resume`` (a last checkpoint then holds every rank's random generators)."""
        self._stages += 1
        if trainer.world_size < 2 or environment is None or not dist.is_initialized():
            return
        self._trainer, self.progress, self._environment = trainer, Progress(), environment
        self.last_checkpoint = LastCheckpoint(zero1)
        if self not in trainer.callbacks:
            trainer.callbacks.insert(0, self)
        prefix = f"custom_ddp/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{self._stages}/"
        try:
            store = connect_store(environment.main_address, environment.main_port, prefix)
        except (RuntimeError, OSError, ValueError) as error:  # e.g. a process group the user made on a file:// store
            log.warning(
                "custom_ddp: no stall watch and no exit causes: cannot reach the job's TCP store at %s:%s (%s)",
                environment.main_address,
                environment.main_port,
                error,
            )
            return
        rank = trainer.global_rank
        heartbeat = Heartbeat(store, rank, trainer.world_size, self.progress, self._on_beat, self._on_store_error)
        timeout = math.inf if self.stall_timeout is None else float(self.stall_timeout)
        self._watch = StallWatch(
            rank, trainer.world_size, timeout, heartbeat.identity, heartbeat.main_stack, self.checkpoint_note
        )
        self._heartbeat = heartbeat
        heartbeat.start()
        if keep_generators and not zero1 and trainer.state.fn == TrainerFn.FITTING:  # zero1 writes no last checkpoint
            # The store lives in rank 0's process unless it is torchrun's agent store: mirror it on rank 1.
            toward = None if uses_shared_agent_store() else (environment.main_address, environment.main_port)
            self._generators = WindowGenerators(store, rank, trainer.world_size, mirror_toward=toward)

    def detach(self) -> None:
        self._disconnect()
        trainer, self._trainer, self._environment = self._trainer, None, None
        if trainer is not None and self in trainer.callbacks:
            trainer.callbacks.remove(self)

    def _stop(self) -> None:
        if self._generators is not None:
            self._generators.stop()  # what it kept stays readable: this rank may still write the last checkpoint
        if self._heartbeat is not None:
            self._heartbeat.stop()
            self._heartbeat.join(timeout=1.0)  # a store call to a dead host would take STORE_OP_S
            self._heartbeat = None

    def _disconnect(self) -> None:
        # Close this rank's store client now. Left open until interpreter exit, rank 0's store server
        # (under Lightning's launchers) waits ~2 s at exit for the peers' heartbeat connections while
        # those peers wait for rank 0 to exit first.
        heartbeat = self._heartbeat
        self._stop()
        if heartbeat is not None:
            heartbeat.store.close()
        if self._generators is not None:
            self._generators.close()
        self._watch = self._generators = None

    def _on_beat(self, records: list[dict[str, Any] | None], store: dist.Store) -> None:
        if self._watch is not None:
            self._watch(records, store)

    def _on_store_error(self, error: Exception) -> None:
        if self._watch is not None:
            self._watch.on_store_error(error)

    def checkpoint_note(self, own_record: dict[str, Any] | None = None, rank0_lost: bool = False) -> str:
        """Write the last checkpoint if this rank can (:mod:`last_checkpoint`); the report's line.
        ``own_record``: this rank's heartbeat record now (``None``: read it here)."""
        heartbeat = self._heartbeat
        if own_record is None and heartbeat is not None:
            own_record = heartbeat.record()
        # From the heartbeat thread: only while the main thread waits in a collective (it touches no state).
        parked = own_record is not None and bool(own_record.get("collective")) and not own_record.get("busy")
        return self.last_checkpoint.note(self._trainer, parked, rank0_lost)

    def training_starts(self, trainer: pl.Trainer, generators: RngState | None) -> None:
        """The strategy's ``on_train_start``, after a resume's restore: the first window may begin here, and
        ``generators`` are the ones a checkpoint of this point must hold."""
        if self._generators is not None and generators is not None:
            self._generators.keep(_batches_processed(trainer), generators)

    def _window_may_begin(self, trainer: pl.Trainer) -> None:
        if self._generators is not None and not self.last_checkpoint.window_open:
            self._generators.keep(_batches_processed(trainer))

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        if restart and trainer.is_global_zero and self._heartbeat is not None:
            log.warning("custom_ddp: %s", self._restart_line(trainer, restart))

    def _restart_line(self, trainer: pl.Trainer, restart: int) -> str:
        """Steps re-done by this torchrun restart: the failed attempt's furthest step (its records in the
        agent's store, which outlives the workers) minus the step this attempt resumed at."""
        env = self._environment
        reached = []
        try:
            previous = connect_store(env.main_address, env.main_port, f"custom_ddp/{restart - 1}/{self._stages}/")
            for key in [f"{kind}/{rank}" for kind in ("hb", "exit") for rank in range(trainer.world_size)]:
                if previous.check([key]):
                    reached.append(json.loads(previous.get(key))["where"].get("step"))
        except (RuntimeError, OSError, ValueError, KeyError):
            pass
        steps = [step for step in reached if isinstance(step, int)]
        head = f"torchrun restart {restart}: resumed at optimizer step {trainer.global_step}"
        if not steps:
            return f"{head} (the failed attempt's progress is unknown)"
        lost = max(0, max(steps) - trainer.global_step)
        return f"{head}; the failed attempt had reached step {max(steps)}: {lost} step(s) re-done"

    # ------------------------------------------------------------- progress markers

    def _mark(self, trainer: pl.Trainer, stage: str, batch_idx: int | None = None) -> None:
        where = {"stage": stage, "epoch": trainer.current_epoch}
        if batch_idx is not None:
            where["batch"] = batch_idx
        where["step"] = trainer.global_step
        self.progress.mark(**where)

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._mark(trainer, "train", batch_idx)
        if self._heartbeat is not None:  # a last checkpoint may be written during this batch
            self.last_checkpoint.batch_started(trainer, pl_module)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.last_checkpoint.batch_ended():
            self._window_may_begin(trainer)
        self._mark(trainer, "train", batch_idx)

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.last_checkpoint.epoch_ended()
        self._window_may_begin(trainer)  # after the epoch's validation, before the next epoch's loader iterator

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.state.fn == TrainerFn.FITTING and not trainer.sanity_checking:  # its draws come before a window
            self._window_may_begin(trainer)

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        self.last_checkpoint.updating = True
        self.progress.mark(**{**self.progress.where, "optimizer_step": trainer.global_step + 1})

    def _eval_mark(self, trainer: pl.Trainer, batch_idx: int) -> None:
        stage = (
            "sanity check"
            if trainer.sanity_checking
            else trainer.state.stage.value
            if trainer.state.stage
            else "evaluation"
        )
        self._mark(trainer, stage, batch_idx)

    @override
    def on_validation_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        self._eval_mark(trainer, batch_idx)

    @override
    def on_validation_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._eval_mark(trainer, batch_idx)

    # Test and predict batches mark progress as validation batches do (the same hook signatures).
    on_test_batch_start = on_predict_batch_start = on_validation_batch_start
    on_test_batch_end = on_predict_batch_end = on_validation_batch_end

    @override
    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        self.last_checkpoint.saving(trainer, checkpoint, self._generators)

    # ------------------------------------------------------------- exit causes

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        heartbeat = self._heartbeat
        if self._generators is not None:
            self._generators.flush()  # the writer, if this rank is the one lost, reads them
        self._stop()  # this rank is on its way out: its silence is no stall
        if heartbeat is None:
            return
        write_exit_record(heartbeat.store, trainer.global_rank, exception, self.progress.where)
        if not is_peer_loss(exception) or self._watch is None:
            return
        causes = peer_causes(heartbeat.store, trainer.global_rank, self._watch.last_records, heartbeat.identity["host"])
        rank0_lost = 0 in causes.lost
        lines = list(causes.lines)
        if trainer.global_rank == self.last_checkpoint.writer(rank0_lost):
            lines.append(f"custom_ddp: {self.last_checkpoint.save(trainer, rank0_lost)}")
        for line in lines:
            exception.add_note(line)
            log.error("%s", line)
