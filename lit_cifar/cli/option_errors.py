"""How ``train.py`` reports a bad option: the one-line reason, not a traceback or jsonargparse's dumps.

A bad option reaches the user from three places, each with its own noise around the one sentence
that matters:

- jsonargparse's parser (a wrong type, a value outside a ``Literal``, an unknown flag) prints the
  usage of every option (60+ lines) before its message, and for an option of a ``Union`` type (the
  Trainer's ``strategy`` is ``str | Strategy``) the message lists what every alternative said.
  LightningCLI builds the parser with ``exit_on_error=False`` (``parser_kwargs``), so the error
  arrives here as an ``ArgumentError``; :func:`condense` keeps the innermost reason and its key.
- The project's own checks in the model, data and nets raise :class:`~lit_cifar.errors.OptionError`
  (from ``__init__`` or ``setup``); its message is already the whole report.
- ``CustomDDPStrategy``'s checks run in its ``__init__``, which jsonargparse calls inside that
  ``Union``: it catches the error and buries the sentence in a 58-line report of both alternatives.
  :func:`check_strategy_config` runs the same checks (``train.py`` passes them in, so this module
  needs no strategy) on the parsed config first.

:func:`short_option_errors` prints ``error: <reason>`` and one hint line, and exits 2 (argparse's
code for a usage error). ``JSONARGPARSE_DEBUG=true`` (jsonargparse's own switch) lets the error
through instead, with jsonargparse's full report and the traceback.
"""

from __future__ import annotations

import importlib
import inspect
import os
import re
import sys
from argparse import ArgumentError
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from jsonargparse import Namespace

from lit_cifar.errors import OptionError

__all__ = ["check_strategy_config", "condense", "short_option_errors"]

DEBUG_VARIABLE = "JSONARGPARSE_DEBUG"
_PARSER_KEY = re.compile(r'^Parser key "(?P<key>[^"]+)":$')


def _depth(line: str) -> int:
    """Nesting level of a line of a jsonargparse message: its indentation, list bullets included."""
    return len(line) - len(line.lstrip(" -"))


def condense(message: str) -> str:
    """jsonargparse's error message as one line: the most deeply nested reason, after its full key.

    ``Parser key "trainer.strategy": ... Parser key "sync_mode": Expected a ...`` becomes
    ``trainer.strategy.sync_mode: Expected a ...``. When the innermost level lists what each type
    of a ``Union`` said, all of them are kept, joined by `` / ``. A one-line message stays as it is.
    """
    lines = [line.rstrip() for line in message.splitlines() if line.strip()]
    if len(lines) <= 1:
        return message.strip()
    deepest = max(_depth(line) for line in lines)
    first = next(i for i, line in enumerate(lines) if _depth(line) == deepest)
    last = first
    while last + 1 < len(lines) and _depth(lines[last + 1]) == deepest:
        last += 1  # the other alternatives of the same Union
    keys, level = [], deepest
    for line in reversed(lines[:first]):  # the reason's ancestors: each less indented than the last
        if _depth(line) < level:
            level = _depth(line)
            match = _PARSER_KEY.match(line.strip(" -"))
            if match:
                keys.insert(0, match["key"])
    reason = " / ".join(line.strip(" -") for line in lines[first : last + 1])
    return f"{'.'.join(keys)}: {reason}" if keys else reason


def _import(class_path: str) -> Any:
    module, _, name = class_path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        return None  # jsonargparse resolved it already; a path it cannot resolve is its error to report


def check_strategy_config(strategy: Any, strategy_class: type, check: Callable[[dict[str, Any]], None]) -> None:
    """Run ``check`` on the constructor arguments of a parsed ``trainer.strategy`` of ``strategy_class``.

    ``strategy`` is what the parser holds: a registered name (nothing to check: no options), or a
    ``Namespace`` with ``class_path`` and ``init_args``; ``check`` gets every argument, defaults
    included, and raises ``ValueError``/``TypeError``, re-raised as :class:`OptionError`. Other
    strategies are left to their constructors.
    """
    if not isinstance(strategy, Namespace) or not isinstance(strategy.get("class_path"), str):
        return
    cls = _import(strategy.class_path)
    if not (isinstance(cls, type) and issubclass(cls, strategy_class)):
        return
    init_args = strategy.get("init_args")
    try:
        arguments = inspect.signature(cls).bind_partial(**(init_args.as_dict() if init_args else {}))
    except TypeError:
        return  # arguments the constructor does not take: jsonargparse reports those
    arguments.apply_defaults()
    try:
        check(dict(arguments.arguments))
    except (ValueError, TypeError) as error:
        raise OptionError(str(error)) from error


def _debug() -> bool:
    return os.environ.get(DEBUG_VARIABLE, "").lower() == "true"


@contextmanager
def short_option_errors(help_command: str) -> Iterator[None]:
    """Turn a parse error or an :class:`OptionError` into ``error: <reason>`` on stderr and exit code 2.

    ``help_command`` is named in the hint line (e.g. ``python train.py fit --help``). Any other
    exception, and every exception while ``JSONARGPARSE_DEBUG=true``, passes through unchanged.
    """
    try:
        yield
    except (ArgumentError, OptionError) as error:
        if _debug():
            raise
        reason = condense(str(error)) if isinstance(error, ArgumentError) else str(error)
        sys.stderr.write(
            f"error: {reason}\n  (every option: {help_command}; jsonargparse's full report: {DEBUG_VARIABLE}=true)\n"
        )
        raise SystemExit(2) from None
