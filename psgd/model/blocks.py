"""The modules a network is made of (:mod:`psgd.model.module` says what a module is): dense layers, convolutions,
recurrent cells and the module that runs one over a sequence, multi-head attention, layer and batch normalization,
dropout, and functions without parameters (ReLU, flattening, pooling)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from psgd.autodiff import Tensor, nn, ops
from psgd.autodiff.tensor import array_module as get_array_module
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

    def __init__(
        self,
        c_in: int,
        c_out: int,
        kernel: int = 3,
        padding: int | str = "same",
        init: str = "he_normal",
        bias: bool = True,
    ):
        super().__init__()
        k = int(kernel)
        self.padding = _padding("Conv2d", padding, k, 1, 1)
        self.W = Parameter((int(c_out), int(c_in), k, k), init, fan_in=c_in * k * k, fan_out=c_out * k * k)
        self.b = Parameter((int(c_out),), "zeros") if bias else None

    def forward(self, x: Any) -> Tensor:
        return nn.conv2d(x, self.W, self.b, self.padding)


def _padding(name: str, padding: int | str, k: int, dilation: int, stride: int) -> int:
    """A convolution's padding in positions: ``"same"`` (the output as long as the input: an odd kernel, stride 1),
    ``"valid"`` (none) or an int >= 0."""
    if padding == "same":
        if k % 2 == 0 or stride != 1:
            raise ModelError(
                f"{name}: 'same' padding needs an odd kernel and stride 1 (got kernel {k}, stride {stride})"
            )
        return dilation * (k // 2)
    if padding == "valid":
        return 0
    if isinstance(padding, bool) or not isinstance(padding, int) or padding < 0:
        raise ModelError(f"{name}: padding must be 'same', 'valid' or an int >= 0 (got {padding!r})")
    return padding


class Conv1d(Module):
    """1-D convolution over (B, C, L): ``W`` (out, in // groups, k); ``padding`` in positions, ``"same"``
    (dilation * (k // 2), odd k, stride 1) or ``"valid"`` (0); ``stride``, ``dilation`` and ``groups`` as PyTorch's
    ``Conv1d``."""

    kind = "conv"

    def __init__(
        self,
        c_in: int,
        c_out: int,
        kernel: int = 3,
        stride: int = 1,
        padding: int | str = "same",
        dilation: int = 1,
        groups: int = 1,
        init: str = "he_normal",
        bias: bool = True,
    ):
        super().__init__()
        k, groups = int(kernel), int(groups)
        if min(k, int(stride), int(dilation), groups) < 1 or c_in % groups or c_out % groups:
            raise ModelError(
                f"Conv1d: kernel, stride, dilation and groups must be positive, and groups must divide "
                f"{c_in} and {c_out} channels (got {k}, {stride}, {dilation}, {groups})"
            )
        self.stride, self.dilation, self.groups = int(stride), int(dilation), groups
        self.padding = _padding("Conv1d", padding, k, self.dilation, self.stride)
        fan = c_in // groups * k
        self.W = Parameter((int(c_out), int(c_in) // groups, k), init, fan_in=fan, fan_out=c_out // groups * k)
        self.b = Parameter((int(c_out),), "zeros") if bias else None

    def forward(self, x: Any) -> Tensor:
        return nn.conv1d(x, self.W, self.b, self.stride, self.padding, self.dilation, self.groups)


class GRUCell(Module):
    """One step of a GRU (:func:`psgd.autodiff.nn.gru_cell`): ``cell(x, h)`` -> the next ``h`` (B, hidden);
    ``w_ih`` (n_in, 3 hidden), ``w_hh`` (hidden, 3 hidden), ``b_ih`` and ``b_hh``."""

    kind = "gru"
    gates = 3

    def __init__(self, n_in: int, hidden: int, bias: bool = True, init: str = "glorot_uniform"):
        super().__init__()
        self.hidden = int(hidden)
        width = self.gates * self.hidden
        self.w_ih = Parameter((int(n_in), width), init, fan_in=int(n_in), fan_out=self.hidden)
        self.w_hh = Parameter((self.hidden, width), init, fan_in=self.hidden, fan_out=self.hidden)
        self.b_ih = Parameter((width,), "zeros") if bias else None
        self.b_hh = Parameter((width,), "zeros") if bias else None

    def initial(self, x: Any) -> Any:
        """The state before the first step of a batch like ``x``: zeros."""
        return get_array_module(x).zeros((x.shape[0], self.hidden), dtype=x.dtype)

    def forward(self, x: Any, h: Any) -> Tensor:
        return nn.gru_cell(x, h, self.w_ih, self.w_hh, self.b_ih, self.b_hh)

    def output(self, state: Any) -> Any:
        """What a step hands on as its output: ``h``."""
        return state


class LSTMCell(GRUCell):
    """One step of an LSTM (:func:`psgd.autodiff.nn.lstm_cell`): ``cell(x, (h, c))`` -> the next ``(h, c)``;
    ``w_ih`` (n_in, 4 hidden), ``w_hh`` (hidden, 4 hidden), ``b_ih`` and ``b_hh``."""

    kind = "lstm"
    gates = 4

    def initial(self, x: Any) -> Any:
        zeros = GRUCell.initial(self, x)
        return zeros, zeros

    def forward(self, x: Any, state: Any) -> tuple[Tensor, Tensor]:
        h, c = state
        return nn.lstm_cell(x, h, c, self.w_ih, self.w_hh, self.b_ih, self.b_hh)

    def output(self, state: Any) -> Any:
        return state[0]


class RNN(Module):
    """A recurrent cell (:class:`GRUCell`, :class:`LSTMCell`) run over a sequence, batch first: ``rnn(x)`` with
    ``x`` (B, T, n_in) -> every step's output ``h``, (B, T, hidden), from a zero state (or ``rnn(x, state)``); its
    variables are the cell's, ``cell/w_ih`` ...  The last step's output is ``out[:, -1]``."""

    kind = "rnn"

    def __init__(self, cell: GRUCell):
        super().__init__()
        if not isinstance(cell, GRUCell):
            raise ModelError(f"RNN: needs a GRUCell or an LSTMCell (got {type(cell).__name__})")
        self.cell = cell

    def forward(self, x: Any, state: Any = None) -> Tensor:
        cell = self.cell
        if state is None:
            state = cell.initial(x.data if isinstance(x, Tensor) else x)
        outputs = []
        for t in range(x.shape[1]):
            state = cell.forward(ops.getitem(x, (slice(None), t)), state)
            outputs.append(cell.output(state))
        return ops.stack(outputs, axis=1)


class MultiHeadAttention(Module):
    """Multi-head self-attention (Vaswani et al., 2017) over ``x`` (B, T, dim): queries, keys and values by the
    dense layers ``q``, ``k``, ``v`` (dim, dim), split into ``heads``, each attended by
    :func:`psgd.autodiff.nn.attention` (``causal``: a position sees itself and those before it only), joined, and
    projected by ``out``."""

    kind = "attention"

    def __init__(self, dim: int, heads: int, causal: bool = False, bias: bool = True):
        super().__init__()
        dim, heads = int(dim), int(heads)
        if heads < 1 or dim % heads:
            raise ModelError(f"MultiHeadAttention: heads must divide dim (got dim {dim}, heads {heads})")
        self.heads, self.causal = heads, bool(causal)
        self.q, self.k, self.v, self.out = (Linear(dim, dim, "glorot_uniform", bias) for _ in range(4))

    def forward(self, x: Any) -> Tensor:
        b, t, dim = x.shape
        flat = ops.reshape(x, (b * t, dim))

        def heads(linear: Linear) -> Tensor:  # (B, heads, T, dim / heads)
            return ops.transpose(ops.reshape(linear(flat), (b, t, self.heads, -1)), (0, 2, 1, 3))

        mixed = nn.attention(heads(self.q), heads(self.k), heads(self.v), self.causal)
        return ops.reshape(self.out(ops.reshape(ops.transpose(mixed, (0, 2, 1, 3)), (b * t, dim))), (b, t, dim))


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


def MaxPool1d(size: int = 2) -> Function:  # noqa: N802
    return Function(lambda x: nn.max_pool1d(x, size), "pool")


def AvgPool1d(size: int = 2) -> Function:  # noqa: N802
    return Function(lambda x: nn.avg_pool1d(x, size), "pool")


def MaxPool2d(size: int = 2) -> Function:  # noqa: N802
    return Function(lambda x: nn.max_pool2d(x, size), "pool")


def AvgPool2d(size: int = 2) -> Function:  # noqa: N802
    return Function(lambda x: nn.avg_pool2d(x, size), "pool")
