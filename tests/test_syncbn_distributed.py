"""SyncBatchNorm across 2 and 3 gloo ranks vs torch's BatchNorm on the concatenated global batch.

Each case runs a few training steps (outputs, input/weight/bias gradients, running statistics)
and then eval mode; the reference is ``torch.nn.BatchNorm{1,2,3}d`` in one process on the same
data. Plus: uneven and empty local batches, a large offset, bf16 autocast, and the number of
collectives per forward and per backward.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

from benchmarks.launcher import run_workers
from parallel.grad_sync import SyncedDataParallel
from parallel.syncbn import SyncBatchNorm

pytestmark = pytest.mark.distributed

_TORCH_BATCH_NORM = {1: nn.BatchNorm1d, 2: nn.BatchNorm1d, 3: nn.BatchNorm2d, 4: nn.BatchNorm3d}


@dataclass(frozen=True)
class Case:
    sizes: tuple[int, ...]  # local batch size of each rank
    feature_shape: tuple[int, ...] = (6,)  # (C,), (C, L), (C, H, W) or (C, D, H, W)
    offset: float = 0.0
    momentum: float | None = 0.1
    channels_last: bool = False
    steps: int = 2

    @property
    def num_features(self) -> int:
        return self.feature_shape[0]

    def batch(self, step: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
        """Global input, upstream gradient and eval input of training step ``step``."""
        generator = torch.Generator().manual_seed(100 + step)
        shape = (sum(self.sizes), *self.feature_shape)
        x = self.offset + 2.0 * torch.randn(shape, generator=generator, dtype=torch.float64)
        grad = torch.randn(shape, generator=generator, dtype=torch.float64)
        eval_x = self.offset + torch.randn((5, *self.feature_shape), generator=generator).double()
        return x.to(dtype), grad.to(dtype), eval_x.to(dtype)

    def shard(self, rank: int) -> slice:
        first = sum(self.sizes[:rank])
        return slice(first, first + self.sizes[rank])


def _init_affine(layer: nn.Module, num_features: int) -> None:
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        layer.weight.copy_(0.5 + torch.rand(num_features, generator=generator))
        layer.bias.copy_(torch.randn(num_features, generator=generator))


def _train_and_eval(layer: nn.Module, case: Case, rows: slice, dtype: torch.dtype) -> dict:
    """Run ``case`` through ``layer`` on the given rows of every global batch."""
    _init_affine(layer, case.num_features)
    outputs, input_grads = [], []
    for step in range(case.steps):
        x, grad, _ = case.batch(step, dtype)
        x = x[rows].clone()
        if case.channels_last:
            x = x.to(memory_format=torch.channels_last)
        x.requires_grad_()
        out = layer(x)
        out.backward(grad[rows])
        outputs.append(out.detach())
        input_grads.append(x.grad)
    layer.eval()
    eval_out = layer(case.batch(case.steps - 1, dtype)[2])
    return {
        "outputs": outputs,
        "input_grads": input_grads,
        "weight_grad": layer.weight.grad,
        "bias_grad": layer.bias.grad,
        "running_mean": layer.running_mean,
        "running_var": layer.running_var,
        "num_batches_tracked": layer.num_batches_tracked,
        "eval_output": eval_out.detach(),
    }


def _sync_worker(rank: int, world_size: int, case: Case) -> dict:
    layer = SyncBatchNorm(case.num_features, momentum=case.momentum)
    return _train_and_eval(layer, case, case.shard(rank), torch.float32)


def _reference(case: Case, dtype: torch.dtype = torch.float32) -> dict:
    batch_norm = _TORCH_BATCH_NORM[len(case.feature_shape)]
    layer = batch_norm(case.num_features, momentum=case.momentum).to(dtype)
    return _train_and_eval(layer, case, slice(None), dtype)


def _assert_matches(results: list[dict], expected: dict, **tolerance) -> None:
    for step, want in enumerate(expected["outputs"]):
        got = torch.cat([r["outputs"][step] for r in results])
        torch.testing.assert_close(got, want.float(), **tolerance)
        got = torch.cat([r["input_grads"][step] for r in results])
        torch.testing.assert_close(got, expected["input_grads"][step].float(), **tolerance)
    # Parameter gradients stay local sums (the data-parallel sync averages them later).
    for name in ("weight_grad", "bias_grad"):
        torch.testing.assert_close(sum(r[name] for r in results), expected[name].float(), **tolerance)
    for result in results:  # every rank holds the same, global running statistics
        for name in ("running_mean", "running_var", "eval_output"):
            torch.testing.assert_close(result[name], expected[name].float(), **tolerance)
        assert result["num_batches_tracked"] == expected["num_batches_tracked"]


CASES = {
    "2d-even": Case(sizes=(4, 4)),
    "2d-uneven": Case(sizes=(3, 7)),
    "3d-3ranks": Case(sizes=(2, 3, 4), feature_shape=(5, 3)),
    "4d-conv": Case(sizes=(3, 5), feature_shape=(8, 4, 5)),
    "4d-channels-last": Case(sizes=(4, 2), feature_shape=(8, 3, 3), channels_last=True),
    "5d": Case(sizes=(2, 2), feature_shape=(3, 2, 3, 2)),
    "empty-rank": Case(sizes=(0, 6), feature_shape=(4, 3, 3)),
    "empty-middle-3ranks": Case(sizes=(3, 0, 5)),
    "cumulative-momentum": Case(sizes=(3, 4), momentum=None, steps=3),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_matches_torch_batch_norm_on_the_global_batch(tmp_path, case):
    results = run_workers(_sync_worker, len(case.sizes), args=(case,), init_file=tmp_path / "store")

    _assert_matches(results, _reference(case), atol=2e-5, rtol=1e-4)
    for rank, result in enumerate(results):
        assert result["outputs"][0].shape[0] == case.sizes[rank]
        if case.channels_last:
            assert result["outputs"][0].is_contiguous(memory_format=torch.channels_last)


def test_large_offset_is_as_accurate_as_torch(tmp_path):
    """1e4 + N(0, 1) in fp32: the error vs an fp64 reference stays within torch's own."""
    case = Case(sizes=(64, 40), feature_shape=(4, 8, 8), offset=1e4)
    results = run_workers(_sync_worker, 2, args=(case,), init_file=tmp_path / "store")

    exact = _reference(case, torch.float64)
    torch_fp32 = _reference(case, torch.float32)
    for name in ("outputs", "input_grads"):
        for step, want in enumerate(exact[name]):
            ours = torch.cat([r[name][step] for r in results])
            ours_error = (ours.double() - want).abs().max()
            torch_error = (torch_fp32[name][step].double() - want).abs().max()
            assert ours_error <= 1.5 * torch_error + 1e-6, (name, step, ours_error, torch_error)
    for name in ("running_mean", "running_var"):
        torch_error = (torch_fp32[name].double() - exact[name]).abs().max()
        assert (results[0][name].double() - exact[name]).abs().max() <= 2 * torch_error + 1e-6
    # The data really discriminates: E[x^2] - E[x]^2 in fp32 is off by whole units here.
    x = case.batch(0)[0].transpose(0, 1).reshape(case.num_features, -1)
    naive_var = (x * x).mean(1) - x.mean(1) ** 2
    assert (naive_var.double() - x.double().var(1, unbiased=False)).abs().max() > 0.5


