"""SyncBatchNorm(compile=True): the compiled passes against the eager kernel and torch's BatchNorm.

The full parity matrix (every case of test_syncbn_distributed.py, the 1e4 offset, bf16 autocast)
runs compiled there too, marked ``slow``; here: one 2-rank parity check (``slow`` as well: nothing
compiles in the default run, a first compile takes ~20 s with a cold inductor cache), the fallback
when compiling fails, what is compiled at all, recompilation counts, fp16/bf16 inputs, the
assignment's grid and the strategy option.
"""

from __future__ import annotations

import warnings
from dataclasses import replace

import pytest
import torch
import torch._functorch.config as functorch_config
import torch._inductor.config as inductor_config
from syncbn_cases import (
    CASES,
    COMPILE_EVERY_SHAPE,
    COMPILE_TIMEOUT_S,
    assert_matches,
    no_silent_fallback,
    reference,
    sync_worker,
)
from torch import nn
from torch._dynamo.utils import counters
from torch.profiler import ProfilerActivity, profile

import parallel.batchnorm.syncbn
from collectives.launcher import run_workers
from parallel.batchnorm.syncbn import SyncBatchNorm
from parallel.batchnorm.syncbn_kernels import COMPILED_KERNELS, compiled_kernels

pytestmark = pytest.mark.distributed


def _parity_worker(rank: int, world_size: int, case) -> dict:
    eager = sync_worker(rank, world_size, replace(case, compile=False))
    graphs_before = counters["stats"]["unique_graphs"]
    compiled = sync_worker(rank, world_size, case)
    layer = SyncBatchNorm(case.num_features, compile=True, force_sync=True)
    x = torch.randn(case.sizes[rank], *case.feature_shape, requires_grad=True)
    out = []
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        out.append(layer(x))
        out[0].square().sum().backward()
    return {
        "eager": eager,
        "compiled": compiled,
        "graphs": counters["stats"]["unique_graphs"] - graphs_before,
        "compiled_calls": sum(e.name.startswith("Torch-Compiled Region") for e in prof.events()),
        "collectives": sum(e.name.startswith("c10d::") for e in prof.events()),
    }


@pytest.mark.slow  # torch.compile stays out of the default run (a first compile: ~20 s, more on a loaded machine)
def test_compiled_matches_eager_and_batch_norm_on_two_ranks(tmp_path):
    """Uneven local batches (3 and 5), a conv input, 2 steps and eval: the compiled passes give
    torch's results on the global batch and the eager kernel's within fp32 rounding, with one
    collective per forward and one per backward. (~20 s on a quiet machine with a cold inductor
    cache, each rank compiling its 4 graphs; a few seconds with a warm one.)"""
    case = replace(CASES["4d-conv"], compile=True, offset=5.0)
    results = run_workers(_parity_worker, 2, args=(case,), init_file=tmp_path / "store", timeout_s=COMPILE_TIMEOUT_S)

    assert_matches([r["compiled"] for r in results], reference(case), atol=2e-5, rtol=1e-4)
    assert_matches([r["compiled"] for r in results], _as_expected(results), atol=1e-5, rtol=1e-5)
    for result in results:
        assert result["compiled_calls"] == 4  # the four passes ran compiled: no silent fallback
        assert result["collectives"] == 2  # one all_gather forward, one all_reduce backward
        assert 4 <= result["graphs"] <= 6  # 4 passes (+ backward for another grad layout), once each


def _as_expected(results: list[dict]) -> dict:
    """The eager ranks' results in the shape of a one-process reference (concatenated, summed)."""
    eager = [r["eager"] for r in results]
    steps = range(len(eager[0]["outputs"]))
    return eager[0] | {
        "outputs": [torch.cat([r["outputs"][s] for r in eager]) for s in steps],
        "input_grads": [torch.cat([r["input_grads"][s] for r in eager]) for s in steps],
        "weight_grad": sum(r["weight_grad"] for r in eager),
        "bias_grad": sum(r["bias_grad"] for r in eager),
    }


def _failing_backend(graph_module, example_inputs):
    raise RuntimeError("simulated inductor failure")


# Compiling AND running a backward in the pytest process would break every later test that forks
# ranks (torch: "Unable to handle autograd's threading in combination with fork-based
# multiprocessing"), so every compiling test runs in a worker process, even a 1-rank one.
def _fallback_worker(rank: int, world_size: int, failure: str) -> dict:
    if failure == "no-compiler":  # inductor cannot build its C++ (and has nothing cached to load)
        inductor_config.cpp.cxx = ("/nonexistent/g++",)
        inductor_config.fx_graph_cache = False
        functorch_config.enable_autograd_cache = False
        parallel.batchnorm.syncbn.COMPILED_KERNELS = compiled_kernels(min_elements=0, spatial_only=False)
    else:
        parallel.batchnorm.syncbn.COMPILED_KERNELS = compiled_kernels(
            backend=_failing_backend, min_elements=0, spatial_only=False
        )
    compiled, eager = SyncBatchNorm(3, compile=True, force_sync=True), SyncBatchNorm(3, force_sync=True)
    x = 2.0 + torch.randn(4, 3, 5, 5, dtype=torch.float64)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        steps = [[_step(layer, x) for layer in (compiled, eager)] for _ in range(2)]
    return {
        "steps": steps,
        "running_var": (compiled.running_var, eager.running_var),
        "messages": [str(w.message) for w in caught if "torch.compile failed" in str(w.message)],
    }


