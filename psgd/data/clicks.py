"""Click logs in the shape of Criteo's, generated at any size: categorical ids for an embedding table, dense
features, and labels from a fixed random teacher whose accuracy is known.

Each example has ``fields`` categorical fields (26, as Criteo's) and ``dense`` dense ones (13).  Field f has a
vocabulary of ``cardinality[f]`` values, spread log-uniformly from 4 to ``max_cardinality`` over the fields (Criteo's
run from 3 to about 10^7), drawn by rank from a power law with exponent ``alpha`` (about 1.1-1.2 in click logs:
a few values are everywhere, most are rare).  The vocabulary grows over time: example i of n draws from the
first ``cardinality * (GROWTH_START + (1 - GROWTH_START) i / n)`` ranks, so new ids keep arriving and the test
set, drawn at the end of time, holds ids the early examples never saw.  A value's id is a 64-bit hash of (seed,
field, rank), an int64 of unbounded range as hashed click logs carry them, never the same for two values.

The label comes from a teacher over the same values: each value has a random vector, weighted down along its
rank (the rare tail carries little of the signal, so what a student can learn is what the teacher knows), each
field a random projection of it, and the dense features a random linear part; their sum, centred, is the logit
``z``, and the label is 1 with probability ``sigmoid(z)``.  The best any model can do on an example is
``max(p, 1 - p)``: :func:`reachable_accuracy` averages it over a set, the accuracy a student is measured against.

Everything is a function of (seed, split, example index) alone, with no random stream to replay: any range of
examples can be made on its own, and a smaller set is a prefix of a larger one.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from psgd.data.base import DataError, Dataset
from psgd.model.table import mix64, name_key

FIELDS, DENSE = 26, 13
ALPHA = 1.15
MAX_CARDINALITY = 10**6
GROWTH_START = 0.5  # the share of each vocabulary in use at the start of time
TEACHER_DIM = 4
HEAD_RANKS = 200.0  # a value's teacher weight is 1 / (1 + rank / HEAD_RANKS)
CHUNK = 1 << 16


@dataclasses.dataclass
class Clicks:
    """Examples of one split: ``ids`` ``[n, fields]`` int64, ``dense`` ``[n, dense]`` float32, ``y`` ``[n]``
    int64 (0 or 1), and ``p`` ``[n]`` the teacher's probability of a click."""

    ids: np.ndarray
    dense: np.ndarray
    y: np.ndarray
    p: np.ndarray

    def __len__(self) -> int:
        return int(self.y.size)


def cardinalities(fields: int = FIELDS, max_cardinality: int = MAX_CARDINALITY, seed: int = 0) -> np.ndarray:
    """Each field's vocabulary size: log-uniform from 4 to ``max_cardinality``, in an order fixed by ``seed``."""
    sizes = np.round(np.logspace(np.log10(4), np.log10(max(4, max_cardinality)), fields)).astype(np.int64)
    order = np.argsort(mix64(np.arange(fields, dtype=np.uint64) ^ name_key("clicks-order", seed)))
    return sizes[order]


def _unit(key: np.uint64, cells: np.ndarray) -> np.ndarray:
    """Uniforms in (0, 1), one per uint64 cell, a function of (key, cell) only."""
    bits = mix64(mix64(cells) ^ key) >> np.uint64(11)
    return (bits.astype(np.float64) + 0.5) * (1.0 / (1 << 53))


def _normal(key: np.uint64, cells: np.ndarray) -> np.ndarray:
    u1 = _unit(key, cells)
    u2 = _unit(key ^ np.uint64(0x5DEECE66D), cells)
    return np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2)


def zipf_ranks(u: np.ndarray, size: np.ndarray, alpha: float) -> np.ndarray:
    """Ranks 0..size-1 with P(rank r) about proportional to (r + 1)^-alpha (the continuous law's inverse)."""
    a = 1.0 - alpha
    top = np.power(size.astype(np.float64) + 1.0, a)
    r = np.power(1.0 + u * (top - 1.0), 1.0 / a) - 1.0
    return np.minimum(np.floor(r).astype(np.int64), size - 1)


