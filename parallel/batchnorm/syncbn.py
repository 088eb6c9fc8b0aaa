"""Synchronised BatchNorm: batch statistics over the batches of every rank, on any device.

A drop-in for ``torch.nn.BatchNorm{1,2,3}d`` whose training-mode statistics are aggregated over
all ranks of a process group with exactly one collective in forward and one in backward (the
math and its hand-derived backward live in :mod:`parallel.batchnorm.syncbn_function`; on CUDA the same math runs in
Triton kernels, :mod:`parallel.batchnorm.syncbn_fused`). Unlike
``torch.nn.SyncBatchNorm`` it runs on CPU/gloo as well as CUDA/NCCL, and it is not a subclass of
it (torch DDP rejects that class on CPU).

Example:
    >>> net = SyncBatchNorm.convert(torchvision.models.resnet18())  # doctest: +SKIP
    >>> net = SyncBatchNorm.revert(net)  # the same BatchNorm2d objects again  # doctest: +SKIP

Pure torch; no Lightning import (the Lightning adapter is :mod:`strategies.training.layer_sync`).
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from parallel.batchnorm import syncbn_fused
from parallel.batchnorm.syncbn_convert import BatchNormXd, defines_dim_check, original_of, replace_modules, replacement
from parallel.batchnorm.syncbn_function import StatsExchange, sync_batch_norm
from parallel.batchnorm.syncbn_kernels import COMPILED_KERNELS
from parallel.torch_compat import drop_bias, norm_bias_kwargs, reset_norm_parameters

__all__ = ["SyncBatchNorm", "SyncBatchNorm1d", "SyncBatchNorm2d", "SyncBatchNorm3d"]


class SyncBatchNorm(_BatchNorm):
    """BatchNorm over (N, C), (N, C, L), (N, C, H, W) or (N, C, D, H, W) with cross-rank statistics.

    Statistics are synchronised only in training mode when ``torch.distributed`` is initialised
    and the group has more than one rank; otherwise the layer runs torch's native batch norm, as
    ``torch.nn.SyncBatchNorm`` does (one rank pays nothing for the layer). Eval mode uses the
    running statistics like torch. Every rank of the group must call forward and backward of this
    layer the same number of times, also ranks whose local batch is empty. A layer made by
    :meth:`convert` accepts the input ranks the replaced layer accepted (``BatchNorm2d``: 4D only);
    one built directly accepts 2D to 5D. :meth:`convert` makes a ``BatchNorm{1,2,3}d`` (or a subclass of one) a
    :class:`SyncBatchNorm1d` / ``2d`` / ``3d``, which is also an instance of that torch class.

    Args:
        num_features: Number of channels C.
        eps: Added to the variance for numerical stability.
        momentum: Weight of the batch statistics in the running averages; ``None`` for a
            cumulative moving average.
        affine: Learn a per-channel scale and shift.
        track_running_stats: Keep running mean/variance for eval mode.
        process_group: Group to synchronise over; ``None`` for the default (world) group.
        device: Device of parameters and buffers.
        dtype: Dtype of parameters and buffers.
        bias: With ``affine``, learn the shift as well (keyword-only, as in torch).
        compile: Run the training-mode passes compiled with ``torch.compile`` (the same math as
            the eager kernel, fused: :mod:`parallel.batchnorm.syncbn_kernels`); the first training step
            compiles (~20 s on CPU with a cold inductor cache, ~3 s per new layer shape). If
            compiling fails the layer warns once and runs eagerly. Off by default: see docs/strategy.md. Without
            it, and with it for the inputs the compiled passes leave ((N, C) and small ones), CUDA inputs run the
            Triton kernels of :mod:`parallel.batchnorm.syncbn_fused` (if Triton imports).
        force_sync: Run the hand-written synchronising kernel where nothing is synchronised as well
            (a one-rank group: its collectives run on it; no process group: local statistics), not
            torch's native batch norm: for benchmarks and tests of the kernel.
    """

    # What revert makes of a layer built directly, and (unless BatchNormXd) whose input check it applies.
    _torch_class: ClassVar[type[_BatchNorm]] = BatchNormXd

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        process_group: dist.ProcessGroup | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        bias: bool = True,
        compile: bool = False,
        force_sync: bool = False,
    ) -> None:
        factory = {"device": device, "dtype": dtype, **norm_bias_kwargs(bias)}
        super().__init__(num_features, eps, momentum, affine, track_running_stats, **factory)
        drop_bias(self, bias)
        for name, flag in (("compile", compile), ("force_sync", force_sync)):
            if not isinstance(flag, bool):
                raise TypeError(f"SyncBatchNorm: {name}={flag!r} must be a bool")
        self.process_group = process_group
        # Not `self.compile`: that is nn.Module.compile(), which compiles the whole module.
        self.compile_kernel = compile
        self.force_sync = force_sync
        # The layer `convert` replaced, so that `revert` hands back that very object. Set with
        # object.__setattr__: registered as a submodule it would enter state_dict, parameters()
        # and module traversals twice.
        object.__setattr__(self, "_original_module", None)
        # Another transport for this layer's two collectives (use_exchange); not state: never pickled.
        self._exchange: StatsExchange | None = None

    def reset_parameters(self) -> None:
        reset_norm_parameters(self)

    @property
    def original_module(self) -> _BatchNorm | None:
        """The layer :meth:`convert` replaced (``None`` for a layer built directly)."""
        return self._original_module

    def _check_input_dim(self, input: Tensor) -> None:
        original = self._original_module
        if original is not None and defines_dim_check(original):
            # As strict as the replaced class, with its (torch's) message.
            original._check_input_dim(input)
        elif original is None and self._torch_class is not BatchNormXd:
            self._torch_class._check_input_dim(self, input)
        elif input.dim() not in (2, 3, 4, 5):
            raise ValueError(
                f"SyncBatchNorm expects a 2D-5D input (N, C, *), got {input.dim()}D input of "
                f"shape {tuple(input.shape)}; add a batch dimension for a single sample."
            )
        if input.dim() < 2 or input.shape[1] != self.num_features:
            raise ValueError(
                f"SyncBatchNorm was built for num_features={self.num_features} channels, got "
                f"input of shape {tuple(input.shape)}; channels must be in dim 1."
            )
        if not input.is_floating_point():
            raise ValueError(
                f"SyncBatchNorm expects a floating-point input, got dtype {input.dtype}; convert it with .float()."
            )

    def forward(self, input: Tensor) -> Tensor:
        self._check_input_dim(input)
        # Parameters and buffers are read once: each nn.Module attribute lookup costs ~0.5 us,
        # a sizeable share of a small layer's call.
        running_mean, running_var = self.running_mean, self.running_var
        if not self.training and running_mean is not None and running_var is not None:
            return self._normalize_with_running_stats(input)
        momentum = 0.0 if self.momentum is None else self.momentum
        num_batches_tracked = self.num_batches_tracked
        if self.training and self.track_running_stats:
            assert num_batches_tracked is not None
            if self.momentum is None:  # cumulative moving average, as in torch
                momentum = 1.0 / float(num_batches_tracked + 1)
        else:  # running stats are updated only in training (eval without them uses batch stats)
            running_mean = running_var = None
        group, world_size = self._sync_group()
        if group is None and not self.force_sync:
            # Nothing to synchronise: torch's own fused kernel (cuDNN on a GPU), as torch's SyncBatchNorm does.
            output = F.batch_norm(input, running_mean, running_var, self.weight, self.bias, True, momentum, self.eps)
        else:
            args = (self.weight, self.bias, running_mean, running_var, momentum, self.eps, group, world_size)
            # compile=True: the compiled passes where they apply; an input they leave ((N, C), small) takes the
            # default path. CUDA: the same math in Triton kernels; in a model the user compiles, the eager ops, which
            # dynamo traces.
            compiled = self.compile_kernel and COMPILED_KERNELS.handles(input)
            if not compiled and not torch.compiler.is_compiling() and syncbn_fused.handles(input):
                output = syncbn_fused.FusedSyncBatchNorm.apply(input, *args)
            else:
                exchange = self._exchange if group is not None else None
                output = sync_batch_norm(input, *args, COMPILED_KERNELS if compiled else None, exchange)
        if running_mean is not None:
            # Counted once the statistics are in, as the running averages are: a forward that fails in
            # its collective (a peer lost) leaves the layer as it was, and a checkpoint written then
            # resumes exactly.
            num_batches_tracked.add_(1)
        return output

    def _sync_group(self) -> tuple[dist.ProcessGroup | None, int]:
        """The group to synchronise over and its size; ``(None, 1)`` when statistics stay local."""
        if not (self.training and dist.is_available() and dist.is_initialized()):
            return None, 1
        group = dist.group.WORLD if self.process_group is None else self.process_group
        world_size = dist.get_world_size(group)
        return (group, world_size) if world_size > 1 or self.force_sync else (None, 1)

    def _normalize_with_running_stats(self, input: Tensor) -> Tensor:
        """Eval mode: a fixed per-channel affine map; plain ops, so autograd derives it."""
        assert self.running_mean is not None and self.running_var is not None
        shape = (1, -1, *([1] * (input.dim() - 2)))
        acc_dtype = torch.promote_types(input.dtype, torch.float32)
        scale = torch.rsqrt(self.running_var.to(acc_dtype) + self.eps)
        if self.weight is not None:
            scale = scale * self.weight
        shift = -self.running_mean.to(acc_dtype) * scale
        if self.bias is not None:
            shift = shift + self.bias
        return torch.addcmul(shift.view(shape), input, scale.view(shape)).to(input.dtype)

    def __getstate__(self) -> dict:
        # A copy or an unpickled layer synchronises through its process group: the exchange maps this process's
        # shared memory and is attached again by whoever made it (use_exchange).
        return {**super().__getstate__(), "_exchange": None}

    @staticmethod
    def use_exchange(module: nn.Module, exchange: StatsExchange | None, process_group: dist.ProcessGroup | None) -> int:
        """Send the collectives of every :class:`SyncBatchNorm` in ``module`` that synchronises over
        ``process_group`` (``None``: the world) through ``exchange`` (:mod:`parallel.host.host_exchange`, the same
        ranks); ``None`` puts them back on the process group. Returns how many layers it set."""
        layers = [m for m in module.modules() if isinstance(m, SyncBatchNorm) and m.process_group is process_group]
        for layer in layers:
            layer._exchange = exchange
        return len(layers)

    @staticmethod
    def largest_statistics(module: nn.Module) -> int:
        """Bytes of the largest statistics exchange any :class:`SyncBatchNorm` in ``module`` makes: ``2C + 1`` values
        of float64, the widest accumulation dtype."""
        channels = [m.num_features for m in module.modules() if isinstance(m, SyncBatchNorm)]
        return (2 * max(channels, default=0) + 1) * torch.float64.itemsize

    def extra_repr(self) -> str:
        text = super().extra_repr()
        if self.affine and self.bias is None and "bias=" not in text:  # torch < 2.12 does not show it
            text += ", bias=False"
        flags = {"compile": self.compile_kernel, "force_sync": self.force_sync}
        return text + "".join(f", {name}=True" for name, on in flags.items() if on)

    @classmethod
    def convert(
        cls, module: nn.Module, process_group: dist.ProcessGroup | None = None, *, compile: bool = False
    ) -> nn.Module:
        """Replace every BatchNorm layer in ``module`` recursively, like torch's converter.

        Every ``_BatchNorm`` instance is replaced: ``BatchNorm{1,2,3}d``, subclasses of them or
        of ``_BatchNorm``, and ``torch.nn.SyncBatchNorm``; layers of this class stay. As in
        torch, a subclass's own ``forward`` and extra parameters are not used while converted.
        Parameters and buffers are shared with the replaced layers (not copied), so
        ``requires_grad``, values, device and dtype carry over; so do the training flag,
        ``qconfig``, child modules and hooks (the registries are shared: a forward hook registered on the
        BatchNorm keeps running, its handle still removes it). A layer reachable from several places (``self.backbone =
        self.net[:2]``, an alias ``self.bn = self.net[1]``) becomes ONE new layer in all of them, so
        ``.eval()`` or ``track_running_stats`` set through any of its names reaches the layer that runs
        (torch's converter makes one copy per place and skips a second name in the same parent).

        Args:
            module: A model, or a single BatchNorm layer.
            process_group: Group the new layers synchronise over; ``None`` for the world.
            compile: Build the new layers with ``compile=True`` (see the class).

        Returns:
            ``module`` itself with its children replaced, or the new layer if ``module`` is one.

        Raises:
            ValueError: a lazy BatchNorm has not been initialised by a first forward yet.
        """
        return replace_modules(module, lambda layer: cls._converted(layer, process_group, compile))

    @classmethod
    def convert_sync_batchnorm(cls, module: nn.Module, process_group: dist.ProcessGroup | None = None) -> nn.Module:
        """Alias of :meth:`convert` under ``torch.nn.SyncBatchNorm``'s name."""
        return cls.convert(module, process_group)

    @classmethod
    def _converted(cls, module: nn.Module, process_group: dist.ProcessGroup | None, compile: bool) -> nn.Module:
        if not isinstance(module, _BatchNorm) or isinstance(module, cls):
            return module
        layer_class = cls  # a subclass of this class converts to itself
        if cls is SyncBatchNorm:
            layer_class = next((c for c in _BY_DIMENSION if isinstance(module, c._torch_class)), cls)
        return replacement(module, layer_class, process_group=process_group, compile=compile)

    @staticmethod
    def revert(module: nn.Module) -> nn.Module:
        """Undo :meth:`convert`: every :class:`SyncBatchNorm` gives back the layer it replaced.

        That is the original object (same class, hooks and attributes) holding the current
        parameters and buffers, which may have been reassigned meanwhile (e.g. by ``.to()``), the hooks
        registered meanwhile and the flags set meanwhile (``track_running_stats``, ``momentum``, ``eps``, mode).
        A layer built directly as :class:`SyncBatchNorm` becomes a ``BatchNorm`` accepting any
        of the input ranks this class accepts; one built as :class:`SyncBatchNorm2d` a ``BatchNorm2d``.

        Args:
            module: A model, or a single :class:`SyncBatchNorm` layer.

        Returns:
            ``module`` itself with its children reverted, or the restored layer if ``module`` is one.
        """
        return replace_modules(module, SyncBatchNorm._reverted, children_first=True)

    @staticmethod
    def _reverted(module: nn.Module) -> nn.Module:
        return original_of(module, module._torch_class) if isinstance(module, SyncBatchNorm) else module


class SyncBatchNorm1d(SyncBatchNorm, nn.BatchNorm1d):
    """What :meth:`SyncBatchNorm.convert` makes of a ``BatchNorm1d``: also an ``nn.BatchNorm1d``, so code that
    tests ``isinstance(module, nn.BatchNorm1d)`` (to freeze BatchNorm layers, to build weight-decay groups)
    finds it while the model is converted."""

    _torch_class = nn.BatchNorm1d


class SyncBatchNorm2d(SyncBatchNorm, nn.BatchNorm2d):
    """:class:`SyncBatchNorm1d` for ``BatchNorm2d``."""

    _torch_class = nn.BatchNorm2d


class SyncBatchNorm3d(SyncBatchNorm, nn.BatchNorm3d):
    """:class:`SyncBatchNorm1d` for ``BatchNorm3d``."""

    _torch_class = nn.BatchNorm3d


_BY_DIMENSION = (SyncBatchNorm1d, SyncBatchNorm2d, SyncBatchNorm3d)
