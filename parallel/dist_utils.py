"""Small process-group helpers shared by the core modules. Pure torch; no Lightning import."""

from __future__ import annotations

import itertools
from collections import defaultdict

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["broadcast_module_state", "group_world_size"]


def group_world_size(process_group: dist.ProcessGroup | None = None) -> int:
    """World size of ``process_group``; 1 when ``torch.distributed`` is not initialised."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(process_group)


def broadcast_module_state(module: nn.Module, process_group: dist.ProcessGroup | None = None) -> None:
    """Copy the group's rank 0 parameters and buffers into every rank, one broadcast per dtype."""
    src = 0 if process_group is None else dist.get_global_rank(process_group, 0)
    by_kind: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
    for tensor in itertools.chain(module.parameters(), module.buffers()):
        by_kind[(tensor.device, tensor.dtype)].append(tensor.detach())
    for tensors in by_kind.values():
        flat = torch.cat([t.reshape(-1) for t in tensors])
        dist.broadcast(flat, src=src, group=process_group)
        for tensor, chunk in zip(tensors, flat.split([t.numel() for t in tensors])):
            tensor.copy_(chunk.view_as(tensor))
