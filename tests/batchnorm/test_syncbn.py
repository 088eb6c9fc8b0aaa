"""SyncBatchNorm in one process (no process group): torch BatchNorm semantics and errors.

Without a process group the layer runs torch's native batch norm; ``force_sync=True`` runs the hand-written
kernel instead (local statistics), and each test of behaviour runs both ways (``path``).

Conversion of models (``SyncBatchNorm.convert`` / ``revert``) is in test_syncbn_convert.py, multi-rank
parity in test_syncbn_distributed.py and the assignment's grid in test_syncbn_grid.py.
"""

import pytest
import torch
from syncbn_cases import forward_backward
from torch import nn

from parallel.batchnorm import syncbn_kernels
from parallel.batchnorm.syncbn import SyncBatchNorm
from parallel.torch_compat import make_norm

# The layer's two ways in one process: torch's native batch norm (default) and the hand-written kernel.
PATHS = pytest.mark.parametrize("path", [{}, {"force_sync": True}], ids=["native", "kernel"])


def _pair(torch_class, num_features, path, bias=True, **kwargs):
    """A torch BatchNorm and a SyncBatchNorm with equal, non-trivial affine parameters."""
    reference = make_norm(torch_class, num_features, bias=bias, **kwargs).double()  # torch < 2.12: no bias=
    kwargs["bias"] = bias
    ours = SyncBatchNorm(num_features, **path, **kwargs).double()
    if reference.affine:
        with torch.no_grad():
            reference.weight.uniform_(0.5, 1.5)
            ours.weight.copy_(reference.weight)
            if reference.bias is not None:
                reference.bias.normal_()
                ours.bias.copy_(reference.bias)
    return reference, ours


@pytest.mark.parametrize(
    ("torch_class", "shape"),
    [
        (nn.BatchNorm1d, (7, 5)),
        (nn.BatchNorm1d, (4, 5, 3)),
        (nn.BatchNorm2d, (3, 5, 4, 2)),
        (nn.BatchNorm3d, (2, 5, 2, 3, 2)),
    ],
)
@pytest.mark.parametrize(
    "kwargs",
    [{}, {"momentum": None}, {"affine": False}, {"track_running_stats": False}, {"bias": False}],
    ids=["default", "cumulative", "no-affine", "no-running-stats", "no-bias"],
)
@PATHS
def test_matches_torch_batch_norm_without_a_process_group(torch_class, shape, kwargs, path):
    reference, ours = _pair(torch_class, shape[1], path, **kwargs)
    generator = torch.Generator().manual_seed(0)
    for mode in ("train", "train", "eval"):
        reference.train(mode == "train")
        ours.train(mode == "train")
        x = 3.0 + 2.0 * torch.randn(shape, generator=generator, dtype=torch.float64)
        grad = torch.randn(shape, generator=generator, dtype=torch.float64)
        for got, want in zip(forward_backward(ours, x, grad), forward_backward(reference, x, grad), strict=True):
            torch.testing.assert_close(got, want)
    torch.testing.assert_close(ours.state_dict(), reference.state_dict())
    if reference.affine:
        torch.testing.assert_close(ours.weight.grad, reference.weight.grad)
    if reference.bias is not None:
        torch.testing.assert_close(ours.bias.grad, reference.bias.grad)
    assert (ours.bias is None) == (reference.bias is None)