@pytest.mark.parametrize("failure", ["no-compiler", "backend-error"])
def test_a_failing_compile_warns_once_and_runs_the_same_math_eagerly(tmp_path, failure):
    (result,) = run_workers(
        _fallback_worker, 1, args=(failure,), init_file=tmp_path / "store", timeout_s=COMPILE_TIMEOUT_S
    )

    for compiled, eager in result["steps"]:
        torch.testing.assert_close(compiled, eager)
    torch.testing.assert_close(*result["running_var"])
    messages = result["messages"]
    assert len(messages) == 1 and "\n" not in messages[0], messages
    assert "running the same math eagerly" in messages[0]
    if failure == "backend-error":
        assert "RuntimeError: simulated inductor failure" in messages[0], messages
    else:
        assert "No working C++ compiler" in messages[0], messages


def _step(layer: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.clone().requires_grad_()
    out = layer(x)
    out.backward(torch.cos(x.detach()))
    return out.detach(), x.grad


def test_the_default_compiled_set_leaves_small_and_2d_inputs_to_the_eager_kernel():
    assert COMPILED_KERNELS.handles(torch.empty(8, 64, 32, 32))  # ResNet-18's first stage at batch 8
    assert COMPILED_KERNELS.handles(torch.empty(8, 512, 4, 4))
    assert not COMPILED_KERNELS.handles(torch.empty(2, 512, 4, 4))  # 16,384 elements: dispatch-bound
    assert not COMPILED_KERNELS.handles(torch.empty(256, 1024))  # (N, C)
    assert not COMPILED_KERNELS.handles(torch.empty(0, 64, 32, 32))  # an empty shard
    assert COMPILE_EVERY_SHAPE.handles(torch.empty(2, 3)) and not COMPILE_EVERY_SHAPE.handles(torch.empty(0, 3))


def test_layers_carry_the_option_through_convert_and_repr():
    net = SyncBatchNorm.convert(nn.Sequential(nn.BatchNorm2d(4), nn.BatchNorm1d(3)), compile=True)
    assert [m.compile_kernel for m in net] == [True, True] and "compile=True" in repr(net[0])
    assert not SyncBatchNorm.convert(nn.BatchNorm2d(4)).compile_kernel
    with pytest.raises(TypeError, match="compile='yes' must be a bool"):
        SyncBatchNorm(4, compile="yes")


def _recompile_worker(rank: int, world_size: int) -> list[int]:
    parallel.batchnorm.syncbn.COMPILED_KERNELS = compiled_kernels(min_elements=0, spatial_only=False)
    no_silent_fallback()
    layers = [SyncBatchNorm(n, compile=True, force_sync=True) for n in (16, 16, 8)]

    def graphs_after(layer: nn.Module, *batch_sizes: int) -> int:
        before = counters["stats"]["unique_graphs"]
        for n in batch_sizes:
            _step(layer, torch.randn(n, layer.num_features, 6, 6))
        return counters["stats"]["unique_graphs"] - before

    return [
        graphs_after(layers[0], 32, 9, 1),
        graphs_after(layers[0], 31, 17, 64, 7, 2, 16),
        graphs_after(layers[1], 32, 5),
        graphs_after(layers[2], 32, 5, 1),
    ]


@pytest.mark.slow
def test_new_batch_sizes_and_layers_of_one_shape_do_not_recompile(tmp_path):
    """The batch dimension is dynamic: after sizes 32, 9 and 1 (inductor keeps graphs for >= 17,
    2-16 and 1), a ragged last batch or another batch size compiles nothing, nor does a second
    layer of the same shape; a new layer shape compiles once more."""
    ((first, new_sizes, same_shape, new_shape),) = run_workers(
        _recompile_worker, 1, init_file=tmp_path / "store", timeout_s=COMPILE_TIMEOUT_S
    )
    assert 4 <= first <= 12, first  # 4 passes x at most 3 size classes
    assert new_sizes == 0  # ragged and new batch sizes
    assert same_shape == 0  # another layer, same shape
    assert new_shape <= first  # a new shape: bounded like the first


def _low_precision_worker(rank: int, world_size: int, dtype: torch.dtype, compile: bool) -> tuple:
    parallel.batchnorm.syncbn.COMPILED_KERNELS = COMPILE_EVERY_SHAPE
    no_silent_fallback()
    generator = torch.Generator().manual_seed(3)
    x, grad = (torch.randn(10, 6, 4, 4, generator=generator).to(dtype) for _ in range(2))
    rows = slice(0, 4) if rank == 0 else slice(4, 10)
    layer = SyncBatchNorm(6, compile=compile, force_sync=True).to(dtype)
    x = x[rows].clone().requires_grad_()
    out = layer(x)
    out.backward(grad[rows])
    return out.detach(), x.grad


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fp16_and_bf16_inputs_match_the_eager_kernel(tmp_path, dtype):
    """Half-precision inputs (no autocast): fp32 statistics inside, results rounded once to the
    input dtype, so compiled and eager agree within one rounding of that dtype."""
    got, want = (
        run_workers(
            _low_precision_worker,
            2,
            args=(dtype, compile),
            init_file=tmp_path / f"store{compile}",
            timeout_s=COMPILE_TIMEOUT_S,
        )
        for compile in (True, False)
    )
    for (out, grad), (out_eager, grad_eager) in zip(got, want, strict=True):
        assert out.dtype == grad.dtype == dtype
        torch.testing.assert_close(out, out_eager, atol=2e-2, rtol=1e-2)
        torch.testing.assert_close(grad, grad_eager, atol=2e-2, rtol=1e-2)
