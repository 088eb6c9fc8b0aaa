"""The private Lightning names custom_ddp relies on are listed once and checked against the installed Lightning."""

from __future__ import annotations

import pytest

from strategies import lightning_seams
from strategies.lightning_seams import PRIVATE_SEAMS, Seam, check_private_seams


def test_every_listed_seam_exists_in_the_installed_lightning() -> None:
    check_private_seams()  # the installed 2.6.x: nothing moved
    assert any(seam.name == "_configure_launcher" for seam in PRIVATE_SEAMS)


def test_an_unverified_lightning_series_fails_loudly() -> None:
    with pytest.raises(RuntimeError, match="found Lightning 2.7.0, verified for 2.6.x"):
        check_private_seams("2.7.0")


def test_a_moved_seam_is_named_with_its_user(monkeypatch: pytest.MonkeyPatch) -> None:
    moved = Seam("lightning.pytorch.strategies.ddp.DDPStrategy", "_renamed_in_2_7", "custom_ddp", "an example")
    monkeypatch.setattr(lightning_seams, "PRIVATE_SEAMS", (*PRIVATE_SEAMS, moved))
    with pytest.raises(RuntimeError, match=r"DDPStrategy\._renamed_in_2_7 \(used by custom_ddp: an example\)"):
        check_private_seams()