@PATHS
def test_channels_last_input_gives_channels_last_output_and_grad(path):
    x = torch.randn(4, 6, 5, 5).to(memory_format=torch.channels_last).requires_grad_()
    out = SyncBatchNorm(6, **path)(x)
    out.backward(torch.randn_like(out))
    assert out.is_contiguous(memory_format=torch.channels_last)
    assert x.grad.is_contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize(
    ("shape", "channels_last", "dtype", "offset"),
    [
        ((5, 3, 6), False, torch.float32, 3.0),
        ((6, 4, 3, 5), True, torch.float32, 3.0),
        ((6, 4, 3, 5), False, torch.bfloat16, 3.0),
        ((6, 4, 3, 5), False, torch.float32, 1e4),
        ((3, 2, 2, 3, 4), False, torch.float64, 3.0),
    ],
    ids=["3d", "4d-channels-last", "4d-bf16", "4d-offset-1e4", "5d-fp64"],
)
def test_large_inputs_in_row_blocks_match_the_whole_tensor_passes(monkeypatch, shape, channels_last, dtype, offset):
    """Large CPU inputs run the kernel's passes in row blocks (syncbn_kernels.BLOCKED_MIN_BYTES), forced here on
    small ones with blocks of one row: the same output, gradients and running statistics as whole-tensor passes."""
    generator = torch.Generator().manual_seed(0)
    x = (offset + torch.randn(shape, generator=generator, dtype=torch.float64)).to(dtype)
    x = x.to(memory_format=torch.channels_last) if channels_last else x
    grad = torch.randn(shape, generator=generator, dtype=torch.float64).to(dtype)
    whole, blocked = (SyncBatchNorm(shape[1], force_sync=True).to(dtype) for _ in range(2))
    for layer in (whole, blocked):
        with torch.no_grad():
            layer.weight.copy_(torch.linspace(0.5, 1.5, shape[1]))
    expected = forward_backward(whole, x, grad)
    calls = []
    monkeypatch.setattr(syncbn_kernels, "BLOCKED_MIN_BYTES", 0)
    monkeypatch.setattr(syncbn_kernels, "CPU_BLOCK_BYTES", 1)
    centred_sums = syncbn_kernels._centred_sums
    monkeypatch.setattr(syncbn_kernels, "_centred_sums", lambda *args: calls.append(1) or centred_sums(*args))
    got = forward_backward(blocked, x, grad)
    assert len(calls) == 2  # the forward's moments and the backward's sums
    for actual, wanted in zip(got, expected, strict=True):
        torch.testing.assert_close(actual, wanted)
    assert got[0].is_contiguous(memory_format=torch.channels_last) == channels_last
    torch.testing.assert_close(blocked.state_dict(), whole.state_dict())
    torch.testing.assert_close(blocked.weight.grad, whole.weight.grad)


def test_saves_only_the_input_and_per_channel_vectors_for_backward():
    x = torch.randn(8, 16, 4, 4, requires_grad=True)
    out = SyncBatchNorm(16, force_sync=True)(x)
    saved = out.grad_fn.saved_tensors
    assert saved[0].data_ptr() == x.data_ptr()  # the input itself, no normalised copy
    assert all(t.numel() <= 16 for t in saved[1:])


@pytest.mark.parametrize(
    ("x", "message"),
    [
        (torch.randn(5), "expects a 2D-5D input"),
        (torch.randn(2, 4, 1, 1, 1, 1), "expects a 2D-5D input"),
        (torch.randn(2, 3, 5), "num_features=4"),
        (torch.ones(2, 4, dtype=torch.int64), "floating-point"),
    ],
)
@PATHS
def test_bad_input_raises_a_value_error_naming_the_fix(x, message, path):
    with pytest.raises(ValueError, match=message):
        SyncBatchNorm(4, **path)(x)


@PATHS
def test_one_value_per_channel_in_training_raises_like_torch(path):
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        SyncBatchNorm(3, **path)(torch.randn(1, 3))
    SyncBatchNorm(3, **path).eval()(torch.randn(1, 3))  # eval mode needs no batch statistics


@PATHS
def test_empty_batch_returns_empty_and_keeps_running_stats(path):
    layer = SyncBatchNorm(3, **path)
    x = torch.randn(0, 3, 4, requires_grad=True)
    out = layer(x)
    out.sum().backward()
    assert out.shape == (0, 3, 4) and x.grad.shape == (0, 3, 4)
    torch.testing.assert_close(layer.running_var, torch.ones(3))
    assert layer.num_batches_tracked == 1  # torch counts the call too


def test_a_forward_whose_collective_fails_leaves_the_layer_as_it_was(monkeypatch):
    """A peer lost during the statistics' all_gather: no batch counted, so a checkpoint written then
    (strategies.fault_tolerance.last_checkpoint) resumes exactly. torch's BatchNorm counts the call before it
    computes."""
    import parallel.batchnorm.syncbn

    def lost_peer(*args, **kwargs):
        raise RuntimeError("Connection closed by peer")

    layer = SyncBatchNorm(3, momentum=None, force_sync=True)
    layer(torch.randn(4, 3))
    monkeypatch.setattr(parallel.batchnorm.syncbn, "sync_batch_norm", lost_peer)
    with pytest.raises(RuntimeError, match="closed by peer"):
        layer(torch.randn(4, 3))
    assert layer.num_batches_tracked == 1
    monkeypatch.undo()
    reference = nn.BatchNorm1d(3, momentum=None)
    batches = [torch.randn(4, 3) for _ in range(2)]
    for batch in batches:
        reference(batch)
    fresh = SyncBatchNorm(3, momentum=None)
    for batch in batches:
        fresh(batch)
    torch.testing.assert_close(fresh.running_mean, reference.running_mean)  # the cumulative average as torch's
    assert fresh.num_batches_tracked == reference.num_batches_tracked == 2
