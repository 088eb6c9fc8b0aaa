"""Synthetic CIFAR-100 files, the DataModule's splits and dataset choice, damaged-file errors, batched transforms."""

from __future__ import annotations

import pickle
import shlex
import shutil
import urllib.error
from pathlib import Path

import pytest
import torch
from torchvision.datasets import CIFAR100

from lit_cifar import synthetic, transforms
from lit_cifar.data import CIFAR100DataModule
from lit_cifar.synthetic import SyntheticCIFAR100, write_synthetic_cifar100


@pytest.fixture(scope="module")
def synthetic_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("synthetic")
    write_synthetic_cifar100(root, train_size=300, test_size=120, seed=3)
    return root


def test_synthetic_files_have_the_official_layout(synthetic_root: Path) -> None:
    folder = synthetic_root / "cifar-100-python"
    with open(folder / "train", "rb") as f:
        train = pickle.load(f, encoding="latin1")
    with open(folder / "meta", "rb") as f:
        meta = pickle.load(f, encoding="latin1")
    assert train["data"].dtype.name == "uint8" and train["data"].shape == (300, 3072)
    assert len(train["fine_labels"]) == len(train["coarse_labels"]) == 300
    assert len(meta["fine_label_names"]) == 100 and len(meta["coarse_label_names"]) == 20


def test_synthetic_loads_through_torchvision(synthetic_root: Path) -> None:
    train = SyntheticCIFAR100(str(synthetic_root), train=True)
    test = SyntheticCIFAR100(str(synthetic_root), train=False)
    assert isinstance(train, CIFAR100)
    assert train.data.shape == (300, 32, 32, 3) and test.data.shape == (120, 32, 32, 3)
    assert set(train.targets) == set(range(100))  # balanced: every class present
    assert len(train.classes) == 100
    # The untouched torchvision class keeps its md5 check and rejects generated files.
    with pytest.raises(RuntimeError, match="not found or corrupted"):
        CIFAR100(str(synthetic_root), train=True)


def test_synthetic_is_deterministic(tmp_path: Path, synthetic_root: Path) -> None:
    again = write_synthetic_cifar100(tmp_path / "a", train_size=300, test_size=120, seed=3)
    other = write_synthetic_cifar100(tmp_path / "b", train_size=300, test_size=120, seed=4)
    reference = (synthetic_root / "cifar-100-python" / "train").read_bytes()
    assert (again / "train").read_bytes() == reference
    assert (other / "train").read_bytes() != reference


def test_synthetic_never_overwrites_real_data(tmp_path: Path) -> None:
    (tmp_path / "cifar-100-python").mkdir()
    (tmp_path / "cifar-100-python" / "train").write_bytes(b"real data")
    with pytest.raises(FileExistsError, match="refusing to overwrite"):
        write_synthetic_cifar100(tmp_path, train_size=10, test_size=10)


def test_split_sizes_items_and_determinism(tiny_datamodule) -> None:
    dm = tiny_datamodule()
    dm.prepare_data()
    dm.setup()
    total = dm.hparams.synthetic_train_size
    assert (len(dm.train_set), len(dm.val_set), len(dm.test_set)) == (total - 100, 100, 200)
    image, label = dm.train_set[0]
    assert image.dtype == torch.uint8 and image.shape == (3, 32, 32)
    assert isinstance(label, int) and 0 <= label < 100
    assert dm.dataset_used == "synthetic" and dm.hparams.dataset_used == "synthetic"

    same, other = tiny_datamodule(), tiny_datamodule(split_seed=1)
    same.setup("fit")
    other.setup("fit")
    assert torch.equal(same.val_set.images, dm.val_set.images)
    assert not torch.equal(other.val_set.images, dm.val_set.images)
    # The split is a partition of the training images.
    assert len(same.train_set) + len(same.val_set) == total


