"""The checks every section of the job file makes of its keys' values, each naming the file, the section and the
key in its :class:`~psgd.errors.ConfigError`."""

from __future__ import annotations

from typing import Any

from psgd.errors import ConfigError


def check_ints(src: str, section: str, values: Any, ranges: dict[str, tuple[int, int]]) -> None:
    """Each key of ``ranges`` an integer (not a bool) from its lowest to its highest."""
    for key, (low, high) in ranges.items():
        value = getattr(values, key)
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise ConfigError(f"{src}: [{section}] {key} must be an integer from {low} to {high}, got {value!r}")


def check_seconds(src: str, section: str, values: Any, ranges: dict[str, tuple[float, float]]) -> None:
    """Each key of ``ranges`` a number of seconds from its least to its most."""
    for key, (least, most) in ranges.items():
        value = getattr(values, key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not least <= value <= most:
            raise ConfigError(f"{src}: [{section}] {key} must be a number of seconds from {least:g} to {most:g}, "
                              f"got {value!r}")


def check_bools(src: str, section: str, values: Any, keys: tuple[str, ...]) -> None:
    """Each of ``keys`` true or false."""
    for key in keys:
        if not isinstance(getattr(values, key), bool):
            raise ConfigError(f"{src}: [{section}] {key} must be true or false, got {getattr(values, key)!r}")


def check_addresses(src: str, section: str, key: str, addresses: Any) -> None:
    """``addresses`` a list of host:port strings."""
    if not isinstance(addresses, list) or not all(isinstance(a, str) and a.rpartition(":")[2].isdigit()
                                                  for a in addresses):
        raise ConfigError(f"{src}: [{section}] {key} must be a list of host:port strings, got {addresses!r}")
