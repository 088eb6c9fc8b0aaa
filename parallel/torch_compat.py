"""What moved between the torch releases this project supports (2.11 and later), in one place.

The oldest supported torch is the one the lent GPU machines carry (2.11): it sets the floor in
``pyproject.toml``. Each seam below names the release that moved the API; CI runs the SyncBN,
gradient-sync and strategy tests on the floor as well (``.ci/run``).

Pure torch; no Lightning import.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch.distributed as dist
from torch.nn import init
from torch.nn.modules.batchnorm import _NormBase
from torch.nn.parallel import DistributedDataParallel

__all__ = [
    "DDP_SYNC_BUFFERS",
    "all_gather_single",
    "drop_bias",
    "make_norm",
    "norm_bias_kwargs",
    "reset_norm_parameters",
]

# torch 2.14 renamed all_gather_into_tensor (now deprecated) to all_gather_single.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

# torch 2.14 renamed DDP's broadcast_buffers (rank 0's buffers before each forward; now deprecated) to
# forward_sync_buffers: the name this torch's DDP takes (torch 2.11 rejects the new one).
DDP_SYNC_BUFFERS = next(
    name
    for name in ("forward_sync_buffers", "broadcast_buffers")
    if name in inspect.signature(DistributedDataParallel.__init__).parameters
)

# torch 2.12 added `bias=` to the BatchNorm constructors; before it, every affine layer has a bias.
_NORM_TAKES_BIAS = "bias" in inspect.signature(_NormBase.__init__).parameters


def norm_bias_kwargs(bias: bool) -> dict[str, bool]:
    """The ``bias=`` keyword of a torch BatchNorm constructor, where this torch has it (else :func:`drop_bias`)."""
    return {"bias": bias} if _NORM_TAKES_BIAS else {}


def drop_bias(layer: _NormBase, bias: bool) -> None:
    """Without ``bias``, remove the shift an older torch's constructor made (torch 2.12 and later made none)."""
    if not bias and layer.bias is not None:
        layer.register_parameter("bias", None)


def make_norm(norm_class: type[_NormBase], *args: Any, bias: bool = True, **kwargs: Any) -> _NormBase:
    """``norm_class(*args, bias=bias, **kwargs)`` on every supported torch."""
    layer = norm_class(*args, **kwargs, **norm_bias_kwargs(bias))
    drop_bias(layer, bias)
    return layer


def reset_norm_parameters(layer: _NormBase) -> None:
    """``_NormBase.reset_parameters`` that also holds for a layer without a shift (torch < 2.12 assumes one)."""
    layer.reset_running_stats()
    if layer.weight is not None:
        init.ones_(layer.weight)
    if layer.bias is not None:
        init.zeros_(layer.bias)
