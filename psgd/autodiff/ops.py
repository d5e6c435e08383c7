"""The differentiable operations on arrays: each forward beside its vector-Jacobian rule (the gradient of the
output in, one gradient per input out), written once against the array module of its inputs (NumPy or CuPy).

Broadcasting is undone in the rules (:func:`~psgd.autodiff.tensor.unbroadcast`), as HIPS autograd does.  An input
may be a :class:`~psgd.autodiff.tensor.Tensor`, an array or a number; only tensors receive gradients.  A rule keeps
only what it needs: the output where the gradient is a function of it (exp, tanh, sigmoid, sqrt, relu), the inputs
where not.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any

import numpy as np

from psgd.autodiff.tensor import Part, Tensor, array_module, data_of, make, unbroadcast
from psgd.compute import kernels
from psgd.compute.backend import get_array_module, scatter_add

__all__ = [
    "add",
    "sub",
    "mul",
    "div",
    "power",
    "neg",
    "matmul",
    "sum",
    "mean",
    "max",
    "reshape",
    "transpose",
    "concatenate",
    "pad",
    "stack",
    "getitem",
    "take",
    "where",
    "maximum",
    "exp",
    "log",
    "sqrt",
    "abs",
    "tanh",
    "sigmoid",
    "relu",
    "softplus",
    "gelu",
]


def _shape(x: Any) -> tuple[int, ...]:
    return tuple(getattr(data_of(x), "shape", ()))


_xp = array_module


# -- arithmetic, with broadcasting ---------------------------------------------------------------------------------
def add(a: Any, b: Any) -> Tensor:
    sa, sb = _shape(a), _shape(b)
    return make(data_of(a) + data_of(b), (a, b), lambda g: (unbroadcast(g, sa), unbroadcast(g, sb)), "add")


def sub(a: Any, b: Any) -> Tensor:
    sa, sb = _shape(a), _shape(b)
    return make(data_of(a) - data_of(b), (a, b), lambda g: (unbroadcast(g, sa), unbroadcast(-g, sb)), "sub")


def mul(a: Any, b: Any) -> Tensor:
    A, B = data_of(a), data_of(b)
    return make(A * B, (a, b), lambda g: (unbroadcast(g * B, _shape(a)), unbroadcast(g * A, _shape(b))), "mul")


def div(a: Any, b: Any) -> Tensor:
    A, B = data_of(a), data_of(b)
    out = A / B
    return make(out, (a, b), lambda g: (unbroadcast(g / B, _shape(a)), unbroadcast(-g * out / B, _shape(b))), "div")


def power(a: Any, p: Any) -> Tensor:
    """``a ** p``; the gradient with respect to a tensor exponent is ``a ** p * log(a)`` (``a`` > 0 there)."""
    A, P = data_of(a), data_of(p)
    out = A**P

    def rule(g):
        ga = unbroadcast(g * P * A ** (P - 1), _shape(a)) if isinstance(a, Tensor) else None
        gp = unbroadcast(g * out * _xp(a).log(A), _shape(p)) if isinstance(p, Tensor) else None
        return ga, gp

    return make(out, (a, p), rule, "power")


def neg(a: Any) -> Tensor:
    return make(-data_of(a), (a,), lambda g: (-g,), "neg")


def matmul(a: Any, b: Any) -> Tensor:
    """``a @ b`` as NumPy's matmul: vectors, matrices, and stacks of matrices broadcast over their leading axes (the
    products of matrices and 3-D stacks :func:`psgd.compute.kernels.matmul`'s, so that a GPU step can be captured)."""
    A, B = data_of(a), data_of(b)
    out = kernels.matmul(A, B) if A.ndim > 1 and B.ndim > 1 else A @ B

    def rule(g):
        if A.ndim == 2 and B.ndim == 2:
            return (
                kernels.matmul(g, B.T) if isinstance(a, Tensor) else None,
                kernels.matmul(A.T, g) if isinstance(b, Tensor) else None,
            )
        xp = get_array_module(g)
        a2 = A[None, :] if A.ndim == 1 else A  # a vector is a row on the left, a column on the right
        b2 = B[:, None] if B.ndim == 1 else B
        g2 = g
        if A.ndim == 1:
            g2 = xp.expand_dims(g2, -2)
        if B.ndim == 1:
            g2 = xp.expand_dims(g2, -1)
        ga = (
            unbroadcast(kernels.matmul(g2, xp.swapaxes(b2, -1, -2)), a2.shape).reshape(A.shape)
            if isinstance(a, Tensor)
            else None
        )
        gb = (
            unbroadcast(kernels.matmul(xp.swapaxes(a2, -1, -2), g2), b2.shape).reshape(B.shape)
            if isinstance(b, Tensor)
            else None
        )
        return ga, gb

    return make(out, (a, b), rule, "matmul")


# -- reductions ----------------------------------------------------------------------------------------------------
def _axes(axis: Any, ndim: int) -> tuple[int, ...]:
    if axis is None:
        return tuple(range(ndim))
    return tuple(sorted(a % ndim for a in (axis if isinstance(axis, (tuple, list)) else (axis,))))


