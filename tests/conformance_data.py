"""The datasets of the conformance modules (``tests/lightning_conformance/conformance_modules.py``): seeded, and
able to say which samples a rank saw, in the batch structures users' loaders produce (tensor, tuple, dict)."""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.demos.boring_classes import RandomDataset
from torch.utils.data import Dataset

NUM_FEATURES = 4
NUM_CLASSES = 3
BATCH_KINDS = ("tensor", "tuple", "dict")


def seeded_random_dataset(size: int, length: int, seed: int) -> RandomDataset:
    """Lightning's ``RandomDataset`` (global-RNG data) made reproducible."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return RandomDataset(size, length)


class IndexedClassification(Dataset):
    """``n`` samples of (features, label, index) delivered as one tensor, a tuple or a dict.

    ``tensor``: ``[f0..f3, label, index]`` as one float tensor (the batch is a single tensor);
    ``tuple``: ``(features, label, index)``; ``dict``: ``{"x": ..., "y": ..., "idx": ...}``.
    The index lets a test check which samples each rank evaluated.
    """

    def __init__(self, n: int, kind: str = "tuple", seed: int = 0) -> None:
        assert kind in BATCH_KINDS, kind
        generator = torch.Generator().manual_seed(seed)
        self.kind = kind
        self.features = torch.randn(n, NUM_FEATURES, generator=generator)
        self.labels = torch.randint(0, NUM_CLASSES, (n,), generator=generator)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> Any:
        x, y = self.features[i], self.labels[i]
        if self.kind == "tensor":
            return torch.cat([x, torch.tensor([float(y), float(i)])])
        if self.kind == "tuple":
            return x, int(y), i
        return {"x": x, "y": y, "idx": torch.tensor(i)}


def unpack(batch: Any, kind: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(features, labels, indices) of a collated batch; the batch must have the loader's structure."""
    if kind == "tensor":
        assert isinstance(batch, torch.Tensor), f"expected a tensor batch, got {type(batch).__name__}"
        return batch[:, :NUM_FEATURES], batch[:, NUM_FEATURES].long(), batch[:, NUM_FEATURES + 1].long()
    if kind == "tuple":
        assert isinstance(batch, (list, tuple)) and len(batch) == 3, f"expected a 3-sequence, got {type(batch)}"
        return batch[0], batch[1], batch[2]
    assert isinstance(batch, dict) and set(batch) == {"x", "y", "idx"}, f"expected a dict batch, got {type(batch)}"
    return batch["x"], batch["y"], batch["idx"]
