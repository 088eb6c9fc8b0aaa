"""``SyncBatchNorm.convert`` and ``revert`` on models: every BatchNorm layer replaced, its state shared,
subclasses, lazy layers and layers reachable from several places handled, the originals given back.
"""

import re

import pytest
import torch
from lightning.pytorch.plugins import LayerSync
from syncbn_cases import forward_backward
from torch import nn

from parallel.batchnorm.syncbn import SyncBatchNorm, SyncBatchNorm1d, SyncBatchNorm2d, SyncBatchNorm3d
from parallel.torch_compat import make_norm
from strategies.training.layer_sync import CustomSyncBatchNorm


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
    assert [type(layer) for layer in layers] == [SyncBatchNorm2d, SyncBatchNorm3d, SyncBatchNorm1d]
    # Still instances of the classes they replaced: isinstance(m, nn.BatchNorm2d) (freezing BatchNorm) finds them.
    assert isinstance(net.features[1], nn.BatchNorm2d) and isinstance(net.volume, nn.BatchNorm3d)
    assert isinstance(net.head[1], nn.BatchNorm1d) and not isinstance(net.head[1], nn.BatchNorm2d)
    after = net.state_dict(keep_vars=True)
    assert after.keys() == before.keys()
    assert all(after[name] is before[name] for name in before)  # shared, not copied
    assert not net.features[1].weight.requires_grad
    assert not net.volume.training and net.features[1].training
    assert net.volume.momentum is None and not net.head[1].affine
    assert SyncBatchNorm.convert(net) is net and type(net.volume) is SyncBatchNorm3d  # idempotent


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
    assert type(net.features[1]) is SyncBatchNorm2d
    assert type(plugin.revert(net).features[1]) is nn.BatchNorm2d


def test_convert_without_bias_keeps_bias_none_and_matches_torch():
    reference = make_norm(nn.BatchNorm2d, 4, bias=False).double()
    with torch.no_grad():
        reference.weight.uniform_(0.5, 1.5)
    layer = make_norm(nn.BatchNorm2d, 4, bias=False).double()
    layer.load_state_dict(reference.state_dict())
    converted = SyncBatchNorm.convert(layer)
    assert type(converted) is SyncBatchNorm2d and converted.bias is None
    assert "bias=False" in repr(converted)
    assert [name for name, _ in converted.named_parameters()] == ["weight"]  # nothing on meta
    generator = torch.Generator().manual_seed(1)
    for mode in ("train", "train", "eval"):
        reference.train(mode == "train")
        converted.train(mode == "train")
        x = 1.0 + torch.randn(3, 4, 2, 5, generator=generator, dtype=torch.float64)
        grad = torch.randn(3, 4, 2, 5, generator=generator, dtype=torch.float64)
        for got, want in zip(forward_backward(converted, x, grad), forward_backward(reference, x, grad), strict=True):
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
    # A subclass of BatchNorm2d becomes a SyncBatchNorm2d; torch's SyncBatchNorm (no BatchNorm2d) a SyncBatchNorm.
    assert type(net[1]) is SyncBatchNorm2d and type(net[2]) is SyncBatchNorm
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
    assert type(layer) is SyncBatchNorm  # a plain _BatchNorm subclass: no torch class of a dimension
    assert layer(torch.randn(4, 3)).shape == (4, 3)
    with pytest.raises(ValueError, match="2D-5D"):
        layer(torch.randn(3))


def test_convert_rejects_an_uninitialised_lazy_batch_norm():
    with pytest.raises(ValueError, match="LazyBatchNorm2d.*run one forward pass"):
        SyncBatchNorm.convert(nn.Sequential(nn.LazyBatchNorm2d()))
    lazy = nn.LazyBatchNorm2d()
    lazy(torch.randn(2, 3, 2, 2))  # initialised: it has become a BatchNorm2d
    assert type(SyncBatchNorm.convert(lazy)) is SyncBatchNorm2d


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


