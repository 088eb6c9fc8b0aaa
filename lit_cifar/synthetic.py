"""A learnable stand-in for CIFAR-100, written in the official ``cifar-100-python/`` layout.

Offline machines, CI and tests cannot download CIFAR-100, yet they should exercise the *same*
loading code as real runs. This module writes the three pickles torchvision's ``CIFAR100`` reads
(``train``, ``test``, ``meta``: uint8 ``data`` of shape (N, 3072) in R/G/B planes,
``fine_labels``, ``coarse_labels``, label names) plus a ``SYNTHETIC.json`` marker, and
:class:`SyntheticCIFAR100` loads them through torchvision's class, checking presence and the
marker instead of the official md5 sums (which only the real files can match).

Every class owns a smooth colour template (a left-right symmetric 4x4 colour grid, upsampled, so
a horizontal flip keeps the class); each image is its class template blended with a random other
class's template, with random contrast, brightness, a small shift and Gaussian pixel noise. A
small net climbs well above chance (1 %) within a few epochs without saturating at once, so
accuracy curves mean something. The fine labels are balanced and ``coarse = fine // 5``
(not the real CIFAR-100 super-class mapping).

Usage:
    python -m lit_cifar.synthetic --root data/synthetic --train-size 10000 --test-size 2000
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torchvision.datasets import CIFAR100

__all__ = ["SyntheticCIFAR100", "is_synthetic", "write_synthetic_cifar100"]

NUM_CLASSES = 100
_MARKER = "SYNTHETIC.json"
_FORMAT_VERSION = 1
# What reading a damaged pickle or JSON file raises: truncation gives UnpicklingError or EOFError,
# flipped bytes anything from UnicodeDecodeError (a ValueError) to MemoryError.
_READ_ERRORS = (
    pickle.UnpicklingError,
    EOFError,
    ValueError,
    KeyError,
    IndexError,
    TypeError,
    AttributeError,
    MemoryError,
)


def _class_templates(rng: np.random.Generator, grid: int = 4) -> np.ndarray:
    """(100, 3, 32, 32) float templates in [0, 255], symmetric under horizontal flip."""
    half = rng.uniform(0.0, 255.0, size=(NUM_CLASSES, 3, grid, grid // 2))
    coarse = np.concatenate([half, half[..., ::-1]], axis=-1)
    smooth = F.interpolate(torch.from_numpy(coarse), size=(32, 32), mode="bilinear", align_corners=False)
    return smooth.numpy()


def _make_split(
    rng: np.random.Generator, templates: np.ndarray, size: int, noise_std: float, max_distractor: float
) -> tuple[np.ndarray, np.ndarray]:
    """Balanced labels (every class when ``size >= 100``) and uint8 images (size, 3, 32, 32).

    Each image blends its class template with a random other template (weight up to
    ``max_distractor``), so classes overlap and accuracy rises over epochs instead of saturating.
    """
    labels = rng.permutation(np.arange(size) % NUM_CLASSES)
    distractors = rng.integers(0, NUM_CLASSES, size=size)
    weight = rng.uniform(0.0, max_distractor, size=(size, 1, 1, 1))
    contrast = rng.uniform(0.6, 1.2, size=(size, 1, 1, 1))
    brightness = rng.uniform(-40.0, 40.0, size=(size, 1, 1, 1))
    images = ((1.0 - weight) * templates[labels] + weight * templates[distractors]) * contrast + brightness
    shifts = rng.integers(-2, 3, size=(size, 2))
    for i, (dy, dx) in enumerate(shifts):  # a few px of jitter so position is not a giveaway
        images[i] = np.roll(images[i], (int(dy), int(dx)), axis=(1, 2))
    images += rng.normal(0.0, noise_std, size=images.shape)
    return np.clip(np.rint(images), 0, 255).astype(np.uint8), labels.astype(np.int64)


def _split_pickle(images: np.ndarray, labels: np.ndarray, name: str) -> dict[str, Any]:
    return {
        "filenames": [f"synthetic_{name}_{i:06d}.png" for i in range(len(labels))],
        "batch_label": f"synthetic {name} set",
        "fine_labels": labels.tolist(),
        "coarse_labels": (labels // 5).tolist(),
        "data": images.reshape(len(labels), 3 * 32 * 32),  # R plane, G plane, B plane per row
    }


def _meta_pickle() -> dict[str, list[str]]:
    return {
        "fine_label_names": [f"synthetic_class_{c:02d}" for c in range(NUM_CLASSES)],
        "coarse_label_names": [f"synthetic_superclass_{c:02d}" for c in range(NUM_CLASSES // 5)],
    }


def _check_args(train_size: int, test_size: int, noise_std: float, max_distractor: float) -> None:
    for name, value in (("train_size", train_size), ("test_size", test_size)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}.")
    if noise_std < 0:
        raise ValueError(f"noise_std must be >= 0, got {noise_std!r}.")
    if not 0.0 <= max_distractor < 1.0:
        raise ValueError(f"max_distractor must lie in [0, 1), got {max_distractor!r}.")


def _regenerate_command(folder: Path) -> str:
    """The shell command that rewrites ``folder`` with the settings its marker records."""
    command = f"rm -r {folder} && python -m lit_cifar.synthetic --root {folder.parent}"
    try:
        config = json.loads((folder / _MARKER).read_text())
        flags = {
            "--train-size": config["train_size"],
            "--test-size": config["test_size"],
            "--seed": config["seed"],
            "--noise-std": config["noise_std"],
            "--max-distractor": config["max_distractor"],
        }
    except (OSError, *_READ_ERRORS):  # the marker is the damaged file (or gone): settings unknown
        return command + " (add the --train-size/--test-size/--seed it was written with)"
    return command + "".join(f" {flag} {value}" for flag, value in flags.items())


def _corrupt_file_error(path: Path, err: BaseException) -> RuntimeError:
    """The error for a damaged file of a synthetic set: names the file and how to regenerate it."""
    return RuntimeError(
        f"cannot read {path}: the file is truncated or corrupt ({type(err).__name__}: {err}). It is generated "
        f"data: delete {path.parent} and run again (the DataModule writes it anew), or regenerate it now:\n"
        f"  {_regenerate_command(path.parent)}"
    )


def _read_marker(folder: Path) -> Any:
    path = folder / _MARKER
    try:
        return json.loads(path.read_text())
    except ValueError as err:  # JSONDecodeError, UnicodeDecodeError
        raise _corrupt_file_error(path, err) from err


def write_synthetic_cifar100(
    root: str | os.PathLike[str],
    train_size: int = 10_000,
    test_size: int = 2_000,
    seed: int = 0,
    noise_std: float = 60.0,
    max_distractor: float = 0.6,
) -> Path:
    """Write a synthetic CIFAR-100 under ``root/cifar-100-python`` and return that folder.

    The same arguments always give byte-identical files. An existing synthetic folder written
    with the same arguments is reused; one with other arguments is replaced. The files appear
    atomically (written to a temporary folder, then renamed), so a reader never sees half a set.

    Args:
        root: Folder that will contain ``cifar-100-python/``.
        train_size: Number of training images.
        test_size: Number of test images.
        seed: Seed of the generator (templates and samples).
        noise_std: Standard deviation of the per-pixel Gaussian noise, in 0..255 units.
        max_distractor: Largest weight of the other-class template blended into an image, in
            [0, 1); above 0.5 some images are dominated by the wrong class (harder set).

    Raises:
        ValueError: On non-positive sizes or negative noise.
        FileExistsError: If ``root/cifar-100-python`` holds something that is not synthetic
            (for example the real CIFAR-100); it is never overwritten.
    """
    _check_args(train_size, test_size, noise_std, max_distractor)
    config = {
        "format_version": _FORMAT_VERSION,
        "train_size": train_size,
        "test_size": test_size,
        "seed": seed,
        "noise_std": float(noise_std),
        "max_distractor": float(max_distractor),
    }
    target = Path(root) / CIFAR100.base_folder
    if target.exists():
        if not is_synthetic(target):
            raise FileExistsError(
                f"{target} exists and is not a synthetic set (no {_MARKER}); refusing to overwrite it. "
                "Choose another --root for the synthetic data."
            )
        if _read_marker(target) == config:
            return target

    rng = np.random.default_rng(seed)
    templates = _class_templates(rng)
    train = _make_split(rng, templates, train_size, noise_std, max_distractor)
    test = _make_split(rng, templates, test_size, noise_std, max_distractor)

    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".synthetic-", dir=target.parent))
    staging.chmod(0o755)  # mkdtemp creates 0700; the data folder should read like any other
    for name, payload in (
        ("train", _split_pickle(*train, "train")),
        ("test", _split_pickle(*test, "test")),
        ("meta", _meta_pickle()),
    ):
        with open(staging / name, "wb") as f:
            pickle.dump(payload, f, protocol=2)  # the protocol of the official files
    (staging / _MARKER).write_text(json.dumps(config, indent=2) + "\n")
    if target.exists():
        shutil.rmtree(target)
    os.replace(staging, target)
    return target


def is_synthetic(folder: str | os.PathLike[str]) -> bool:
    """Whether ``folder`` (a ``cifar-100-python/`` directory) was written by this module."""
    return (Path(folder) / _MARKER).is_file()


class SyntheticCIFAR100(CIFAR100):
    """torchvision's ``CIFAR100`` reading a synthetic set written by :func:`write_synthetic_cifar100`.

    Only the integrity checks differ: the md5 sums of the official files cannot match generated
    data, so presence of the three pickles and the synthetic marker is checked instead. Real data
    keeps going through the untouched ``CIFAR100`` class and its md5 checks. A truncated or
    damaged file raises a ``RuntimeError`` that names it and the command that regenerates the set.
    """

    def __init__(self, root: str | os.PathLike[str], train: bool = True, **kwargs: Any) -> None:
        try:
            super().__init__(root, train=train, **kwargs)
        except _READ_ERRORS as err:
            split_files = [name for name, _ in (self.train_list if train else self.test_list)]
            raise _corrupt_file_error(self._first_unreadable(split_files + [self.meta["filename"]]), err) from err

    def _first_unreadable(self, names: list[str]) -> Path:
        """The first of ``names`` (in torchvision's reading order) that does not unpickle."""
        for name in names:
            try:
                with open(self._folder() / name, "rb") as f:
                    pickle.load(f, encoding="latin1")
            except _READ_ERRORS:
                return self._folder() / name
        return self._folder() / names[0]  # every file unpickles: the split's content is inconsistent

    def _folder(self) -> Path:
        return Path(self.root) / self.base_folder

    def _check_integrity(self) -> bool:
        folder = self._folder()
        names = [name for name, _ in self.train_list + self.test_list] + [self.meta["filename"]]
        return is_synthetic(folder) and all((folder / name).is_file() for name in names)

    def _load_meta(self) -> None:
        with open(self._folder() / self.meta["filename"], "rb") as f:
            self.classes = pickle.load(f, encoding="latin1")[self.meta["key"]]
        self.class_to_idx = {name: i for i, name in enumerate(self.classes)}

    def download(self) -> None:
        raise RuntimeError(
            "Synthetic CIFAR-100 is generated, not downloaded: call "
            "lit_cifar.synthetic.write_synthetic_cifar100(root) first."
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", default="data/synthetic", help="folder that will hold cifar-100-python/")
    parser.add_argument("--train-size", type=int, default=10_000)
    parser.add_argument("--test-size", type=int, default=2_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--noise-std", type=float, default=60.0)
    parser.add_argument("--max-distractor", type=float, default=0.6)
    args = parser.parse_args(argv)
    folder = write_synthetic_cifar100(
        args.root, args.train_size, args.test_size, args.seed, args.noise_std, args.max_distractor
    )
    print(f"wrote synthetic CIFAR-100 ({args.train_size} train / {args.test_size} test) to {folder}")


if __name__ == "__main__":
    main()
