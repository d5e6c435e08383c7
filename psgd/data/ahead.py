"""A worker's batches by their rows: augmented where the job says how, and the next one gathered on a thread while
the step in hand computes where the rows are read from disk (``npy:DIR``), so that reading them costs a step
nothing unless it takes longer than the step.

Rows held in memory are gathered in the step itself: a thread's hand-over would cost a small step more than the
gathering does.  While rows are gathered ahead, the interpreter offers the reading thread its turn every
``SWITCH`` seconds (``sys.setswitchinterval``, put back after): at its default of 5 ms, a step's own Python kept
the reader from starting its read until the step waited for it, and hid almost nothing (benchmarks/prefetch.py).

An augmentation (``[train] augment``, ``package.module:function``) is called on each training batch on the host,
``f(x, y, rng) -> (x, y)``, with a generator seeded by the job's seed, the worker's rank and the step: the same
step is augmented the same way again, gathered ahead or not.
"""

from __future__ import annotations

import importlib
import re
import sys
from collections.abc import Callable
from concurrent import futures
from typing import Any

import numpy as np

from psgd.data.base import DataError, read_targets

Augment = Callable[[np.ndarray, np.ndarray, np.random.Generator], tuple[np.ndarray, np.ndarray]]
#: seconds between the interpreter's offers of another thread's turn, while batches are gathered ahead
SWITCH = 0.0005
_NAMED = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")


def load_augment(name: str) -> Augment:
    """The function ``package.module:function`` names, as ``[train] augment`` gives it."""
    if not _NAMED.match(name):
        raise DataError(f"augment {name!r}: name a function as package.module:function")
    module, _, attr = name.partition(":")
    try:
        found: Any = importlib.import_module(module)
        for part in attr.split("."):
            found = getattr(found, part)
    except (ImportError, AttributeError) as exc:
        raise DataError(f"augment {name!r}: cannot import it ({type(exc).__name__}: {exc})") from None
    except Exception as exc:  # the module's own code failed as it ran: the user's to fix, said in one line
        raise DataError(f"augment {name!r}: importing it raised {type(exc).__name__}: {exc}") from None
    if not callable(found):
        raise DataError(f"augment {name!r}: is a {type(found).__name__}, not a function")
    return found


class Ahead:
    """Batches of ``x`` and ``y`` by their rows, augmented by ``augment`` (seeded by ``seed`` and the step), the
    next one gathered ahead where ``on``."""

    def __init__(
        self,
        x: Any,
        y: Any,
        on: bool,
        augment: Augment | None = None,
        seed: tuple[int, ...] = (0,),
        target: str = "classes",
        classes: int | None = None,
    ):
        self.x, self.y, self.augment, self.seed = x, y, augment, tuple(seed)
        self.target, self.classes = target, classes  # what an augmentation's targets must be (classes: 0..classes-1)
        self._pool = futures.ThreadPoolExecutor(1, thread_name_prefix="batch-ahead") if on else None
        self._next: tuple[int, futures.Future] | None = None  # (its step, its batch)
        self._interval = sys.getswitchinterval()
        if on:
            sys.setswitchinterval(min(SWITCH, self._interval))

    @property
    def on(self) -> bool:
        return self._pool is not None

    def take(self, step: int, rows: np.ndarray) -> tuple[Any, Any]:
        """Step ``step``'s batch, the rows ``rows``: as gathered ahead for that step, else gathered now."""
        pending, self._next = self._next, None
        if pending is not None and pending[0] == step:
            return pending[1].result()
        return self._gather(step, rows)

    def ahead(self, step: int, rows: np.ndarray) -> None:
        """Start gathering step ``step``'s batch (a step that goes back instead finds it is not its own)."""
        if self._pool is not None:
            self._next = (step, self._pool.submit(self._gather, step, rows))

    def _gather(self, step: int, rows: np.ndarray) -> tuple[Any, Any]:
        x, y = self.x[rows], self.y[rows]
        if self.augment is None:
            return x, y
        out = self.augment(x, y, np.random.default_rng([*self.seed, step]))
        name = getattr(self.augment, '__qualname__', self.augment)
        if not (
            isinstance(out, tuple)
            and len(out) == 2
            and getattr(out[0], "shape", None) == x.shape
            and getattr(out[1], "shape", None) == y.shape
        ):
            raise DataError(f"augment {name!r} must return (x, y) of the shapes it was given, {x.shape} and {y.shape}")
        self._check_targets(name, np.asarray(out[1]))
        return out

    def _check_targets(self, name: str, y: np.ndarray) -> None:
        """The targets an augmentation returned, checked as the data's own were when read: a class out of range
        trained on to a NaN loss."""
        if self.target != "classes":
            read_targets(y, f"augment {name!r} returned targets that", self.target)
            return
        if y.dtype.kind not in "iu":
            raise DataError(f"augment {name!r} returned labels of {y.dtype}: class labels are integers")
        if self.classes is None or not y.size:
            return
        low, high = int(y.min()), int(y.max())
        if low < 0 or high >= self.classes:
            raise DataError(
                f"augment {name!r} returned label {low if low < 0 else high} for a job of "
                f"{self.classes} classes (0..{self.classes - 1})"
            )

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            sys.setswitchinterval(self._interval)
