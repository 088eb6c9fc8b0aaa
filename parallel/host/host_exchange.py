"""SyncBatchNorm's two collectives through shared memory, for the CPU ranks of one host.

Each training call of a :class:`parallel.batchnorm.syncbn.SyncBatchNorm` layer exchanges ``2C + 1`` floats in
forward (an all_gather of every rank's count, mean and M2) and ``2C`` in backward (an all_reduce of
two sums). Over gloo each is a TCP loopback round trip through gloo's threads on the cores that run
the model, 0.2-0.5 ms on 2 shared cores: a quarter of a ResNet-18 step at batch 8
(``benchmarks/results/compare``). Here every rank of a group owns two slots and one barrier word in
a file under ``/dev/shm`` that every rank maps (allocated by the gradient buckets'
:class:`parallel.host.host_reduce.SharedMemoryAllReduce`, reserved at setup)::

    all_gather(t):  write t into my slot; barrier; read every member's slot, in rank order
    all_reduce_(t): write t into my slot; barrier; t = slot of member 0 + member 1 + ... (in rank order)

One barrier per collective: consecutive collectives alternate between the two slots, and a rank that
passes the barrier of collective g + 1 knows every member finished reading the slots of collective g
(each read them before arriving at g + 1), so their slot may be written again at g + 2.

The bits are gloo's: a gather copies, and the sum of two ranks is ``a + b`` either way (addition of two
terms commutes exactly); with more ranks every rank adds in the same order, so every rank holds the
same bits. The barrier is a :class:`parallel.host.shm_barrier.FutexBarrier` of the group's members: a
member that died raises within ~0.1 s, one alive but silent after ``timeout``, both with
:data:`parallel.host.shm_barrier.PEER_LOSS_TEXT`, as the gradient buckets do.

Pure torch; no Lightning.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Sequence
from contextlib import nullcontext
from datetime import timedelta

import torch
from torch import Tensor
from torch.profiler import record_function

from parallel.host.host_reduce import SharedMemoryAllReduce
from parallel.host.shm_barrier import FutexBarrier

__all__ = ["EXCHANGE_LABEL", "SharedMemoryExchange", "open_shared_memory_exchange", "parse_exchange_label"]

log = logging.getLogger(__name__)

# Profiler label of each exchange: measure.collective_count counts it as one collective of that kind.
EXCHANGE_LABEL = "SharedMemoryExchange"
_LABEL_RE = re.compile(re.escape(EXCHANGE_LABEL) + r"\.(all_gather|all_reduce)\((\w+)\[(\d+)\]\)$")
_WORD_INTS = 16  # one int32 barrier word per rank, alone on its 64-byte cache line
# How long a rank polls at an exchange's barrier before it sleeps: the main thread waits there with nothing else to
# do, and the other rank's lead is mostly under this (a layer's skew); longer leads sleep.
SPIN_S = 200e-6


def spin_seconds(members: int) -> float:
    """:data:`SPIN_S` where every member can have a core of its own, else 0: a spinning rank would take the core
    of the rank it waits for."""
    return SPIN_S if members <= len(os.sched_getaffinity(0)) else 0.0


class SharedMemoryExchange:
    """All-gathers and all-reduces of small tensors among ``members`` (global ranks of one host) through
    shared memory (module docstring). Every member calls them in the same order, as any collective."""

    def __init__(
        self, host: SharedMemoryAllReduce, members: Sequence[int], capacity_bytes: int, timeout: timedelta | None
    ) -> None:
        # Collective over the world: every rank allocates every rank's slots (each maps all files).
        slots, words = host.allocate([(2 * capacity_bytes, torch.uint8), (_WORD_INTS, torch.int32)])
        self._members = list(members)
        self._rank = self._members.index(host.rank)
        self._capacity = capacity_bytes
        self._slots = [[slots[k][i * capacity_bytes : (i + 1) * capacity_bytes] for k in self._members] for i in (0, 1)]
        peers = [host.peers[k] for k in self._members]
        words = [words[k][:1] for k in self._members]
        self._barrier = FutexBarrier(words, self._rank, peers, timeout, spin_s=spin_seconds(len(self._members)))
        self._calls = 0
        self._views: dict[tuple[int, torch.dtype, torch.Size], list[Tensor]] = {}

    @property
    def world_size(self) -> int:
        return len(self._members)

    @property
    def capacity_bytes(self) -> int:
        """The largest tensor (in bytes) one call exchanges; a larger one goes through the process group."""
        return self._capacity

    def fits(self, device: torch.device, nbytes: int) -> bool:
        """Whether a tensor of ``nbytes`` on ``device`` fits a slot (else it goes through the process group)."""
        return device.type == "cpu" and nbytes <= self._capacity

    def all_gather(self, tensor: Tensor) -> Tensor:
        """Every member's ``tensor`` (same shape and dtype on each), flat and in rank order: ``all_gather_single``'s
        output."""
        slots = self._exchange(tensor, "all_gather")
        return torch.cat(slots if tensor.dim() == 1 else [slot.view(-1) for slot in slots])

    def all_reduce_(self, tensor: Tensor) -> Tensor:
        """Sum every member's ``tensor`` into it, members added in rank order; returns ``tensor``."""
        slots = self._exchange(tensor, "all_reduce")
        if len(slots) == 1:
            return tensor.copy_(slots[0])
        torch.add(slots[0], slots[1], out=tensor)  # 2 members (the common case): one call
        for slot in slots[2:]:
            tensor.add_(slot)
        return tensor

    def _exchange(self, tensor: Tensor, kind: str) -> list[Tensor]:
        """Write ``tensor`` into this rank's slot of this call, meet every member, return every member's slot
        viewed as ``tensor``."""
        parity = self._calls % 2
        self._calls += 1
        # A layer's tensors keep their shape from call to call: the views of the slots are made once per shape, as
        # each torch call from Python costs microseconds, a sizeable share of an exchange of a few KB.
        key = (parity, tensor.dtype, tensor.shape)
        slots = self._views.get(key)
        if slots is None:
            nbytes = tensor.numel() * tensor.element_size()
            assert self.fits(tensor.device, nbytes), (tuple(tensor.shape), tensor.dtype, self._capacity)
            slots = self._views[key] = [
                slot[:nbytes].view(tensor.dtype).view(tensor.shape) for slot in self._slots[parity]
            ]
        scope = nullcontext()
        if torch.autograd._profiler_enabled():  # the label is for profiles only (collective counts)
            dtype = str(tensor.dtype).removeprefix("torch.")
            scope = record_function(f"{EXCHANGE_LABEL}.{kind}({dtype}[{tensor.numel()}])")
        with scope:
            slots[self._rank].copy_(tensor)
            self._barrier.wait()
        return slots


def open_shared_memory_exchange(
    host: SharedMemoryAllReduce | None, members: Sequence[int], capacity_bytes: int
) -> SharedMemoryExchange | None:
    """A :class:`SharedMemoryExchange` for ``members`` (this rank's group) where the gradient buckets sum in shared
    memory behind futex barriers, else ``None`` with the reason logged at INFO. Every rank of the world calls it at
    the same point with the same ``capacity_bytes`` (it allocates every rank's slots); its barriers wait as long as
    the buckets' (``host.timeout``)."""
    if host is None:
        reason = "the gradient buckets are summed by the process group (grad_transport), and so are they"
    elif host.barrier_kind != "futex":
        reason = "shared memory has gloo barriers only here: no faster than the process group's collectives"
    else:
        return SharedMemoryExchange(host, members, capacity_bytes, host.timeout)
    log.info("SyncBatchNorm statistics go through the process group: %s", reason)
    return None


def parse_exchange_label(name: str) -> tuple[str, str, int] | None:
    """``(kind, dtype, numel)`` of the tensor an exchange's profiler label names, ``None`` for any other name."""
    match = _LABEL_RE.match(name)
    return (match.group(1), match.group(2), int(match.group(3))) if match else None
