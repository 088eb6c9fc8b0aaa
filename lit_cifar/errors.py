"""``OptionError``: a bad value of an option that lit-cifar itself checks (model, data, strategy).

Its message is the whole report: it names the option, the bad value and the fix. ``train.py``
prints it as one line instead of a traceback (:mod:`lit_cifar.cli.option_errors`); from Python it is an
ordinary ``ValueError``.
"""

from __future__ import annotations

__all__ = ["OptionError"]


class OptionError(ValueError):
    """A bad option value; the message names the option, the value and the fix."""