def _spread(g: Any, shape: tuple[int, ...], axes: tuple[int, ...], keepdims: bool) -> Any:
    """A reduction's output gradient ``g`` back over the input's ``shape``."""
    if not keepdims:
        g = g.reshape([1 if i in axes else n for i, n in enumerate(shape)])
    return get_array_module(g).broadcast_to(g, shape)


def sum(a: Any, axis: Any = None, keepdims: bool = False) -> Tensor:  # noqa: A001 - the array method's name
    A = data_of(a)
    axes = _axes(axis, A.ndim)
    return make(A.sum(axis=axes, keepdims=keepdims), (a,), lambda g: (_spread(g, A.shape, axes, keepdims),), "sum")


def mean(a: Any, axis: Any = None, keepdims: bool = False) -> Tensor:
    A = data_of(a)
    axes = _axes(axis, A.ndim)
    count = math.prod(A.shape[i] for i in axes)
    return make(
        A.mean(axis=axes, keepdims=keepdims), (a,), lambda g: (_spread(g / count, A.shape, axes, keepdims),), "mean"
    )


def max(a: Any, axis: Any = None, keepdims: bool = False) -> Tensor:  # noqa: A001
    """The largest values over ``axis``; the gradient is shared equally by the entries that tie for it."""
    A = data_of(a)
    axes = _axes(axis, A.ndim)
    top = A.max(axis=axes, keepdims=True)

    def rule(g):
        winners = (A == top).astype(A.dtype)
        return (_spread(g, A.shape, axes, keepdims) * winners / winners.sum(axis=axes, keepdims=True),)

    return make(
        top if keepdims else top.reshape([n for i, n in enumerate(A.shape) if i not in axes]), (a,), rule, "max"
    )


# -- shapes and indexing -------------------------------------------------------------------------------------------
def reshape(a: Any, shape: Any) -> Tensor:
    A = data_of(a)
    return make(A.reshape(shape), (a,), lambda g: (g.reshape(A.shape),), "reshape")


def transpose(a: Any, axes: Sequence[int] | None = None) -> Tensor:
    A = data_of(a)
    order = tuple(range(A.ndim))[::-1] if axes is None else tuple(a % A.ndim for a in axes)
    back = tuple(order.index(i) for i in range(len(order)))
    return make(A.transpose(order), (a,), lambda g: (g.transpose(back),), "transpose")


def concatenate(xs: Sequence[Any], axis: int = 0) -> Tensor:
    arrays = [data_of(x) for x in xs]
    xp = get_array_module(*arrays)
    out = xp.concatenate(arrays, axis=axis)
    cuts = [0]
    for a in arrays:
        cuts.append(cuts[-1] + a.shape[axis])

    def rule(g):
        index = [slice(None)] * g.ndim
        parts = []
        for lo, hi in zip(cuts, cuts[1:]):
            index[axis] = slice(lo, hi)
            parts.append(g[tuple(index)])
        return parts

    return make(out, tuple(xs), rule, "concatenate")


def pad(a: Any, widths: Any, value: float = 0.0) -> Tensor:
    """``a`` with ``value`` added before and after each axis, as NumPy's constant ``pad``: ``widths`` is one
    ``(before, after)`` per axis, or one pair (or one number) for every axis.  Its gradient is a slice (a view) of the
    output's."""
    A = data_of(a)
    xp = get_array_module(A)
    spans = [
        (int(before), int(after))
        for before, after in np.broadcast_to(np.asarray(widths, dtype=np.int64), (A.ndim, 2)).tolist()
    ]
    if any(before < 0 or after < 0 for before, after in spans):
        raise ValueError(f"pad: widths must be >= 0, got {widths!r}")
    inner = tuple(slice(before, before + n) for (before, _), n in zip(spans, A.shape))
    return make(xp.pad(A, spans, constant_values=value), (a,), lambda g: (g[inner],), "pad")


def stack(xs: Sequence[Any], axis: int = 0) -> Tensor:
    arrays = [data_of(x) for x in xs]
    out = get_array_module(*arrays).stack(arrays, axis=axis)
    before = (slice(None),) * (axis % out.ndim)
    return make(out, tuple(xs), lambda g: [g[before + (i,)] for i in range(len(arrays))], "stack")  # views


def _basic(index: Any) -> bool:
    """Whether ``index`` is basic indexing (integers, slices, ``...``, None): each entry taken at most once."""
    for i in index if type(index) is tuple else (index,):
        if not (
            i is None
            or i is Ellipsis
            or type(i) is slice
            or (isinstance(i, numbers.Integral) and not isinstance(i, bool))
        ):
            return False
    return True


def getitem(a: Any, index: Any) -> Tensor:
    """``a[index]``: slices, integers, and integer arrays (a gather: each row's gradient is the sum over every place
    it was taken to).  By slices and integers the gradient is added into the input's in place
    (:class:`~psgd.autodiff.tensor.Part`); only a gather scatters."""
    A = data_of(a)
    index = tuple(data_of(i) for i in index) if isinstance(index, tuple) else data_of(index)
    if _basic(index):
        return make(A[index], (a,), lambda g: (Part(A.shape, A.dtype, index, g),), "getitem")

    def rule(g):
        out = get_array_module(g).zeros_like(A)
        scatter_add(out, index, g)
        return (out,)

    return make(A[index], (a,), rule, "getitem")


