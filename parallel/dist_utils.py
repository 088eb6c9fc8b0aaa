"""Small process-group helpers shared by the core modules. Pure torch; no Lightning import."""

from __future__ import annotations

import hashlib
import itertools
from collections import defaultdict
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["broadcast_module_state", "check_same_layout", "consecutive_rank_group", "group_world_size", "module_layout"]


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
        for tensor, chunk in zip(tensors, flat.split([t.numel() for t in tensors]), strict=True):
            tensor.copy_(chunk.view_as(tensor))


def module_layout(module: nn.Module) -> list[str]:
    """One line per parameter and buffer of ``module``: what every rank's copy must share to be averaged."""
    named = itertools.chain(
        (("parameter", name, t) for name, t in module.named_parameters()),
        (("buffer", name, t) for name, t in module.named_buffers()),
    )
    return [
        f"{kind} {name} of shape {tuple(t.shape)}, {str(t.dtype).removeprefix('torch.')}, strides {t.stride()}"
        for kind, name, t in named
    ]


def check_same_layout(module: nn.Module, process_group: dist.ProcessGroup | None = None) -> None:
    """Raise ``ValueError`` on every rank of the group when the ranks' copies of ``module`` differ in a parameter's
    or buffer's name, shape, dtype or strides (torch DDP checks the same): rank 0's values would be broadcast into
    tensors of another shape and gradients summed element by element across different tensors. One all_gather
    of a digest; the layouts themselves only when they differ."""
    lines = module_layout(module)
    digest = int.from_bytes(hashlib.sha256("\n".join(lines).encode()).digest()[:8], "little", signed=True)
    nccl = dist.get_backend(process_group) == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    mine = torch.tensor([digest], dtype=torch.int64, device=device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(process_group))]
    dist.all_gather(every, mine, group=process_group)
    if all(torch.equal(other, mine) for other in every):
        return
    layouts: list[list[str] | None] = [None] * len(every)
    dist.all_gather_object(layouts, lines, group=process_group)
    raise ValueError(_first_difference(layouts))  # type: ignore[arg-type]


def _first_difference(layouts: list[list[str]]) -> str:
    rank = next(r for r, lines in enumerate(layouts) if lines != layouts[0])
    first, other = layouts[0], layouts[rank]
    at = next((i for i, (a, b) in enumerate(zip(first, other, strict=False)) if a != b), min(len(first), len(other)))
    line = lambda lines: lines[at] if at < len(lines) else "nothing more"  # noqa: E731
    return (
        f"the ranks' models differ, so their gradients cannot be averaged: rank 0 has {len(first)} parameters and "
        f"buffers, rank {rank} has {len(other)}; the first difference: rank 0 has {line(first)}, rank {rank} has "
        f"{line(other)}. Build the same model on every rank: sizes that do not depend on the rank or its data, "
        "the same dtype and memory format"
    )


def consecutive_rank_group(group_size: int, timeout: timedelta | None = None) -> dist.ProcessGroup:
    """This rank's group among the world's blocks of ``group_size`` consecutive ranks.

    Ranks ``[0, k)``, ``[k, 2k)``, ... form one group each (apex's ``create_syncbn_process_group``
    layout: on a multi-GPU node, neighbours share a machine). Every rank must call this, with the
    same ``group_size``: ``dist.new_group`` is itself collective and creates every block's group on
    every rank, in the same order. ``timeout`` bounds the new groups' collectives (default: the
    process group default). Raises ``ValueError`` on every rank, before any group exists, when
    ``group_size`` does not divide the world size.
    """
    world_size = dist.get_world_size()
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1 or world_size % group_size:
        raise ValueError(f"group_size={group_size!r} must be an int >= 1 that divides the world size {world_size}")
    rank = dist.get_rank()
    own = None
    for first in range(0, world_size, group_size):
        group = dist.new_group(list(range(first, first + group_size)), timeout=timeout)
        if first <= rank < first + group_size:
            own = group
    assert own is not None
    return own
