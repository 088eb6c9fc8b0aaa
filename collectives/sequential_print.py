"""Print ``Process <rank>`` from every rank in a deterministic order, using only barriers.

Run:
    torchrun --nproc_per_node 3 -m collectives.sequential_print --num-iter 2 --order both

prints, byte-identically on every run::

    Process 0
    Process 1
    Process 2
    Process 2
    Process 1
    Process 0
    ---
    Process 0
    ...

``--order ascending`` (default) prints ranks ``0 .. N-1`` each iteration; ``--order both`` prints
``0 .. N-1`` then ``N-1 .. 0``. Iterations are separated by a ``---`` line (none after the last).

Why it is deterministic: all ranks share one stdout (torchrun does not redirect children by
default). A rank writes and *flushes* its line, so the bytes are in the pipe before it enters the
barrier that releases the next rank; ``dist.barrier`` is the only synchronisation. The rank that
prints an iteration's last line also writes the separator, so no extra barrier is needed for it.
Pure torch; no Lightning import.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import TextIO

import torch.distributed as dist

__all__ = ["ORDERS", "print_order", "print_sequentially"]

ORDERS = ("ascending", "both")
SEPARATOR = "---"


def print_order(world_size: int, order: str = "ascending") -> list[int]:
    """Ranks in the order they print within one iteration.

    Args:
        world_size: Number of ranks, ``>= 1``.
        order: ``"ascending"`` (``0 .. N-1``) or ``"both"`` (``0 .. N-1`` then ``N-1 .. 0``).

    Raises:
        ValueError: unknown ``order`` or ``world_size < 1``.
    """
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ascending = list(range(world_size))
    return ascending + ascending[::-1] if order == "both" else ascending


def print_sequentially(
    num_iter: int = 1,
    order: str = "ascending",
    stream: TextIO | None = None,
    group: dist.ProcessGroup | None = None,
) -> None:
    """Every rank of ``group`` prints ``Process <rank>`` in ``print_order`` for ``num_iter`` rounds.

    Must be called by every rank of ``group`` (it issues the same barriers on every rank).

    Args:
        num_iter: Number of iterations, ``>= 0``.
        order: See :func:`print_order`.
        stream: Where to write; ``sys.stdout`` when ``None``. Ranks must share it (same pipe, or
            the same file opened in append mode) for the order to be meaningful.
        group: Process group; the default (world) group when ``None``.

    Raises:
        ValueError: ``num_iter < 0`` or unknown ``order``.
        RuntimeError: ``torch.distributed`` is not initialised.
    """
    if num_iter < 0:
        raise ValueError(f"num_iter must be >= 0, got {num_iter}")
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised; launch with torchrun")
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    sequence = print_order(world_size, order)
    for iteration in range(num_iter):
        for position, speaker in enumerate(sequence):
            if rank == speaker:
                last_line = position == len(sequence) - 1
                separator = f"{SEPARATOR}\n" if last_line and iteration < num_iter - 1 else ""
                _write(stream, f"Process {rank}\n{separator}")
            dist.barrier(group)


def _write(stream: TextIO | None, text: str) -> None:
    # Resolve sys.stdout at call time (tests and tools swap it) and flush before the barrier:
    # the next rank's bytes must not overtake ours in a buffer.
    out = sys.stdout if stream is None else stream
    out.write(text)
    out.flush()


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m collectives.sequential_print",
        description="Print 'Process <rank>' in deterministic rank order (run under torchrun).",
    )
    parser.add_argument("--num-iter", type=int, default=1, help="iterations (default 1)")
    parser.add_argument("--order", choices=ORDERS, default="ascending", help="print order")
    parser.add_argument("--backend", default="gloo", help="torch.distributed backend (gloo)")
    args = parser.parse_args(argv)
    if args.num_iter < 0:
        parser.error(f"--num-iter must be >= 0, got {args.num_iter}")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point: join the torchrun group (``env://``), print, leave the group."""
    args = _parse_args(argv)
    dist.init_process_group(args.backend)
    try:
        print_sequentially(args.num_iter, args.order)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