@pytest.mark.parametrize("val_size", [0, 400, 1.0, -0.5, "10"])
def test_bad_val_size_is_rejected(tiny_datamodule, val_size) -> None:
    dm = tiny_datamodule(val_size=val_size)
    with pytest.raises(ValueError, match="val_size"):
        dm.setup("fit")


def test_fraction_val_size(tiny_datamodule) -> None:
    dm = tiny_datamodule(val_size=0.25)
    dm.setup("fit")
    assert len(dm.val_set) == 100


def test_missing_cifar100_offline_gives_the_fix(tmp_path: Path) -> None:
    dm = CIFAR100DataModule(data_dir=str(tmp_path), dataset="cifar100", download=False)
    with pytest.raises(FileNotFoundError) as err:
        dm.prepare_data()
    message = str(err.value)
    for hint in ("cifar-100-python", "--data.download=true", "cifar-100-python.tar.gz", "--data.dataset=synthetic"):
        assert hint in message


def test_download_failure_gives_the_fix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_network(*args, **kwargs):
        raise urllib.error.URLError("Temporary failure in name resolution")

    monkeypatch.setattr("torchvision.datasets.cifar.download_and_extract_archive", no_network)
    dm = CIFAR100DataModule(data_dir=str(tmp_path), dataset="cifar100", download=True)
    with pytest.raises(FileNotFoundError, match="the download failed: URLError"):
        dm.prepare_data()


def test_auto_falls_back_to_synthetic_loudly(tiny_datamodule) -> None:
    dm = tiny_datamodule(dataset="auto", download=False)
    with pytest.warns(UserWarning, match="FALLING BACK TO SYNTHETIC DATA"):
        dm.prepare_data()
    dm.setup("fit")
    assert dm.hparams.dataset_used == "synthetic" and dm.hparams_initial.dataset_used == "synthetic"


@pytest.mark.parametrize(("split", "size"), [("test", 200), ("val", 100), ("train", 300)])
def test_predict_dataloader_serves_the_chosen_split_in_order(tiny_datamodule, split: str, size: int) -> None:
    dm = tiny_datamodule(predict_split=split, eval_batch_size=64)
    dm.setup("predict")
    loader = dm.predict_dataloader()
    images = torch.cat([batch[0] for batch in loader])
    assert len(loader.dataset) == size and torch.equal(images, getattr(dm, f"{split}_set").images)


def test_bad_predict_split_is_rejected(tiny_datamodule) -> None:
    with pytest.raises(ValueError, match="predict_split must be 'test', 'val' or 'train', got 'holdout'"):
        tiny_datamodule(predict_split="holdout")


@pytest.fixture
def damaged_copy(tmp_path: Path, data_dir: Path, tiny_datamodule):
    """A private copy of the TINY synthetic set and its DataModule: (datamodule, cifar-100-python folder)."""
    shutil.copytree(data_dir / "synthetic", tmp_path / "synthetic")
    dm = CIFAR100DataModule(**{**tiny_datamodule().hparams, "data_dir": str(tmp_path)})
    return dm, dm.synthetic_root / "cifar-100-python"


def _truncate(path: Path, keep: float = 0.5) -> None:
    path.write_bytes(path.read_bytes()[: int(path.stat().st_size * keep)])


@pytest.mark.parametrize(
    ("name", "stage", "keep"), [("train", "fit", 0.5), ("test", "test", 0.01), ("meta", "fit", 0.0)]
)
def test_damaged_synthetic_pickle_names_the_file_and_the_fix(damaged_copy, name: str, stage: str, keep: float) -> None:
    dm, folder = damaged_copy
    original = dm.synthetic_root
    _truncate(folder / name, keep)
    with pytest.raises(RuntimeError) as err:
        dm.setup(stage)
    message = str(err.value)
    assert f"cannot read {folder / name}: the file is truncated or corrupt" in message
    assert isinstance(err.value.__cause__, (pickle.UnpicklingError, EOFError))
    # The fix works as printed: delete the folder and run the regenerate command.
    command = message.splitlines()[-1].strip()
    assert command.startswith(f"rm -r {folder} && python -m lit_cifar.synthetic --root {original}")
    shutil.rmtree(folder)
    synthetic.main(shlex.split(command.split("&&")[1])[3:])
    dm.setup(stage)
    assert len(dm.test_set or dm.train_set) > 0


