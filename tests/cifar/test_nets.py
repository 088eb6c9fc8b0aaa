"""The template net and the CIFAR ResNet-18: shapes, gradients, parameter counts."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torchvision.models import resnet18

from lit_cifar.errors import OptionError
from lit_cifar.nets import CifarResNet18, TemplateNet, build_net


def _num_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _forward_backward(net: nn.Module, batch: int = 4) -> torch.Tensor:
    logits = net(torch.randn(batch, 3, 32, 32))
    logits.sum().backward()
    missing = [name for name, p in net.named_parameters() if p.grad is None]
    assert not missing, f"no gradient for {missing}"
    return logits


def test_template_net_shapes_and_parameter_count() -> None:
    net = TemplateNet()
    assert _forward_backward(net).shape == (4, 100)
    # conv 3->32 (3*32*9 + 32) + conv 32->32 (32*32*9 + 32) + fc 6272->128 + BN1d(128) affine + fc 128->100
    expected = (3 * 32 * 9 + 32) + (32 * 32 * 9 + 32) + (6272 * 128 + 128) + 2 * 128 + (128 * 100 + 100)
    assert _num_params(net) == expected == 826_244
    assert any(isinstance(m, nn.BatchNorm1d) for m in net.modules())


def test_resnet18_matches_torchvision_except_the_cifar_stem() -> None:
    ours, reference = CifarResNet18(num_classes=100), resnet18(num_classes=100)
    stem_ours, stem_reference = 3 * 64 * 3 * 3, 3 * 64 * 7 * 7  # 3x3 vs 7x7 stem conv
    assert _num_params(ours) == _num_params(reference) - stem_reference + stem_ours == 11_220_132
    assert sum(isinstance(m, nn.BatchNorm2d) for m in ours.modules()) == 20


def test_narrow_resnet18_trains_on_cpu() -> None:
    net = CifarResNet18(width=0.25)
    assert _forward_backward(net, batch=2).shape == (2, 100)
    assert _num_params(net) < _num_params(CifarResNet18(width=0.5)) < 11_220_132


def test_build_net_and_its_errors() -> None:
    assert isinstance(build_net("template", num_classes=10), TemplateNet)
    assert build_net("resnet18", num_classes=10, width=0.25).fc.out_features == 10
    with pytest.raises(ValueError, match="choose one of"):
        build_net("vgg")
    with pytest.raises(OptionError, match=r"net 'template' takes no 'width'; it takes \['dropout'\]"):
        build_net("template", width=2.0)
    with pytest.raises(ValueError, match="width"):
        CifarResNet18(width=0.001)
