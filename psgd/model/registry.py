"""Models by name: the built-in networks' names, loading a user model given as ``package.module:Class``,
and building either for an input shape and class count (every failure a one-line :class:`ModelError`)."""

from __future__ import annotations

import importlib
import inspect
import re
from typing import Any

from psgd import moved
from psgd.model.base import VarSpecError
from psgd.model.embed import Embed
from psgd.model.errors import ModelError
from psgd.model.nets import CNN, MLP, SoftmaxRegression

MODELS: dict[str, type] = {"softmax": SoftmaxRegression, "mlp": MLP, "cnn": CNN, "embed": Embed}

MODEL_METHODS = ("specs", "init", "loss_and_grads", "predict")
_BUILT_IN_ARGS = ("input_shape", "num_classes", "dtype", "id_shape", "target")
_DOTTED = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")


def _one_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: " + " ".join(str(exc).split())


def load_model_class(name: str | type) -> type:
    """The class named by a built-in name (``softmax``, ``mlp``, ``cnn``) or ``package.module:Class``, or the
    class itself (checked as one named would be)."""
    if inspect.isclass(name):
        return _with_methods(name, class_name(name), name.__qualname__)
    if name in MODELS:
        return MODELS[name]
    module_name, sep, attr = str(name).partition(":")
    if not sep or not _DOTTED.match(module_name) or not _DOTTED.match(attr):
        raise ModelError(
            f"unknown model {name!r}: use one of {', '.join(MODELS)}, or package.module:Class for your own model"
        )
    try:
        with moved.shown():  # an old name the module imports says where it went
            obj: Any = importlib.import_module(module_name)
    except BaseException as exc:  # SyntaxError, ImportError, or whatever the module raises
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        raise ModelError(f"model {name!r}: cannot import module {module_name!r} ({_one_line(exc)})") from exc
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ModelError(f"model {name!r}: module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not inspect.isclass(obj):
        raise ModelError(f"model {name!r}: {attr!r} is a {type(obj).__name__}, not a class")
    return _with_methods(obj, name, attr)


def class_name(cls: type) -> str:
    """``package.module:Class``: how a job file names ``cls``."""
    return f"{cls.__module__}:{cls.__qualname__}"


def _with_methods(cls: type, name: str, attr: str) -> type:
    missing = [m for m in MODEL_METHODS if not callable(getattr(cls, m, None))]
    if missing:
        raise ModelError(
            f"model {name!r}: class {attr!r} lacks the model method(s) {', '.join(missing)} "
            f"(a model needs {', '.join(MODEL_METHODS)})"
        )
    return cls


def model_options(cls: type) -> list[str] | None:
    """The options ``cls`` takes besides input_shape, num_classes and dtype (None if unknown)."""
    try:
        params = inspect.signature(cls).parameters.values()
    except (TypeError, ValueError):
        return None
    return [p.name for p in params if p.name not in _BUILT_IN_ARGS and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def _takes(cls: type, name: str) -> bool:
    try:
        return name in inspect.signature(cls).parameters
    except (TypeError, ValueError):
        return False


def build_model(
    name: str | type,
    input_shape: Any,
    num_classes: int,
    dtype: str = "float32",
    id_shape: Any = None,
    target: str = "classes",
    **options: Any,
) -> Any:
    """Build model ``name`` (see :func:`load_model_class`) for ``input_shape`` and ``num_classes``; for a dataset
    with categorical ids (:attr:`psgd.data.Dataset.id_shape`), also ``id_shape``, which a model of embedding tables
    takes (``embed``); and ``target`` (:attr:`psgd.data.Dataset.target`) to a model that takes it by name (the
    built-in ones, which choose their loss by it)."""
    cls = load_model_class(name)
    name = class_name(cls) if name is cls else name
    args = dict(input_shape=input_shape, num_classes=num_classes, dtype=dtype, **options)
    if id_shape is not None:
        args["id_shape"] = tuple(id_shape)
    known = model_options(cls)
    if _takes(cls, "target"):
        args["target"] = target
    takes = ", ".join(known) if known else "none"
    try:
        if known is not None:
            inspect.signature(cls).bind(**args)
    except TypeError as exc:
        raise ModelError(f"model {name!r}: {' '.join(str(exc).split())} (options it takes: {takes})") from None
    try:
        return cls(**args)
    except VarSpecError as exc:  # a VarSpec made in the constructor: name the model too
        raise ModelError(f"model {name!r}: {exc}") from None
    except ModelError:
        raise
    except (TypeError, ValueError) as exc:  # a bad option value in a user model
        raise ModelError(f"model {name!r}: {_one_line(exc)} (options it takes: {takes})") from exc
