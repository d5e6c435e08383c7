"""Pooling over non-overlapping windows of (B, C, L) or (B, C, H, W), each forward beside its rule: one elementwise
pass over a strided view per offset in a window, no copy of the input and no reduction over a short axis (a
reshape to windows and a max over an axis of two is many times slower in NumPy).  :mod:`psgd.autodiff.nn` offers
them."""

from __future__ import annotations

import itertools
from typing import Any

from psgd.autodiff.tensor import Tensor, data_of, make
from psgd.compute.backend import get_array_module


def max_pool1d(x: Any, size: int = 2) -> Tensor:
    """The largest value of each ``size`` positions of ``x`` (B, C, L) (stride ``size``); one winner per window, the
    first."""
    return _max_pool(x, size, 1, "max_pool1d")


def max_pool2d(x: Any, size: int = 2) -> Tensor:
    """The largest value of each ``size`` x ``size`` window (stride ``size``); one winner per window, the first."""
    return _max_pool(x, size, 2, "max_pool2d")


def _max_pool(x: Any, size: int, nd: int, name: str) -> Tensor:
    X, xp, taps = _checked_taps(x, size, nd, name)
    out = taps[0][1].copy()
    for _, view in taps[1:]:
        xp.maximum(out, view, out=out)

    def rule(g):
        gx = xp.zeros(X.shape, dtype=g.dtype)
        rest = g.copy()  # what is still to go to a window's first winner
        for t, (index, view) in enumerate(taps):
            won = gx[index]  # (a view: written in place)
            xp.multiply(rest, view == out, out=won)
            if t < len(taps) - 1:
                rest -= won  # (exact: rest or 0)
        return (gx,)

    return make(out, (x,), rule, name)


def avg_pool1d(x: Any, size: int = 2) -> Tensor:
    """The mean of each ``size`` positions of ``x`` (B, C, L) (stride ``size``)."""
    return _avg_pool(x, size, 1, "avg_pool1d")


def avg_pool2d(x: Any, size: int = 2) -> Tensor:
    """The mean of each ``size`` x ``size`` window (stride ``size``)."""
    return _avg_pool(x, size, 2, "avg_pool2d")


def _avg_pool(x: Any, size: int, nd: int, name: str) -> Tensor:
    X, xp, taps = _checked_taps(x, size, nd, name)
    scale = 1.0 / size**nd
    out = taps[0][1].copy()
    for _, view in taps[1:]:
        out += view
    out *= scale

    def rule(g):
        gx = xp.zeros(X.shape, dtype=g.dtype)
        share = g * scale
        for index, _ in taps:
            gx[index] = share
        return (gx,)

    return make(out, (x,), rule, name)


def _checked_taps(x: Any, size: int, nd: int, name: str) -> tuple[Any, Any, list[tuple[Any, Any]]]:
    """The array of ``x``, its array module and its taps (:func:`_taps`), once ``x`` is checked to have ``nd``
    axes after batch and channels."""
    X = data_of(x)
    if X.ndim != nd + 2:
        raise ValueError(f"{name}: needs an input of {nd + 2} axes, got {X.shape}")
    return X, get_array_module(X), _taps(X, size)


def _taps(X: Any, size: int) -> list[tuple[Any, Any]]:
    """The offsets of non-overlapping windows of ``size`` along each axis after the first two of ``X`` (B, C, L) or
    (B, C, H, W), each ``(index, X[index])``: a strided view (B, C, L // size) or (B, C, H // size, W // size) of the
    entries at that offset in every window (a last part shorter than a window is cropped).  Pooling is one
    elementwise pass over each of these views: no copy, no reshuffle, no reduction over a short axis."""
    spatial = X.shape[2:]
    out = tuple(n // size for n in spatial)
    if min(out) < 1:
        raise ValueError(
            f"pooling: input {'x'.join(map(str, spatial))} is smaller than the "
            f"{'x'.join([str(size)] * len(spatial))} window"
        )
    taps = []
    for offset in itertools.product(range(size), repeat=len(spatial)):
        index = (slice(None), slice(None)) + tuple(slice(o, size * n, size) for o, n in zip(offset, out))
        taps.append((index, X[index]))
    return taps
