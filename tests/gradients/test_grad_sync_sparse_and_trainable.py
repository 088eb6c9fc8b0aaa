"""SyncedDataParallel without Lightning: sparse gradients and a changing set of trainable parameters.

2 ranks (fork + gloo) against one process on the concatenated batches, checked right after each
backward: an embedding with ``sparse=True`` that both ranks, one rank, then no rank use, and a
layer frozen at the start, unfrozen at step 1 and frozen again at step 3.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from collectives.launcher import run_workers
from parallel.gradients.grad_sync import SyncedDataParallel

pytestmark = pytest.mark.distributed
WORLD_SIZE, STEPS = 2, 4


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(12, 4, sparse=True)
        self.late = nn.Linear(4, 4).requires_grad_(False)  # unfrozen at step 1, frozen at step 3
        self.head = nn.Linear(4, 2)

    def forward(self, ids: torch.Tensor, features: torch.Tensor, use_embedding: bool) -> torch.Tensor:
        hidden = features + (self.embedding(ids).mean(1) if use_embedding else 0)
        return self.head(torch.tanh(self.late(hidden)))


def _uses_embedding(step: int, rank: int) -> bool:
    return step == 0 or (step in (1, 3) and rank == 0)  # step 2: no rank: its grad stays None


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(10 * step + rank)
    return (
        torch.randint(0, 12, (3, 5), generator=generator),
        torch.randn(3, 4, generator=generator),
        torch.randn(3, 2, generator=generator),
    )


def _train(net: _Net, losses) -> list[dict[str, torch.Tensor | None]]:
    """Grads after each step's backward (``losses(step)`` runs it); SGD steps between."""
    optimizer = torch.optim.SGD(net.parameters(), lr=0.2)
    seen = []
    for step in range(STEPS):
        net.late.requires_grad_(step in (1, 2))
        optimizer.zero_grad()
        losses(step).backward()
        seen.append({n: None if p.grad is None else p.grad.to_dense().clone() for n, p in net.named_parameters()})
        optimizer.step()
    return seen


def _worker(rank: int, world_size: int) -> list:
    torch.manual_seed(0)
    net = _Net()
    model = SyncedDataParallel(net)

    def loss(step: int) -> torch.Tensor:
        ids, features, target = _batch(step, rank)
        return (model(ids, features, _uses_embedding(step, rank)) - target).pow(2).mean()

    return _train(net, loss)


def _reference() -> list:
    torch.manual_seed(0)
    net = _Net()

    def loss(step: int) -> torch.Tensor:
        per_rank = []
        for rank in range(WORLD_SIZE):
            ids, features, target = _batch(step, rank)
            per_rank.append((net(ids, features, _uses_embedding(step, rank)) - target).pow(2).mean())
        return torch.stack(per_rank).mean()

    return _train(net, loss)


def test_sparse_gradients_and_unfreezing_match_one_process_after_every_backward(tmp_path) -> None:
    results = run_workers(_worker, WORLD_SIZE, init_file=tmp_path / "store")
    reference = _reference()
    assert reference[2]["embedding.weight"] is None and reference[0]["late.weight"] is None
    for result in results:
        for step, (grads, expected) in enumerate(zip(result, reference, strict=True)):
            for name, grad in expected.items():
                assert (grads[name] is None) == (grad is None), f"step {step} {name}"
                if grad is not None:
                    torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-6, msg=f"step {step} {name}")
    for step in range(STEPS):  # the ranks hold the same bits
        for name, grad in results[0][step].items():
            assert grad is None or torch.equal(grad, results[1][step][name]), f"step {step} {name}"


def _status_worker(rank: int, world_size: int) -> tuple:
    net = nn.EmbeddingBag(12, 2, sparse=True)  # no dense gradient, so no bucket to carry the status
    model = SyncedDataParallel(net, carry_rank_status=True)
    model.set_rank_status(15 if rank == 1 else 0)
    model(torch.randint(0, 12, (3, 4))).sum().backward()
    return model.rank_status


def test_rank_status_rides_with_the_sparse_counts_when_every_gradient_is_sparse(tmp_path) -> None:
    assert run_workers(_status_worker, WORLD_SIZE, init_file=tmp_path / "store") == [(0, 15), (0, 15)]
