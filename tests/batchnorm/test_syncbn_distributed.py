"""SyncBatchNorm across 2 and 3 gloo ranks vs torch's BatchNorm on the concatenated global batch.

Each case runs a few training steps (outputs, input/weight/bias gradients, running statistics)
and then eval mode; the reference is ``torch.nn.BatchNorm{1,2,3}d`` in one process on the same
data. Plus: uneven and empty local batches, a large offset, bf16 autocast, and the number of
collectives per forward and per backward.
"""

from __future__ import annotations

import pytest
import torch
from syncbn_cases import (
    CASES,
    COMPILE_EVERY_SHAPE,
    COMPILE_TIMEOUT_S,
    Case,
    assert_matches,
    init_affine,
    make_layer,
    no_silent_fallback,
    reference,
    sync_worker,
    timeout_s,
    train_and_eval,
    with_compiled,
)
from torch import nn
from torch.profiler import ProfilerActivity, profile

import parallel.batchnorm.syncbn
from collectives.launcher import run_workers
from parallel.batchnorm.syncbn import SyncBatchNorm
from parallel.gradients.grad_sync import SyncedDataParallel
from parallel.torch_compat import make_norm

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("case", with_compiled(CASES))
def test_matches_torch_batch_norm_on_the_global_batch(tmp_path, case):
    results = run_workers(
        sync_worker, len(case.sizes), args=(case,), init_file=tmp_path / "store", timeout_s=timeout_s(case)
    )

    assert_matches(results, reference(case), atol=2e-5, rtol=1e-4)
    for rank, result in enumerate(results):
        assert result["outputs"][0].shape[0] == case.sizes[rank]
        if case.channels_last:
            assert result["outputs"][0].is_contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize(
    "case", with_compiled({"offset-1e4": Case(sizes=(64, 40), feature_shape=(4, 8, 8), offset=1e4)})
)
def test_large_offset_is_as_accurate_as_torch(tmp_path, case):
    """1e4 + N(0, 1) in fp32: the error vs an fp64 reference stays within torch's own."""
    results = run_workers(sync_worker, 2, args=(case,), init_file=tmp_path / "store", timeout_s=timeout_s(case))

    exact = reference(case, torch.float64)
    torch_fp32 = reference(case, torch.float32)
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
    layer = make_layer(case)
    init_affine(layer, case.num_features)
    x, grad, _ = case.batch(0, torch.bfloat16)
    x = x[case.shard(rank)].clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(x)
    out.backward(grad[case.shard(rank)])
    return out.detach(), x.grad, layer.weight.grad, layer.running_mean, layer.running_var


@pytest.mark.parametrize("case", with_compiled({"bf16": Case(sizes=(6, 10), feature_shape=(8, 4, 4), offset=3.0)}))
def test_bf16_autocast_keeps_fp32_statistics(tmp_path, case):
    results = run_workers(_bf16_worker, 2, args=(case,), init_file=tmp_path / "store", timeout_s=timeout_s(case))

    # Reference in fp64 on exactly the bf16 values the ranks saw.
    x, grad, _ = (t.double() for t in case.batch(0, torch.bfloat16))
    layer = nn.BatchNorm2d(case.num_features).double()
    init_affine(layer, case.num_features)
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


def _one_gpu_worker(rank: int, world_size: int, name: str) -> dict:
    torch.cuda.set_device(0)  # every rank on the one GPU; gloo stages the collectives through the host
    case = CASES[name]
    return train_and_eval(make_layer(case).cuda(), case, case.shard(rank), torch.float32, device="cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", ["4d-conv", "empty-rank"])
def test_two_ranks_sharing_one_gpu_over_gloo_match_one_process(tmp_path, name):
    """The CUDA path of the kernel on one GPU (spawn: a forked child cannot use CUDA)."""
    kwargs = {"init_file": tmp_path / "store", "start_method": "spawn", "timeout_s": 120}
    results = run_workers(_one_gpu_worker, 2, args=(name,), **kwargs)
    assert_matches(results, reference(CASES[name]), atol=1e-4, rtol=1e-4)


def test_one_collective_per_forward_and_per_backward(tmp_path):
    results = run_workers(_collective_count_worker, 2, init_file=tmp_path / "store")
    expected = {"train_forward": 1, "train_backward": 1, "eval_forward_backward": 0}
    assert results == [expected, expected]


