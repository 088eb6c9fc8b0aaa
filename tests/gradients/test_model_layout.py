"""SyncedDataParallel and the ranks' models: one layout on every rank, checked at construction (2 CPU ranks), and
gradients laid out as their parameters (a channels_last convolution's too), as under torch DDP."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from collectives.launcher import WorkerError, run_workers
from parallel.gradients.grad_sync import SyncedDataParallel

pytestmark = pytest.mark.distributed


def _rank_dependent_model(rank: int, variant: str) -> nn.Module:
    torch.manual_seed(0)
    if variant == "shape":  # e.g. a vocabulary built from the rank's own data
        return nn.Linear(3, 4 + rank)
    if variant == "count":
        return nn.Sequential(*[nn.Linear(3, 3) for _ in range(1 + rank)])
    net = nn.Conv2d(2, 4, 3)  # "memory_format"
    return net.to(memory_format=torch.channels_last) if rank == 1 else net


def _wrap(rank: int, world_size: int, variant: str) -> str:
    SyncedDataParallel(_rank_dependent_model(rank, variant))
    return "built"


@pytest.mark.parametrize(
    ("variant", "difference"),
    [
        (
            "shape",
            "rank 0 has parameter weight of shape (4, 3), float32, strides (3, 1), rank 1 has parameter weight "
            "of shape (5, 3)",
        ),
        (
            "count",
            "rank 0 has 2 parameters and buffers, rank 1 has 4; the first difference: rank 0 has nothing more, "
            "rank 1 has parameter 1.weight",
        ),
        (
            "memory_format",
            "strides (18, 9, 3, 1), rank 1 has parameter weight of shape (4, 2, 3, 3), float32, strides (18, 1, 6, 2)",
        ),
    ],
)
def test_models_that_differ_across_ranks_fail_on_every_rank_naming_the_first_difference(variant, difference) -> None:
    with pytest.raises(WorkerError) as failed:
        run_workers(_wrap, 2, args=(variant,), timeout_s=20)
    message = str(failed.value)
    for rank in (0, 1):  # every rank raises, with the same message
        assert f"rank {rank}:" in message
    assert message.count("the ranks' models differ, so their gradients cannot be averaged") == 2
    assert message.count(difference) == 2
    assert "Build the same model on every rank" in message


def _channels_last_step(rank: int, world_size: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(2, 4, 3), nn.Tanh(), nn.Conv2d(4, 3, 1)).to(memory_format=torch.channels_last)
    model = SyncedDataParallel(net)
    batch = torch.randn(2 * world_size, 2, 5, 5, generator=torch.Generator().manual_seed(1))
    for _ in range(2):  # the second step accumulates into the bucket views themselves
        model(batch[rank * 2 : rank * 2 + 2].contiguous(memory_format=torch.channels_last)).square().mean().backward()
        model.finish()
    return {name: p.grad.clone() for name, p in net.named_parameters()} | {
        f"{name} layout": torch.tensor(p.grad.stride() == p.stride()) for name, p in net.named_parameters()
    }


def test_gradients_of_a_channels_last_model_keep_its_layout_and_equal_one_process() -> None:
    ranks = run_workers(_channels_last_step, 2)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(2, 4, 3), nn.Tanh(), nn.Conv2d(4, 3, 1)).to(memory_format=torch.channels_last)
    batch = torch.randn(4, 2, 5, 5, generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        # Each rank's loss is the mean over its 2 samples; the ranks' average is the mean over the 4.
        net(batch.contiguous(memory_format=torch.channels_last)).square().mean().backward()
    for name, p in net.named_parameters():
        for grads in ranks:
            assert bool(grads[f"{name} layout"]), f"{name}: its gradient is not laid out as the parameter"
            torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-6, msg=name)
