"""The argument parser of every psgd command: no abbreviations, and a nearest-match hint for typos.

``--epoch 1`` is refused instead of being taken for ``--epochs``, and the error
says ``did you mean --epochs?``; ``psgd lauch`` says ``did you mean launch?``.
Sub-commands made with ``add_subparsers`` are of this class too.
"""

from __future__ import annotations

import argparse
import difflib
import re
from typing import Any, Sequence

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
