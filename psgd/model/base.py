"""The model protocol every psgd process relies on.

A model is described by its variable specs (name, shape, dtype, initializer).
Every process derives the same initial values from a seed, *per variable*, so a
parameter-server shard can create only the variables it owns.  Training code
calls ``loss_and_grads(params, x, y)`` and ``predict(params, x)`` with arrays of
one array module (NumPy or CuPy); models never import CuPy themselves.

A user model is any class with these methods, constructed as
``Class(input_shape=..., num_classes=..., dtype=..., **options)`` and named on
the command line as ``package.module:Class``.
"""

from __future__ import annotations

import dataclasses
import inspect
import zlib
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import numpy as np

from psgd.model.errors import ModelError

INITIALIZERS = ("zeros", "ones", "he_normal", "glorot_uniform", "normal")


class VarSpecError(ModelError):
    """A :class:`VarSpec` that cannot be: an unknown initializer, a non-positive dimension."""


@dataclasses.dataclass(frozen=True)
class VarSpec:
    """One variable: its name, shape, dtype and how to initialize it.

    ``init`` is one of ``zeros``, ``ones``, ``he_normal`` (std sqrt(2/fan_in)),
    ``glorot_uniform`` (limit sqrt(6/(fan_in+fan_out))) or ``normal`` (std
    ``scale``).  ``fan_in``/``fan_out`` default to the leading/trailing
    dimensions.  ``state``: a value training moves but does not train (batch
    norm's running statistics): its "gradient" is the change a step made to it,
    added as it is (averaged over workers), never given to the optimizer.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str = "float32"
    init: str = "zeros"
    fan_in: int | None = None
    fan_out: int | None = None
    scale: float = 0.01
    state: bool = False

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        except (TypeError, ValueError):
            raise VarSpecError(f"variable {self.name!r}: shape {self.shape!r} is not a tuple of integers") from None
        try:
            object.__setattr__(self, "dtype", np.dtype(self.dtype).name)
        except TypeError:
            raise VarSpecError(f"variable {self.name!r}: unknown dtype {self.dtype!r}") from None
        if self.init not in INITIALIZERS:
            raise VarSpecError(
                f"variable {self.name!r}: unknown initializer {self.init!r} (use one of {', '.join(INITIALIZERS)})"
            )
        if any(d <= 0 for d in self.shape):
            raise VarSpecError(f"variable {self.name!r}: shape {self.shape} has a non-positive dimension")

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        return self.size * np.dtype(self.dtype).itemsize


def variable_rng(seed: int, name: str) -> np.random.Generator:
    """The generator that initializes variable ``name``: independent of every other variable."""
    return np.random.default_rng([int(seed) & 0xFFFFFFFF, zlib.crc32(name.encode())])


def init_variable(spec: VarSpec, seed: int) -> np.ndarray:
    """The initial value of one variable, a host array, deterministic in (seed, name)."""
    shape, dtype = spec.shape, np.dtype(spec.dtype)
    if spec.init in ("zeros", "ones"):
        return (np.zeros if spec.init == "zeros" else np.ones)(shape, dtype=dtype)
    rng = variable_rng(seed, spec.name)
    fan_in = spec.fan_in or (shape[0] if len(shape) > 1 else spec.size)
    fan_out = spec.fan_out or (shape[-1] if len(shape) > 1 else spec.size)
    if spec.init == "he_normal":
        values = rng.standard_normal(shape) * np.sqrt(2.0 / fan_in)
    elif spec.init == "glorot_uniform":
        limit = np.sqrt(6.0 / (fan_in + fan_out))
        values = rng.uniform(-limit, limit, size=shape)
    else:  # normal
        values = rng.standard_normal(shape) * spec.scale
    return values.astype(dtype)


def hands_over_gradients(model: Any) -> bool:
    """Whether ``model.loss_and_grads`` takes ``on_grad``: a callback it calls with each variable's gradient
    as soon as backward has produced it (the built-in models do, last layer first), so that moving the
    gradients can start while backward goes on ([cluster] overlap)."""
    try:
        return "on_grad" in inspect.signature(model.loss_and_grads).parameters
    except (TypeError, ValueError):  # a callable without a signature Python can read
        return False


@runtime_checkable
class Model(Protocol):
    """What psgd needs from a network.

    A model may also hold embedding tables: ``tables()`` lists them (:class:`psgd.model.table.TableSpec`) and
    ``lookups(ids)`` says which ids a batch's examples look up in each (``{table: int64 array}``); its
    ``params[table]`` is then the batch's :class:`psgd.model.table.Rows` and so is its gradient
    (:mod:`psgd.model.embed` is one).
    """

    def specs(self) -> list[VarSpec]:
        """The trainable variables, in a fixed order."""

    def init(self, seed: int, names: list[str] | None = None) -> dict[str, np.ndarray]:
        """Initial values (host arrays) of all variables, or of ``names`` only."""

    def loss_and_grads(self, params: Mapping[str, Any], x: Any, y: Any) -> tuple[float, dict[str, Any]]:
        """Mean loss over the batch and its gradient for every variable (same array module as params)."""

    def predict(self, params: Mapping[str, Any], x: Any) -> Any:
        """Per-class scores for a batch (argmax is the predicted class)."""


def model_tables(model: Any) -> list:
    """The embedding tables of ``model`` (:class:`psgd.model.table.TableSpec`); none where it declares none."""
    tables = getattr(model, "tables", None)
    return list(tables()) if callable(tables) else []


class BaseModel:
    """Convenience base: ``init`` from the specs, a ``loss`` helper and accuracy."""

    def specs(self) -> list[VarSpec]:  # pragma: no cover - abstract
        raise NotImplementedError

    def init(self, seed: int, names: list[str] | None = None) -> dict[str, np.ndarray]:
        specs = self.specs()
        if names is not None:
            wanted = set(names)
            unknown = wanted - {s.name for s in specs}
            if unknown:
                raise KeyError(f"unknown variable(s): {sorted(unknown)}")
            specs = [s for s in specs if s.name in wanted]
        return {s.name: init_variable(s, seed) for s in specs}

    def loss(self, params: Mapping[str, Any], x: Any, y: Any) -> float:
        return self.loss_and_grads(params, x, y)[0]

    def loss_and_grads(
        self, params: Mapping[str, Any], x: Any, y: Any
    ) -> tuple[float, dict[str, Any]]:  # pragma: no cover
        raise NotImplementedError

    def predict(self, params: Mapping[str, Any], x: Any) -> Any:  # pragma: no cover
        raise NotImplementedError
