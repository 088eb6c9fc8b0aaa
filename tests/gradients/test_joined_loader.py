"""The core of uneven data per rank (``parallel.uneven``, ``SyncedDataParallel.weight_next_sync``), without Lightning:
2 ranks (fork + gloo) against what one process computes."""

from __future__ import annotations

from collections import namedtuple

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset

from collectives.launcher import run_workers
from measure.collective_count import count_collectives
from parallel.gradients.grad_sync import SyncedDataParallel
from parallel.uneven.joined_loader import JoinedLoader, UnevenDataError, empty_like_batch, join_uneven

Pair = namedtuple("Pair", "x y")


def test_an_empty_batch_keeps_the_structure_with_every_tensor_cut_to_zero_rows() -> None:
    batch = {
        "image": torch.ones(4, 3, 2),
        "pair": Pair(torch.ones(4), [torch.zeros(4, 2), "name"]),
        "t": torch.tensor(7),
    }
    empty = empty_like_batch(batch)
    assert empty["image"].shape == (0, 3, 2) and empty["image"].dtype == torch.float32
    assert isinstance(empty["pair"], Pair) and empty["pair"].x.shape == (0,)
    assert empty["pair"].y[0].shape == (0, 2) and empty["pair"].y[1] == "name"
    assert empty["t"].item() == 7  # a 0-dim tensor has no rows to cut


class _Stream(IterableDataset):
    def __init__(self, count: int) -> None:
        self.count = count

    def __iter__(self):
        return iter({"x": torch.full((2, 3), float(i))} for i in range(self.count))


def _join(rank: int, world_size: int, lengths: tuple[int, ...], passes: int) -> list:
    loader = join_uneven(DataLoader(_Stream(lengths[rank]), batch_size=None))
    seen = []
    for _ in range(passes):
        for batch in loader:
            share = loader.take_share()
            seen.append((tuple(batch["x"].shape), share.trained))
    return [type(loader).__name__, seen]


def test_a_rank_without_a_single_batch_runs_empty_batches_shaped_like_its_peers() -> None:
    results = run_workers(_join, 2, args=((3, 0), 2))
    assert results[0][0] == results[1][0] == "JoinedLoader"  # an IterableDataset: exchanged per step
    step = (True, False)
    assert results[0][1] == [((2, 3), step)] * 6  # two passes of 3 steps
    assert results[1][1] == [((0, 3), step)] * 6  # the structure came from rank 0, once


def _counted(rank: int, world_size: int) -> list[str]:
    loader = join_uneven(DataLoader(_Stream(2 + rank), batch_size=None))
    with count_collectives() as collectives:
        for _ in loader:
            pass
    return [c.source for c in collectives]


def test_the_per_step_flags_are_one_collective_per_step_attributed_to_the_join() -> None:
    # 3 steps (rank 1's 3 batches) and the exchange that finds every loader ended
    assert run_workers(_counted, 2) == [["uneven_join"] * 4] * 2


def _lengths(rank: int, world_size: int, lengths: tuple[int, ...], refuse: str | None) -> list:
    loader = join_uneven(DataLoader(list(range(lengths[rank])), batch_size=1), refuse=refuse)
    if not isinstance(loader, JoinedLoader):
        return ["unwrapped", len(loader)]
    steps = [(tuple(batch.shape), loader.take_share().trained) for batch in loader]
    return [len(loader), steps]


def test_known_lengths_join_without_a_per_step_exchange_and_equal_ones_are_left_alone() -> None:
    assert run_workers(_lengths, 2, args=((3, 3), None)) == [["unwrapped", 3]] * 2
    rank0, rank1 = run_workers(_lengths, 2, args=((3, 1), None))
    assert rank0 == [3, [((1,), (True, True)), ((1,), (True, False)), ((1,), (True, False))]]
    assert rank1 == [3, [((1,), (True, True)), ((0,), (True, False)), ((0,), (True, False))]]


def _refused(rank: int, world_size: int, lengths: tuple[int, ...], iterable: bool) -> str:
    data = _Stream(lengths[rank]) if iterable else [{"x": torch.zeros(2, 3)}] * lengths[rank]
    try:
        for _ in join_uneven(DataLoader(data, batch_size=None), refuse="Make them even."):
            pass
    except UnevenDataError as error:
        return str(error)
    return "no error"


@pytest.mark.parametrize("iterable", [True, False], ids=["exchanged", "known_lengths"])
def test_refusing_raises_on_every_rank_naming_each_ranks_batch_count(iterable: bool) -> None:
    messages = run_workers(_refused, 2, args=((4, 2), iterable))
    assert messages[0] == messages[1]
    expected = (
        "rank 1's training data ended after 2 batches of epoch 0; rank 0 has more (batch 3 is next). Make them even."
        if iterable
        else "the ranks' training loaders differ in length per epoch: rank 0's 4 batches, rank 1's 2 batches. "
        "Make them even."
    )
    assert messages[0] == expected


def _weighted_grads(rank: int, world_size: int, transport: str) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = SyncedDataParallel(nn.Linear(3, 2), grad_transport=transport)
    inputs = torch.arange(12.0).reshape(2, 2, 3)[rank] / 10
    with model.no_sync():  # micro-batch 1: both ranks trained
        model(inputs).pow(2).mean().div(2).backward()
    loss = model(inputs[:0]).pow(2).mean() if rank == 1 else model(inputs).pow(2).mean()  # rank 1: empty, NaN
    model.weight_next_sync(contributes=True, divisor=3 / 2)  # 3 (rank, micro-batch) pairs trained over 2
    (loss * 0.0 if rank == 1 else loss).div(2).backward()
    after_step = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model(inputs).pow(2).mean().backward()  # the next step: the plain rank mean again
    return after_step + [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("transport", ["process_group", "shared_memory"])
def test_a_joined_window_averages_over_the_trained_rank_micro_batch_pairs(transport: str) -> None:
    results = run_workers(_weighted_grads, 2, args=(transport,))
    torch.manual_seed(0)
    reference = nn.Linear(3, 2)
    inputs = torch.arange(12.0).reshape(2, 2, 3) / 10
    # The mean over the three trained (rank, micro-batch) pairs: rank 0 twice, rank 1 once.
    (reference(inputs[0]).pow(2).mean() * 2 + reference(inputs[1]).pow(2).mean()).div(3).backward()
    expected = [p.grad.clone() for p in reference.parameters()]
    reference.zero_grad()
    sum(reference(inputs[r]).pow(2).mean() for r in range(2)).div(2).backward()
    expected += [p.grad.clone() for p in reference.parameters()]
    for grads in results:
        for got, want in zip(grads, expected, strict=True):
            torch.testing.assert_close(got, want)
