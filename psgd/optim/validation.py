"""The optimizers' error and the checks of their hyperparameter values.

Every check names its owner (``"adam"``, ``"cosine schedule"``) and the value,
and raises :class:`OptimizerError` with one line that says what is wrong.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import Any

from psgd.errors import InputError


class OptimizerError(InputError):
    """A bad optimizer or schedule name, option or value, or a bad update."""


def real(owner: str, name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise OptimizerError(f"{owner}: {name} must be a number, got {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise OptimizerError(f"{owner}: {name} must be finite, got {value!r}")
    return value


def positive(owner: str, name: str, value: Any) -> float:
    value = real(owner, name, value)
    if value <= 0:
        raise OptimizerError(f"{owner}: {name} must be > 0, got {value!r}")
    return value


def non_negative(owner: str, name: str, value: Any) -> float:
    value = real(owner, name, value)
    if value < 0:
        raise OptimizerError(f"{owner}: {name} must be >= 0, got {value!r}")
    return value


def fraction(owner: str, name: str, value: Any) -> float:
    """A value in [0, 1): a momentum or a moment decay rate."""
    value = real(owner, name, value)
    if not 0 <= value < 1:
        raise OptimizerError(f"{owner}: {name} must be in [0, 1), got {value!r}")
    return value


def integer(owner: str, name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise OptimizerError(f"{owner}: {name} must be an integer, got {value!r}")
    if value < minimum:
        raise OptimizerError(f"{owner}: {name} must be >= {minimum}, got {value!r}")
    return int(value)


def reject_unknown(owner: str, given: Mapping[str, Any], accepted: tuple[str, ...]) -> None:
    unknown = [name for name in given if name not in accepted]
    if unknown:
        what = "option" if len(unknown) == 1 else "options"
        raise OptimizerError(
            f"{owner}: unknown {what} {', '.join(repr(u) for u in unknown)}; accepted: {', '.join(accepted) or 'none'}"
        )
