"""lit_cifar.cli.console's warning filters: each drops one warning from its real source, and only from there."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities._pytree import _tree_flatten

from lit_cifar.cli.console import quiet_checkpoint_dirpath_warning, quiet_leafspec_deprecation


def _leafspec_from_lightning() -> None:
    _tree_flatten(1)  # a leaf: Lightning 2.6 builds torch's deprecated LeafSpec()


def _dirpath_change_from_lightning() -> None:
    ModelCheckpoint(dirpath="this_run").load_state_dict({"dirpath": "the_fit", "best_model_path": ""})


def _messages(trigger: Callable[[], None], quiet: Callable[[], None] | None) -> list[str]:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        if quiet is not None:
            quiet()
        trigger()
    return [str(warning.message) for warning in seen]


@pytest.mark.parametrize(
    ("trigger", "quiet", "words", "module", "category"),
    [
        (
            _leafspec_from_lightning,
            quiet_leafspec_deprecation,
            "`isinstance(treespec, LeafSpec)` is deprecated",
            "lightning.pytorch.utilities._pytree",
            FutureWarning,
        ),
        (
            _dirpath_change_from_lightning,
            quiet_checkpoint_dirpath_warning,
            "The dirpath has changed from",
            "lightning.pytorch.callbacks.model_checkpoint",
            UserWarning,
        ),
    ],
    ids=["leafspec", "checkpoint-dirpath"],
)
def test_the_warning_is_dropped_at_its_source_and_kept_elsewhere(
    trigger, quiet, words: str, module: str, category: type[Warning]
) -> None:
    assert any(message.startswith(words) for message in _messages(trigger, None))  # the pinned versions emit it
    assert _messages(trigger, quiet) == []
    # The same words from another module, or as another category, still print.
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        quiet()
        warnings.warn_explicit(words, category, "elsewhere.py", 1, module="my_project.module")
        warnings.warn_explicit(words, DeprecationWarning, "source.py", 1, module=module)
        warnings.warn_explicit(words, category, "source.py", 1, module=module + "_other")
    assert len(seen) == 3
