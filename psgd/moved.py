"""Names psgd's documentation once showed users and psgd has since moved.  Each still answers at its old place, from
its new home, with a DeprecationWarning that names the new home, until a later release removes it; CHANGELOG.md lists
them.  An old module is a shim of three lines (``psgd/xp.py``) whose attributes come from :data:`MOVED`."""

from __future__ import annotations

import contextlib
import importlib
import sys
import warnings
from collections.abc import Callable, Iterator
from typing import Any

#: {old module: {name: the public module it lives in now}}
MOVED: dict[str, dict[str, str]] = {
    "psgd.xp": {"get_array_module": "psgd.model"},  # the array backend, moved to psgd/compute/
    "psgd.compute.xp": {"get_array_module": "psgd.model"},  # then renamed backend, which is psgd's own
}


def forward(module: str) -> Callable[[str], Any]:
    """The module ``__getattr__`` of the shim ``module``: a moved name's value, said once per name (it is then
    kept in the shim, where Python looks before it asks ``__getattr__``)."""
    names = MOVED[module]

    def __getattr__(name: str) -> Any:
        if name not in names:
            raise AttributeError(
                f"{module} has no attribute {name!r}: it has moved, and of its names only "
                + ", ".join(f"{n} (now in {home})" for n, home in names.items())
                + " were public"
            )
        value = getattr(importlib.import_module(names[name]), name)
        warnings.warn(
            f"{module}.{name} has moved: import it from {names[name]}; the old name goes in a later "
            "release (CHANGELOG.md)",
            DeprecationWarning,
            stacklevel=2,
        )
        vars(sys.modules[module])[name] = value
        return value

    return __getattr__


@contextlib.contextmanager
def shown() -> Iterator[None]:
    """Show the moved names' warnings raised meanwhile: Python hides a DeprecationWarning raised outside
    ``__main__``, and a network's module, imported by a job's processes, is where an old name is met."""
    with warnings.catch_warnings():
        warnings.filterwarnings("default", category=DeprecationWarning, message=r"psgd\.[\w.]+ has moved")
        yield
