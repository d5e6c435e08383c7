"""The operations networks are made of, each forward beside its rule: dense layers (with the bias and a ReLU in
one kernel on a GPU), softmax and the losses, convolution by im2col, pooling, layer and batch normalization,
dropout, and the lookup of a batch's rows of an embedding table.

Images are NCHW.  Every function takes tensors, arrays or numbers, and returns a tensor
(:mod:`psgd.autodiff.tensor`).
"""

from __future__ import annotations

import itertools
import math
from typing import Any

from psgd.autodiff import ops
from psgd.autodiff.pool import avg_pool1d, avg_pool2d, max_pool1d, max_pool2d  # (nn's operations: pool.py's code)
from psgd.autodiff.tensor import Tensor, data_of, make, scaled
from psgd.compute import kernels
from psgd.compute.backend import get_array_module

__all__ = [
    "linear",
    "log_softmax",
    "softmax",
    "cross_entropy",
    "sigmoid_cross_entropy",
    "mse",
    "conv1d",
    "conv2d",
    "max_pool1d",
    "max_pool2d",
    "avg_pool1d",
    "avg_pool2d",
    "gru_cell",
    "lstm_cell",
    "attention",
    "layer_norm",
    "batch_norm",
    "dropout",
    "lookup",
]


def linear(x: Any, w: Any, b: Any = None, relu: bool = False) -> Tensor:
    """``x @ w + b`` (``x``: (B, in), ``w``: (in, out)), then a ReLU where ``relu``; on a GPU the bias and the ReLU
    are one kernel, and no gradient is computed for an ``x`` that needs none (a model's input)."""
    X = x.data if type(x) is Tensor else x
    W = w.data if type(w) is Tensor else w
    out = kernels.matmul(X, W)
    if b is not None:
        B = b.data if type(b) is Tensor else b
        if relu:
            out = kernels.bias_relu_(out, B)
        else:
            out += B
    elif relu:
        out = kernels.relu(out)

    def rule(g):
        if relu:
            g = kernels.relu_grad(g, out)
        gx = kernels.matmul(g, W.T) if isinstance(x, Tensor) and (x.requires_grad or x.node) else None
        return gx, kernels.matmul(X.T, g), (g.sum(axis=0) if b is not None else None)

    return make(out, (x, w, b), rule, "linear")


# -- softmax and the losses ----------------------------------------------------------------------------------------
def log_softmax(x: Any, axis: int = -1) -> Tensor:
    X = data_of(x)
    xp = get_array_module(X)
    z = X - X.max(axis=axis, keepdims=True)
    out = z - xp.log(xp.exp(z).sum(axis=axis, keepdims=True))
    return make(out, (x,), lambda g: (g - xp.exp(out) * g.sum(axis=axis, keepdims=True),), "log_softmax")


def softmax(x: Any, axis: int = -1) -> Tensor:
    X = data_of(x)
    xp = get_array_module(X)
    e = xp.exp(X - X.max(axis=axis, keepdims=True))
    out = e / e.sum(axis=axis, keepdims=True)
    return make(out, (x,), lambda g: (out * (g - (g * out).sum(axis=axis, keepdims=True)),), "softmax")