def _single_rank_worker(rank: int, world_size: int) -> dict[str, object]:
    """A one-rank world: torch's native batch norm (the same bits as ``nn.BatchNorm1d``, no collective); with
    ``force_sync`` the hand-written kernel and its two collectives on the one-rank group."""
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(6, 4, generator=generator) + 3.0
    # A random upstream gradient: d(sum(y**2))/dx is ~0 after BatchNorm's centring (the terms cancel), so its
    # difference between two correct kernels is all rounding, and 1 seed in 500 put it past any fixed atol.
    upstream = torch.randn(6, 4, generator=generator)
    result = {}
    for force_sync in (False, True):
        layer, reference = SyncBatchNorm(4, force_sync=force_sync), nn.BatchNorm1d(4)
        inputs = [x.clone().requires_grad_() for _ in range(2)]
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            layer(inputs[0]).backward(upstream)
        reference(inputs[1]).backward(upstream)
        names = [event.name for event in prof.events()]
        result[force_sync] = {
            "collectives": sum(1 for name in names if name.startswith("c10d::")),
            "native": "aten::native_batch_norm" in names,
            "same_bits": torch.equal(inputs[0].grad, inputs[1].grad)
            and torch.equal(layer.running_var, reference.running_var),
            "close": torch.allclose(inputs[0].grad, inputs[1].grad, rtol=1e-4, atol=1e-5),
        }
    return result


def test_world_size_one_runs_torch_native_batch_norm_and_communicates_nothing(tmp_path):
    (result,) = run_workers(_single_rank_worker, 1, init_file=tmp_path / "store")
    assert result[False] == {"collectives": 0, "native": True, "same_bits": True, "close": True}
    forced = result[True]
    assert (forced["collectives"], forced["native"], forced["close"]) == (2, False, True)


# A conv net trained for 2 SGD steps: converted + gradient averaging on 2 ranks with uneven
# local batches must equal one process training the unconverted net on the global batch.
_NET_SIZES = (3, 5)


def _conv_net(norm_kwargs: dict) -> nn.Module:
    torch.manual_seed(11)
    return nn.Sequential(
        nn.Conv2d(3, 6, 3, padding=1, bias=False),
        make_norm(nn.BatchNorm2d, 6, **norm_kwargs),
        nn.ReLU(),
        nn.Conv2d(6, 4, 3),
        make_norm(nn.BatchNorm2d, 4, momentum=None, **norm_kwargs),
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


def _net_worker(rank: int, world_size: int, norm_kwargs: dict, compile: bool) -> dict:
    if compile:
        parallel.batchnorm.syncbn.COMPILED_KERNELS = COMPILE_EVERY_SHAPE
        no_silent_fallback()
    net = SyncBatchNorm.convert(_conv_net(norm_kwargs), compile=compile)
    assert all(type(m) is not nn.BatchNorm2d for m in net.modules())
    synced = SyncedDataParallel(net)  # averages: scale the local sum so the average is the mean
    first = sum(_NET_SIZES[:rank])
    rows = slice(first, first + _NET_SIZES[rank])
    return _train_net(net, rows, world_size / sum(_NET_SIZES), synced, synced.finish)


@pytest.mark.parametrize("compile", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["eager", "compiled"])
@pytest.mark.parametrize("norm_kwargs", [{"bias": False}, {"affine": False}], ids=["no-bias", "no-affine"])
def test_converted_conv_net_trains_like_one_process_on_the_global_batch(tmp_path, norm_kwargs, compile):
    results = run_workers(
        _net_worker,
        2,
        args=(norm_kwargs, compile),
        init_file=tmp_path / "store",
        timeout_s=COMPILE_TIMEOUT_S if compile else 60.0,
    )

    expected = _train_net(_conv_net(norm_kwargs), slice(None), 1 / sum(_NET_SIZES))
    for result in results:
        assert result.keys() == expected.keys()
        torch.testing.assert_close(result, expected, atol=1e-10, rtol=1e-9)
    weights = [k for k in expected if k.endswith(("weight", "bias"))]
    max_diff = max((results[0][k] - expected[k]).abs().max().item() for k in weights)
    print(f"max |weight difference| vs one process ({norm_kwargs}): {max_diff:.3g}")
    assert max_diff < 1e-10, max_diff
    assert not any(k.endswith("1.bias") for k in expected)  # no BatchNorm shift in either case
