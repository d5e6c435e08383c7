"""Calling a model under check and saying in words what came back.

The helpers the model checks (:mod:`psgd.model.check`, :mod:`psgd.model.gradcheck`)
share: a value in a few words, an exception on one line with the model's file
and line, a loss as a float or why it is not one, and one ``loss_and_grads``
call with the order of its results sorted out.
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Mapping
from typing import Any

import numpy as np

from psgd.compute import backend
from psgd.errors import PsgdError

#: The checks' own files: a traceback's frames in them are not the model's.
_CHECK_FILES = frozenset(
    os.path.join(os.path.dirname(os.path.abspath(__file__)), name) for name in ("check.py", "gradcheck.py", "probe.py")
)


class Skip(PsgdError):
    """A check that cannot run here; its message says why."""


def quoted(names: list[str]) -> str:
    """'a', 'b': names for a message."""
    return ", ".join(repr(n) for n in names)


def kind(value: Any) -> str:
    """A few words for what ``value`` is: 'a dict', 'a float', 'an array of shape (3,)'."""
    if value is None:
        return "None"
    shape = getattr(value, "shape", None)
    if shape is not None and not isinstance(value, (np.generic,)):
        return f"an array of shape {tuple(shape)}"
    name = type(value).__name__
    return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"


def _where(exc: BaseException) -> str:
    """' (at file.py:LINE)' for the innermost frame outside NumPy, CuPy and the checks."""
    frames = traceback.extract_tb(exc.__traceback__)
    for frame in reversed(frames):
        path = os.path.abspath(frame.filename)
        parts = path.split(os.sep)
        if path not in _CHECK_FILES and "numpy" not in parts and "cupy" not in parts:
            return f" (at {os.path.basename(path)}:{frame.lineno})"
    return ""


def raised(call: str, exc: BaseException) -> str:
    """'CALL raised KeyError: 'b2' (at net.py:12)' on one line; CALL may be empty."""
    text = " ".join(str(exc).split())
    return f"{call} raised {type(exc).__name__}".lstrip() + (f": {text}" if text else "") + _where(exc)


def scalar(value: Any) -> tuple[float | None, str]:
    """``(float(value), "")`` for a real scalar, or ``(None, why not)``."""
    if isinstance(value, (bool, np.bool_)):
        return None, "a bool, not a number"
    if isinstance(value, (int, float, np.integer, np.floating)):
        return float(value), ""
    shape = getattr(value, "shape", None)
    if shape is None:
        return None, f"{kind(value)}, not a number"
    if tuple(shape) != ():
        return None, f"an array of shape {tuple(shape)}, not a scalar (return the mean over the batch)"
    host = backend.to_host(value)
    if host.dtype.kind not in "fiu":
        return None, f"an array of {host.dtype}, not a real number"
    return float(host), ""


def call_loss_and_grads(model: Any, params: Mapping[str, Any], x: Any, y: Any) -> tuple[float | None, Any, list[str]]:
    """Call ``model.loss_and_grads``; ``(loss or None, gradients, problems)`` with the order sorted out."""
    result = model.loss_and_grads(dict(params), x, y)
    if not isinstance(result, (tuple, list)) or len(result) != 2:
        return None, None, [f"returned {kind(result)}; it must return a (loss, gradients) tuple"]
    first, second = result
    problems = []
    if isinstance(first, Mapping) and not isinstance(second, Mapping):
        problems.append("returned (gradients, loss); it must return (loss, gradients), in that order")
        first, second = second, first
    loss, why = scalar(first)
    if loss is None:
        problems.append(f"the loss is {why}")
    if not isinstance(second, Mapping):
        problems.append(f"the gradients are {kind(second)}, not a dict of arrays by variable name")
        second = None
    return loss, second, problems
