"""All-reduce (average) written from point-to-point messages: ring and butterfly.

Both functions average a floating-point tensor in place over a process group using only
``dist.isend`` / ``dist.irecv``, and both send the bandwidth-optimal ``2 * (N - 1) / N`` tensor
sizes per rank. They split the flat tensor into ``N`` near-equal chunks (``torch.tensor_split``:
sizes differ by at most one element, so any length works, including lengths shorter than ``N``
where some chunks are empty) and make exactly one rank the owner of each chunk's final value:

* ``ring_all_reduce``: reduce-scatter then all-gather around the ring ``rank -> rank + 1``, one
  chunk per step, ``2 * (N - 1)`` steps. Each rank talks to two neighbours and needs two
  chunk-sized receive buffers; latency grows with N.
* ``butterfly_all_reduce``: the same two phases done all-to-all in one step each (every rank sends
  chunk ``j`` straight to its owner ``j``, the owner averages, then sends the result to everyone).
  Two steps whatever N is, at the price of ``N - 1`` simultaneous peers and an ``N``-chunk receive
  buffer.

Because the owner divides by ``N`` before broadcasting its chunk, every rank ends with
bit-identical values. Summation order within a chunk is fixed (ring order, or rank order for the
butterfly), so the result is also identical run to run.

Receives are posted before the data they wait for is due: gloo transfers a message only after
the receiver has posted its receive, so a late ``irecv`` costs a round trip per step. Tested on
gloo (CPU); the calls are backend-neutral. Pure torch; no Lightning import.

Example:
    >>> grad = torch.randn(1000)
    >>> ring_all_reduce(grad)  # doctest: +SKIP  (inside an initialised process group)
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["butterfly_all_reduce", "ring_all_reduce"]


def ring_all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Average ``tensor`` in place across ``group`` with a ring reduce-scatter + all-gather.

    Args:
        tensor: Floating-point tensor of the same shape and dtype on every rank.
        group: Process group; the default (world) group when ``None``.

    Returns:
        ``tensor`` itself, now holding the element-wise mean over the group's ranks.

    Raises:
        TypeError: ``tensor`` is not a floating-point ``torch.Tensor``.
        RuntimeError: ``torch.distributed`` is not initialised.
        ValueError: this process is not a member of ``group``.
    """
    flat, group, rank, world_size = _prepare(tensor, group)
    if world_size == 1:
        return tensor
    chunks = flat.tensor_split(world_size)
    right = dist.get_global_rank(group, (rank + 1) % world_size)
    left = dist.get_global_rank(group, (rank - 1) % world_size)
    _ring_reduce_scatter(chunks, rank, left, right, group)
    # This rank now holds the full sum of chunk (rank + 1): it alone averages it.
    chunks[(rank + 1) % world_size].div_(world_size)
    _ring_all_gather(chunks, rank, left, right, group)
    return _write_back(tensor, flat)


def _ring_reduce_scatter(
    chunks: tuple[torch.Tensor, ...], rank: int, left: int, right: int, group: dist.ProcessGroup
) -> None:
    """Step s: send chunk (rank - s) right, add the left's chunk (rank - s - 1) into ours."""
    world_size, steps = len(chunks), len(chunks) - 1
    targets = [chunks[(rank - step - 1) % world_size] for step in range(steps)]
    # Gloo moves a message only once its receive is posted, so the receive for step s + 1 is
    # posted (into a second buffer) before step s is summed: that hides one round trip a step.
    buffers = [torch.empty_like(chunks[0]) for _ in range(min(2, steps))]
    incoming = [buffers[step % 2][: targets[step].numel()] for step in range(steps)]
    pending = [_irecv(incoming[step], left, group) for step in range(len(buffers))]
    sends = []
    for step in range(steps):
        sends.append(_isend(chunks[(rank - step) % world_size], right, group))
        _wait_all([pending[step]])
        targets[step].add_(incoming[step])
        if step + 2 < steps:
            pending.append(_irecv(incoming[step + 2], left, group))
    _wait_all(sends)  # the all-gather receives into chunks sent here


