"""SyncBatchNorm's CUDA path (Triton kernels, :mod:`parallel.batchnorm.syncbn_fused`) against the eager reference
and torch's BatchNorm on the global batch.

Without a GPU the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, on CPU tensors), so every case runs
here; on a GPU they run compiled on CUDA tensors (``test_triton_compile.py`` builds them for GPUs without
one). The layer is made to take the fused path on CPU by patching :func:`parallel.batchnorm.syncbn_fused.handles`
(it takes CUDA inputs only).
"""

from __future__ import annotations

import pytest
import torch
from syncbn_cases import CASES, Case, assert_matches, reference, sync_worker

from collectives.launcher import run_workers
from parallel.batchnorm import syncbn, syncbn_fused
from parallel.batchnorm.syncbn import SyncBatchNorm
from parallel.batchnorm.syncbn_function import sync_batch_norm

triton = pytest.importorskip("triton")


# Where the kernels run: compiled on a GPU, else interpreted on CPU tensors.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module", autouse=True)
def kernels():
    """The kernels: compiled on a GPU, else run by Triton's interpreter (conftest sets ``TRITON_INTERPRET=1`` before
    Triton is imported: it reads it then)."""
    kernels = syncbn_fused._triton_kernels()
    if DEVICE == "cpu" and type(kernels.moments_kernel).__name__ != "InterpretedFunction":
        pytest.fail("Triton was imported before conftest could set TRITON_INTERPRET=1: run these tests with it set")
    if DEVICE == "cpu":
        try:  # a runtime loop bound: Triton 3.6's interpreter fails on it with numpy 2 (a 1-element array as index)
            kernels.moments_kernel[(1,)](torch.ones(2, 1), torch.empty(4), 2, 1, 1, 1, 1, 1, BLOCK=16)
        except Exception as error:  # noqa: BLE001 -- the interpreter's own failure, whatever it raises
            pytest.skip(f"Triton {triton.__version__}'s interpreter cannot run the kernels: {error!r:.200}")
    return kernels


def _fused_everywhere(monkeypatch: pytest.MonkeyPatch | None = None) -> None:
    """The layer takes the fused path for CPU inputs too (in this process, or a forked worker)."""
    if monkeypatch is None:
        syncbn_fused.handles = lambda x: True
    else:
        monkeypatch.setattr(syncbn_fused, "handles", lambda x: True)


# (shape, channels_last, dtype, affine, running stats, offset)
ONE_PROCESS = {
    "2d": ((8, 5), False, torch.float32, True, True, 0.0),
    "3d-no-affine": ((4, 3, 7), False, torch.float32, False, True, 0.0),
    "4d": ((4, 3, 5, 5), False, torch.float32, True, True, 0.0),
    "4d-channels-last": ((4, 3, 5, 5), True, torch.float32, True, True, 0.0),
    "4d-no-running-stats": ((4, 3, 5, 5), False, torch.float32, True, False, 0.0),
    "5d": ((2, 3, 2, 3, 4), False, torch.float32, True, True, 0.0),
    "4d-bf16": ((4, 3, 5, 5), False, torch.bfloat16, True, True, 0.0),
    "4d-offset-1e4": ((16, 4, 12, 12), False, torch.float32, True, True, 1e4),
    "large-2-blocks": ((3, 2, 20, 20), False, torch.float32, True, True, 3.0),
}


def _run(fn, case: tuple, *extra, device: str = "cpu") -> dict[str, torch.Tensor]:
    """``fn``'s forward and backward on ``case``'s input (on ``device``); results on the CPU."""
    shape, channels_last, dtype, affine, running, offset = case
    generator = torch.Generator().manual_seed(0)
    x = (offset + torch.randn(shape, generator=generator, dtype=torch.float64)).to(dtype)
    grad = torch.randn(shape, generator=generator, dtype=torch.float64).to(dtype)
    if channels_last:
        x, grad = x.to(memory_format=torch.channels_last), grad.to(memory_format=torch.channels_last)
    x.requires_grad_()
    channels = shape[1]
    weight = (0.5 + torch.rand(channels, generator=generator)).requires_grad_() if affine else None
    bias = torch.randn(channels, generator=generator).requires_grad_() if affine else None
    running_mean = torch.randn(channels, generator=generator) if running else None
    running_var = torch.rand(channels, generator=generator) + 0.5 if running else None
    x, grad, weight, bias, running_mean, running_var = (
        t if t is None else t.detach().to(device).requires_grad_(t.requires_grad)
        for t in (x, grad, weight, bias, running_mean, running_var)
    )
    out = fn(x, weight, bias, running_mean, running_var, 0.1, 1e-5, None, 1, *extra)
    out.backward(grad)
    result = {"out": out, "input_grad": x.grad, "running_mean": running_mean, "running_var": running_var}
    if affine:
        result |= {"weight_grad": weight.grad, "bias_grad": bias.grad}
    return {name: t if t is None else t.detach().cpu() for name, t in result.items()}


