"""A rank's random generators as one checkpointable value, and every rank's gathered into one list.

A training step draws from generators it never names: dropout and ``torch.randn`` from torch's
default generators (the CPU one, and the current CUDA device's once CUDA is in use), ``np.random.*``
from NumPy's legacy global generator, ``random.*`` from Python's. These are the ones Lightning's
``seed_everything`` seeds, and the ones a resumed run must continue for its draws to be the
uninterrupted run's. Generators a program owns (a ``torch.Generator``, ``np.random.default_rng()``)
are its own to checkpoint, as anywhere in PyTorch.

The value holds tensors, ints, strings and tuples only, so a checkpoint holding it loads with
``torch.load(weights_only=True)`` (torch's default, and Lightning's when resuming): NumPy's key
array travels as a tensor.

    states = gather_rng_states()    # every rank, collectively: [rank 0's, rank 1's, ...]
    set_rng_state(states[rank])     # later, on the same rank of a run with as many ranks

:func:`encode_rng_state` turns a state into bytes for a key-value store (a pickle of builtins only,
about 14 KB, 20 us); :func:`decode_rng_state` reads them back without loading any class.
"""

from __future__ import annotations

import io
import pickle
import random
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

__all__ = ["RngState", "decode_rng_state", "encode_rng_state", "gather_rng_states", "rng_state", "set_rng_state"]

RngState = dict[str, Any]


def rng_state() -> RngState:
    """This process's default generators: Python's, NumPy's global one, torch's CPU one and (in use) the current
    CUDA device's."""
    kind, keys, position, has_gauss, cached_gaussian = np.random.get_state()
    state: RngState = {
        "python": random.getstate(),
        "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), int(position), int(has_gauss), float(cached_gaussian)),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # asking would otherwise start CUDA
        state["cuda"] = torch.cuda.get_rng_state()  # this rank's device (DDP: one per process)
    return state


def set_rng_state(state: RngState) -> None:
    """Make this process's default generators continue from ``state`` (a :func:`rng_state` value)."""
    random.setstate(state["python"])
    kind, keys, position, has_gauss, cached_gaussian = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), position, has_gauss, cached_gaussian))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])  # onto the current device: the same rank's, on resuming


def gather_rng_states(group: dist.ProcessGroup | None = None) -> list[RngState]:
    """Every rank's :func:`rng_state`, indexed by rank in ``group``; a collective (every rank calls it).

    The states travel encoded (:func:`encode_rng_state`): ``all_gather_object`` pickles a tensor through
    ``torch.save``, and every rank saving into a buffer at each checkpoint is indistinguishable, to a user's or
    Lightning's check that only the checkpoint's writer calls ``torch.save``, from every rank saving a file."""
    encoded: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(encoded, encode_rng_state(rng_state()), group=group)
    return [decode_rng_state(data) for data in encoded]


class _BuiltinsOnly(pickle.Unpickler):
    """Loads tuples, dicts, numbers, strings and bytes; refuses every class (nothing runs on loading)."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"an encoded generator state holds builtins only, not {module}.{name}")


def encode_rng_state(state: RngState) -> bytes:
    """``state`` (a :func:`rng_state` value) as bytes: its tensors as raw bytes, pickled with builtins only."""
    kind, keys, position, has_gauss, cached_gaussian = state["numpy"]
    plain = {name: state[name].numpy().tobytes() for name in ("torch", "cuda") if name in state}
    plain.update(python=state["python"], numpy=(kind, keys.numpy().tobytes(), position, has_gauss, cached_gaussian))
    return pickle.dumps(plain, protocol=pickle.HIGHEST_PROTOCOL)


def decode_rng_state(data: bytes) -> RngState:
    """The :func:`rng_state` value :func:`encode_rng_state` encoded (raises ``pickle.UnpicklingError`` on other
    data)."""
    plain = _BuiltinsOnly(io.BytesIO(data)).load()
    kind, keys, position, has_gauss, cached_gaussian = plain["numpy"]
    state: RngState = {
        name: torch.frombuffer(bytearray(plain[name]), dtype=torch.uint8) for name in ("torch", "cuda") if name in plain
    }
    keys = torch.frombuffer(bytearray(keys), dtype=torch.int64)
    state.update(python=plain["python"], numpy=(kind, keys, position, has_gauss, cached_gaussian))
    return state
