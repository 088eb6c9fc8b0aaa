"""``custom_ddp``: Lightning's DDP with hand-written SyncBatchNorm, gradient sync and evaluation.

``CustomDDPStrategy`` subclasses Lightning's ``DDPStrategy``, so launching (popen by default;
fork/spawn selectable), cluster environments (torchrun, SLURM, Lightning's own), ``num_nodes``,
the process group and its timeout, ``barrier``/``broadcast``/``reduce`` and checkpoint I/O are
Lightning's. It replaces three things, each through a public seam of the strategy API:

1. **BatchNorm** (``sync_batchnorm``): at fit setup every ``BatchNorm*d`` becomes
   :class:`parallel.syncbn.SyncBatchNorm` (one collective forward, one backward) through the
   :class:`strategies.layer_sync.CustomSyncBatchNorm` plugin; teardown reverts it. The plugin is
   installed in ``setup`` because Lightning's connector overwrites ``_layer_sync`` after
   ``__init__``; ``plugins=[CustomSyncBatchNorm(group)]`` works too, and ``Trainer(
   sync_batchnorm=True)`` (CUDA-only ``torch.nn.SyncBatchNorm``) is swapped for ours.
2. **Gradients** (``sync_mode``, ``bucket_cap_mb``): the module is wrapped in
   :class:`parallel.grad_sync.SyncedDataParallel` instead of torch DDP. Lightning runs
   non-stepping micro-batches of ``accumulate_grad_batches`` inside ``block_backward_sync`` ->
   ``no_sync()``: no gradient collective at all. ``post_backward`` (after backward, before the
   precision plugin unscales/clips and ``on_before_optimizer_step``) calls ``finish()``, which
   leaves rank-averaged gradients in ``p.grad``. ``zero1`` re-creates each optimizer as a
   :class:`parallel.zero.ShardedOptimizer` (state sharded over ranks; checkpoints hold the
   consolidated state and every rank loads its shard on resume).
3. **Evaluation** (``scatter_eval``): for validation/test/sanity loaders ``process_dataloader``
   replaces Lightning's ``DistributedSampler`` (which pads shards with duplicates) by a loader
   over this rank's shard (:mod:`strategies.scatter_eval`, the one component of scatter evaluation):
   rank 0 scatters contiguous shards of the sample INDICES and every rank reads its own samples
   through the user's loader settings, so every sample is evaluated once and no sample crosses the
   network. Shards differ by one sample, so ranks run different numbers of batches and nothing may
   communicate per batch. Every torchmetrics metric of the module and of the callbacks is made
   exact without the module knowing (:mod:`parallel.metric_sync`: its compute-time sync waits for
   the rank's last step of the loader, then all metrics merge in at most four collectives);
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
import warnings
from collections.abc import Generator
from contextlib import AbstractContextManager, contextmanager
from datetime import timedelta
from typing import Any, Literal, Optional

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import _StrategyRegistry
from lightning.pytorch.plugins import TorchSyncBatchNorm
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.nn import Module
from typing_extensions import override

import lightning.pytorch as pl
from parallel.grad_sync import SyncedDataParallel
from parallel.sync_config import DEFAULT_BUCKET_CAP_MB, DEFAULT_FIRST_BUCKET_CAP_MB, GradCompression, SyncMode
from parallel.zero import ShardedOptimizer
from strategies.desync import check_desync_option, enable_desync_check, report_desync
from strategies.elastic_store import init_attempt_process_group, uses_shared_agent_store
from strategies.launchers import one_stage_launcher
from strategies.layer_sync import CustomSyncBatchNorm
from strategies.options import as_timedelta, check_options, check_syncbn_group_size
from strategies.preemption import Preemption
from strategies.scatter_eval import ScatterEvaluation
from strategies.uneven_gathers import UnevenGathers
from strategies.watchdog import DEFAULT_STALL_TIMEOUT_S, Watchdog, check_stall_timeout

__all__ = ["CustomDDPStrategy"]

log = logging.getLogger(__name__)

_REPOINTED_SCHEDULER_WARNING = r"Seems like `optimizer\.step\(\)` has been overridden after learning rate scheduler"


class CustomDDPStrategy(ScatterEvaluation, UnevenGathers, DDPStrategy):
    """Multi-process data parallelism with hand-written SyncBN, gradient sync and scatter evaluation.

    Args:
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin:
            As in ``DDPStrategy`` (normally filled in by the Trainer).
        sync_batchnorm: Convert BatchNorm layers to the hand-written SyncBatchNorm while fitting.
        syncbn_group_size: Synchronise BatchNorm statistics within groups of this many
            consecutive ranks (ranks 0..k-1, k..2k-1, ...; apex's ``create_syncbn_process_group``)
            instead of over all ranks; must divide the world size (checked at setup).
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
        stall_timeout: Optional[float] = DEFAULT_STALL_TIMEOUT_S,
    ) -> None:
        check_options(sync_batchnorm, sync_mode, bucket_cap_mb, zero1, scatter_eval, first_bucket_cap_mb=first_bucket_cap_mb,
                      grad_compression=grad_compression, syncbn_group_size=syncbn_group_size)
        check_desync_option(desync_check)
        check_stall_timeout(stall_timeout)
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
        self._sync_batchnorm = sync_batchnorm
        self._sync_mode = sync_mode
        self._bucket_cap_mb = float(bucket_cap_mb)
        self._first_bucket_cap_mb = float(first_bucket_cap_mb)
        self._grad_compression = grad_compression
        self._syncbn_group_size = syncbn_group_size
        self._syncbn_group: Optional[tuple[Any, CustomSyncBatchNorm]] = None  # (world group, plugin for its blocks)
        self._zero1 = zero1
        self._scatter_eval = scatter_eval
        self._desync_check = desync_check
        self._preemption = Preemption()  # signals stop every rank at one optimizer step
        self._watchdog = Watchdog(stall_timeout)  # a stalled rank ends the job; survivors name a failed rank
        self._running_stage: Optional[TrainerFn] = None  # between setup and teardown of a trainer call

    @property
    def sync_batchnorm(self) -> bool:
        return self._sync_batchnorm

    @property
    def sync_mode(self) -> str:
        return self._sync_mode

    @property
    def bucket_cap_mb(self) -> float:
        return self._bucket_cap_mb

    @property
    def first_bucket_cap_mb(self) -> float:
        return self._first_bucket_cap_mb

    @property
    def grad_compression(self) -> Optional[str]:
        return self._grad_compression

    @property
    def syncbn_group_size(self) -> Optional[int]:
        return self._syncbn_group_size

    @property
    def zero1(self) -> bool:
        return self._zero1

    @property
    def scatter_eval(self) -> bool:
        return self._scatter_eval

    @property
    def desync_check(self) -> bool:
        return self._desync_check

    @property
    def stall_timeout(self) -> Optional[float]:
        return self._watchdog.stall_timeout

    def busy(self, label: str) -> AbstractContextManager[None]:
        """``with strategy.busy("rank-0 report"):`` a slow phase the stall watch allows 10 x stall_timeout."""
        return self._watchdog.progress.busy(label)

    @property
    def options(self) -> dict[str, Any]:
        """This strategy's own settings, for logs, hyperparameters and benchmark records."""
        return {
            "sync_batchnorm": self._sync_batchnorm,
            "syncbn_group_size": self._syncbn_group_size,
            "sync_mode": self._sync_mode,
            "bucket_cap_mb": self._bucket_cap_mb,
            "first_bucket_cap_mb": self._first_bucket_cap_mb,
            "grad_compression": self._grad_compression,
            "zero1": self._zero1,
            "scatter_eval": self._scatter_eval,
            "desync_check": self._desync_check,
            "stall_timeout": self._watchdog.stall_timeout,
        }

    # ----------------------------------------------------------------- setup / teardown

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        self._running_stage = trainer.state.fn
        if trainer.state.fn == TrainerFn.FITTING and self._sync_batchnorm:
            self._layer_sync = self._resolve_layer_sync()
        super().setup(trainer)
        self._preemption.attach(trainer)
        self._watchdog.attach(trainer)
        log.debug("%s: setup done for %s with %s", self.__class__.__name__, trainer.state.fn, self.options)

    @override
    def setup_environment(self) -> None:
        if self._desync_check:
            enable_desync_check()  # before the process group exists: torch wraps it at creation
        super().setup_environment()

    @override
    def setup_distributed(self) -> None:
        if uses_shared_agent_store() and not dist.is_initialized():  # torchrun: see strategies.elastic_store
            self.set_world_ranks()
            init_attempt_process_group(self._get_process_group_backend(), self.global_rank, self.world_size,
                                       self._timeout)
        super().setup_distributed()  # Lightning finds the group initialised and keeps it

    def _resolve_layer_sync(self) -> CustomSyncBatchNorm | Any:
        if self._layer_sync is not None and not isinstance(self._layer_sync, TorchSyncBatchNorm):
            if self._syncbn_group_size is not None:
                raise ValueError(f"CustomDDPStrategy: syncbn_group_size={self._syncbn_group_size} and the plugin "
                                 f"{type(self._layer_sync).__name__} both choose the BatchNorm sync; pass only one")
            return self._layer_sync  # a plugin the user passed, e.g. CustomSyncBatchNorm(process_group)
        if isinstance(self._layer_sync, TorchSyncBatchNorm):
            rank_zero_info("custom_ddp: replacing torch.nn.SyncBatchNorm (sync_batchnorm=True) by the hand-written one")
        if self._syncbn_group_size is None:
            return CustomSyncBatchNorm()
        # dist.new_group is collective and its groups live as long as the world group: made once per
        # world, on every rank (a second fit in the same processes reuses them).
        if self._syncbn_group is None or self._syncbn_group[0] is not dist.group.WORLD:
            check_syncbn_group_size(self._syncbn_group_size, dist.get_world_size())
            plugin = CustomSyncBatchNorm.in_consecutive_groups(self._syncbn_group_size, self._timeout)
            self._syncbn_group = (dist.group.WORLD, plugin)
        return self._syncbn_group[1]

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
        return SyncedDataParallel(model, mode=self._sync_mode, bucket_cap_mb=self._bucket_cap_mb,
                                  first_bucket_cap_mb=self._first_bucket_cap_mb,
                                  grad_compression=self._grad_compression, carry_rank_status=True)

    @override
    def configure_ddp(self) -> None:
        # No torch DDP, hence none of DDPStrategy's comm hooks: SyncedDataParallel owns the sync.
        self.model = self._setup_model(self.model)

    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        super().setup_optimizers(trainer)
        if self._zero1:
            self.optimizers = [self._shard_optimizer(optimizer) for optimizer in self.optimizers]

    def _shard_optimizer(self, optimizer: torch.optim.Optimizer) -> ShardedOptimizer:
        """Re-create ``optimizer`` as a ZeRO-1 ShardedOptimizer and re-point its LR schedulers."""
        # The group dicts are shared with the original optimizer, so hyperparameters a scheduler
        # already set (lr, initial_lr) carry over.
        sharded = ShardedOptimizer.from_optimizer(optimizer)
        for config in self.lr_scheduler_configs:
            if config.scheduler.optimizer is optimizer:
                config.scheduler.optimizer = sharded
                # torch marks the optimizer a scheduler was built on and warns at the first
                # scheduler step that the re-pointed one's step() "has been overridden": intended.
                warnings.filterwarnings("ignore", message=_REPOINTED_SCHEDULER_WARNING, category=UserWarning)
        return sharded

    @override
    def teardown(self) -> None:
        self._preemption.detach()
        self._watchdog.detach()
        if isinstance(self.model, SyncedDataParallel):
            self.model.remove_hooks()
            self.model = self.lightning_module
        self._running_stage = None
        super().teardown()

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
            self.model.finish()
            self._preemption.after_gradient_sync(self.model)

    @override
    def on_exception(self, exception: BaseException) -> None:
        if self._desync_check and self.cluster_environment is not None:
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
