"""Built-in networks: softmax regression, an MLP and a small CNN.

Each is built as ``Class(input_shape, num_classes, dtype="float32",
loss="cross_entropy" | "mse", **options)``; an unknown option or a bad value
raises :class:`ModelError` naming the model and the option.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping

import numpy as np

from psgd.model.base import BaseModel, VarSpec
from psgd.model.errors import ModelError
from psgd.model.layers import Conv2D, Dense, Flatten, Layer, MaxPool2D, ReLU, Sequential
from psgd.model.losses import mean_squared_error, softmax_cross_entropy
from psgd.xp import get_array_module

LOSSES = ("cross_entropy", "mse")


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


class LayeredModel(BaseModel):
    """A :class:`Sequential` net plus a loss; subclasses say which layers in ``layers()``."""

    name = "model"
    OPTIONS: tuple[str, ...] = ()
    #: the same kernels for the same shapes, nothing read back to the host: a step can be a CUDA graph
    static_step = True

    def __init__(self, input_shape: Any, num_classes: int, dtype: str = "float32",
                 loss: str = "cross_entropy", unknown: Mapping[str, Any] | None = None) -> None:
        if unknown:
            bad = ", ".join(repr(k) for k in sorted(unknown))
            raise ModelError(f"{self.name}: unknown option(s) {bad} (options: {', '.join(('loss',) + self.OPTIONS)})")
        if isinstance(input_shape, (int, np.integer)):
            input_shape = (input_shape,)
        try:
            self.input_shape = tuple(_positive_int(self.name, "input_shape", d) for d in input_shape)
        except (TypeError, ModelError):
            raise ModelError(f"{self.name}: input_shape must be positive integers (got {input_shape!r})") from None
        if not self.input_shape:
            raise ModelError(f"{self.name}: input_shape must not be empty")
        self.num_classes = _positive_int(self.name, "num_classes", num_classes)
        if self.num_classes < 2:
            raise ModelError(f"{self.name}: num_classes must be at least 2 (got {num_classes!r})")
        try:
            self.dtype = np.dtype(dtype).name
        except TypeError:
            self.dtype = None
        if self.dtype is None or np.dtype(self.dtype).kind != "f":
            raise ModelError(f"{self.name}: dtype must be a float type such as float32 or float64 (got {dtype!r})")
        if loss not in LOSSES:
            raise ModelError(f"{self.name}: option 'loss' must be one of {', '.join(LOSSES)} (got {loss!r})")
        self.loss_name = loss
        self.net = Sequential(self.layers(), self.dtype)
        self._first = self.net.specs()[0].name

    def layers(self) -> list[Layer]:
        raise NotImplementedError(f"{type(self).__name__} must define layers()")

    def batch_shape(self) -> tuple[int, ...]:
        """The shape one example has inside the net (flat for dense models)."""
        return (math.prod(self.input_shape),)

    def specs(self) -> list[VarSpec]:
        return self.net.specs()

    def _inputs(self, params: Mapping[str, Any], x: Any) -> Any:
        xp = get_array_module(params[self._first])
        x = xp.asarray(x, dtype=self.dtype)
        if x.ndim < 1 or math.prod(x.shape[1:]) != math.prod(self.input_shape):
            raise ModelError(f"{self.name}: expected inputs of shape (B, {', '.join(map(str, self.input_shape))}), "
                             f"got {tuple(x.shape)}")
        return x.reshape((x.shape[0],) + self.batch_shape())

    def loss_grads_and_dx(self, params: Mapping[str, Any], x: Any, y: Any, need_dx: bool = True,
                          on_grad: Callable[[str, Any], None] | None = None) -> tuple[Any, dict[str, Any], Any]:
        """Like :meth:`loss_and_grads`, plus the gradient with respect to the (reshaped) inputs."""
        out, caches = self.net.forward(params, self._inputs(params, x))
        if self.loss_name == "mse":
            loss, dout = mean_squared_error(out, y, self.num_classes)
        else:
            loss, dout = softmax_cross_entropy(out, y)
        dx, grads = self.net.backward(params, caches, dout, need_dx=need_dx, on_grad=on_grad)
        return loss, grads, dx

    def loss_and_grads(self, params: Mapping[str, Any], x: Any, y: Any,
                       on_grad: Callable[[str, Any], None] | None = None) -> tuple[Any, dict[str, Any]]:
        """The mean loss (a 0-d array on the params' device: reading it waits for the GPU, so the
        caller does that once the step's work is queued) and the gradients; ``on_grad(name, grad)``
        hears of each gradient as soon as backward has produced it, last layer first."""
        loss, grads, _ = self.loss_grads_and_dx(params, x, y, need_dx=False, on_grad=on_grad)
        return loss, grads

    def predict(self, params: Mapping[str, Any], x: Any) -> Any:
        return self.net.forward(params, self._inputs(params, x))[0]


class SoftmaxRegression(LayeredModel):
    """One dense layer from the flattened input to the class scores."""

    name = "softmax"

    def __init__(self, input_shape: Any, num_classes: int, dtype: str = "float32",
                 loss: str = "cross_entropy", **unknown: Any) -> None:
        super().__init__(input_shape, num_classes, dtype, loss, unknown)

    def layers(self) -> list[Layer]:
        return [Dense(self.batch_shape()[0], self.num_classes, init="glorot_uniform")]


class MLP(LayeredModel):
    """Dense + ReLU for each width in ``hidden``, then dense to the class scores."""

    name = "mlp"
    OPTIONS = ("hidden",)

    def __init__(self, input_shape: Any, num_classes: int, dtype: str = "float32",
                 loss: str = "cross_entropy", hidden: Any = (128, 64), **unknown: Any) -> None:
        self.hidden = _positive_ints(self.name, "hidden", hidden)
        super().__init__(input_shape, num_classes, dtype, loss, unknown)

    def layers(self) -> list[Layer]:
        widths = self.batch_shape() + self.hidden
        layers: list[Layer] = []
        for n_in, n_out in zip(widths, widths[1:]):
            layers += [Dense(n_in, n_out, init="he_normal"), ReLU()]
        return layers + [Dense(widths[-1], self.num_classes, init="glorot_uniform")]


class CNN(LayeredModel):
    """(Conv2D 'same' + ReLU + 2x2 MaxPool) per entry of ``channels``, dense ``hidden`` + ReLU, dense.

    ``input_shape`` is (C, H, W), or (H, W) for one channel.
    """

    name = "cnn"
    OPTIONS = ("channels", "kernel", "hidden")

    def __init__(self, input_shape: Any, num_classes: int, dtype: str = "float32",
                 loss: str = "cross_entropy", channels: Any = (8, 16), kernel: Any = 3, hidden: Any = 64,
                 **unknown: Any) -> None:
        self.channels = _positive_ints(self.name, "channels", channels)
        self.kernel = _positive_int(self.name, "kernel", kernel)
        if self.kernel % 2 == 0:
            raise ModelError(f"{self.name}: option 'kernel' must be odd for 'same' padding (got {kernel!r})")
        self.hidden = _positive_int(self.name, "hidden", hidden)
        super().__init__(input_shape, num_classes, dtype, loss, unknown)

    def batch_shape(self) -> tuple[int, ...]:
        return self.input_shape if len(self.input_shape) == 3 else (1,) + self.input_shape

    def layers(self) -> list[Layer]:
        if len(self.input_shape) not in (2, 3):
            raise ModelError(f"{self.name}: input_shape must be (C, H, W) or (H, W) (got {self.input_shape})")
        c, h, w = self.batch_shape()
        if h >> len(self.channels) < 1 or w >> len(self.channels) < 1:
            raise ModelError(f"{self.name}: input {h}x{w} is too small for {len(self.channels)} 2x2 poolings "
                             "(fewer 'channels' or a larger input)")
        layers: list[Layer] = []
        for c_out in self.channels:
            layers += [Conv2D(c, c_out, self.kernel, padding="same"), ReLU(), MaxPool2D()]
            c, h, w = c_out, h // 2, w // 2
        return layers + [Flatten(), Dense(c * h * w, self.hidden, init="he_normal"), ReLU(),
                         Dense(self.hidden, self.num_classes, init="glorot_uniform")]
