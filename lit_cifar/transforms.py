"""Batched CIFAR image transforms: tensor ops on a whole (N, 3, 32, 32) uint8 batch.

The per-sample torchvision pipeline (PIL image -> RandomCrop(32, padding=4) ->
RandomHorizontalFlip -> ToTensor -> Normalize) costs a Python round trip per image inside the
data-loader workers; on a 2-core machine that competes with the training processes for the same
cores. Doing the same augmentation on the batch after it reached the device (airbench style) is a
handful of vectorised ops, runs on the GPU when there is one, and lets datasets hand out raw
uint8 tensors. The numbers behind this choice: ``python -m benchmarks.costs.data_pipeline``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["CIFAR100_MEAN", "CIFAR100_STD", "normalize", "random_crop", "random_flip", "augment"]

# Per-channel statistics of the 50k CIFAR-100 training images, in [0, 1] units.
CIFAR100_MEAN = (0.5071, 0.4865, 0.4409)
CIFAR100_STD = (0.2673, 0.2564, 0.2762)


def _check_batch(images: Tensor) -> None:
    if images.dim() != 4 or images.dtype != torch.uint8:
        raise TypeError(
            f"expected a uint8 batch of shape (N, C, H, W), got dtype={images.dtype} shape={tuple(images.shape)}; "
            "apply the batched transforms before converting images to float."
        )


def normalize(
    images: Tensor,
    mean: tuple[float, ...] = CIFAR100_MEAN,
    std: tuple[float, ...] = CIFAR100_STD,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """uint8 (N, C, H, W) in 0..255 -> float ``(x / 255 - mean) / std`` per channel."""
    _check_batch(images)
    mean_t = torch.tensor(mean, dtype=dtype, device=images.device).view(1, -1, 1, 1)
    std_t = torch.tensor(std, dtype=dtype, device=images.device).view(1, -1, 1, 1)
    return (images.to(dtype) / 255.0 - mean_t) / std_t


def random_crop(images: Tensor, padding: int = 4, generator: torch.Generator | None = None) -> Tensor:
    """Zero-pad by ``padding`` pixels and take an independent random crop of the original size per image.

    Equals torchvision's ``RandomCrop(size, padding=padding)`` (constant fill 0) applied image by
    image: each image gets its own offset, drawn uniformly from ``0..2*padding`` on both axes.
    """
    _check_batch(images)
    if padding < 0:
        raise ValueError(f"padding must be >= 0, got {padding}.")
    n, c, h, w = images.shape
    padded = F.pad(images, (padding, padding, padding, padding))
    offsets = torch.randint(0, 2 * padding + 1, (2, n), device=images.device, generator=generator)
    rows = (offsets[0].view(n, 1) + torch.arange(h, device=images.device)).view(n, 1, h, 1)
    cols = (offsets[1].view(n, 1) + torch.arange(w, device=images.device)).view(n, 1, 1, w)
    # One gather with broadcast indices: (n, 1, 1, 1) x (1, c, 1, 1) x (n, 1, h, 1) x (n, 1, 1, w).
    batch_idx = torch.arange(n, device=images.device).view(n, 1, 1, 1)
    channel_idx = torch.arange(c, device=images.device).view(1, c, 1, 1)
    return padded[batch_idx, channel_idx, rows, cols]


def random_flip(images: Tensor, p: float = 0.5, generator: torch.Generator | None = None) -> Tensor:
    """Mirror each image left-right independently with probability ``p``."""
    _check_batch(images)
    flip = torch.rand(images.shape[0], device=images.device, generator=generator) < p
    return torch.where(flip.view(-1, 1, 1, 1), images.flip(-1), images)


def augment(images: Tensor, padding: int = 4, generator: torch.Generator | None = None) -> Tensor:
    """The standard CIFAR train augmentation on a uint8 batch: random crop, then random flip."""
    return random_flip(random_crop(images, padding, generator), generator=generator)
