"""ShardedOptimizer (ZeRO-1): parity with the unsharded optimizer, state per rank, checkpoints."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from collectives.launcher import run_workers
from parallel.gradients import zero
from parallel.gradients.grad_sync import SyncedDataParallel
from parallel.gradients.zero import ShardedOptimizer

_WORLD_SIZE = 2
_OPTIMIZERS = {
    "sgd-momentum": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    "adamw": (torch.optim.AdamW, {"lr": 0.01}),
}


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(4)]).double()


def _batch(step: int, rank: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s half of the step's global batch; the whole batch for ``None``."""
    gen = torch.Generator().manual_seed(step)
    x = torch.randn(_WORLD_SIZE, 4, 32, generator=gen, dtype=torch.float64)
    y = torch.randn(_WORLD_SIZE, 4, 32, generator=gen, dtype=torch.float64)
    return (x.reshape(-1, 32), y.reshape(-1, 32)) if rank is None else (x[rank], y[rank])


def _make_optimizer(net: nn.Module, optimizer_cls, options: dict, sharded: bool):
    # Weights at construction, biases through add_param_group (with their own weight decay).
    weights = [p for name, p in net.named_parameters() if name.endswith("weight")]
    biases = [p for name, p in net.named_parameters() if name.endswith("bias")]
    groups = [{"params": weights, "weight_decay": 0.1}]
    if sharded:
        optimizer = ShardedOptimizer(groups, optimizer_cls, **options)
    else:
        optimizer = optimizer_cls(groups, **options)
    optimizer.add_param_group({"params": biases, "weight_decay": 0.0})
    return optimizer


def _train(net: nn.Module, model: nn.Module, optimizer, steps: range, rank: int | None) -> None:
    for step in steps:
        optimizer.zero_grad()
        x, y = _batch(step, rank)
        (model(x) - y).pow(2).mean().backward()
        if isinstance(model, SyncedDataParallel):
            model.finish()
        optimizer.step()
        # What a per-step scheduler does after the step: the new lr must reach the next step
        # and the next checkpoint on every rank.
        for group in optimizer.param_groups:
            group["lr"] *= 0.7


def _state_numel(optimizer: torch.optim.Optimizer) -> int:
    states = optimizer.state.values()
    return sum(v.numel() for state in states for v in state.values() if torch.is_tensor(v))


def _sharded_worker(rank: int, world_size: int, name: str, checkpoint_path: str) -> dict:
    optimizer_cls, options = _OPTIMIZERS[name]
    net = _net()
    model = SyncedDataParallel(net)
    optimizer = _make_optimizer(net, optimizer_cls, options, sharded=True)
    _train(net, model, optimizer, range(3), rank)
    optimizer.consolidate_state_dict(to=0)
    if rank == 0:
        torch.save(optimizer.state_dict(), checkpoint_path)
    dist.barrier()
    # A fresh optimizer restored from the checkpoint continues exactly like the original.
    restored = _make_optimizer(net, optimizer_cls, options, sharded=True)
    restored.load_state_dict(torch.load(checkpoint_path))
    resumed_net = _net()
    resumed_net.load_state_dict(net.state_dict())
    resumed = _make_optimizer(resumed_net, optimizer_cls, options, sharded=True)
    resumed.load_state_dict(torch.load(checkpoint_path))
    _train(net, model, optimizer, range(3, 5), rank)
    _train(resumed_net, SyncedDataParallel(resumed_net), resumed, range(3, 5), rank)
    return {
        "params": [p.detach().clone() for p in net.parameters()],
        "resumed_params": [p.detach().clone() for p in resumed_net.parameters()],
        "state_numel": _state_numel(optimizer),
    }


