"""The argument parser of every psgd command: no abbreviations, and a nearest-match hint for typos.

``--epoch 1`` is refused instead of being taken for ``--epochs``, and the error
says ``did you mean --epochs?``; ``psgd lauch`` says ``did you mean launch?``.
Sub-commands made with ``add_subparsers`` are of this class too.

Every flag that takes a comma-separated list (``--workers 1,2,4``,
``--network 1gbit,none``) is read by :func:`comma_list`, with one wording for
its errors whatever the command.
"""

from __future__ import annotations

import argparse
import difflib
import re
from collections.abc import Callable, Sequence
from typing import Any

_INVALID_CHOICE = re.compile(r"invalid choice: '([^']*)' \(choose from (.*)\)")


class Parser(argparse.ArgumentParser):
    def __init__(self, *args: Any, **kwargs: Any):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args: Sequence[str] | None = None, namespace: Any = None):
        namespace, extras = super().parse_known_args(args, namespace)
        if not hasattr(namespace, "_parser"):  # the innermost sub-command parser sets it first
            namespace._parser = self
        return namespace, extras

    def parse_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> argparse.Namespace:
        namespace, extras = self.parse_known_args(args, namespace)
        innermost = vars(namespace).pop("_parser", self)
        if extras:
            innermost.error(f"unrecognized arguments: {' '.join(extras)}")
        return namespace

    def error(self, message: str):  # type: ignore[override]
        super().error(message + self.suggestion(message))

    def suggestion(self, message: str) -> str:
        """``; did you mean X?`` for the first unknown flag or choice in ``message`` with a near match."""
        choice = _INVALID_CHOICE.search(message)
        if choice:
            options = [c.strip().strip("'") for c in choice.group(2).split(",")]
            return _nearest(choice.group(1), options)
        if message.startswith("unrecognized arguments: "):
            known = list(self._option_string_actions)
            for word in message.split(": ", 1)[1].split():
                if word.startswith("-"):
                    hint = _nearest(word.split("=", 1)[0], known)
                    if hint:
                        return hint
        return ""


def _nearest(word: str, options: Sequence[str]) -> str:
    found = difflib.get_close_matches(word, options, n=1, cutoff=0.6)
    return f"; did you mean {found[0]}?" if found else ""


def comma_list(
    text: str,
    flag: str = "",
    *,
    kind: Callable[[str], Any] = str,
    what: str = "names",
    choices: Sequence[str] | None = None,
    at_least: float | None = None,
    empty: bool = False,
    unique: bool = False,
    error: Callable[[str], Exception] = argparse.ArgumentTypeError,
) -> list:
    """The items of a comma-separated value (``"1gbit, 10gbit"``): stripped, empty ones dropped, each converted
    by ``kind``; with ``unique``, repeats dropped (the first kept).  A wrong one raises ``error`` (an argparse
    type error by default; a command that checks its flags later passes its own), worded alike for every flag:
    ``--flag: unknown x; choose from a, b``, ``--flag: expected WHAT separated by commas, got '...'``,
    ``--flag: every value must be at least N, got '...'``, ``--flag: give at least one``."""
    where = f"{flag}: " if flag else ""
    items = [p.strip() for p in str(text).split(",") if p.strip()]
    if choices is not None:
        unknown = [p for p in items if p not in choices]
        if unknown:
            raise error(f"{where}unknown {', '.join(unknown)}; choose from {', '.join(choices)}")
    try:
        values = [kind(p) for p in items]
    except ValueError:
        raise error(f"{where}expected {what} separated by commas, got {text!r}") from None
    if at_least is not None and not all(v >= at_least for v in values):  # NaN is not at least anything
        raise error(f"{where}every value must be at least {at_least:g}, got {text!r}")
    if not values and not empty:
        raise error(
            f"{where}give at least one"
            + (f" of {', '.join(choices)}" if choices is not None else f" ({what} separated by commas)")
        )
    return list(dict.fromkeys(values)) if unique else values