def _bf16_worker(rank: int, world_size: int, case: Case) -> dict:
    layer = SyncBatchNorm(case.num_features)
    _init_affine(layer, case.num_features)
    x, grad, _ = case.batch(0, torch.bfloat16)
    x = x[case.shard(rank)].clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(x)
    out.backward(grad[case.shard(rank)])
    return out.detach(), x.grad, layer.weight.grad, layer.running_mean, layer.running_var


def test_bf16_autocast_keeps_fp32_statistics(tmp_path):
    case = Case(sizes=(6, 10), feature_shape=(8, 4, 4), offset=3.0)
    results = run_workers(_bf16_worker, 2, args=(case,), init_file=tmp_path / "store")

    # Reference in fp64 on exactly the bf16 values the ranks saw.
    x, grad, _ = (t.double() for t in case.batch(0, torch.bfloat16))
    layer = nn.BatchNorm2d(case.num_features).double()
    _init_affine(layer, case.num_features)
    x.requires_grad_()
    expected = layer(x)
    expected.backward(grad)

    out, input_grad = (torch.cat([r[i] for r in results]) for i in (0, 1))
    assert out.dtype == input_grad.dtype == torch.bfloat16
    # Output and input gradient are rounded to bf16 once (relative 2^-8).
    torch.testing.assert_close(out.double(), expected.detach(), atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(input_grad.double(), x.grad, atol=2e-2, rtol=1e-2)
    # Statistics and parameter gradients are fp32 reductions of bf16 data: fp32-accurate.
    weight_grad = sum(r[2] for r in results)
    assert weight_grad.dtype == torch.float32
    torch.testing.assert_close(weight_grad.double(), layer.weight.grad, atol=1e-4, rtol=1e-4)
    for i, name in ((3, "running_mean"), (4, "running_var")):
        torch.testing.assert_close(results[0][i].double(), getattr(layer, name), atol=1e-5, rtol=1e-5)


def _count_collectives(fn) -> int:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return sum(1 for event in prof.events() if event.name.startswith("c10d::"))


def _collective_count_worker(rank: int, world_size: int) -> dict[str, int]:
    layer = SyncBatchNorm(4)
    x = torch.randn(3 + rank, 4, 5, requires_grad=True)
    counts = {}
    out = None

    def forward():
        nonlocal out
        out = layer(x)

    counts["train_forward"] = _count_collectives(forward)
    counts["train_backward"] = _count_collectives(lambda: out.square().sum().backward())
    layer.eval()
    counts["eval_forward_backward"] = _count_collectives(lambda: layer(x).square().sum().backward())
    return counts


def test_one_collective_per_forward_and_per_backward(tmp_path):
    results = run_workers(_collective_count_worker, 2, init_file=tmp_path / "store")
    expected = {"train_forward": 1, "train_backward": 1, "eval_forward_backward": 0}
    assert results == [expected, expected]


def _single_rank_worker(rank: int, world_size: int) -> int:
    layer = SyncBatchNorm(4)
    x = torch.randn(6, 4, requires_grad=True)
    return _count_collectives(lambda: layer(x).square().sum().backward())


def test_world_size_one_communicates_nothing(tmp_path):
    assert run_workers(_single_rank_worker, 1, init_file=tmp_path / "store") == [0]


# A conv net trained for 2 SGD steps: converted + gradient averaging on 2 ranks with uneven
# local batches must equal one process training the unconverted net on the global batch.
_NET_SIZES = (3, 5)


def _conv_net(norm_kwargs: dict) -> nn.Module:
    torch.manual_seed(11)
    return nn.Sequential(
        nn.Conv2d(3, 6, 3, padding=1, bias=False),
        nn.BatchNorm2d(6, **norm_kwargs),
        nn.ReLU(),
        nn.Conv2d(6, 4, 3),
        nn.BatchNorm2d(4, momentum=None, **norm_kwargs),
        nn.Flatten(),
        nn.Linear(4 * 4 * 4, 3),
    ).double()


def _net_step_data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(500 + step)
    x = 1.0 + torch.randn(sum(_NET_SIZES), 3, 6, 6, generator=generator, dtype=torch.float64)
    return x, torch.randint(0, 3, (sum(_NET_SIZES),), generator=generator)


def _train_net(net: nn.Module, rows: slice, grad_scale: float, model=None, finish=None) -> dict:
    """2 SGD steps on ``rows`` of each global batch; loss = sum over rows * grad_scale."""
    model, finish = model or net, finish or (lambda: None)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    for step in range(2):
        x, y = _net_step_data(step)
        loss = nn.functional.cross_entropy(model(x[rows]), y[rows], reduction="sum") * grad_scale
        loss.backward()
        finish()
        optimizer.step()
        optimizer.zero_grad()
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


def _net_worker(rank: int, world_size: int, norm_kwargs: dict) -> dict:
    net = SyncBatchNorm.convert(_conv_net(norm_kwargs))
    assert all(type(m) is not nn.BatchNorm2d for m in net.modules())
    synced = SyncedDataParallel(net)  # averages: scale the local sum so the average is the mean
    first = sum(_NET_SIZES[:rank])
    rows = slice(first, first + _NET_SIZES[rank])
    return _train_net(net, rows, world_size / sum(_NET_SIZES), synced, synced.finish)


@pytest.mark.parametrize("norm_kwargs", [{"bias": False}, {"affine": False}], ids=["no-bias", "no-affine"])
def test_converted_conv_net_trains_like_one_process_on_the_global_batch(tmp_path, norm_kwargs):
    results = run_workers(_net_worker, 2, args=(norm_kwargs,), init_file=tmp_path / "store")

    expected = _train_net(_conv_net(norm_kwargs), slice(None), 1 / sum(_NET_SIZES))
    for result in results:
        assert result.keys() == expected.keys()
        torch.testing.assert_close(result, expected, atol=1e-10, rtol=1e-9)
    weights = [k for k in expected if k.endswith(("weight", "bias"))]
    max_diff = max((results[0][k] - expected[k]).abs().max().item() for k in weights)
    print(f"max |weight difference| vs one process ({norm_kwargs}): {max_diff:.3g}")
    assert max_diff < 1e-10, max_diff
    assert not any(k.endswith("1.bias") for k in expected)  # no BatchNorm shift in either case