class Generator:
    """The click logs of one seed and shape; :meth:`make` makes any range of examples of a split."""

    def __init__(
        self,
        seed: int = 0,
        fields: int = FIELDS,
        dense: int = DENSE,
        alpha: float = ALPHA,
        max_cardinality: int = MAX_CARDINALITY,
        sharpness: float = 3.0,
    ):
        if fields < 1 or dense < 0 or not 1.0 < alpha < 3.0 or max_cardinality < 4 or sharpness <= 0:
            raise ValueError("clicks: need fields >= 1, dense >= 0, 1 < alpha < 3, max_cardinality >= 4, sharpness > 0")
        self.seed, self.fields, self.dense, self.alpha, self.sharpness = seed, fields, dense, alpha, sharpness
        self.cardinality = cardinalities(fields, max_cardinality, seed)
        self.field_keys = np.array([name_key("clicks-field", seed, f) for f in range(fields)], np.uint64)
        teacher = name_key("clicks-teacher", seed)
        self.projection = _normal(teacher, np.arange(fields * TEACHER_DIM, dtype=np.uint64)).reshape(
            fields, TEACHER_DIM
        ) / np.sqrt(fields * TEACHER_DIM)
        self.dense_weights = _normal(teacher ^ np.uint64(1), np.arange(dense, dtype=np.uint64)) / np.sqrt(max(dense, 1))
        self.value_key = teacher ^ np.uint64(2)
        self.bias = 0.0
        sample = self._raw(name_key("clicks-calibration", seed), np.arange(8192), 8192)
        self.bias = -float(np.median(sample[3]))  # about as many clicks as not

    def ids_of(self, field: int, ranks: np.ndarray) -> np.ndarray:
        """The id of each value of ``field`` by rank: a hash of (seed, field, rank), as int64."""
        return mix64(ranks.astype(np.uint64) ^ self.field_keys[field]).view(np.int64)

    def _raw(self, key: np.uint64, index: np.ndarray, total: int, at_end: bool = False):
        n, F, D = index.size, self.fields, self.dense
        base = index.astype(np.uint64) * np.uint64(F + D + 1)
        time = np.ones(n) if at_end else index / max(total, 1)
        ranks = np.empty((n, F), np.int64)
        ids = np.empty((n, F), np.int64)
        z = np.zeros(n)
        for f in range(F):
            size = np.maximum(1, np.floor(self.cardinality[f] * (GROWTH_START + (1 - GROWTH_START) * time)))
            ranks[:, f] = zipf_ranks(_unit(key, base + np.uint64(f)), size.astype(np.int64), self.alpha)
            ids[:, f] = self.ids_of(f, ranks[:, f])
            cells = (
                ids[:, f].view(np.uint64)[:, None] * np.uint64(TEACHER_DIM)
                + np.arange(TEACHER_DIM, dtype=np.uint64)[None, :]
            )
            vectors = _normal(self.value_key, cells) / (1.0 + ranks[:, f : f + 1] / HEAD_RANKS)
            z += vectors @ self.projection[f]
        cells = base[:, None] + np.uint64(F) + np.arange(D, dtype=np.uint64)[None, :]
        dense = _normal(key ^ np.uint64(3), cells)
        z += dense @ self.dense_weights
        z = self.sharpness * z + self.bias
        return ids, dense.astype(np.float32), ranks, z

    def make(self, split: str, start: int, stop: int, total: int) -> Clicks:
        """Examples ``start..stop-1`` of a split of ``total`` (``train``: the vocabulary grows along it;
        ``test``: drawn at the end of time)."""
        if split not in ("train", "test") or not 0 <= start <= stop <= total:
            raise ValueError(f"clicks: no examples {start}..{stop} of a {split!r} split of {total}")
        parts = [self.at(split, np.arange(a, min(stop, a + CHUNK)), total) for a in range(start, stop, CHUNK)]
        if not parts:
            return Clicks(
                np.zeros((0, self.fields), np.int64),
                np.zeros((0, self.dense), np.float32),
                np.zeros(0, np.int64),
                np.zeros(0),
            )
        return Clicks(*(np.concatenate([getattr(c, k) for c in parts]) for k in ("ids", "dense", "y", "p")))

    def at(self, split: str, index: np.ndarray, total: int) -> Clicks:
        """Examples ``index`` (any int array, each in ``[0, total)``) of a split of ``total``."""
        index = np.asarray(index, dtype=np.int64)
        if split not in ("train", "test") or (index.size and (index.min() < 0 or index.max() >= total)):
            raise ValueError(f"clicks: no such examples of a {split!r} split of {total}")
        key = name_key("clicks", self.seed, split)
        ids, dense, _, z = self._raw(key, index, total, at_end=split == "test")
        p = 1.0 / (1.0 + np.exp(-z))
        y = (_unit(key ^ np.uint64(4), index.astype(np.uint64)) < p).astype(np.int64)
        return Clicks(ids, dense, y, p)