def test_corrupt_synthetic_marker_names_the_file_and_the_fix(damaged_copy) -> None:
    dm, folder = damaged_copy
    (folder / "SYNTHETIC.json").write_text('{"format_version": 1, "train_si')
    with pytest.raises(
        RuntimeError, match=r"cannot read .*SYNTHETIC\.json: the file is truncated or corrupt \(JSONDecodeError"
    ) as err:
        dm.prepare_data()
    assert f"delete {folder} and run again" in str(err.value)
    assert "add the --train-size/--test-size/--seed it was written with" in str(err.value)  # settings unknown


def test_damaged_real_cifar100_lists_the_files_and_the_fix(tmp_path: Path) -> None:
    folder = tmp_path / "cifar-100-python"
    folder.mkdir()
    (folder / "train").write_bytes(b"\x80\x02}q\x00(X")  # a truncated pickle: fails the md5 check first
    dm = CIFAR100DataModule(data_dir=str(tmp_path), dataset="cifar100", download=False)
    with pytest.raises(FileNotFoundError) as err:
        dm.prepare_data()
    message = str(err.value)
    assert f"{folder / 'train'} is truncated or corrupt (md5 mismatch)" in message
    assert f"{folder / 'meta'} is missing" in message
    assert f"delete {folder} and re-run with --data.download=true" in message


def _images(n: int = 64) -> torch.Tensor:
    return torch.randint(0, 256, (n, 3, 32, 32), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))


def test_random_crop_is_a_per_image_padded_crop() -> None:
    images = _images()
    out = transforms.random_crop(images, padding=4, generator=torch.Generator().manual_seed(1))
    padded = torch.nn.functional.pad(images, (4, 4, 4, 4))
    offsets = set()
    for i in range(len(images)):
        matches = [
            (dy, dx)
            for dy in range(9)
            for dx in range(9)
            if torch.equal(out[i], padded[i, :, dy : dy + 32, dx : dx + 32])
        ]
        assert matches, f"image {i} is not a crop of its padded original"
        offsets.add(matches[0])
    assert len(offsets) > 10  # independent offsets per image, not one per batch
    assert torch.equal(transforms.random_crop(images, padding=0), images)


def test_random_flip_flips_some_images() -> None:
    images = _images()
    out = transforms.random_flip(images, generator=torch.Generator().manual_seed(2))
    flipped = torch.tensor([torch.equal(o, i.flip(-1)) for o, i in zip(out, images, strict=True)])
    kept = torch.tensor([torch.equal(o, i) for o, i in zip(out, images, strict=True)])
    assert bool((flipped | kept).all()) and 0 < int(flipped.sum()) < len(images)


def test_normalize_matches_the_formula() -> None:
    images = _images(4)
    out = transforms.normalize(images)
    mean = torch.tensor(transforms.CIFAR100_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(transforms.CIFAR100_STD).view(1, 3, 1, 1)
    torch.testing.assert_close(out, (images.float() / 255 - mean) / std)
    with pytest.raises(TypeError, match="uint8"):
        transforms.normalize(out)


def test_batch_hook_normalizes_and_augments_only_in_training(tiny_datamodule) -> None:
    class _State:
        training = False

    dm = tiny_datamodule()
    dm.trainer = _State()
    images, labels = _images(8), torch.arange(8)
    eval_images, eval_labels = dm.on_after_batch_transfer((images, labels), 0)
    torch.testing.assert_close(eval_images, transforms.normalize(images))
    assert eval_labels is labels
    dm.trainer.training = True
    train_images, _ = dm.on_after_batch_transfer((images, labels), 0)
    assert train_images.dtype == torch.float32 and not torch.equal(train_images, eval_images)
