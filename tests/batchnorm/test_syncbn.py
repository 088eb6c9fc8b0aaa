"""SyncBatchNorm in one process (no process group): torch BatchNorm semantics, conversion, errors.

Without a process group the layer runs torch's native batch norm; ``force_sync=True`` runs the hand-written
kernel instead (local statistics), and each test of behaviour runs both ways (``path``).

Multi-rank parity lives in test_syncbn_distributed.py and the assignment's grid in
test_syncbn_grid.py.
"""

import re

import pytest
import torch
from lightning.pytorch.plugins import LayerSync
from torch import nn

from parallel.batchnorm import syncbn_kernels
from parallel.batchnorm.syncbn import SyncBatchNorm
from parallel.torch_compat import make_norm
from strategies.training.layer_sync import CustomSyncBatchNorm

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


def _step(layer, x, grad):
    x = x.clone().requires_grad_()
    out = layer(x)
    out.backward(grad)
    return out.detach(), x.grad


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
        for got, want in zip(_step(ours, x, grad), _step(reference, x, grad), strict=True):
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
    expected = _step(whole, x, grad)
    calls = []
    monkeypatch.setattr(syncbn_kernels, "BLOCKED_MIN_BYTES", 0)
    monkeypatch.setattr(syncbn_kernels, "CPU_BLOCK_BYTES", 1)
    centred_sums = syncbn_kernels._centred_sums
    monkeypatch.setattr(syncbn_kernels, "_centred_sums", lambda *args: calls.append(1) or centred_sums(*args))
    got = _step(blocked, x, grad)
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


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU())
        self.volume = nn.BatchNorm3d(4, momentum=None)
        self.head = nn.Sequential(nn.Flatten(), nn.BatchNorm1d(8, affine=False), nn.Linear(8, 2))


def test_convert_replaces_every_batch_norm_and_shares_its_state():
    net = _Net()
    net.features[1].weight.requires_grad_(False)
    net.volume.eval()
    before = {name: tensor for name, tensor in net.state_dict(keep_vars=True).items()}

    assert SyncBatchNorm.convert(net) is net
    layers = [net.features[1], net.volume, net.head[1]]
    assert all(type(layer) is SyncBatchNorm for layer in layers)
    after = net.state_dict(keep_vars=True)
    assert after.keys() == before.keys()
    assert all(after[name] is before[name] for name in before)  # shared, not copied
    assert not net.features[1].weight.requires_grad
    assert not net.volume.training and net.features[1].training
    assert net.volume.momentum is None and not net.head[1].affine
    assert SyncBatchNorm.convert(net) is net and type(net.volume) is SyncBatchNorm  # idempotent


def test_revert_restores_the_original_classes_and_state():
    net = SyncBatchNorm.convert(_Net())
    before = net.state_dict(keep_vars=True)

    assert SyncBatchNorm.revert(net) is net
    assert type(net.features[1]) is nn.BatchNorm2d
    assert type(net.volume) is nn.BatchNorm3d
    assert type(net.head[1]) is nn.BatchNorm1d
    after = net.state_dict(keep_vars=True)
    assert all(after[name] is before[name] for name in before)


def test_convert_and_revert_a_single_layer():
    layer = nn.BatchNorm2d(3, eps=1e-3)
    converted = SyncBatchNorm.convert(layer)
    assert isinstance(converted, SyncBatchNorm) and converted.eps == 1e-3
    assert type(SyncBatchNorm.revert(converted)) is nn.BatchNorm2d
    # A layer built directly reverts to a BatchNorm that accepts every input rank.
    reverted = SyncBatchNorm.revert(SyncBatchNorm(3))
    assert isinstance(reverted, nn.modules.batchnorm._BatchNorm)
    assert reverted(torch.randn(4, 3, 2, 2)).shape == (4, 3, 2, 2)


def test_layer_sync_plugin_applies_and_reverts():
    plugin = CustomSyncBatchNorm()
    assert isinstance(plugin, LayerSync)
    net = plugin.apply(_Net())
    assert type(net.features[1]) is SyncBatchNorm
    assert type(plugin.revert(net).features[1]) is nn.BatchNorm2d


def test_convert_without_bias_keeps_bias_none_and_matches_torch():
    reference = make_norm(nn.BatchNorm2d, 4, bias=False).double()
    with torch.no_grad():
        reference.weight.uniform_(0.5, 1.5)
    layer = make_norm(nn.BatchNorm2d, 4, bias=False).double()
    layer.load_state_dict(reference.state_dict())
    converted = SyncBatchNorm.convert(layer)
    assert type(converted) is SyncBatchNorm and converted.bias is None
    assert "bias=False" in repr(converted)
    assert [name for name, _ in converted.named_parameters()] == ["weight"]  # nothing on meta
    generator = torch.Generator().manual_seed(1)
    for mode in ("train", "train", "eval"):
        reference.train(mode == "train")
        converted.train(mode == "train")
        x = 1.0 + torch.randn(3, 4, 2, 5, generator=generator, dtype=torch.float64)
        grad = torch.randn(3, 4, 2, 5, generator=generator, dtype=torch.float64)
        for got, want in zip(_step(converted, x, grad), _step(reference, x, grad), strict=True):
            torch.testing.assert_close(got, want)
    torch.testing.assert_close(converted.weight.grad, reference.weight.grad)
    torch.testing.assert_close(converted.state_dict(), reference.state_dict())
    reverted = SyncBatchNorm.revert(converted)
    assert reverted is layer and layer.bias is None and "bias" in layer._parameters


