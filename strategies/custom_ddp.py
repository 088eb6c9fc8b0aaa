"""``custom_ddp``: Lightning's DDP with hand-written SyncBatchNorm, gradient sync and evaluation.

``CustomDDPStrategy`` subclasses Lightning's ``DDPStrategy``, so launching (popen by default;
fork/spawn selectable), cluster environments (torchrun, SLURM, Lightning's own), ``num_nodes``,
the process group and its timeout, ``barrier``/``broadcast``/``reduce`` and checkpoint I/O are
Lightning's. It replaces three things through the strategy API; where Lightning has no public
seam (the DDP wrapping, the launcher, the LayerSync slot, the trainer while loaders are set up)
the private names it uses are listed in :mod:`strategies.lightning_seams` and checked at setup.
Options: one frozen, validated :class:`strategies.options.CustomDDPOptions` (``strategy.options``).

1. **BatchNorm** (``sync_batchnorm``): at fit setup every ``BatchNorm*d`` becomes
   :class:`parallel.syncbn.SyncBatchNorm` (one collective forward, one backward) through the
   :class:`strategies.layer_sync.CustomSyncBatchNorm` plugin; teardown reverts it. The plugin is
   chosen in ``setup`` (:class:`strategies.layer_sync.BatchNormSyncChoice`) because Lightning's
   connector overwrites ``_layer_sync`` after ``__init__``; ``plugins=[CustomSyncBatchNorm(group)]``
   works too, and ``Trainer(sync_batchnorm=True)`` (CUDA-only ``torch.nn.SyncBatchNorm``) is
   swapped for ours.
2. **Gradients** (``sync_mode``, ``bucket_cap_mb``): the module is wrapped in
   :class:`parallel.grad_sync.SyncedDataParallel` instead of torch DDP. Lightning runs
   non-stepping micro-batches of ``accumulate_grad_batches`` inside ``block_backward_sync`` ->
   ``no_sync()``: no gradient collective at all. A synced backward waits for its buckets in an
   autograd-engine callback before it returns, so ``on_after_backward``, code after
   ``manual_backward``, clipping and ``on_before_optimizer_step`` read rank-averaged gradients;
   ``post_backward`` calls ``finish()`` (then a no-op, or the join of a rank whose backward made no
   gradient) and reads the preemption flag that rode in the last bucket. Buffers: rank 0's before
   each training forward (``broadcast_buffers``, as ddp). ``zero1`` re-creates each optimizer as a
   :class:`parallel.zero.ShardedOptimizer` (:mod:`strategies.zero1`; state sharded over ranks;
   checkpoints hold the consolidated state and every rank loads its shard on resume).
3. **Evaluation** (``scatter_eval``): for validation/test/sanity loaders ``process_dataloader``
   replaces Lightning's ``DistributedSampler`` (which pads shards with duplicates) by a loader
   over this rank's shard (:mod:`strategies.scatter_eval`, the one component of scatter evaluation):
   rank 0 scatters contiguous shards of the sample INDICES and every rank reads its own samples
   through the user's loader settings, so every sample is evaluated once and no sample crosses the
   network. Shards differ by one sample, so ranks run different numbers of batches and nothing may
   communicate per batch. Every torchmetrics metric of the module and of the callbacks is made
   exact without the module knowing (:mod:`parallel.metric_sync`: its compute-time sync waits for
   the rank's last step of the loader, then all metrics merge in at most five collectives);
   ``self.log(sync_dist=True)`` epoch means are exact, step values stay per rank;
   :meth:`CustomDDPStrategy.all_gather` accepts uneven row counts (``ddp``'s padded shape, with a
   warning) and :meth:`CustomDDPStrategy.all_gather_samples` gives each sample once, in dataset
   order. Loggers and the progress bar stay rank-0-only as in Lightning; prediction is unchanged.

Example::

    trainer = Trainer(accelerator="cpu", devices=2, strategy="custom_ddp", accumulate_grad_batches=4)
    trainer = Trainer(strategy=CustomDDPStrategy(sync_mode="flat", zero1=True, start_method="fork"))
    # python train.py fit --trainer.strategy=custom_ddp
"""

from __future__ import annotations

import logging
from collections.abc import Generator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import asdict
from datetime import timedelta
from typing import Literal, Optional

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import _StrategyRegistry
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch.nn import Module
from typing_extensions import override

