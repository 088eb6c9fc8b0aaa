"""The official CIFAR-100 files on disk: checked by md5, downloaded within a deadline, and the error that
says what is wrong with them and how to get them (:mod:`lit_cifar.data` decides when each is needed)."""

from __future__ import annotations

import socket
from pathlib import Path

from torchvision.datasets import CIFAR100
from torchvision.datasets.utils import check_integrity

from lit_cifar.synthetic import is_synthetic

__all__ = ["download_cifar100", "file_problems", "missing_cifar100_error", "real_cifar100_present"]

_DOWNLOAD_TIMEOUT_S = 60.0


def file_problems(root: str | Path) -> list[str]:
    """One line per official file under ``root/cifar-100-python`` that is missing or fails its md5."""
    folder = Path(root) / CIFAR100.base_folder
    files = CIFAR100.train_list + CIFAR100.test_list + [[CIFAR100.meta["filename"], CIFAR100.meta["md5"]]]
    problems = []
    for name, md5 in files:
        if not (folder / name).is_file():
            problems.append(f"{folder / name} is missing")
        elif not check_integrity(str(folder / name), md5):
            problems.append(f"{folder / name} is truncated or corrupt (md5 mismatch)")
    return problems


def real_cifar100_present(root: str | Path) -> bool:
    """Whether the official CIFAR-100 files (checked by md5) are under ``root/cifar-100-python``."""
    return not file_problems(root)


def download_cifar100(root: str | Path) -> None:
    """torchvision's download of the official archive into ``root`` (md5-checked), failing within a minute."""
    # urllib has no timeout by default: behind a firewall that drops packets the download would
    # hang forever instead of failing over to missing_cifar100_error or to synthetic data.
    previous = socket.getdefaulttimeout()
    socket.setdefaulttimeout(_DOWNLOAD_TIMEOUT_S)
    try:
        CIFAR100(str(root), train=True, download=True)
    finally:
        socket.setdefaulttimeout(previous)


def missing_cifar100_error(root: str | Path, reason: str) -> FileNotFoundError:
    """The error for real CIFAR-100 wanted but not usable under ``root``: what is wrong, and three fixes."""
    folder = Path(root) / CIFAR100.base_folder
    problems = file_problems(root) if folder.is_dir() else []
    damaged = [line for line in problems if line.endswith("(md5 mismatch)")]
    found = " (it holds a synthetic set, not CIFAR-100)" if is_synthetic(folder) else ""
    listing = "" if found else "".join(f"\n  - {line}" for line in problems)
    # torchvision's download skips files that pass their md5 and re-extracts the others, but a
    # clean folder is the fix that always works.
    delete = f"delete {folder} and re-run with " if damaged else ""
    return FileNotFoundError(
        f"CIFAR-100 not found or corrupted under {folder}{found}; {reason}.{listing}\nFix one of:\n"
        f"  1. {delete}--data.download=true (allows the download; needs network access);\n"
        f"  2. download {CIFAR100.url} on another machine and extract it so that "
        f"{folder}/train, test and meta exist (md5-checked);\n"
        "  3. train on generated data: --data.dataset=synthetic (or auto, which falls back to it)."
    )
