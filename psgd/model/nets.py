"""Built-in networks: softmax regression, an MLP and a small CNN, written as their forward pass
(:mod:`psgd.model.module`): their gradients are derived.

Each is built as ``Class(input_shape, num_classes, dtype="float32", target="classes",
loss=None, **options)``: ``num_classes`` is the width of its output, ``target`` what the dataset's targets are
(:data:`psgd.data.base.TARGETS`) and the loss by default the one that matches them (:data:`LOSS_FOR`).  An
unknown option or a bad value raises :class:`ModelError` naming the model and the option.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from psgd.autodiff import nn
from psgd.model.blocks import Conv2d, Flatten, Linear, MaxPool2d, ReLU
from psgd.model.errors import ModelError
from psgd.model.module import Module, Network, chain

#: the loss a built-in model takes for each kind of target, unless told another; and the losses each kind allows
LOSS_FOR = {"classes": "cross_entropy", "labels": "sigmoid_cross_entropy", "values": "mse"}
ALLOWED = {"classes": ("cross_entropy", "mse"), "labels": ("sigmoid_cross_entropy", "mse"), "values": ("mse",)}


def _positive_int(model: str, option: str, value: Any) -> int:
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise ModelError(f"{model}: option {option!r} must be a positive integer (got {value!r})")
    return int(value)


def _positive_ints(model: str, option: str, value: Any) -> tuple[int, ...]:
    """An int, a sequence of ints or a string like ``"128,64"`` -> a non-empty tuple of positive ints."""
    items = value
    if isinstance(value, str):
        items = [v for v in value.replace(" ", "").split(",") if v] if value.strip() else []
    elif isinstance(value, (int, np.integer)):
        items = [value]
    try:
        items = list(items)
    except TypeError:
        items = None
    if not items:
        raise ModelError(f"{model}: option {option!r} must be one or more positive integers (got {value!r})")
    try:
        return tuple(_positive_int(model, option, v) for v in items)
    except ModelError:
        raise ModelError(f"{model}: option {option!r} must be one or more positive integers (got {value!r})") from None


class LayeredModel(Network):
    """A chain of modules plus a loss; subclasses say which modules in ``layers()``.  Variables are named as a
    :class:`~psgd.model.module.Sequential` names them (``dense0/W``, ``conv1/b``)."""

    name = "model"
    OPTIONS: tuple[str, ...] = ()
    #: the same kernels for the same shapes, nothing read back to the host: a step can be a CUDA graph
    static_step = True

    def __init__(
        self,
        input_shape: Any,
        num_classes: int,
        dtype: str = "float32",
        loss: str | None = None,
        unknown: Mapping[str, Any] | None = None,
        target: str = "classes",
    ) -> None:
        if unknown:
            bad = ", ".join(repr(k) for k in sorted(unknown))
            raise ModelError(f"{self.name}: unknown option(s) {bad} (options: {', '.join(('loss',) + self.OPTIONS)})")
        if target not in ALLOWED:
            raise ModelError(f"{self.name}: target must be one of {', '.join(ALLOWED)} (got {target!r})")
        if isinstance(input_shape, (int, np.integer)):
            input_shape = (input_shape,)
        try:
            shape = tuple(_positive_int(self.name, "input_shape", d) for d in input_shape)
        except (TypeError, ModelError):
            raise ModelError(f"{self.name}: input_shape must be positive integers (got {input_shape!r})") from None
        if not shape:
            raise ModelError(f"{self.name}: input_shape must not be empty")
        classes = _positive_int(self.name, "num_classes", num_classes)
        if classes < 2 and target == "classes":
            raise ModelError(f"{self.name}: num_classes must be at least 2 (got {num_classes!r})")
        try:
            kind = np.dtype(dtype).kind
        except TypeError:
            kind = ""
        if kind != "f":
            raise ModelError(f"{self.name}: dtype must be a float type such as float32 or float64 (got {dtype!r})")
        loss = LOSS_FOR[target] if loss is None else loss
        if loss not in ALLOWED[target]:
            raise ModelError(
                f"{self.name}: option 'loss' must be one of {', '.join(ALLOWED[target])} for targets "
                f"that are {target} (got {loss!r})"
            )
        super().__init__(dtype)  # (a subclass' options are set already)
        self.input_shape, self.num_classes, self.loss_name, self.target = shape, classes, loss, target
        # (values in one input, its shape inside the net): what inputs() checks and reshapes to, worked out once
        object.__setattr__(self, "_shape", (math.prod(shape), tuple(self.batch_shape())))
        self.chain = chain(self, self.layers())

    def layers(self) -> list[Module]:
        raise NotImplementedError(f"{type(self).__name__} must define layers()")

    def batch_shape(self) -> tuple[int, ...]:
        """The shape one example has inside the net (flat for dense models)."""
        return (math.prod(self.input_shape),)

    def inputs(self, params: Mapping[str, Any], x: Any) -> Any:
        x = Network.inputs(self, params, x)
        size, shape = self._shape
        each = x.shape[1:]
        if each == shape:  # already the shape the net takes
            return x
        if x.ndim < 1 or (each != self.input_shape and math.prod(each) != size):
            raise ModelError(
                f"{self.name}: expected inputs of shape (B, {', '.join(map(str, self.input_shape))}), "
                f"got {tuple(x.shape)}"
            )
        return x.reshape((x.shape[0],) + shape)

    def forward(self, x: Any) -> Any:
        for module in self.chain:
            x = module.forward(x)
        return x

    def criterion(self, scores: Any, y: Any) -> Any:
        loss = self.loss_name
        if loss == "cross_entropy":
            return nn.cross_entropy(scores, y)
        if loss == "sigmoid_cross_entropy":
            return nn.sigmoid_cross_entropy(scores, y)
        return nn.mse(scores, y if self.target == "classes" else y.reshape(scores.shape), self.num_classes)


class SoftmaxRegression(LayeredModel):
    """One dense layer from the flattened input to the class scores."""

    name = "softmax"

    def __init__(
        self,
        input_shape: Any,
        num_classes: int,
        dtype: str = "float32",
        loss: str | None = None,
        target: str = "classes",
        **unknown: Any,
    ) -> None:
        super().__init__(input_shape, num_classes, dtype, loss, unknown, target)

    def layers(self) -> list[Module]:
        return [Linear(self.batch_shape()[0], self.num_classes, "glorot_uniform")]


class MLP(LayeredModel):
    """Dense + ReLU for each width in ``hidden``, then dense to the class scores."""

    name = "mlp"
    OPTIONS = ("hidden",)

    def __init__(
        self,
        input_shape: Any,
        num_classes: int,
        dtype: str = "float32",
        loss: str | None = None,
        hidden: Any = (128, 64),
        target: str = "classes",
        **unknown: Any,
    ) -> None:
        object.__setattr__(self, "hidden", _positive_ints(self.name, "hidden", hidden))
        super().__init__(input_shape, num_classes, dtype, loss, unknown, target)

    def layers(self) -> list[Module]:
        widths = self.batch_shape() + self.hidden
        dense: list[Module] = [Linear(n_in, n_out, "he_normal", relu=True) for n_in, n_out in zip(widths, widths[1:])]
        return dense + [Linear(widths[-1], self.num_classes, "glorot_uniform")]


class CNN(LayeredModel):
    """(Conv2D 'same' + ReLU + 2x2 MaxPool) per entry of ``channels``, dense ``hidden`` + ReLU, dense.

    ``input_shape`` is (C, H, W), or (H, W) for one channel.
    """

    name = "cnn"
    OPTIONS = ("channels", "kernel", "hidden")

    def __init__(
        self,
        input_shape: Any,
        num_classes: int,
        dtype: str = "float32",
        loss: str | None = None,
        channels: Any = (8, 16),
        kernel: Any = 3,
        hidden: Any = 64,
        target: str = "classes",
        **unknown: Any,
    ) -> None:
        object.__setattr__(self, "channels", _positive_ints(self.name, "channels", channels))
        object.__setattr__(self, "kernel", _positive_int(self.name, "kernel", kernel))
        if self.kernel % 2 == 0:
            raise ModelError(f"{self.name}: option 'kernel' must be odd for 'same' padding (got {kernel!r})")
        object.__setattr__(self, "hidden", _positive_int(self.name, "hidden", hidden))
        super().__init__(input_shape, num_classes, dtype, loss, unknown, target)

    def batch_shape(self) -> tuple[int, ...]:
        return self.input_shape if len(self.input_shape) == 3 else (1,) + self.input_shape

    def layers(self) -> list[Module]:
        if len(self.input_shape) not in (2, 3):
            raise ModelError(f"{self.name}: input_shape must be (C, H, W) or (H, W) (got {self.input_shape})")
        c, h, w = self.batch_shape()
        if h >> len(self.channels) < 1 or w >> len(self.channels) < 1:
            raise ModelError(
                f"{self.name}: input {h}x{w} is too small for {len(self.channels)} 2x2 poolings "
                "(fewer 'channels' or a larger input)"
            )
        layers: list[Module] = []
        for c_out in self.channels:
            layers += [Conv2d(c, c_out, self.kernel, padding="same"), ReLU(), MaxPool2d()]
            c, h, w = c_out, h // 2, w // 2
        return layers + [
            Flatten(),
            Linear(c * h * w, self.hidden, "he_normal", relu=True),
            Linear(self.hidden, self.num_classes, "glorot_uniform"),
        ]
