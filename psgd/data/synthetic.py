"""Synthetic classification data of any size, labelled by a fixed random teacher network.

``x ~ N(0, I)`` in float32; the label of ``x`` is the argmax of a two-layer
tanh MLP (the *teacher*) drawn once from ``data_seed``.  Labels are a
deterministic function of ``x``, so a student network with enough hidden
units can learn them exactly.  The teacher's output biases are calibrated on
a separate sample so that classes come out roughly balanced (within about
10% of ``1/num_classes`` for the defaults).

Everything is a function of ``data_seed`` alone, drawn from independent
streams: the teacher, the calibration sample, the training inputs and the test
inputs.  So the test set does not change with ``n_train``, and a smaller
training set is a prefix of a larger one.  Inputs are drawn straight into the
output array and labelled chunk by chunk, so ``n_train = 10**6`` needs no
temporaries beyond one chunk.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from psgd.data.base import DataError

CHUNK_ROWS = 16384
CALIBRATION_ROWS = 8192
CALIBRATION_STEPS = 50
_STREAM_TAG = 0x53594E54  # "SYNT": keeps these streams apart from the sharding permutations
_TEACHER, _CALIBRATION, _TRAIN, _TEST = range(4)


def _rng(data_seed: int, stream: int) -> np.random.Generator:
    return np.random.default_rng([data_seed, _STREAM_TAG, stream])


class Teacher:
    """The fixed random labelling network: ``argmax(tanh(x W1 + b1) W2 + b2)``, in float64."""

    def __init__(self, input_dim: int, hidden: int, num_classes: int, data_seed: int) -> None:
        rng = _rng(data_seed, _TEACHER)
        self.w1 = rng.standard_normal((input_dim, hidden)) / np.sqrt(input_dim)
        self.b1 = 0.1 * rng.standard_normal(hidden)
        self.w2 = rng.standard_normal((hidden, num_classes)) / np.sqrt(hidden)
        self.b2 = np.zeros(num_classes)
        calib = _rng(data_seed, _CALIBRATION).standard_normal((CALIBRATION_ROWS, input_dim))
        self.b2 = _balancing_bias(self.logits(calib))

    def logits(self, x: np.ndarray) -> np.ndarray:
        return np.tanh(x @ self.w1 + self.b1) @ self.w2 + self.b2

    def labels(self, x: np.ndarray) -> np.ndarray:
        return np.argmax(self.logits(x), axis=1).astype(np.int64)


def _balancing_bias(logits: np.ndarray) -> np.ndarray:
    """Output biases that make the classes about equally frequent (Sinkhorn on a sharp softmax)."""
    k = logits.shape[1]
    temperature = 0.05 * float(logits.std()) or 1.0
    bias = np.zeros(k)
    for _ in range(CALIBRATION_STEPS):
        z = (logits + bias) / temperature
        z -= z.max(axis=1, keepdims=True)
        p = np.exp(z)
        p /= p.sum(axis=1, keepdims=True)
        bias -= temperature * np.log(np.maximum(p.mean(axis=0), 1e-12) * k)
    return bias


def _sample(teacher: Teacher, n: int, input_dim: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    x = np.empty((n, input_dim), dtype=np.float32)
    y = np.empty(n, dtype=np.int64)
    for start in range(0, n, CHUNK_ROWS):
        stop = min(start + CHUNK_ROWS, n)
        rng.standard_normal(dtype=np.float32, out=x[start:stop])
        y[start:stop] = teacher.labels(x[start:stop].astype(np.float64))
    return x, y


def synthetic_options(
    n_train: int = 10000,
    n_test: int = 2000,
    input_dim: int = 64,
    num_classes: int = 10,
    teacher_hidden: int = 32,
    data_seed: int = 0,
) -> dict[str, int]:
    """The options of :func:`make_synthetic`, checked, with the defaults filled in.

    Each is an integer (strings from a command line or job file accepted):
    the sizes at least 1, ``num_classes`` at least 2, ``data_seed`` at least 0.
    """
    return {
        "n_train": _int_option("n_train", n_train, minimum=1),
        "n_test": _int_option("n_test", n_test, minimum=1),
        "input_dim": _int_option("input_dim", input_dim, minimum=1),
        "num_classes": _int_option("num_classes", num_classes, minimum=2),
        "teacher_hidden": _int_option("teacher_hidden", teacher_hidden, minimum=1),
        "data_seed": _int_option("data_seed", data_seed, minimum=0),
    }


def make_synthetic(**options: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(x_train, y_train, x_test, y_test)``: float32 inputs, int64 labels.

    ``options`` and their defaults are those of :func:`synthetic_options`.
    """
    o = synthetic_options(**options)
    input_dim, data_seed = o["input_dim"], o["data_seed"]
    teacher = Teacher(input_dim, o["teacher_hidden"], o["num_classes"], data_seed)
    x_train, y_train = _sample(teacher, o["n_train"], input_dim, _rng(data_seed, _TRAIN))
    x_test, y_test = _sample(teacher, o["n_test"], input_dim, _rng(data_seed, _TEST))
    return x_train, y_train, x_test, y_test


def _int_option(name: str, value: object, *, minimum: int) -> int:
    """An integer option (strings from a command line or job file accepted), >= minimum."""
    if isinstance(value, bool):
        raise DataError(f"synthetic: option {name} must be an integer, got {value!r}")
    try:
        as_int = int(value)  # type: ignore[call-overload]
        if isinstance(value, float) and as_int != value:
            raise ValueError
    except (TypeError, ValueError) as exc:
        raise DataError(f"synthetic: option {name} must be an integer, got {value!r}") from exc
    if as_int < minimum:
        raise DataError(f"synthetic: option {name} must be >= {minimum}, got {as_int}")
    return as_int