import lightning.pytorch as pl
from parallel.grad_sync import SyncedDataParallel
from parallel.sync_config import DEFAULT_BUCKET_CAP_MB, DEFAULT_FIRST_BUCKET_CAP_MB, GradCompression, SyncMode
from strategies.desync import enable_desync_check, report_desync
from strategies.elastic_store import init_attempt_process_group, uses_shared_agent_store
from strategies.launchers import one_stage_launcher
from strategies.layer_sync import BatchNormSyncChoice
from strategies.lightning_seams import check_private_seams
from strategies.options import DEFAULT_STALL_TIMEOUT_S, CustomDDPOptions, as_timedelta
from strategies.preemption import Preemption
from strategies.scatter_eval import ScatterEvaluation
from strategies.uneven_gathers import UnevenGathers
from strategies.watchdog import Watchdog
from strategies.zero1 import shard_optimizers

__all__ = ["CustomDDPStrategy"]

log = logging.getLogger(__name__)



class CustomDDPStrategy(ScatterEvaluation, UnevenGathers, DDPStrategy):
    """Multi-process data parallelism with hand-written SyncBN, gradient sync and scatter evaluation.

    Args:
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin:
            As in ``DDPStrategy`` (normally filled in by the Trainer).
        sync_batchnorm: Convert BatchNorm layers to the hand-written SyncBatchNorm while fitting.
        syncbn_group_size: Synchronise BatchNorm statistics within groups of this many
            consecutive ranks (ranks 0..k-1, k..2k-1, ...; apex's ``create_syncbn_process_group``)
            instead of over all ranks; must divide the world size (checked at setup).
        syncbn_compile: Run the SyncBatchNorm passes compiled with ``torch.compile``
            (``SyncBatchNorm(compile=True)``; the first step compiles, see README).
        sync_mode: Gradient all-reduce schedule: ``"bucketed"`` (overlapped with backward),
            ``"flat"``, ``"per_param"`` or ``"per_param_overlap"``.
        bucket_cap_mb: Bucket size cap in MiB for ``"bucketed"``.
        first_bucket_cap_mb: Cap in MiB of the first bucket (the last layers' gradients, ready
            first) for ``"bucketed"``: small, so the first all-reduce starts early in backward.
        grad_compression: ``None``, ``"bf16"`` or ``"fp16"``: all-reduce fp32 gradients in that
            dtype, half the bytes on the wire (torch DDP's ``bf16_compress_hook`` /
            ``fp16_compress_hook``; precision in :data:`parallel.sync_config.GradCompression`).
        zero1: Shard optimizer state over ranks (ZeRO stage 1).
        scatter_eval: Scatter evaluation datasets (each sample once) and reduce metric sums once
            per epoch; ``False`` falls back to Lightning's ``DistributedSampler`` behaviour.
        process_group_backend: ``"gloo"``/``"nccl"``; by default gloo on CPU, NCCL on CUDA.
        timeout: Collective timeout, a ``timedelta`` or a number of seconds (> 0); a dead peer ends
            the run with an error after it. ``None``: torch's default.
        start_method: ``"popen"`` (default, re-runs the script), ``"fork"`` or ``"spawn"``.
        desync_check: Check every collective's fingerprint across ranks (torch's
            ``TORCH_DISTRIBUTED_DEBUG=DETAIL``): a rank issuing a different collective ends the run
            with an error naming both sides instead of a wait; costs a few ms per collective of a
            step on 2 CPU ranks (:mod:`strategies.desync`, ``benchmarks/results/desync_cost``).
        broadcast_buffers: As torch DDP's: rank 0's buffers on every rank before each training
            forward, in one collective (:mod:`parallel.buffer_sync`); SyncBN statistics are left
            out, so with every BatchNorm synchronised nothing is sent. Also before validation and
            at the end of fit.
        stall_timeout: Seconds a rank may show no progress (a stopped process, a main thread that
            loops or blocks outside a collective) before every rank ends with exit status 75 and
            rank 0 prints one report naming it (:mod:`strategies.stall_watch`); ``None``: never.

    SIGTERM, SIGINT and SIGUSR1 on any rank stop every rank at the same optimizer step with a
    checkpoint and exit status 128 + signum (:mod:`strategies.preemption`).
    """

    strategy_name = "custom_ddp"

    def __init__(
        self,
        accelerator: Optional[pl.accelerators.Accelerator] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
        sync_batchnorm: bool = True,
        syncbn_group_size: Optional[int] = None,
        syncbn_compile: bool = False,
        sync_mode: SyncMode = "bucketed",
        bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
        first_bucket_cap_mb: float = DEFAULT_FIRST_BUCKET_CAP_MB,
        grad_compression: Optional[GradCompression] = None,
        zero1: bool = False,
        scatter_eval: bool = True,
        process_group_backend: Optional[str] = None,
        timeout: float | timedelta | None = default_pg_timeout,  # float first: a config dumps 90 as 90.0
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        desync_check: bool = False,
        broadcast_buffers: bool = True,
        stall_timeout: Optional[float] = DEFAULT_STALL_TIMEOUT_S,
    ) -> None:
        self._options = CustomDDPOptions(
            sync_batchnorm=sync_batchnorm, syncbn_group_size=syncbn_group_size, syncbn_compile=syncbn_compile,
            sync_mode=sync_mode, bucket_cap_mb=bucket_cap_mb, first_bucket_cap_mb=first_bucket_cap_mb,
            grad_compression=grad_compression, zero1=zero1, scatter_eval=scatter_eval, desync_check=desync_check,
            broadcast_buffers=broadcast_buffers, stall_timeout=stall_timeout)
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
        self._batchnorm_sync = BatchNormSyncChoice(syncbn_group_size, syncbn_compile, self._timeout)
        self._preemption = Preemption()  # signals stop every rank at one optimizer step
        self._watchdog = Watchdog(stall_timeout)  # a stalled rank ends the job; survivors name a failed rank
        self._running_stage: Optional[TrainerFn] = None  # between setup and teardown of a trainer call

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
        self._preemption.attach(trainer)
        self._watchdog.attach(trainer)
        log.debug("%s: setup done for %s with %s", self.__class__.__name__, trainer.state.fn, self.options)

    @override
    def setup_environment(self) -> None:
        if self._options.desync_check:
            enable_desync_check()  # before the process group exists: torch wraps it at creation
        super().setup_environment()
        log.debug("%s: environment set up (rank %d of %d)", self.__class__.__name__, self.global_rank, self.world_size)

    @override
    def setup_distributed(self) -> None:
        if uses_shared_agent_store() and not dist.is_initialized():  # torchrun: see strategies.elastic_store
            self.set_world_ranks()
            init_attempt_process_group(self._get_process_group_backend(), self.global_rank, self.world_size,
                                       self._timeout)
        super().setup_distributed()  # Lightning finds the group initialised and keeps it

    @property
    def _collective_device(self) -> torch.device:
        return self.root_device if self.process_group_backend == "nccl" else torch.device("cpu")

    @property
    def running_stage(self) -> Optional[TrainerFn]:
        """The trainer call between this strategy's setup and teardown (``None`` between calls)."""
        return self._running_stage

    @override
    def _configure_launcher(self) -> None:
        # DDPStrategy's choice of launcher, subclassed to refuse a stage started inside another.
        assert self.cluster_environment is not None
        self._launcher = one_stage_launcher(self, self._start_method)

    @override
    def _setup_model(self, model: Module) -> SyncedDataParallel:
        # carry_rank_status: the stop flag of strategies.preemption rides in the last gradient bucket.
        return SyncedDataParallel(model, **asdict(self._options.grad_sync), carry_rank_status=True,
                                  broadcast_buffers=self._options.broadcast_buffers)

    @override
    def configure_ddp(self) -> None:
        # No torch DDP, hence none of DDPStrategy's comm hooks: SyncedDataParallel owns the sync.
        self.model = self._setup_model(self.model)
        log.debug("%s: module wrapped in SyncedDataParallel (%s)", self.__class__.__name__, self._options.grad_sync)

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
        if isinstance(self.model, SyncedDataParallel):
            self.model.remove_hooks()
            self.model = self.lightning_module
        stage, self._running_stage = self._running_stage, None
        super().teardown()
        log.debug("%s: teardown done after %s", self.__class__.__name__, stage)

    # ----------------------------------------------------------------- gradient sync

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Accumulating micro-batch: backward with no gradient communication at all."""
        if isinstance(self.model, SyncedDataParallel):
            with self.model.no_sync():
                yield
        else:
            yield

    @override
    def post_backward(self, closure_loss: torch.Tensor) -> None:
        # Runs inside the optimizer closure: before unscaling, clipping and on_before_optimizer_step.
        if isinstance(self.model, SyncedDataParallel):
            self.model.finish()  # already done at the end of backward, unless this rank made no gradient
            self._preemption.after_gradient_sync(self.model)

    def _sync_buffers(self) -> None:
        # Rank 0's buffers before every rank evaluates and at the end of fit (checkpoint, return):
        # every rank reaches these points, unlike a per-batch evaluation forward.
        if isinstance(self.model, SyncedDataParallel):
            self.model.sync_buffers()

    @override
    def on_validation_start(self) -> None:
        self._sync_buffers()
        super().on_validation_start()

    @override
    def on_train_end(self) -> None:
        self._sync_buffers()
        super().on_train_end()

    @override
    def on_exception(self, exception: BaseException) -> None:
        if self._options.desync_check and self.cluster_environment is not None:
            env = self.cluster_environment
            message = report_desync(exception, self.global_rank, self.world_size, env.main_address, env.main_port)
            if message is not None:
                log.error(message)
        super().on_exception(exception)

    @override
    def barrier(self, name: Optional[str] = None) -> None:
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
                description=f"{description}, processes started with {start_method}",
                start_method=start_method,
            )
