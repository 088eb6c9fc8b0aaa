"""Module buffers as torch DDP keeps them (``broadcast_buffers=True``): rank 0's values on every rank.

A buffer updated in forward from each rank's own data (a running max, an EMA, a queue, BatchNorm's
running statistics when BatchNorm is local) drifts apart per rank. :class:`BufferBroadcast` copies
rank 0's buffers to every rank in ONE broadcast: every buffer, whatever its dtype, is packed as
bytes into one flat ``uint8`` tensor (torch DDP sends one coalesced broadcast per dtype).

Left out: the running statistics of SyncBatchNorm layers (ours or torch's) that synchronise over
the same group, which every rank computes identically already. When nothing is left (every buffer
is such a statistic, e.g. a ResNet with ``sync_batchnorm=True``), :meth:`BufferBroadcast.broadcast`
communicates nothing at all. Pure torch; no Lightning import.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import record_function

from parallel.batchnorm.syncbn import SyncBatchNorm

__all__ = ["BUFFER_BROADCAST", "BufferBroadcast"]

BUFFER_BROADCAST = "SyncedDataParallel.broadcast_buffers"  # profiler label: how CollectiveCounter finds it


def _synced_over(layer: nn.Module, process_group: dist.ProcessGroup | None) -> bool:
    """Whether ``layer`` is a SyncBatchNorm whose statistics are already equal over ``process_group``."""
    if not isinstance(layer, (SyncBatchNorm, nn.SyncBatchNorm)):
        return False
    own = layer.process_group
    world = dist.group.WORLD
    return own is process_group or {own, process_group} <= {None, world}


class BufferBroadcast:
    """Broadcast ``module``'s buffers (SyncBN statistics of ``process_group`` left out) from the group's rank 0
    (:attr:`source`: another rank, where rank 0 trained nothing in a step of uneven data).

    The set of layers is read at construction; their buffers are re-read at each broadcast, so a
    buffer reassigned in forward (``self.buf = new_tensor``) is still the one sent.
    """

    def __init__(self, module: nn.Module, process_group: dist.ProcessGroup | None = None) -> None:
        self._group = process_group
        self._layers = [
            layer
            for layer in module.modules()
            if not _synced_over(layer, process_group) and any(True for _ in layer.buffers(recurse=False))
        ]
        self.source = 0  # the group rank whose buffers every rank takes (torch DDP: always 0)
        self._stale = False  # a forward may have changed buffers since the last broadcast

    def before_forward(self) -> None:
        """Broadcast now (the coming forward reads rank 0's buffers); it may change them again."""
        if self._layers:
            self.broadcast()
            self._stale = True

    def broadcast_if_stale(self) -> None:
        """Broadcast if a forward ran since the last broadcast (every rank calls it at the same point)."""
        if self._stale:
            self.broadcast()
            self._stale = False

    def buffers(self) -> list[torch.Tensor]:
        return [buffer for layer in self._layers for buffer in layer.buffers(recurse=False)]

    @torch.no_grad()
    def broadcast(self) -> None:
        """Every rank: overwrite this rank's buffers with :attr:`source`'s, in one collective."""
        buffers = self.buffers()
        if not buffers:
            return
        flat = torch.cat([b.detach().reshape(-1).view(torch.uint8) for b in buffers])
        with record_function(BUFFER_BROADCAST):
            src = self.source if self._group is None else dist.get_global_rank(self._group, self.source)
            dist.broadcast(flat, src=src, group=self._group)
        offset = 0
        for buffer in buffers:
            size = buffer.numel() * buffer.element_size()
            # clone: a slice at an odd byte offset cannot be viewed as a wider dtype
            buffer.copy_(flat[offset : offset + size].clone().view(buffer.dtype).view_as(buffer))
            offset += size
