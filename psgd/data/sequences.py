"""Sequence tasks made here, for sequence models (a small transformer, say) with no download: ``sequences``.

An example is ``length`` tokens, whole numbers below ``vocab`` held as floats (a model looks each up in an
embedding), and its class is one of the tokens, so there are ``vocab`` classes:

- ``majority`` (the default): the commonest token of the sequence (the smallest of those tied). A model must
  compare every token with every other: attention does it; an MLP over the token values reaches 0.27 on the
  default sequences where a one-block transformer reaches 0.98 (docs/howto/examples.md).
- ``lookup``: the first token is a position p, 1 to length - 1, and the class is the token at p (a model reads
  one token and, by it, looks at another).
- ``sort``: the target is a sequence, the tokens in order: a class per position (``length`` of them), so a model
  gives scores of shape (batch, length, vocab).

Training and test examples come from one seeded generator (``data_seed``), in streams apart: every process of a
job makes the same data.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from psgd.data.base import DataError

TASKS = ("majority", "lookup", "sort")
SEQUENCES_OPTIONS = ("n_train", "n_test", "length", "vocab", "task", "data_seed")
_TRAIN, _TEST = 1, 2  # the generator's streams


def sequences_options(
    n_train: Any = 8000,
    n_test: Any = 2000,
    length: Any = 16,
    vocab: Any = 8,
    task: Any = "majority",
    data_seed: Any = 0,
) -> dict[str, Any]:
    """The options of :func:`make_sequences`, checked, with the defaults filled in (strings from a command line or a
    job file accepted for the numbers)."""
    o = {
        "n_train": _whole("n_train", n_train, 1),
        "n_test": _whole("n_test", n_test, 1),
        "length": _whole("length", length, 2),
        "vocab": _whole("vocab", vocab, 2),
        "task": str(task).strip().lower(),
        "data_seed": _whole("data_seed", data_seed, 0),
    }
    if o["task"] not in TASKS:
        raise DataError(f"sequences: task must be one of {', '.join(TASKS)}, got {task!r}")
    if o["task"] == "lookup" and o["vocab"] < o["length"]:
        raise DataError(
            f"sequences: the lookup task writes a position (1 to {o['length'] - 1}) as its first token, "
            f"so vocab must be at least length ({o['length']}), got {o['vocab']}"
        )
    return o


def make_sequences(**options: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(x_train, y_train, x_test, y_test)``: float32 tokens (n, length), int64 classes (n,), or (n, length) for
    ``sort``."""
    o = sequences_options(**options)
    return (*_sample(o, o["n_train"], _TRAIN), *_sample(o, o["n_test"], _TEST))


def _sample(o: dict[str, Any], n: int, stream: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng([o["data_seed"], stream])
    length, vocab = o["length"], o["vocab"]
    tokens = rng.integers(0, vocab, size=(n, length))
    if o["task"] == "lookup":
        tokens[:, 0] = rng.integers(1, length, size=n)
        labels = tokens[np.arange(n), tokens[:, 0]]
    elif o["task"] == "sort":
        labels = np.sort(tokens, axis=1)
    else:
        counts = np.stack([(tokens == t).sum(axis=1) for t in range(vocab)], axis=1)
        labels = counts.argmax(axis=1)  # the first of the largest: the smallest token tied
    return tokens.astype(np.float32), labels.astype(np.int64)


def _whole(name: str, value: Any, minimum: int) -> int:
    try:
        number = int(str(value).strip()) if not isinstance(value, (int, np.integer)) else int(value)
    except ValueError:
        raise DataError(f"sequences: {name} must be a whole number, got {value!r}") from None
    if isinstance(value, bool) or number < minimum:
        raise DataError(f"sequences: {name} must be a whole number of at least {minimum}, got {value!r}")
    return number