def take(a: Any, indices: Any, axis: int = 0) -> Tensor:
    """The entries ``indices`` (integers, any shape) along ``axis``: a gather."""
    at = axis % data_of(a).ndim
    return getitem(a, (slice(None),) * at + (indices,))


def where(condition: Any, a: Any, b: Any) -> Tensor:
    """``a`` where ``condition`` holds, else ``b`` (the condition takes no gradient)."""
    C = data_of(condition)
    xp = _xp(a, b, condition)
    zero = xp.zeros((), dtype=xp.result_type(data_of(a), data_of(b)))
    return make(
        xp.where(C, data_of(a), data_of(b)),
        (a, b),
        lambda g: (unbroadcast(xp.where(C, g, zero), _shape(a)), unbroadcast(xp.where(C, zero, g), _shape(b))),
        "where",
    )


def maximum(a: Any, b: Any) -> Tensor:
    """The larger of ``a`` and ``b``; on a tie the gradient goes to ``a``."""
    A, B = data_of(a), data_of(b)
    first = A >= B
    return make(
        _xp(a, b).maximum(A, B),
        (a, b),
        lambda g: (unbroadcast(g * first, _shape(a)), unbroadcast(g * ~first, _shape(b))),
        "maximum",
    )


# -- elementwise functions -----------------------------------------------------------------------------------------
def exp(a: Any) -> Tensor:
    out = _xp(a).exp(data_of(a))
    return make(out, (a,), lambda g: (g * out,), "exp")


def log(a: Any) -> Tensor:
    A = data_of(a)
    return make(_xp(a).log(A), (a,), lambda g: (g / A,), "log")


def sqrt(a: Any) -> Tensor:
    out = _xp(a).sqrt(data_of(a))
    return make(out, (a,), lambda g: (g / (2 * out),), "sqrt")


def abs(a: Any) -> Tensor:  # noqa: A001
    A = data_of(a)
    xp = _xp(a)
    return make(xp.abs(A), (a,), lambda g: (g * xp.sign(A),), "abs")


def tanh(a: Any) -> Tensor:
    out = _xp(a).tanh(data_of(a))
    return make(out, (a,), lambda g: (g * (1 - out * out),), "tanh")


def sigmoid(a: Any) -> Tensor:
    A = data_of(a)
    xp = _xp(a)
    out = 0.5 * (xp.tanh(0.5 * A) + 1)  # no overflow for large |a|
    return make(out, (a,), lambda g: (g * out * (1 - out),), "sigmoid")


def relu(a: Any) -> Tensor:
    out = kernels.relu(data_of(a))
    return make(out, (a,), lambda g: (kernels.relu_grad(g, out),), "relu")


def softplus(a: Any) -> Tensor:
    """``log(1 + exp(a))``, without overflow; its gradient is the sigmoid."""
    A = data_of(a)
    xp = _xp(a)
    out = xp.maximum(A, 0) + xp.log1p(xp.exp(-xp.abs(A)))
    return make(out, (a,), lambda g: (g * 0.5 * (xp.tanh(0.5 * A) + 1),), "softplus")


_GELU_C = math.sqrt(2.0 / math.pi)


def gelu(a: Any) -> Tensor:
    """GELU in its tanh form (Hendrycks & Gimpel, 2016), as GPT-2 and BERT use it:
    ``0.5 a (1 + tanh(sqrt(2/pi) (a + 0.044715 a^3)))``."""
    A = data_of(a)
    xp = _xp(a)
    t = xp.tanh(_GELU_C * (A + 0.044715 * A**3))
    out = 0.5 * A * (1 + t)

    def rule(g):
        return (g * (0.5 * (1 + t) + 0.5 * A * (1 - t * t) * _GELU_C * (1 + 3 * 0.044715 * A * A)),)

    return make(out, (a,), rule, "gelu")


# -- a tensor's operators ------------------------------------------------------------------------------------------
def _reshape(self: Tensor, *shape: Any) -> Tensor:
    return reshape(self, shape[0] if len(shape) == 1 else shape)


def _transpose(self: Tensor, *axes: Any) -> Tensor:
    return transpose(self, axes[0] if len(axes) == 1 else (axes or None))


for _name, _method in {
    "__add__": add,
    "__radd__": lambda a, b: add(b, a),
    "__sub__": sub,
    "__rsub__": lambda a, b: sub(b, a),
    "__mul__": mul,
    "__rmul__": lambda a, b: mul(b, a),
    "__truediv__": div,
    "__rtruediv__": lambda a, b: div(b, a),
    "__pow__": power,
    "__neg__": neg,
    "__matmul__": matmul,
    "__rmatmul__": lambda a, b: matmul(b, a),
    "__getitem__": getitem,
    "T": property(transpose),
    "sum": sum,
    "mean": mean,
    "max": max,
    "reshape": _reshape,
    "transpose": _transpose,
}.items():
    setattr(Tensor, _name, _method)