class Made:
    """One part (``ids``, ``dense`` or ``y``) of a split's examples, made when indexed, never held: what a
    worker's batch takes of a data set of any size costs that batch's memory only.  The three parts of one
    split share the last batch made, so a step's ``x[idx]``, ``y[idx]`` and ``ids[idx]`` make it once."""

    def __init__(self, gen: Generator, split: str, total: int, part: str, shared: dict, dtype: object = None):
        self.gen, self.split, self.total, self.part, self.shared = gen, split, total, part, shared
        width = {"ids": (gen.fields,), "dense": (gen.dense,), "y": ()}[part]
        self.shape = (total, *width)
        self.dtype = np.dtype(dtype or {"ids": np.int64, "dense": np.float32, "y": np.int64}[part])
        self.ndim = len(self.shape)

    def __len__(self) -> int:
        return self.total

    def __getitem__(self, index: object) -> np.ndarray:
        rows = np.arange(*index.indices(self.total)) if isinstance(index, slice) else np.asarray(index, dtype=np.int64)
        flat = rows.reshape(-1)
        key = flat.tobytes()
        if self.shared.get("key") != key:
            self.shared.update(key=key, made=self.gen.at(self.split, flat, self.total))
        got = getattr(self.shared["made"], self.part).astype(self.dtype, copy=False)
        return got.reshape(rows.shape + self.shape[1:])

    def astype(self, dtype: object, copy: bool = True) -> Made:
        return Made(self.gen, self.split, self.total, self.part, self.shared, dtype)

    def __array__(self, dtype: object = None, copy: object = None) -> np.ndarray:
        return np.concatenate([self[a : min(self.total, a + CHUNK)] for a in range(0, self.total, CHUNK)]).astype(
            dtype or self.dtype, copy=False
        )


def reachable_accuracy(clicks: Clicks) -> float:
    """The accuracy of the teacher's own best guess, averaged exactly over ``clicks``: what no model can beat
    in expectation."""
    return float(np.mean(np.maximum(clicks.p, 1.0 - clicks.p)))


#: The options of the ``clicks`` dataset (:func:`clicks_options` says what each may be).
CLICKS_OPTIONS = ("n_train", "n_test", "fields", "dense", "alpha", "max_cardinality", "data_seed")


def clicks_options(
    n_train: object = 100_000,
    n_test: object = 10_000,
    fields: object = FIELDS,
    dense: object = DENSE,
    alpha: object = ALPHA,
    max_cardinality: object = MAX_CARDINALITY,
    data_seed: object = 0,
) -> dict:
    """The options of the ``clicks`` dataset, checked (strings from a command line or job file accepted)."""

    def whole(name: str, value: object, least: int) -> int:
        try:
            number = int(value)  # type: ignore[call-overload]
            if isinstance(value, bool) or (isinstance(value, float) and number != value):
                raise ValueError
        except (TypeError, ValueError):
            raise DataError(f"clicks: option {name} must be an integer, got {value!r}") from None
        if number < least:
            raise DataError(f"clicks: option {name} must be >= {least}, got {number}")
        return number

    try:
        exponent = float(alpha)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        exponent = float("nan")
    if not 1.0 < exponent < 3.0:
        raise DataError(f"clicks: option alpha must be a number between 1 and 3, got {alpha!r}")
    return {
        "n_train": whole("n_train", n_train, 1),
        "n_test": whole("n_test", n_test, 1),
        "fields": whole("fields", fields, 1),
        "dense": whole("dense", dense, 1),
        "alpha": exponent,
        "max_cardinality": whole("max_cardinality", max_cardinality, 4),
        "data_seed": whole("data_seed", data_seed, 0),
    }


def load_clicks(**options: object) -> Dataset:
    """The ``clicks`` dataset: ``x`` the dense features, ``ids`` the categorical ones, two classes; the
    training examples are made when a batch takes them (:class:`Made`), the test set is held."""
    o = clicks_options(**options)
    gen = Generator(o["data_seed"], o["fields"], o["dense"], o["alpha"], o["max_cardinality"])
    n, shared = o["n_train"], {}
    test = gen.make("test", 0, o["n_test"], o["n_test"])
    return Dataset(
        "clicks",
        Made(gen, "train", n, "dense", shared),
        Made(gen, "train", n, "y", shared),
        test.dense,
        test.y,
        2,
        (o["dense"],),
        ids_train=Made(gen, "train", n, "ids", shared),
        ids_test=test.ids,
    )
