"""SyncBatchNorm in one process (no process group): torch BatchNorm semantics, conversion, errors.

Multi-rank parity lives in test_syncbn_distributed.py and the assignment's grid in
test_syncbn_grid.py.
"""

import pytest
import torch
from lightning.pytorch.plugins import LayerSync
from torch import nn

from strategies.layer_sync import CustomSyncBatchNorm
from parallel.syncbn import SyncBatchNorm


def _pair(torch_class, num_features, **kwargs):
    """A torch BatchNorm and a SyncBatchNorm with equal, non-trivial affine parameters."""
    reference = torch_class(num_features, **kwargs).double()
    ours = SyncBatchNorm(num_features, **kwargs).double()
    if reference.affine:
        with torch.no_grad():
            reference.weight.uniform_(0.5, 1.5)
            reference.bias.normal_()
            ours.weight.copy_(reference.weight)
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
    [{}, {"momentum": None}, {"affine": False}, {"track_running_stats": False}],
    ids=["default", "cumulative", "no-affine", "no-running-stats"],
)
def test_matches_torch_batch_norm_without_a_process_group(torch_class, shape, kwargs):
    reference, ours = _pair(torch_class, shape[1], **kwargs)
    generator = torch.Generator().manual_seed(0)
    for mode in ("train", "train", "eval"):
        reference.train(mode == "train")
        ours.train(mode == "train")
        x = 3.0 + 2.0 * torch.randn(shape, generator=generator, dtype=torch.float64)
        grad = torch.randn(shape, generator=generator, dtype=torch.float64)
        for got, want in zip(_step(ours, x, grad), _step(reference, x, grad)):
            torch.testing.assert_close(got, want)
    torch.testing.assert_close(ours.state_dict(), reference.state_dict())
    if reference.affine:
        torch.testing.assert_close(ours.weight.grad, reference.weight.grad)
        torch.testing.assert_close(ours.bias.grad, reference.bias.grad)


def test_channels_last_input_gives_channels_last_output_and_grad():
    x = torch.randn(4, 6, 5, 5).to(memory_format=torch.channels_last).requires_grad_()
    out = SyncBatchNorm(6)(x)
    out.backward(torch.randn_like(out))
    assert out.is_contiguous(memory_format=torch.channels_last)
    assert x.grad.is_contiguous(memory_format=torch.channels_last)


def test_saves_only_the_input_and_per_channel_vectors_for_backward():
    x = torch.randn(8, 16, 4, 4, requires_grad=True)
    out = SyncBatchNorm(16)(x)
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
def test_bad_input_raises_a_value_error_naming_the_fix(x, message):
    with pytest.raises(ValueError, match=message):
        SyncBatchNorm(4)(x)


def test_one_value_per_channel_in_training_raises_like_torch():
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        SyncBatchNorm(3)(torch.randn(1, 3))
    SyncBatchNorm(3).eval()(torch.randn(1, 3))  # eval mode needs no batch statistics


def test_empty_batch_returns_empty_and_keeps_running_stats():
    layer = SyncBatchNorm(3)
    x = torch.randn(0, 3, 4, requires_grad=True)
    out = layer(x)
    out.sum().backward()
    assert out.shape == (0, 3, 4) and x.grad.shape == (0, 3, 4)
    torch.testing.assert_close(layer.running_var, torch.ones(3))
    assert layer.num_batches_tracked == 1  # torch counts the call too


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
