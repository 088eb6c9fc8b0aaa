"""``custom_ddp``: Lightning's DDP with hand-written SyncBatchNorm, gradient sync and evaluation.

Wiring only: ``DDPStrategy`` keeps launching, cluster environments, the process group, ``barrier``/
``broadcast``/``reduce`` and checkpoint I/O; each replaced part lives in a room of its own:
SyncBatchNorm while fitting, :class:`parallel.gradients.grad_sync.SyncedDataParallel` instead of torch DDP
(no collective on accumulating micro-batches, averaged gradients when backward returns, rank 0's buffers
before each training forward), uneven training data per rank joined (a rank out of data runs empty
batches until every rank's ends) and ZeRO-1 (:mod:`strategies.training`); each evaluation sample once
with exact metrics (:mod:`strategies.evaluation`); a fit resumed mid-epoch trains only the batches not
yet trained, with the interrupted fit's random generators (:mod:`strategies.resume`); signals stop
every rank at one step (:mod:`strategies.stopping`); a stalled or failed rank ends the job with a
diagnosis (:mod:`strategies.fault_tolerance`). Options: :class:`strategies.options.CustomDDPOptions`.
Private Lightning names used: :mod:`strategies.lightning_seams`, checked at setup. Manual:
docs/strategy.md.

    trainer = Trainer(accelerator="cpu", devices=2, strategy="custom_ddp", accumulate_grad_batches=4)
    trainer = Trainer(strategy=CustomDDPStrategy(sync_mode="flat", zero1=True, start_method="fork"))
"""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager
from datetime import timedelta
from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import _StrategyRegistry
from lightning.fabric.utilities.distributed import _init_dist_connection
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from parallel.sync_config import DEFAULT_BUCKET_CAP_MB, GradCompression, GradTransport, SyncMode
from strategies.evaluation import ScatterEvaluation, UnevenGathers
from strategies.fault_tolerance import (
    Watchdog,
    collective_bound,
    enable_desync_check,
    log_desync,
    rendezvous_store,
    startup_bound,
)
from strategies.launchers import one_stage_launcher
from strategies.lightning_seams import check_private_seams
from strategies.options import (
    DDP_FLAGS,
    DEFAULT_STALL_TIMEOUT_S,
    CustomDDPOptions,
    UnevenData,
    as_timedelta,
    ddp_flags_given,
)
from strategies.resume import ExactResume
from strategies.stopping import Preemption
from strategies.training import BatchNormSyncChoice, SyncedTraining, UnevenTraining, shard_optimizers

__all__ = ["CustomDDPStrategy"]

log = logging.getLogger(__name__)