def cross_entropy(logits: Any, target: Any) -> Tensor:
    """The mean over the batch of softmax cross-entropy: ``target`` holds integer class labels (B,), or a
    distribution over the classes for each example (B, K: soft labels).  Logits with more axes, (B, T, ..., K),
    take a class label per position (B, T, ...): the mean is then over every position of every example."""
    Z, T = data_of(logits), data_of(target)
    xp = get_array_module(Z)
    T = xp.asarray(T)
    shape = Z.shape
    if Z.ndim > 2 and T.shape == shape[:-1]:  # a class per position: each position one row
        Z, T = Z.reshape(-1, shape[-1]), T.reshape(-1)
    batch = Z.shape[0]
    if Z.ndim != 2 or T.shape not in ((batch,), Z.shape):
        raise ValueError(
            f"cross_entropy: need logits (B, K) and labels (B,) or targets (B, K), or logits "
            f"(B, T, K) and labels (B, T), got {shape} and {T.shape}"
        )
    if T.ndim == 1:
        fused = kernels.softmax_xent(Z, T)  # on a GPU: one kernel a row, then the sum
        if fused is not None:
            loss, grad = fused
        else:
            z = Z - Z.max(axis=1, keepdims=True)
            e = xp.exp(z)
            total = e.sum(axis=1, keepdims=True)
            hot = xp.arange(Z.shape[1]) == T[:, None]  # a mask, not a gather: elementwise kernels only
            loss = (xp.log(total).sum() - (z * hot).sum()) / batch
            e /= total  # the gradient made in e: no array for each step of it
            e -= hot
            e /= batch
            grad = e
    else:
        z = Z - Z.max(axis=1, keepdims=True)
        e = xp.exp(z)
        total = e.sum(axis=1, keepdims=True)
        loss = -(T * (z - xp.log(total))).sum() / batch
        grad = (e / total * T.sum(axis=1, keepdims=True) - T) / batch
    if grad.shape != shape:
        grad = grad.reshape(shape)
    return make(loss, (logits,), lambda g: (scaled(grad, g),), "cross_entropy")


def sigmoid_cross_entropy(logits: Any, target: Any) -> Tensor:
    """Multi-label: the mean over the batch of the sum over the labels of binary cross-entropy between
    ``sigmoid(logits)`` and ``target`` (each in [0, 1], same shape), without overflow."""
    Z, T = data_of(logits), data_of(target)
    xp = get_array_module(Z)
    T = xp.asarray(T, dtype=Z.dtype)
    if T.shape != Z.shape:
        raise ValueError(f"sigmoid_cross_entropy: logits {Z.shape} and targets {T.shape} differ")
    batch = Z.shape[0]
    loss = (xp.maximum(Z, 0) - Z * T + xp.log1p(xp.exp(-xp.abs(Z)))).sum() / batch
    return make(loss, (logits,), lambda g: ((0.5 * (xp.tanh(0.5 * Z) + 1) - T) * (g / batch),), "sigmoid_cross_entropy")


def mse(outputs: Any, targets: Any, num_classes: int | None = None) -> Tensor:
    """The mean over the batch of ``sum (outputs - targets)**2``; integer ``targets`` (B,) are class labels, made
    one-hot rows of ``num_classes`` (default: the outputs' width)."""
    O = data_of(outputs)  # noqa: E741
    xp = get_array_module(O)
    T = xp.asarray(data_of(targets))
    batch = O.shape[0]
    if T.ndim == 1 and T.dtype.kind in "iu":
        T = (xp.arange(num_classes or O.shape[-1]) == T[:, None]).astype(O.dtype)
    if T.shape != O.shape:
        raise ValueError(f"mse: outputs {O.shape} and targets {T.shape} differ")
    diff = O - T.astype(O.dtype, copy=False)
    return make((diff * diff).sum() / batch, (outputs,), lambda g: (scaled(diff * (2.0 / batch), g),), "mse")


# -- convolution and pooling ---------------------------------------------------------------------------------------
def conv1d(
    x: Any, w: Any, b: Any = None, stride: int = 1, padding: int = 0, dilation: int = 1, groups: int = 1
) -> Tensor:
    """1-D cross-correlation: ``x`` (B, C, L), ``w`` (O, C // groups, k), ``b`` (O,); ``padding`` zeros each side,
    taps ``dilation`` apart, every ``stride``-th position, the channels in ``groups`` of their own (as PyTorch's
    ``conv1d``).  By strided windows and one matmul each way (see :func:`conv2d`)."""
    return _convolution(x, w, b, stride, padding, dilation, groups, "conv1d")


