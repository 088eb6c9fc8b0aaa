"""Every rank's generators at its window's start, through the job's store (window_generators of
strategies.fault_tolerance).

Unit tests on a real TCP store in one process; the 2-rank fits that lose a rank and resume bitwise from
the last checkpoint are ``tests/fault_tolerance/test_fault_matrix.py``'s ``test_a_failure_inside_a_step_...``.
"""

from __future__ import annotations

import pickle
import random
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from conformance_harness import rank_0_fitting
from lightning.pytorch.loops.progress import _BatchProgress
from torch import nn

from parallel.resume.rng_state import decode_rng_state, encode_rng_state, rng_state, set_rng_state
from strategies.fault_tolerance.job_store import BoundedStore, connect_store, serve_store
from strategies.fault_tolerance.last_checkpoint import LastCheckpoint
from strategies.fault_tolerance.window_generators import WindowGenerators
from strategies.resume.resume_rng import CHECKPOINT_KEY


def _draws() -> tuple:
    return torch.rand(3), np.random.rand(3), np.random.randn(), random.random()


def _same_draws(a: tuple, b: tuple) -> bool:
    return torch.equal(a[0], b[0]) and np.array_equal(a[1], b[1]) and a[2:] == b[2:]


def test_an_encoded_state_decodes_to_the_same_draws_and_refuses_anything_but_builtins() -> None:
    torch.manual_seed(1), np.random.seed(2), random.seed(3)
    np.random.randn()  # a cached Gaussian is part of NumPy's state
    encoded = encode_rng_state(rng_state())
    expected = _draws()
    set_rng_state(decode_rng_state(encoded))
    assert _same_draws(_draws(), expected)
    with pytest.raises(pickle.UnpicklingError, match="builtins only, not numpy"):
        decode_rng_state(pickle.dumps(np.zeros(2)))


@pytest.fixture
def stores() -> Iterator[list[BoundedStore]]:
    server = serve_store("127.0.0.1")
    # A long deadline: these tests check what is read, not how fast (a loaded 2-core machine once took > 5 s).
    clients = [connect_store("127.0.0.1", server.port, "job/", op_timeout_s=60.0) for _ in range(3)]
    yield clients
    for client in clients:
        client.close()
    del server


def test_the_writer_reads_every_ranks_generators_kept_at_the_windows_start(stores: list[BoundedStore]) -> None:
    ranks = [WindowGenerators(store, rank, 2) for rank, store in enumerate(stores[:2])]
    expected = []
    for rank, generators in enumerate(ranks):
        torch.manual_seed(10 + rank), np.random.seed(10 + rank), random.seed(10 + rank)
        generators.keep(5)  # after 5 batches, each rank with its own streams: both ranks' first point
        expected.append(_draws())
    assert ranks[1].flush()
    states, why = ranks[0].every_rank()
    assert states is not None and why == ""
    for state, draws in zip(states, expected, strict=True):
        set_rng_state(state)
        assert _same_draws(_draws(), draws)
    ranks[1].keep(5)  # a later point with as many batches (after validation) on rank 1 only: never mixed
    assert ranks[1].flush()
    assert ranks[0].every_rank() == (
        None,
        "rank 1's newest are from point 2 (after 5 training batches), the window's from point 1 (after 5)",
    )
    assert WindowGenerators(stores[2], 0, 2).every_rank() == (None, "rank 0 kept none")
    for generators in ranks:
        generators.stop()


def test_a_rank_that_wrote_none_leaves_the_checkpoint_without_generators(stores: list[BoundedStore]) -> None:
    writer, peer = WindowGenerators(stores[0], 0, 3), WindowGenerators(stores[1], 1, 3)
    for generators in (writer, peer):
        generators.keep(2)
    assert peer.flush()
    assert writer.every_rank() == (None, "rank(s) [2] wrote none to the job's store")  # rank 2 was lost before


def test_the_last_checkpoint_holds_them_only_when_it_is_the_one_written(stores: list[BoundedStore]) -> None:
    progress = _BatchProgress()
    for _ in range(3):  # 3 training batches done
        progress.increment_ready(), progress.increment_started(), progress.increment_processed()
        progress.increment_completed()
    trainer = rank_0_fitting(global_step=3, current_epoch=0, progress=progress)
    ranks = [WindowGenerators(store, rank, 2) for rank, store in enumerate(stores[:2])]
    for generators in ranks:
        generators.keep(3)
    assert ranks[1].flush()
    last = LastCheckpoint()
    last.batch_started(trainer, nn.Linear(1, 1))  # the window after 3 batches opens
    checkpoint: dict = {"state_dict": {}, "loops": {"fit_loop": {"epoch_loop.batch_progress": progress.state_dict()}}}
    last.saving(trainer, checkpoint, ranks[0])
    assert CHECKPOINT_KEY not in checkpoint  # another checkpoint: every rank's save gathers its own
    last._writing = True  # what save() sets around its own trainer.save_checkpoint
    last.saving(trainer, checkpoint, ranks[0])
    assert len(checkpoint[CHECKPOINT_KEY]) == 2 and last._generators_note == "every rank's at that step"


def test_rank_1_reads_every_rank_from_its_mirror_once_the_job_store_is_gone() -> None:
    """Under Lightning's launchers the job's store lives in rank 0's process: rank 0 lost takes it along, and
    rank 1, which writes the last checkpoint then, reads its peers from the mirror it hosts."""
    server = serve_store("127.0.0.1")
    toward = ("127.0.0.1", server.port)
    clients = [connect_store("127.0.0.1", server.port, "job/", op_timeout_s=5.0) for _ in range(3)]
    ranks = [WindowGenerators(client, rank, 3, mirror_toward=toward) for rank, client in enumerate(clients)]
    expected = []
    for rank, generators in enumerate(ranks):
        torch.manual_seed(20 + rank), np.random.seed(20 + rank), random.seed(20 + rank)
        generators.keep(7)
        expected.append(_draws())
    assert all(generators.flush() for generators in ranks)  # to the job's store and, but rank 1, to the mirror
    assert ranks[0].every_rank()[0] is not None  # rank 0 (rank 1 lost) reads the job's store, not the mirror
    del server  # rank 0's process, and the job's store with it, is gone
    states, why = ranks[1].every_rank()
    assert states is not None and why == ""
    for state, draws in zip(states, expected, strict=True):
        set_rng_state(state)
        assert _same_draws(_draws(), draws)
    for generators, client in zip(ranks, clients, strict=True):
        generators.close()
        client.close()
    states, why = ranks[2].every_rank()  # rank 2 would read the job's store: gone
    assert states is None and why.startswith("the job's store did not give them"), why