@pytest.mark.parametrize(
    ("layer_class", "torch_class", "good", "bad"),
    [
        (SyncBatchNorm1d, nn.BatchNorm1d, (4, 3), (4, 3, 2, 2)),
        (SyncBatchNorm2d, nn.BatchNorm2d, (4, 3, 2, 2), (4, 3)),
        (SyncBatchNorm3d, nn.BatchNorm3d, (4, 3, 2, 2, 2), (4, 3, 2, 2)),
    ],
)
def test_a_layer_of_one_dimension_built_directly_checks_like_and_reverts_to_its_torch_class(
    layer_class, torch_class, good, bad
):
    layer = layer_class(3)
    assert isinstance(layer, torch_class) and isinstance(layer, SyncBatchNorm)
    assert layer(torch.randn(good)).shape == good
    with pytest.raises(ValueError) as expected:
        torch_class(3)(torch.randn(bad))
    with pytest.raises(ValueError, match=f"^{re.escape(str(expected.value))}$"):
        layer(torch.randn(bad))
    assert type(SyncBatchNorm.revert(layer)) is torch_class


def test_convert_sync_batchnorm_is_torchs_name_for_convert():
    group = object()  # stands in for a ProcessGroup: convert only stores it
    net = SyncBatchNorm.convert_sync_batchnorm(nn.Sequential(nn.BatchNorm1d(3)), group)
    assert type(net[0]) is SyncBatchNorm1d and net[0].process_group is group
    assert type(SyncBatchNorm.convert_sync_batchnorm(nn.BatchNorm1d(3))) is SyncBatchNorm1d


class _Finetuned(nn.Module):
    """A model that reaches one BatchNorm from three places, as fine-tuning code does."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
        self.backbone = self.net[:2]  # a second parent of the same layers
        self.norm = self.net[1]
        self.norm_alias = self.norm  # a second name in the same parent


def test_a_layer_reachable_from_several_places_becomes_one_layer_in_all():
    model = _Finetuned()
    original = model.norm

    SyncBatchNorm.convert(model)
    converted = model.net[1]
    assert type(converted) is SyncBatchNorm1d
    assert model.backbone[1] is converted and model.norm is converted and model.norm_alias is converted
    model.backbone.eval()  # freezing through one name reaches the layer the forward runs
    assert not model.net[1].training
    assert len([m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]) == 1

    SyncBatchNorm.revert(model)
    assert all(layer is original for layer in (model.net[1], model.backbone[1], model.norm, model.norm_alias))
    assert not original.training


def test_hooks_of_the_replaced_layer_run_while_converted_and_stay_after_revert():
    net = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    seen = []
    forward = net[1].register_forward_hook(lambda module, args, out: seen.append("forward"))
    net[1].register_forward_pre_hook(lambda module, args: seen.append("pre"))
    net[1].register_full_backward_hook(lambda module, grad_in, grad_out: seen.append("backward"))

    SyncBatchNorm.convert(net)
    net(torch.randn(5, 3)).sum().backward()
    assert seen == ["pre", "forward", "backward"]
    forward.remove()  # the handle torch returned before the conversion still works
    net[1].register_forward_hook(lambda module, args, out: seen.append("added while converted"))

    SyncBatchNorm.revert(net)
    assert type(net[1]) is nn.BatchNorm1d
    seen.clear()
    net(torch.randn(5, 3)).sum().backward()
    assert seen == ["pre", "added while converted", "backward"]


def test_revert_gives_back_the_flags_set_while_converted():
    net = SyncBatchNorm.convert(nn.Sequential(nn.BatchNorm1d(4)))
    net[0].track_running_stats = False  # what BaseFinetuning.freeze(..., train_bn=False) sets
    net[0].momentum, net[0].eps = 0.3, 1e-3
    net[0].eval()

    SyncBatchNorm.revert(net)
    layer = net[0]
    assert type(layer) is nn.BatchNorm1d and not layer.track_running_stats and not layer.training
    assert (layer.momentum, layer.eps) == (0.3, 1e-3)