def conv2d(
    x: Any, w: Any, b: Any = None, padding: int = 0, stride: int = 1, dilation: int = 1, groups: int = 1
) -> Tensor:
    """2-D cross-correlation: ``x`` (B, C, H, W), ``w`` (O, C // groups, kh, kw), ``b`` (O,); ``padding`` zeros each
    side, taps ``dilation`` apart, every ``stride``-th position, the channels in ``groups``.  Every window is one
    copy of a strided view (im2col), and each way is one matmul (:func:`psgd.compute.kernels.matmul`'s, so that on
    a GPU the step can be captured as a CUDA graph); col2im adds each tap's slice back, one strided addition a tap
    (cheaper than the windows of the output's gradient, whose rows are as short as an image's)."""
    return _convolution(x, w, b, stride, padding, dilation, groups, "conv2d")


def _convolution(x: Any, w: Any, b: Any, stride: int, padding: int, dilation: int, groups: int, name: str) -> Tensor:
    X, W = data_of(x), data_of(w)
    xp = get_array_module(X)
    nd = X.ndim - 2
    s, p, d, groups = int(stride), int(padding), int(dilation), int(groups)
    if W.ndim != X.ndim or nd < 1:
        raise ValueError(f"{name}: input {X.shape} and weights {W.shape} do not fit")
    n, c, size = X.shape[0], X.shape[1], X.shape[2:]
    o, k = W.shape[0], W.shape[2:]
    if s < 1 or d < 1 or p < 0 or groups < 1 or c % groups or o % groups or W.shape[1] != c // groups:
        raise ValueError(
            f"{name}: input {X.shape}, weights {W.shape}, stride {s}, padding {p}, dilation {d} and "
            f"groups {groups} do not fit"
        )
    out = tuple((size[i] + 2 * p - d * (k[i] - 1) - 1) // s + 1 for i in range(nd))
    if min(out) < 1:
        raise ValueError(f"{name}: input {size} with padding {p} is smaller than the kernel {k} at dilation {d}")
    xpad = xp.pad(X, ((0, 0), (0, 0)) + ((p, p),) * nd) if p else X
    cols = _windows(xpad, k, d, s, out, groups)  # (B, G, C/G * K, positions)
    og = o // groups
    w3 = W.reshape(groups, og, -1)
    y = (kernels.matmul(w3[0], cols[:, 0]) if groups == 1 else xp.matmul(w3, cols)).reshape((n, o) + out)
    if b is not None:
        y += data_of(b).reshape((1, -1) + (1,) * nd)

    def rule(g):
        g4 = g.reshape(n, groups, og, -1)
        if groups == 1:
            gw = kernels.matmul(g4[:, 0], cols[:, 0].transpose(0, 2, 1)).sum(axis=0)
        else:
            gw = xp.matmul(g4, cols.transpose(0, 1, 3, 2)).sum(axis=0)
        gb = g4.sum(axis=(0, 3)).reshape(-1) if b is not None else None
        if not (isinstance(x, Tensor) and (x.requires_grad or x.node)):
            return None, gw.reshape(W.shape), gb
        gcols = kernels.matmul(w3[0].T, g4[:, 0]) if groups == 1 else xp.matmul(w3.transpose(0, 2, 1), g4)
        gcols = gcols.reshape((n, c) + tuple(k) + out)
        # col2im: each tap's slice of every window added back where it was taken from, one strided addition a tap
        gpad = xp.zeros((n, c) + tuple(m + 2 * p for m in size), dtype=g.dtype)
        for tap in itertools.product(*(range(m) for m in k)):
            gpad[
                (slice(None), slice(None)) + tuple(slice(t * d, t * d + s * (m - 1) + 1, s) for t, m in zip(tap, out))
            ] += gcols[(slice(None), slice(None)) + tap]
        gx = gpad[(slice(None), slice(None)) + tuple(slice(p, p + m) for m in size)] if p else gpad
        return gx, gw.reshape(W.shape), gb

    return make(y, (x, w, b), rule, name)


def _windows(A: Any, k: tuple[int, ...], dilation: int, stride: int, out: tuple[int, ...], groups: int) -> Any:
    """im2col: every window of ``A`` (B, C, ...) with ``k`` taps ``dilation`` apart, ``stride`` apart, one copy of
    a strided view, (B, groups, C / groups * prod(k), prod(out))."""
    n, c = A.shape[:2]
    step = A.strides[2:]
    view = get_array_module(A).lib.stride_tricks.as_strided(
        A,
        (n, groups, c // groups) + tuple(k) + tuple(out),
        A.strides[:1]
        + (c // groups * A.strides[1], A.strides[1])
        + tuple(t * dilation for t in step)
        + tuple(t * stride for t in step),
    )
    return view.reshape(n, groups, -1, math.prod(out))


# -- recurrent cells and attention -----------------------------------------------------------------------------------
def _gates(X: Any, H: Any, W_ih: Any, W_hh: Any, b_ih: Any, b_hh: Any) -> tuple[Any, Any]:
    """``x @ w_ih + b_ih`` and ``h @ w_hh + b_hh`` (a missing bias: none)."""
    gi = kernels.matmul(X, W_ih)
    gh = kernels.matmul(H, W_hh)
    if b_ih is not None:
        gi += data_of(b_ih)
    if b_hh is not None:
        gh += data_of(b_hh)
    return gi, gh


def _cell_grads(
    da: Any, dgh: Any, x: Any, h: Any, X: Any, H: Any, W_ih: Any, W_hh: Any, b_ih: Any, b_hh: Any
) -> tuple[Any, ...]:
    """The gradients of a cell's x, h, w_ih, w_hh, b_ih, b_hh from those of its two products' outputs."""
    gx = kernels.matmul(da, W_ih.T) if isinstance(x, Tensor) else None
    gh = kernels.matmul(dgh, W_hh.T) if isinstance(h, Tensor) else None
    return (
        gx,
        gh,
        kernels.matmul(X.T, da),
        kernels.matmul(H.T, dgh),
        da.sum(axis=0) if b_ih is not None else None,
        dgh.sum(axis=0) if b_hh is not None else None,
    )


def gru_cell(x: Any, h: Any, w_ih: Any, w_hh: Any, b_ih: Any = None, b_hh: Any = None) -> Tensor:
    """One step of a GRU (Cho et al., 2014, as PyTorch's ``GRUCell``): ``x`` (B, in), ``h`` (B, H), ``w_ih``
    (in, 3H), ``w_hh`` (H, 3H), ``b_ih`` and ``b_hh`` (3H,), the gates in the order reset, update, new:
    ``r = sigmoid(.. r), z = sigmoid(.. z), n = tanh(xn + r * hn), h' = (1 - z) * n + z * h``.  One node, its rule
    written out: two matmuls forward, four back."""
    X, H, W_ih, W_hh = data_of(x), data_of(h), data_of(w_ih), data_of(w_hh)
    xp = get_array_module(X)
    gi, gh = _gates(X, H, W_ih, W_hh, b_ih, b_hh)
    size = H.shape[-1]
    rz = gi[:, : 2 * size] + gh[:, : 2 * size]
    rz = 0.5 * (xp.tanh(0.5 * rz) + 1)  # the sigmoid, without overflow
    r, z = rz[:, :size], rz[:, size:]
    hn = gh[:, 2 * size :]
    n = xp.tanh(gi[:, 2 * size :] + r * hn)
    out = n + z * (H - n)

    def rule(g):
        da = xp.empty_like(gi)
        dn = g * (1 - z) * (1 - n * n)  # at n's input
        da[:, :size] = dn * hn * r * (1 - r)
        da[:, size : 2 * size] = g * (H - n) * z * (1 - z)
        da[:, 2 * size :] = dn
        dgh = da.copy()
        dgh[:, 2 * size :] *= r
        grads = _cell_grads(da, dgh, x, h, X, H, W_ih, W_hh, b_ih, b_hh)
        if grads[1] is not None:
            grads[1][...] += g * z
        return grads

    return make(out, (x, h, w_ih, w_hh, b_ih, b_hh), rule, "gru_cell")


def lstm_cell(
    x: Any, h: Any, c: Any, w_ih: Any, w_hh: Any, b_ih: Any = None, b_hh: Any = None
) -> tuple[Tensor, Tensor]:
    """One step of an LSTM (Hochreiter & Schmidhuber, 1997, as PyTorch's ``LSTMCell``): ``x`` (B, in), the state
    ``h`` and ``c`` (B, H), ``w_ih`` (in, 4H), ``w_hh`` (H, 4H), ``b_ih`` and ``b_hh`` (4H,), the gates in the order
    input, forget, cell, output: ``c' = f * c + i * g, h' = o * tanh(c')``.  Returns ``(h', c')``, views of one
    node whose rule is written out."""
    X, H, C, W_ih, W_hh = data_of(x), data_of(h), data_of(c), data_of(w_ih), data_of(w_hh)
    xp = get_array_module(X)
    gi, gh = _gates(X, H, W_ih, W_hh, b_ih, b_hh)
    size = H.shape[-1]
    a = gi + gh
    a[:, 2 * size : 3 * size] = xp.tanh(a[:, 2 * size : 3 * size])
    for lo, hi in ((0, 2 * size), (3 * size, 4 * size)):
        a[:, lo:hi] = 0.5 * (xp.tanh(0.5 * a[:, lo:hi]) + 1)
    i, f, gg, o = (a[:, k * size : (k + 1) * size] for k in range(4))
    state = xp.empty((2,) + H.shape, dtype=a.dtype)
    state[1] = f * C + i * gg
    tc = xp.tanh(state[1])
    state[0] = o * tc

    def rule(g):
        dh, dc = g[0], g[1]
        dc = dc + dh * o * (1 - tc * tc)
        da = xp.empty_like(a)
        da[:, :size] = dc * gg * i * (1 - i)
        da[:, size : 2 * size] = dc * C * f * (1 - f)
        da[:, 2 * size : 3 * size] = dc * i * (1 - gg * gg)
        da[:, 3 * size :] = dh * tc * o * (1 - o)
        gx, gh_, gw_ih, gw_hh, gb_ih, gb_hh = _cell_grads(da, da, x, h, X, H, W_ih, W_hh, b_ih, b_hh)
        return gx, gh_, dc * f if isinstance(c, Tensor) else None, gw_ih, gw_hh, gb_ih, gb_hh

    both = make(state, (x, h, c, w_ih, w_hh, b_ih, b_hh), rule, "lstm_cell")
    return ops.getitem(both, 0), ops.getitem(both, 1)


def attention(q: Any, k: Any, v: Any, causal: bool = False) -> Tensor:
    """Scaled dot-product attention (Vaswani et al., 2017): ``softmax(q @ k^T / sqrt(d)) @ v`` over the last two
    axes, ``q`` (..., Tq, d), ``k`` (..., Tk, d), ``v`` (..., Tk, dv); ``causal``: query i sees keys up to i
    only (Tq == Tk)."""
    Q, K = data_of(q), data_of(k)
    scores = ops.mul(
        ops.matmul(q, ops.transpose(k, tuple(range(K.ndim - 2)) + (K.ndim - 1, K.ndim - 2))),
        1.0 / math.sqrt(Q.shape[-1]),
    )
    if causal:
        tq, tk = Q.shape[-2], K.shape[-2]
        if tq != tk:
            raise ValueError(f"attention: a causal mask needs as many queries as keys, got {tq} and {tk}")
        xp = get_array_module(Q)
        scores = ops.where(xp.tril(xp.ones((tq, tk), dtype=bool)), scores, -math.inf)
    return ops.matmul(softmax(scores, axis=-1), v)


# -- normalization, dropout, lookups -------------------------------------------------------------------------------
def _normalize(x: Any, axes: tuple[int, ...], stats: tuple[Any, Any] | None, eps: float) -> tuple[Tensor, Any, Any]:
    """``((x - mean) / sqrt(var + eps), mean, var)``: the statistics over ``axes`` of ``x`` itself where ``stats`` is
    None (they depend on ``x``, and the rule says how: training), else ``stats`` (constants: evaluation)."""
    X = data_of(x)
    xp = get_array_module(X)
    mean, var = (X.mean(axis=axes, keepdims=True), X.var(axis=axes, keepdims=True)) if stats is None else stats
    inv = 1.0 / xp.sqrt(var + eps)
    out = (X - mean) * inv

    def rule(g):
        if stats is not None:
            return (g * inv,)
        return ((g - g.mean(axis=axes, keepdims=True) - out * (g * out).mean(axis=axes, keepdims=True)) * inv,)

    return make(out, (x,), rule, "normalize"), mean, var


def layer_norm(x: Any, gamma: Any, beta: Any, eps: float = 1e-5) -> Tensor:
    """Each example normalized over its last axis, then scaled by ``gamma`` and shifted by ``beta`` (both of the last
    axis' size): Ba, Kiros & Hinton, "Layer normalization", 2016."""
    normal, _, _ = _normalize(x, (data_of(x).ndim - 1,), None, eps)
    return ops.add(ops.mul(normal, gamma), beta)


def batch_norm(
    x: Any,
    gamma: Any,
    beta: Any,
    running_mean: Any,
    running_var: Any,
    training: bool,
    momentum: float = 0.1,
    eps: float = 1e-5,
) -> Tensor:
    """Batch normalization (Ioffe & Szegedy, 2015) of ``x`` (B, C) or (B, C, H, W) per channel C: in training with
    the batch's statistics, which also move ``running_mean`` and ``running_var`` (arrays of C, updated in place:
    ``(1 - momentum) * running + momentum * batch``, the variance unbiased, as PyTorch does); in evaluation with the
    running statistics."""
    X = data_of(x)
    axes = (0,) if X.ndim == 2 else (0, 2, 3)
    shape = (1, -1) if X.ndim == 2 else (1, -1, 1, 1)
    if training:
        normal, mean, var = _normalize(x, axes, None, eps)
        count = X.size // X.shape[1]
        running_mean *= 1 - momentum
        running_mean += momentum * mean.reshape(-1)
        running_var *= 1 - momentum
        running_var += momentum * var.reshape(-1) * (count / max(count - 1, 1))
    else:
        normal, _, _ = _normalize(x, axes, (running_mean.reshape(shape), running_var.reshape(shape)), eps)
    return ops.add(ops.mul(normal, ops.reshape(gamma, shape)), ops.reshape(beta, shape))


def dropout(x: Any, rate: float, seed: int, training: bool = True) -> Tensor | Any:
    """Each entry zeroed with probability ``rate`` and the rest scaled by ``1 / (1 - rate)`` (inverted dropout), the
    mask drawn from ``seed`` on the array's own device; ``x`` itself in evaluation or at rate 0."""
    if not training or rate == 0:
        return x
    if not 0 <= rate < 1:
        raise ValueError(f"dropout: rate must be in [0, 1), got {rate}")
    X = data_of(x)
    xp = get_array_module(X)
    keep = (xp.random.RandomState(int(seed) & 0xFFFFFFFF).random_sample(X.shape) >= rate).astype(X.dtype)
    keep *= 1.0 / (1.0 - rate)
    return ops.mul(x, keep)


def lookup(values: Any, index: Any) -> Tensor:
    """The rows ``index`` (integers, any shape: (B, fields) say) of ``values`` (rows, dim): an embedding lookup, whose
    gradient is one summed gradient per row of ``values``."""
    return ops.take(values, index, axis=0)