@pytest.mark.parametrize("case", ONE_PROCESS.values(), ids=ONE_PROCESS.keys())
def test_kernels_match_the_eager_reference(case):
    eager = _run(sync_batch_norm, case, None, None)
    fused = _run(syncbn_fused.FusedSyncBatchNorm.apply, case, device=DEVICE)

    assert fused.keys() == eager.keys()
    assert fused["out"].dtype == fused["input_grad"].dtype == case[2]
    assert fused["out"].stride() == eager["out"].stride() == fused["input_grad"].stride()
    bf16 = case[2] == torch.bfloat16
    # The output's centre is the gathered (fp32-rounded) mean: ulp(1e4) * invstd, as eager with a group.
    atol = 2e-2 if bf16 else (1e-3 if case[5] >= 1e4 else 1e-5)
    for name, want in eager.items():
        if want is not None:
            torch.testing.assert_close(fused[name].double(), want.double(), atol=atol, rtol=1e-2 if bf16 else 1e-5)


def test_one_value_per_channel_raises_as_torch():
    with pytest.raises(ValueError, match="Expected more than 1 value per channel"):
        syncbn_fused.FusedSyncBatchNorm.apply(torch.randn(1, 3, device=DEVICE), *(None,) * 4, 0.1, 1e-5, None, 1)


def test_five_kernel_launches_per_training_step(kernels, monkeypatch):
    """torch's CUDA SyncBatchNorm launches 3 kernels forward, 2 backward; so do these (plus the collectives)."""
    launches: list[str] = []
    for name in ("moments_kernel", "merge_kernel", "normalise_kernel", "grad_sums_kernel", "grad_input_kernel"):
        kernel = getattr(kernels, name)

        class Counting:
            def __getitem__(self, grid, kernel=kernel, name=name):
                launches.append(name)
                return kernel[grid]

        monkeypatch.setattr(kernels, name, Counting())
    x = torch.randn(4, 3, 5, 5, device=DEVICE, requires_grad=True)
    weight = torch.ones(3, device=DEVICE, requires_grad=True)
    bias = torch.zeros(3, device=DEVICE)
    out = syncbn_fused.FusedSyncBatchNorm.apply(x, weight, bias, None, None, 0.1, 1e-5, None, 1)
    assert launches == ["moments_kernel", "merge_kernel", "normalise_kernel"]
    out.sum().backward()
    assert launches[3:] == ["grad_sums_kernel", "grad_input_kernel"]


@pytest.mark.parametrize("affine", [True, False])
def test_backward_keeps_x_the_weight_and_2c_plus_1_values(affine):
    """torch's CUDA SyncBatchNorm keeps x, the weight, mean and invstd (2C) and a count per rank; these kernels keep
    the same, in one tensor (peak memory: scale is recomputed from the weight)."""
    saved: list[torch.Tensor] = []
    x = torch.randn(4, 8, 3, 3, device=DEVICE, requires_grad=True)
    weight = torch.ones(8, device=DEVICE, requires_grad=True) if affine else None
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        syncbn_fused.FusedSyncBatchNorm.apply(x, weight, None, None, None, 0.1, 1e-5, None, 1)
    shared = [t for t in saved if t.data_ptr() in (x.data_ptr(), getattr(weight, "data_ptr", lambda: -1)())]
    kept = [t for t in saved if all(t is not s for s in shared)]
    assert len(shared) == (2 if affine else 1) and [t.numel() for t in kept] == [2 * 8 + 1]


@pytest.fixture
def fresh_self_check():
    syncbn_fused.self_check.cache_clear()
    yield syncbn_fused.self_check
    syncbn_fused.self_check.cache_clear()


def test_the_self_check_passes_where_the_kernels_run(fresh_self_check):
    assert fresh_self_check(torch.device(DEVICE))


