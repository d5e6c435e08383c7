"""The modules a network is made of (:mod:`psgd.model.module` says what a module is): dense layers, convolutions,
layer and batch normalization, dropout, and functions without parameters (ReLU, flattening, pooling)."""

from __future__ import annotations

from typing import Any, Callable

from psgd.autodiff import Tensor, nn, ops
from psgd.model.errors import ModelError
from psgd.model.module import Module, Parameter, State


class Linear(Module):
    """``x @ W + b`` with ``W`` (n_in, n_out), then a ReLU where ``relu`` (on a GPU with the bias, one kernel)."""

    kind = "dense"

    def __init__(self, n_in: int, n_out: int, init: str = "he_normal", bias: bool = True, relu: bool = False):
        super().__init__()
        self.relu = relu
        self.W = Parameter((int(n_in), int(n_out)), init)
        self.b = Parameter((int(n_out),), "zeros") if bias else None

    def forward(self, x: Any) -> Tensor:
        return nn.linear(x, self.W, self.b, relu=self.relu)


class Conv2d(Module):
    """2-D convolution, stride 1: ``W`` (out, in, k, k); ``padding`` in pixels, ``"same"`` (k // 2, odd k) or
    ``"valid"`` (0)."""

    kind = "conv"

    def __init__(self, c_in: int, c_out: int, kernel: int = 3, padding: int | str = "same", init: str = "he_normal",
                 bias: bool = True):
        super().__init__()
        k = int(kernel)
        if padding == "same":
            if k % 2 == 0:
                raise ModelError(f"Conv2d: 'same' padding needs an odd kernel (got {k})")
            padding = k // 2
        elif padding == "valid":
            padding = 0
        if isinstance(padding, bool) or not isinstance(padding, int) or padding < 0:
            raise ModelError(f"Conv2d: padding must be 'same', 'valid' or an int >= 0 (got {padding!r})")
        self.padding = padding
        self.W = Parameter((int(c_out), int(c_in), k, k), init, fan_in=c_in * k * k, fan_out=c_out * k * k)
        self.b = Parameter((int(c_out),), "zeros") if bias else None

    def forward(self, x: Any) -> Tensor:
        return nn.conv2d(x, self.W, self.b, self.padding)


class LayerNorm(Module):
    """Layer normalization over the last axis (``width``), with a scale ``g`` and a shift ``b``."""

    kind = "norm"

    def __init__(self, width: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.g = Parameter((int(width),), "ones")
        self.b = Parameter((int(width),), "zeros")

    def forward(self, x: Any) -> Tensor:
        return nn.layer_norm(x, self.g, self.b, self.eps)


class BatchNorm(Module):
    """Batch normalization per channel (axis 1) of (B, C) or (B, C, H, W), with a scale ``g`` and a shift ``b``
    (Ioffe & Szegedy, 2015): in training with the batch's statistics, which move the running ones by ``momentum``;
    in evaluation with the running ones, ``mean`` and ``var``, state variables that travel with the weights."""

    kind = "bn"

    def __init__(self, channels: int, momentum: float = 0.1, eps: float = 1e-5):
        super().__init__()
        if not 0 < momentum <= 1:
            raise ModelError(f"BatchNorm: momentum must be in (0, 1], got {momentum}")
        self.momentum, self.eps = momentum, eps
        self.g = Parameter((int(channels),), "ones")
        self.b = Parameter((int(channels),), "zeros")
        self.mean = State((int(channels),), "zeros")
        self.var = State((int(channels),), "ones")

    def forward(self, x: Any) -> Tensor:
        if not self.training:
            return nn.batch_norm(x, self.g, self.b, self.mean, self.var, False, eps=self.eps)
        mean, var = self.mean.copy(), self.var.copy()  # moved here, never in the pulled weights
        out = nn.batch_norm(x, self.g, self.b, mean, var, True, self.momentum, self.eps)
        self.move("mean", mean)
        self.move("var", var)
        return out


class Dropout(Module):
    """Each entry zeroed with probability ``rate`` in training, the others scaled by 1 / (1 - rate); nothing in
    evaluation.  Each step draws new masks (:meth:`Module.draw`), so a network with one is never captured as a CUDA
    graph, which would replay one mask."""

    kind = "dropout"

    def __init__(self, rate: float):
        super().__init__()
        if not 0 <= rate < 1:
            raise ModelError(f"Dropout: rate must be in [0, 1), got {rate}")
        self.rate = float(rate)
        self.random = self.rate > 0  # its network's steps draw random numbers (Network.random_step)

    def forward(self, x: Any) -> Any:
        return nn.dropout(x, self.rate, self.draw(), self.training)


class Function(Module):
    """A module without parameters: ``fn(x)`` (a ReLU, a flattening, a pooling)."""

    def __init__(self, fn: Callable[[Any], Any], kind: str):
        super().__init__()
        self.fn, self.kind = fn, kind

    def forward(self, x: Any) -> Any:
        return self.fn(x)


def ReLU() -> Function:  # noqa: N802 - built like a module class
    return Function(ops.relu, "relu")


def Flatten() -> Function:  # noqa: N802
    return Function(lambda x: ops.reshape(x, (x.shape[0], -1)), "flatten")


def MaxPool2d(size: int = 2) -> Function:  # noqa: N802
    return Function(lambda x: nn.max_pool2d(x, size), "pool")


def AvgPool2d(size: int = 2) -> Function:  # noqa: N802
    return Function(lambda x: nn.avg_pool2d(x, size), "pool")