def _ring_all_gather(
    chunks: tuple[torch.Tensor, ...], rank: int, left: int, right: int, group: dist.ProcessGroup
) -> None:
    """Step s: forward chunk (rank + 1 - s) right, receive chunk (rank - s) from the left."""
    world_size, steps = len(chunks), len(chunks) - 1
    incoming = [chunks[(rank - step) % world_size] for step in range(steps)]
    # Every chunk arrives straight into its final place, so all receives are posted up front.
    pending = [_irecv(chunk, left, group) for chunk in incoming]
    sends = [_isend(chunks[(rank + 1) % world_size], right, group)]
    for step in range(steps):
        _wait_all([pending[step]])
        if step < steps - 1:  # the last arrival completes the ring: nothing left to forward
            sends.append(_isend(incoming[step], right, group))
    _wait_all(sends)


def butterfly_all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Average ``tensor`` in place across ``group`` with an all-to-all reduce-scatter + all-gather.

    Arguments, return value and errors are those of :func:`ring_all_reduce`.
    """
    flat, group, rank, world_size = _prepare(tensor, group)
    if world_size == 1:
        return tensor
    chunks = flat.tensor_split(world_size)
    peers = {r: dist.get_global_rank(group, r) for r in range(world_size) if r != rank}
    owned = chunks[rank]
    # Row r receives rank r's copy of the owned chunk; summing rows in rank order keeps the
    # result independent of message arrival order.
    gathered = torch.empty((world_size, owned.numel()), dtype=flat.dtype, device=flat.device)
    gathered[rank].copy_(owned)
    recvs = [_irecv(gathered[r], peer, group) for r, peer in peers.items()]
    sends = [_isend(chunks[r], peer, group) for r, peer in peers.items()]
    _wait_all(recvs + sends)
    # The results land in the chunks just sent (those sends are complete); posting the
    # receives before summing lets each peer's result flow the moment it is ready.
    recvs = [_irecv(chunks[r], peer, group) for r, peer in peers.items()]
    torch.sum(gathered, dim=0, out=owned)
    owned.div_(world_size)
    sends = [_isend(owned, peer, group) for peer in peers.values()]
    _wait_all(recvs + sends)
    return _write_back(tensor, flat)


def _prepare(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> tuple[torch.Tensor, dist.ProcessGroup, int, int]:
    """Validate the input and return (flat contiguous view or copy, group, rank, world size)."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(tensor).__name__}")
    if not tensor.is_floating_point():
        raise TypeError(
            f"cannot average a {tensor.dtype} tensor in place; pass a floating-point tensor "
            f"(e.g. tensor.float()) or use dist.all_reduce for integer sums"
        )
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialised; call dist.init_process_group(...) first (or launch with torchrun)"
        )
    group = group if group is not None else dist.group.WORLD
    if dist.get_rank(group) < 0:
        raise ValueError(
            f"global rank {dist.get_rank()} is not a member of the group passed; call the "
            f"all-reduce only on the group's own ranks"
        )
    # A non-contiguous tensor is averaged in a contiguous copy and written back at the end.
    flat = tensor.contiguous().view(-1)
    return flat, group, dist.get_rank(group), dist.get_world_size(group)


def _write_back(tensor: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
    """Copy the result into ``tensor`` when it was not contiguous (``flat`` was then a copy)."""
    if not tensor.is_contiguous():
        tensor.copy_(flat.view(tensor.shape))
    return tensor


# Both ends of every message derive the same chunk sizes, so an empty chunk is skipped on both.
def _isend(chunk: torch.Tensor, peer: int, group: dist.ProcessGroup) -> dist.Work | None:
    return dist.isend(chunk, peer, group) if chunk.numel() else None


def _irecv(chunk: torch.Tensor, peer: int, group: dist.ProcessGroup) -> dist.Work | None:
    return dist.irecv(chunk, peer, group) if chunk.numel() else None


def _wait_all(works: list[dist.Work | None]) -> None:
    for work in works:
        if work is not None:
            work.wait()