class CustomDDPStrategy(UnevenTraining, SyncedTraining, ExactResume, ScatterEvaluation, UnevenGathers, DDPStrategy):
    """Multi-process data parallelism with hand-written SyncBN, gradient sync and scatter evaluation.

    Args:
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin,
            process_group_backend: As in ``DDPStrategy`` (normally filled in by the Trainer).
        sync_batchnorm: Convert BatchNorm layers to the hand-written SyncBatchNorm while fitting.
        syncbn_group_size: Sync BatchNorm within groups of this many consecutive ranks (must divide the world size).
        syncbn_compile: Run the SyncBatchNorm passes with ``torch.compile`` (the first step compiles).
        sync_mode: ``"bucketed"`` (overlapped with backward), ``"flat"``, ``"per_param"`` or ``"per_param_overlap"``.
        bucket_cap_mb: Bucket size cap in MiB for ``"bucketed"``.
        first_bucket_cap_mb: Cap in MiB of the first bucket; ``None``: 1 MiB on NCCL, ``bucket_cap_mb`` on gloo.
        grad_compression: ``None``, ``"bf16"`` or ``"fp16"``: all-reduce fp32 gradients in that dtype.
        grad_transport: ``"auto"``: CPU ranks on one host sum buckets in shared memory; ``"process_group"``,
        ``"shared_memory"``.
        zero1: Shard optimizer state over ranks (ZeRO stage 1).
        scatter_eval: Evaluate each sample once with exact metrics; ``False``: Lightning's ``DistributedSampler``.
        timeout: Collective timeout, a ``timedelta`` or seconds (> 0); ``None``: torch's default.
        startup_timeout: How long the start waits for every rank, a ``timedelta`` or seconds (> 0); ``None``:
            the longer of ``timeout`` and 30 minutes (``ddp`` bounds its start by ``timeout``).
        start_method: ``"popen"`` (default, re-runs the script), ``"fork"``, ``"spawn"`` or ``"forkserver"``.
        desync_check: Check every collective's fingerprint across ranks; a mismatch ends the run naming both sides.
        broadcast_buffers: Rank 0's buffers on every rank before each training forward (as torch DDP's).
        stall_timeout: Seconds without progress on a rank before every rank ends (exit 75); ``None``: never.
        exact_resume: A fit resumed mid-epoch trains only the batches the interrupted epoch had not, and every
            checkpoint saved while fitting holds every rank's random generators, restored on resuming.
        uneven_data: ``"join"``: a rank whose training data ends first runs empty batches until every rank's
            has (gradients averaged over the ranks that trained); ``"refuse"``: an error naming the counts.
        find_unused_parameters, static_graph, gradient_as_bucket_view: torch DDP's flags, accepted so that a
            ``ddp`` configuration runs unchanged; no effect (custom_ddp does what each asks for either way).

    SIGTERM, SIGINT and SIGUSR1 on any rank stop every rank at the same optimizer step with a
    checkpoint and exit status 128 + signum. Details per option: docs/strategy.md#options.
    """

    strategy_name = "custom_ddp"

    def __init__(
        self,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        sync_batchnorm: bool = True,
        syncbn_group_size: int | None = None,
        syncbn_compile: bool = False,
        sync_mode: SyncMode = "bucketed",
        bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
        first_bucket_cap_mb: float | None = None,
        grad_compression: GradCompression | None = None,
        grad_transport: GradTransport = "auto",
        zero1: bool = False,
        scatter_eval: bool = True,
        process_group_backend: str | None = None,
        timeout: float | timedelta | None = default_pg_timeout,  # float first: a config dumps 90 as 90.0
        startup_timeout: float | timedelta | None = None,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        desync_check: bool = False,
        broadcast_buffers: bool = True,
        stall_timeout: float | None = DEFAULT_STALL_TIMEOUT_S,
        exact_resume: bool = True,
        uneven_data: UnevenData = "join",
        find_unused_parameters: bool | None = None,
        static_graph: bool | None = None,
        gradient_as_bucket_view: bool | None = None,
    ) -> None:
        self._options = CustomDDPOptions.pick(locals())  # validated once: one error names every bad value
        for name, value in ddp_flags_given(locals()).items():
            rank_zero_info(f"custom_ddp: {name}={value}, a ddp option, has no effect here: {DDP_FLAGS[name]}")
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=as_timedelta(timeout),
            start_method=start_method,
        )
        self._startup_timeout = as_timedelta(startup_timeout, "startup_timeout")
        self._batchnorm_sync = BatchNormSyncChoice(syncbn_group_size, syncbn_compile, self._timeout)
        self._preemption = Preemption()  # signals stop every rank at one optimizer step
        self._watchdog = Watchdog(stall_timeout)  # a stalled rank ends the job; survivors name a failed rank
        self._running_stage: TrainerFn | None = None  # between setup and teardown of a trainer call

    @property
    def options(self) -> CustomDDPOptions:
        """This strategy's own settings (``options.as_dict()`` for logs, hyperparameters, records)."""
        return self._options

    def busy(self, label: str) -> AbstractContextManager[None]:
        """``with strategy.busy("rank-0 report"):`` a slow phase the stall watch allows 10 x stall_timeout."""
        return self._watchdog.progress.busy(label)

    # ----------------------------------------------------------------- setup / teardown

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        check_private_seams()
        self._running_stage = trainer.state.fn
        if trainer.state.fn == TrainerFn.FITTING and self._options.sync_batchnorm:
            self._layer_sync = self._batchnorm_sync.plugin(self._layer_sync)
        super().setup(trainer)
        self._preemption.attach(trainer, self.cluster_environment, self.launcher)
        self._watchdog.attach(trainer, self.cluster_environment, self._options.zero1, self._options.exact_resume)
        log.debug("%s: setup done for %s with %s", self.__class__.__name__, trainer.state.fn, self.options)

    @override
    def setup_environment(self) -> None:
        if self._options.desync_check:
            enable_desync_check()  # before the process group exists: torch wraps it at creation
        super().setup_environment()
        log.debug("%s: environment set up (rank %d of %d)", self.__class__.__name__, self.global_rank, self.world_size)

    @override
    def setup_distributed(self) -> None:
        if not dist.is_initialized():  # a group user code made first is kept, as ddp keeps it
            self._init_process_group()
        super().setup_distributed()  # Lightning finds the group initialised and keeps it

    def _init_process_group(self) -> None:
        # torch bounds the rendezvous and every collective by one timeout: a timeout short enough to end a
        # hung job soon would fail ranks that start apart. Every rank joins the job's store first, bounded
        # by startup_timeout; the group is made on that store, bounded by timeout.
        self.set_world_ranks()
        assert self.cluster_environment is not None
        backend, environment = self._get_process_group_backend(), self.cluster_environment
        store = rendezvous_store(
            environment.main_address,
            environment.main_port,
            self.global_rank,
            self.world_size,
            startup_bound(self._startup_timeout, self._timeout, backend),
            collective_bound(self._timeout, backend),
        )
        device_id = self.root_device if self.root_device.type != "cpu" else None  # as DDPStrategy passes it
        _init_dist_connection(
            environment,
            backend,
            self.global_rank,
            self.world_size,
            timeout=self._timeout,
            store=store,
            device_id=device_id,
        )

    @property
    def _collective_device(self) -> torch.device:
        return self.root_device if self.process_group_backend == "nccl" else torch.device("cpu")

    @property
    def running_stage(self) -> TrainerFn | None:
        """The trainer call between this strategy's setup and teardown (``None`` between calls)."""
        return self._running_stage

    @override
    def _configure_launcher(self) -> None:
        # DDPStrategy's choice of launcher, subclassed to refuse a stage started inside another.
        assert self.cluster_environment is not None
        self._launcher = one_stage_launcher(self, self._start_method)

    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        super().setup_optimizers(trainer)
        if self._options.zero1:
            self.optimizers = shard_optimizers(self.optimizers, self.lr_scheduler_configs)
            log.debug("%s: %d optimizer(s) sharded (ZeRO-1)", self.__class__.__name__, len(self.optimizers))

    @override
    def teardown(self) -> None:
        self._preemption.detach()
        self._watchdog.detach()
        stage, self._running_stage = self._running_stage, None
        super().teardown()
        log.debug("%s: teardown done after %s", self.__class__.__name__, stage)

    @override
    def on_exception(self, exception: BaseException) -> None:
        # A rank's (popen, torchrun). Under fork/spawn/forkserver Lightning runs it in the launching
        # process only, which is no rank and has no process group: the workers' own path is
        # on_worker_exception. Without the guard that process reported a "desync of rank 0".
        if self._options.desync_check and self.cluster_environment is not None and dist.is_initialized():
            log_desync(exception, self.global_rank, self.world_size, self.cluster_environment)
        super().on_exception(exception)

    def on_worker_exception(self, trainer: pl.Trainer, exception: BaseException) -> None:
        """A fork/spawn/forkserver worker's exception path (called by its launcher before the error
        travels to the launching process): what Lightning's interrupt path runs in a popen rank, for
        this strategy's parts only: the exit record, a lost peer's diagnosis and last checkpoint
        (:mod:`strategies.fault_tolerance.watchdog`), the desync report. Users' callbacks keep Lightning's order (their
        ``on_exception`` runs in the launching process, as under ``ddp``)."""
        if self._watchdog in trainer.callbacks:
            self._watchdog.on_exception(trainer, trainer.lightning_module, exception)
        self.on_exception(exception)

    @override
    def on_train_start(self) -> None:
        super().on_train_start()  # a resumed fit's generators are restored here (strategies.resume.exact_resume)
        self._watchdog.training_starts(self.lightning_module.trainer, self.generators_at_train_start())

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        self.save_epoch_order(checkpoint)
        if self._watchdog.writing_last_checkpoint and not self.is_global_zero:  # rank 1's, rank 0 being lost
            self.checkpoint_io.save_checkpoint(checkpoint, filepath, storage_options=storage_options)
            return
        if not self._watchdog.ending:  # every rank saves; a last checkpoint's writer has no peer left to ask
            self.save_rng_states(checkpoint)
        super().save_checkpoint(checkpoint, filepath, storage_options)

    @override
    def barrier(self, name: str | None = None) -> None:
        if self._watchdog.ending:  # the last checkpoint of a stalled or failed job: no peer left to meet
            return
        super().barrier(name)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        description = "DDP with hand-written SyncBatchNorm, bucketed gradient sync and scatter evaluation"
        strategy_registry.register(cls.strategy_name, cls, description=description)
        # Like Lightning's ddp_fork / ddp_spawn: the same strategy with another start method.
        for start_method in ("fork", "spawn"):
            strategy_registry.register(
                f"{cls.strategy_name}_{start_method}",
                cls,
                start_method=start_method,
                description=f"{description}, processes started with {start_method}",
            )