def test_kernels_that_fail_send_the_layers_to_the_eager_kernel_with_one_warning(kernels, fresh_self_check, monkeypatch):
    class Failing:
        def __getitem__(self, grid):
            raise RuntimeError("PTX assembly failed\n(details)")

    monkeypatch.setattr(kernels, "moments_kernel", Failing())
    with pytest.warns(RuntimeWarning, match=r"Triton kernels failed: RuntimeError: PTX assembly failed \(on cpu\)"):
        assert not fresh_self_check(torch.device("cpu"))
    assert not fresh_self_check(torch.device("cpu"))  # cached: checked, and warned, once per device


def test_kernels_that_compute_wrong_values_are_not_used(kernels, fresh_self_check, monkeypatch):
    normalise = kernels.normalise_kernel

    class OffByOne:
        def __getitem__(self, grid):
            def launch(x, output, *args, **kwargs):
                normalise[grid](x, output, *args, **kwargs)
                output.add_(1.0)

            return launch

    monkeypatch.setattr(kernels, "normalise_kernel", OffByOne())
    with pytest.warns(RuntimeWarning, match="differ from the eager reference in y"):
        assert not fresh_self_check(torch.device(DEVICE))


def _fused_sync_worker(rank: int, world_size: int, case: Case) -> dict:
    _fused_everywhere()
    return sync_worker(rank, world_size, case)


@pytest.mark.distributed
@pytest.mark.skipif(DEVICE != "cpu", reason="gloo ranks on CPU tensors: the interpreted kernels")
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_ranks_match_torch_batch_norm_on_the_global_batch(tmp_path, case):
    """2 and 3 gloo ranks through the layer: uneven and empty local batches, channels_last, momentum=None."""
    store = tmp_path / "store"
    results = run_workers(_fused_sync_worker, len(case.sizes), args=(case,), init_file=store, timeout_s=120)

    assert_matches(results, reference(case), atol=2e-5, rtol=1e-4)


def _mixed_worker(rank: int, world_size: int, case: Case) -> dict:
    if rank == 0:  # rank 0 on the Triton kernels, the others on the eager kernel (a GPU whose self-check failed)
        _fused_everywhere()
    return sync_worker(rank, world_size, case)


@pytest.mark.distributed
@pytest.mark.skipif(DEVICE != "cpu", reason="gloo ranks on CPU tensors: the interpreted kernels")
@pytest.mark.parametrize("name", ["4d-conv", "empty-middle-3ranks"])
def test_ranks_on_the_triton_and_the_eager_kernel_work_together(tmp_path, name):
    """Both send the same rows ([count, mean, M2]) and sums: a rank that fell back to the eager kernel still matches."""
    case = CASES[name]
    results = run_workers(_mixed_worker, len(case.sizes), args=(case,), init_file=tmp_path / "store", timeout_s=120)

    assert_matches(results, reference(case), atol=2e-5, rtol=1e-4)


def test_the_layer_takes_the_fused_path_for_cuda_inputs_the_compiled_passes_do_not_take(monkeypatch):
    assert not syncbn_fused.handles(torch.randn(2, 3))  # CUDA inputs only
    paths = []
    monkeypatch.setattr(syncbn_fused, "handles", lambda x: True)
    monkeypatch.setattr(syncbn_fused.FusedSyncBatchNorm, "apply", lambda *args: paths.append("fused") or args[0])
    kernels_path = lambda kernels: "compiled" if kernels is syncbn.COMPILED_KERNELS else "eager"  # noqa: E731
    monkeypatch.setattr(syncbn, "sync_batch_norm", lambda x, *args: paths.append(kernels_path(args[-2])) or x)
    small, large = torch.randn(4, 3), torch.randn(4, 3, 128, 128)  # the compiled passes leave (N, C), take this
    SyncBatchNorm(3, force_sync=True)(small)
    SyncBatchNorm(3, force_sync=True, compile=True)(small)  # left by the compiled passes: the default path
    SyncBatchNorm(3, force_sync=True, compile=True)(large)
    SyncBatchNorm(3)(small)  # nothing synchronised: torch's native batch norm
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    SyncBatchNorm(3, force_sync=True)(small)  # traced by torch.compile: the eager kernel's ops
    assert paths == ["fused", "fused", "compiled", "eager"]