class _TaggedBatchNorm(nn.BatchNorm2d):
    """A user subclass whose constructor differs from BatchNorm2d's."""

    def __init__(self, tag: str, num_features: int) -> None:
        super().__init__(num_features, momentum=0.3)
        self.tag = tag


class _PlainNorm(nn.modules.batchnorm._BatchNorm):
    """A direct `_BatchNorm` subclass without its own input-dim check (torch's only raises)."""


def test_convert_and_revert_subclasses_give_back_the_same_objects():
    net = nn.Sequential(nn.Conv2d(3, 4, 1), _TaggedBatchNorm("mine", 4), nn.SyncBatchNorm(4))
    originals = [net[1], net[2]]
    net[1].weight.requires_grad_(False)
    net[2].eval()
    net[1].qconfig = "q"  # torch's converter carries qconfig; any value does for the check
    before = net.state_dict(keep_vars=True)

    SyncBatchNorm.convert(net)
    assert type(net[1]) is SyncBatchNorm and type(net[2]) is SyncBatchNorm
    assert net[1].original_module is originals[0] and net[1].momentum == 0.3
    assert net[1].qconfig == "q" and not net[1].weight.requires_grad and not net[2].training
    assert all(net.state_dict(keep_vars=True)[k] is v for k, v in before.items())
    assert len(list(net.modules())) == 4  # the held originals are not submodules
    net(torch.randn(2, 3, 3, 3)).sum().backward()
    net.double()  # reassigns the buffers: revert must hand the new tensors to the originals
    after = net.state_dict(keep_vars=True)

    assert SyncBatchNorm.revert(net) is net
    assert net[1] is originals[0] and type(net[1]) is _TaggedBatchNorm and net[1].tag == "mine"
    assert net[2] is originals[1] and type(net[2]) is nn.SyncBatchNorm and not net[2].training
    assert all(net.state_dict(keep_vars=True)[k] is v for k, v in after.items())
    assert net[1].running_mean.dtype == torch.float64 and net[1].num_batches_tracked == 1


def test_convert_a_plain_batch_norm_subclass_accepts_2d_to_5d():
    layer = SyncBatchNorm.convert(_PlainNorm(3))
    assert type(layer) is SyncBatchNorm
    assert layer(torch.randn(4, 3)).shape == (4, 3)
    with pytest.raises(ValueError, match="2D-5D"):
        layer(torch.randn(3))


def test_convert_rejects_an_uninitialised_lazy_batch_norm():
    with pytest.raises(ValueError, match="LazyBatchNorm2d.*run one forward pass"):
        SyncBatchNorm.convert(nn.Sequential(nn.LazyBatchNorm2d()))
    lazy = nn.LazyBatchNorm2d()
    lazy(torch.randn(2, 3, 2, 2))  # initialised: it has become a BatchNorm2d
    assert type(SyncBatchNorm.convert(lazy)) is SyncBatchNorm


@pytest.mark.parametrize(
    ("torch_class", "good", "bad"),
    [
        (nn.BatchNorm1d, [(4, 3), (4, 3, 2)], [(4, 3, 2, 2)]),
        (nn.BatchNorm2d, [(4, 3, 2, 2)], [(4, 3), (4, 3, 2), (4, 3, 2, 2, 2)]),
        (nn.BatchNorm3d, [(4, 3, 2, 2, 2)], [(4, 3, 2, 2)]),
    ],
)
def test_converted_layers_check_input_dims_like_the_class_they_replaced(torch_class, good, bad):
    converted = SyncBatchNorm.convert(torch_class(3))
    for shape in good:
        assert converted(torch.randn(shape)).shape == shape
    for shape in bad:
        with pytest.raises(ValueError) as expected:
            torch_class(3)(torch.randn(shape))
        with pytest.raises(ValueError, match=f"^{re.escape(str(expected.value))}$"):
            converted(torch.randn(shape))
    with pytest.raises(ValueError, match="num_features=3"):  # our checks still follow
        converted(torch.randn(good[0][:1] + (5,) + good[0][2:]))


def test_a_layer_built_directly_accepts_2d_to_5d():
    layer = SyncBatchNorm(3)
    for shape in [(4, 3), (4, 3, 2), (4, 3, 2, 2), (4, 3, 2, 2, 2)]:
        assert layer(torch.randn(shape)).shape == shape


def test_convert_sync_batchnorm_is_torchs_name_for_convert():
    group = object()  # stands in for a ProcessGroup: convert only stores it
    net = SyncBatchNorm.convert_sync_batchnorm(nn.Sequential(nn.BatchNorm1d(3)), group)
    assert type(net[0]) is SyncBatchNorm and net[0].process_group is group
    assert type(SyncBatchNorm.convert_sync_batchnorm(nn.BatchNorm1d(3))) is SyncBatchNorm
