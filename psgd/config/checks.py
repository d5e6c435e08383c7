"""What each key of the job file may be, said beside its field: ``staleness: int = integer(2, 0, 10**6)``.

Each helper makes a dataclass field whose metadata holds its :class:`Rule`; a settings part calls :func:`refuse_bad`
from ``__post_init__``, so a bad value is refused when the part is made, by a :class:`~psgd.errors.ConfigError`
that names the section, the key, what it may be and the value (a job adds its file's name in front).  The rules
across keys are not here: they are :meth:`psgd.config.ClusterConfig.check_across` and
:meth:`psgd.config.JobConfig.validate`.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Iterable
from typing import Any

from psgd.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Rule:
    """What one key may be: ``words`` say it (``must be an integer from 1 to 1024``), ``accepts`` tells it;
    ``range`` is (lowest, highest) for a number."""

    words: str
    accepts: Callable[[Any], bool]
    range: tuple[float, float] | None = None


def _number(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float))


def _field(default: Any, rule: Rule) -> Any:
    return dataclasses.field(default=default, metadata={"rule": rule})


def integer(default: int, low: int, high: int) -> Any:
    """An integer (not a bool) from ``low`` to ``high``."""
    return _field(
        default,
        Rule(
            f"must be an integer from {low} to {high}",
            lambda v: _number(v) and isinstance(v, int) and low <= v <= high,
            (low, high),
        ),
    )


def seconds(default: float, least: float, most: float) -> Any:
    """A number of seconds from ``least`` to ``most``."""
    return _field(
        default,
        Rule(
            f"must be a number of seconds from {least:g} to {most:g}",
            lambda v: _number(v) and least <= v <= most,
            (least, most),
        ),
    )


def number(
    default: float, words: str, low: float, high: float = math.inf, *, above: bool = False, below: bool = False
) -> Any:
    """A finite number from ``low`` to ``high``: greater than ``low`` with ``above``, less than ``high`` with
    ``below``."""

    def accepts(v: Any) -> bool:
        return (
            _number(v) and math.isfinite(v) and (v > low if above else v >= low) and (v < high if below else v <= high)
        )

    return _field(default, Rule(f"must be {words}", accepts, (low, high)))


def flag(default: bool) -> Any:
    """True or false."""
    return _field(default, Rule("must be true or false", lambda v: isinstance(v, bool)))


def one_of(default: str, choices: Iterable[str], words: str = "", *, quoted: bool = False) -> Any:
    """One of ``choices`` (strings), said as ``words``, else as the list of them (``quoted``: as a job file writes
    them, ``"a", "b" or "c"``)."""
    choices = tuple(choices)
    if not words:
        said = [json.dumps(c) for c in choices] if quoted else list(choices)
        words = f"{', '.join(said[:-1])} or {said[-1]}" if quoted else f"one of {', '.join(said)}"
    return _field(default, Rule(f"must be {words}", lambda v: isinstance(v, str) and v in choices))


def text(default: str, words: str, accepts: Callable[[str], bool] = lambda v: True) -> Any:
    """A string that ``accepts`` takes."""
    return _field(default, Rule(words, lambda v: isinstance(v, str) and accepts(v)))


def addresses() -> Any:
    """A list of host:port strings (empty by default), kept as a tuple."""
    return _field(
        (),
        Rule(
            "must be a list of host:port strings",
            lambda v: (
                isinstance(v, (list, tuple)) and all(isinstance(a, str) and a.rpartition(":")[2].isdigit() for a in v)
            ),
        ),
    )


def ports() -> Any:
    """A list of TCP ports, one per shard (empty by default), kept as a tuple."""
    return _field(
        (),
        Rule(
            "must be a list of ports (1-65535), one per shard",
            lambda v: (
                isinstance(v, (list, tuple))
                and all(isinstance(p, int) and not isinstance(p, bool) and 0 < p < 65536 for p in v)
            ),
        ),
    )


def refuse_bad(settings: Any, section: str) -> None:
    """Raise the ConfigError of the first key of ``settings`` whose value its rule refuses; then keep each list (a
    job file's, a flag's) as a tuple, so that a frozen part cannot be changed through one of its keys either."""
    for f in dataclasses.fields(settings):
        rule, value = f.metadata.get("rule"), getattr(settings, f.name)
        if rule is not None and not rule.accepts(value):
            raise ConfigError(f"[{section}] {f.name} {rule.words}, got {value!r}")
        if isinstance(value, list):
            object.__setattr__(settings, f.name, tuple(value))  # a frozen dataclass's own way to set a field
