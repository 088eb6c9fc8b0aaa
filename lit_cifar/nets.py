"""Networks for 32x32 CIFAR images: the assignment's template net and a CIFAR ResNet-18.

Both contain BatchNorm layers on purpose: they are what the hand-written SyncBatchNorm of the
``custom_ddp`` strategy synchronises (``BatchNorm1d`` in the template net, ``BatchNorm2d`` in the
ResNet). :func:`build_net` maps the names used in configs to constructors.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from lit_cifar.errors import OptionError

__all__ = ["TemplateNet", "BasicBlock", "CifarResNet18", "NETS", "build_net"]


class TemplateNet(nn.Module):
    """The assignment's net: two 3x3 convs, max-pool, dropout, fc 6272->128, BatchNorm1d, fc->classes.

    The convolutions are unpadded (32 -> 30 -> 28), pooling halves to 14, so the flattened feature
    is 32 * 14 * 14 = 6272, as the assignment specifies.

    Args:
        num_classes: Output logits.
        dropout: Drop probability after the pooling layer.
    """

    def __init__(self, num_classes: int = 100, dropout: float = 0.25) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 32, kernel_size=3),
            nn.ReLU(inplace=True),
            nn.Conv2d(32, 32, kernel_size=3),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
            nn.Dropout(dropout),
        )
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Linear(32 * 14 * 14, 128),
            nn.BatchNorm1d(128),
            nn.ReLU(inplace=True),
            nn.Linear(128, num_classes),
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(self.features(x))


class BasicBlock(nn.Module):
    """Two 3x3 conv-BN layers with a residual connection (1x1 conv-BN when the shape changes)."""

    def __init__(self, in_channels: int, out_channels: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False), nn.BatchNorm2d(out_channels)
            )

    def forward(self, x: Tensor) -> Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return torch.relu(out + self.shortcut(x))


class CifarResNet18(nn.Module):
    """ResNet-18 for 32x32 inputs: 3x3 stem without max-pool, stages [2, 2, 2, 2] of BasicBlocks.

    Identical to torchvision's ``resnet18`` except the stem (3x3 stride-1 conv instead of 7x7
    stride-2 conv + max-pool), which keeps the spatial resolution CIFAR images need.

    Args:
        num_classes: Output logits.
        width: Channel multiplier; stage widths are ``round(64 * width) * (1, 2, 4, 8)``.
            ``width=0.25`` (~0.7 M parameters) trains on CPU; ``1.0`` is the standard 11.2 M net.
    """

    def __init__(self, num_classes: int = 100, width: float = 1.0) -> None:
        super().__init__()
        base = round(64 * width)
        if base < 1:
            raise OptionError(f"width={width} leaves no channels; use width >= {1 / 64:.4f}.")
        self.stem = nn.Sequential(
            nn.Conv2d(3, base, 3, padding=1, bias=False), nn.BatchNorm2d(base), nn.ReLU(inplace=True)
        )
        stages, in_channels = [], base
        for i, stride in enumerate((1, 2, 2, 2)):
            out_channels = base * 2**i
            stages.append(
                nn.Sequential(BasicBlock(in_channels, out_channels, stride), BasicBlock(out_channels, out_channels))
            )
            in_channels = out_channels
        self.stages = nn.Sequential(*stages)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(in_channels, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(torch.flatten(self.pool(self.stages(self.stem(x))), 1))


NETS: dict[str, Callable[..., nn.Module]] = {"template": TemplateNet, "resnet18": CifarResNet18}


def build_net(name: str, num_classes: int = 100, **kwargs: Any) -> nn.Module:
    """Construct a net by its config name (``template`` or ``resnet18``) with its own keyword args."""
    if name not in NETS:
        raise OptionError(f"unknown net {name!r}; choose one of {sorted(NETS)}.")
    # Checked against the signature, not by catching TypeError: a TypeError raised inside the
    # constructor is a bug to show whole, not a bad option.
    accepted = [arg for arg in inspect.signature(NETS[name]).parameters if arg != "num_classes"]
    unknown = sorted(set(kwargs) - set(accepted))
    if unknown:
        raise OptionError(
            f"model.net_kwargs {kwargs}: net {name!r} takes no {', '.join(map(repr, unknown))}; "
            f"it takes {accepted}, e.g. --model.net_kwargs='{{\"{accepted[0]}\": ...}}'."
        )
    return NETS[name](num_classes=num_classes, **kwargs)