def _reference(name: str) -> tuple[list[torch.Tensor], dict, int]:
    optimizer_cls, options = _OPTIMIZERS[name]
    net = _net()
    optimizer = _make_optimizer(net, optimizer_cls, options, sharded=False)
    _train(net, net, optimizer, range(3), None)
    checkpoint = copy.deepcopy(optimizer.state_dict())  # the live dict shares state tensors
    _train(net, net, optimizer, range(3, 5), None)
    return [p.detach().clone() for p in net.parameters()], checkpoint, _state_numel(optimizer)


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(_OPTIMIZERS))
def test_sharded_matches_unsharded_and_checkpoints_round_trip(tmp_path, monkeypatch, name):
    # ~8 KiB chunks: every shard travels in several broadcasts (inherited by the forked ranks).
    monkeypatch.setattr(zero, "_SHARE_CHUNK_MB", 0.005)
    checkpoint_path = str(tmp_path / "optimizer.pt")
    results = run_workers(_sharded_worker, _WORLD_SIZE, args=(name, checkpoint_path), init_file=tmp_path / "store")
    ref_params, ref_checkpoint, full_state_numel = _reference(name)
    for result in results:
        for key in ("params", "resumed_params"):
            for param, ref in zip(result[key], ref_params, strict=True):
                torch.testing.assert_close(param, ref, atol=1e-6, rtol=0.0)
    # Each rank holds half of the optimizer state, and together all of it.
    per_rank = [result["state_numel"] for result in results]
    assert sum(per_rank) == full_state_numel
    assert max(per_rank) <= 0.55 * full_state_numel, per_rank
    # The consolidated checkpoint is exactly the unsharded optimizer's state dict.
    checkpoint = torch.load(checkpoint_path)
    assert checkpoint["param_groups"] == ref_checkpoint["param_groups"]
    assert checkpoint["state"].keys() == ref_checkpoint["state"].keys()
    for index, state in checkpoint["state"].items():
        for key, value in state.items():
            expected = ref_checkpoint["state"][index][key]
            torch.testing.assert_close(value, expected, atol=1e-6, rtol=0.0)


def test_without_process_group_it_is_the_plain_optimizer():
    net, ref_net = _net(), _net()
    optimizer = _make_optimizer(net, torch.optim.AdamW, {"lr": 0.01}, sharded=True)
    reference = _make_optimizer(ref_net, torch.optim.AdamW, {"lr": 0.01}, sharded=False)
    _train(net, net, optimizer, range(2), None)
    _train(ref_net, ref_net, reference, range(2), None)
    for p, q in zip(net.parameters(), ref_net.parameters(), strict=True):
        torch.testing.assert_close(p, q, atol=0.0, rtol=0.0)
    optimizer.consolidate_state_dict()
    assert optimizer.state_dict()["param_groups"] == reference.state_dict()["param_groups"]


def test_state_dict_before_consolidation_names_the_fix():
    optimizer = ShardedOptimizer(nn.Linear(2, 2).parameters(), torch.optim.SGD, lr=0.1)
    with pytest.raises(RuntimeError, match="consolidate_state_dict"):
        optimizer.state_dict()


def test_optimizer_instance_instead_of_class_is_a_type_error():
    params = list(nn.Linear(2, 2).parameters())
    with pytest.raises(TypeError, match="must be a torch.optim.Optimizer subclass"):
        ShardedOptimizer(params, torch.optim.SGD(params, lr=0.1), lr=0.1)


@pytest.mark.parametrize("optimizer_cls", [torch.optim.AdamW, torch.optim.SGD])
def test_from_optimizer_keeps_groups_hyperparameters_and_state(optimizer_cls):
    net, ref_net = _net(), _net()
    options = {"lr": 0.01, "momentum": 0.9} if optimizer_cls is torch.optim.SGD else {"lr": 0.01}
    original = _make_optimizer(net, optimizer_cls, options, sharded=False)
    reference = _make_optimizer(ref_net, optimizer_cls, options, sharded=False)
    _train(net, net, original, range(2), None)
    _train(ref_net, ref_net, reference, range(2), None)
    sharded = ShardedOptimizer.from_optimizer(original)  # AdamW: defaults its __init__ rejects
    _train(net, net, sharded, range(2, 4), None)
    _train(ref_net, ref_net, reference, range(2, 4), None)
    for p, q in zip(net.parameters(), ref_net.parameters(), strict=True):
        torch.testing.assert_close(p, q, atol=0.0, rtol=0.0)
