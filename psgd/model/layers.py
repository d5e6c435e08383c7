"""Layers written once against ``xp`` (NumPy or CuPy), forward and backward side by side.

Every layer has ``specs(prefix, dtype)`` (its variables, named ``prefix/W``...),
``forward(params, x) -> (out, cache)`` and ``backward(params, cache, dout) ->
(dx, grads)``.  ``params`` and ``grads`` are keyed by the layer's own short
names (``W``, ``b``); :class:`Sequential` adds the prefixes.  Images are NCHW.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

from psgd import kernels
from psgd.model.base import VarSpec
from psgd.xp import get_array_module


class Layer:
    """A layer without variables; subclasses override what they need.

    A layer whose ``backward`` takes ``need_dx=False`` (and then returns ``None`` for the input's
    gradient) sets ``skips_dx``: as the first layer of a model it is spared that product, which
    training never uses.
    """

    kind = "layer"
    param_names: tuple[str, ...] = ()
    skips_dx = False

    def specs(self, prefix: str, dtype: str = "float32") -> list[VarSpec]:
        return []

    def forward(self, params: Mapping[str, Any], x: Any) -> tuple[Any, Any]:  # pragma: no cover
        raise NotImplementedError

    def backward(self, params: Mapping[str, Any], cache: Any, dout: Any) -> tuple[Any, dict[str, Any]]:  # pragma: no cover
        raise NotImplementedError


class Dense(Layer):
    """``x @ W + b`` with ``W`` of shape (in, out)."""

    kind = "dense"
    param_names = ("W", "b")

    def __init__(self, n_in: int, n_out: int, init: str = "he_normal") -> None:
        self.n_in, self.n_out, self.init = int(n_in), int(n_out), init

    def specs(self, prefix: str, dtype: str = "float32") -> list[VarSpec]:
        return [
            VarSpec(f"{prefix}/W", (self.n_in, self.n_out), dtype, self.init),
            VarSpec(f"{prefix}/b", (self.n_out,), dtype, "zeros"),
        ]

    def forward(self, params, x):
        out = kernels.matmul(x, params["W"])
        out += params["b"]
        return out, x

    def forward_relu(self, params, x):
        """This layer then a ReLU, the bias and the ReLU one kernel: ``(out, cache)``, ``out`` being the ReLU's
        output and its cache (see :class:`ReLU`)."""
        return kernels.bias_relu_(kernels.matmul(x, params["W"]), params["b"]), x

    skips_dx = True

    def backward(self, params, cache, dout, need_dx=True):
        x = cache
        dx = kernels.matmul(dout, params["W"].T) if need_dx else None
        return dx, {"W": kernels.matmul(x.T, dout), "b": dout.sum(axis=0)}


class ReLU(Layer):
    """``x * (x > 0)``; its cache is its output, positive exactly where the input was.  After a :class:`Dense`
    in a :class:`Sequential`, the dense layer's bias and this are one kernel (``Dense.forward_relu``)."""

    kind = "relu"

    def forward(self, params, x):
        out = kernels.relu(x)
        return out, out

    def backward(self, params, cache, dout):
        return kernels.relu_grad(dout, cache), {}


class Flatten(Layer):
    """(B, ...) -> (B, prod(...))."""

    kind = "flatten"

    def forward(self, params, x):
        return x.reshape(x.shape[0], -1), x.shape

    def backward(self, params, cache, dout):
        return dout.reshape(cache), {}


class Conv2D(Layer):
    """2-D convolution (cross-correlation), stride 1, zero padding, via im2col.

    ``W`` has shape (out_channels, in_channels, k, k).  ``padding`` is a
    number of pixels, ``"same"`` (k // 2, odd k only) or ``"valid"`` (0).
    im2col and col2im loop over the k*k kernel offsets with slices, which
    NumPy and CuPy both support.
    """

    kind = "conv"
    param_names = ("W", "b")

    def __init__(self, in_channels: int, out_channels: int, kernel: int = 3, padding: int | str = "same",
                 init: str = "he_normal") -> None:
        self.c_in, self.c_out, self.k, self.init = int(in_channels), int(out_channels), int(kernel), init
        if padding == "same":
            if self.k % 2 == 0:
                raise ValueError(f"Conv2D: 'same' padding needs an odd kernel (got {self.k})")
            padding = self.k // 2
        elif padding == "valid":
            padding = 0
        if isinstance(padding, bool) or not isinstance(padding, int) or padding < 0:
            raise ValueError(f"Conv2D: padding must be 'same', 'valid' or an int >= 0 (got {padding!r})")
        self.pad = padding

    def specs(self, prefix: str, dtype: str = "float32") -> list[VarSpec]:
        fan_in, fan_out = self.c_in * self.k * self.k, self.c_out * self.k * self.k
        return [
            VarSpec(f"{prefix}/W", (self.c_out, self.c_in, self.k, self.k), dtype, self.init,
                    fan_in=fan_in, fan_out=fan_out),
            VarSpec(f"{prefix}/b", (self.c_out,), dtype, "zeros"),
        ]

    def output_hw(self, h: int, w: int) -> tuple[int, int]:
        return h + 2 * self.pad - self.k + 1, w + 2 * self.pad - self.k + 1

    def _offsets(self):
        return [(i, j) for i in range(self.k) for j in range(self.k)]

    def forward(self, params, x):
        xp = get_array_module(x)
        b, c, h, w = x.shape
        ho, wo = self.output_hw(h, w)
        if ho < 1 or wo < 1:
            raise ValueError(f"Conv2D: input {h}x{w} is smaller than the {self.k}x{self.k} kernel")
        p = self.pad
        xpad = xp.pad(x, ((0, 0), (0, 0), (p, p), (p, p))) if p else x
        # im2col: (B, C, k*k, Ho, Wo) -> (B, C*k*k, Ho*Wo), in the order of W's (C, k, k) axes
        cols = xp.stack([xpad[:, :, i:i + ho, j:j + wo] for i, j in self._offsets()], axis=2)
        cols = cols.reshape(b, c * self.k * self.k, ho * wo)
        w2 = params["W"].reshape(self.c_out, -1)
        out = (w2 @ cols).reshape(b, self.c_out, ho, wo) + params["b"].reshape(1, -1, 1, 1)
        return out, (x.shape, cols)

    skips_dx = True

    def backward(self, params, cache, dout, need_dx=True):
        xp = get_array_module(dout)
        (b, c, h, w), cols = cache
        ho, wo = dout.shape[2:]
        p = self.pad
        d2 = dout.reshape(b, self.c_out, ho * wo)
        w2 = params["W"].reshape(self.c_out, -1)
        dw = xp.tensordot(d2, cols, axes=([0, 2], [0, 2])).reshape(params["W"].shape)
        db = d2.sum(axis=(0, 2))
        if not need_dx:
            return None, {"W": dw, "b": db}
        # col2im: add each kernel offset's slice back into the padded input
        dcols = (w2.T @ d2).reshape(b, c, self.k * self.k, ho, wo)
        dxpad = xp.zeros((b, c, h + 2 * p, w + 2 * p), dtype=dout.dtype)
        for n, (i, j) in enumerate(self._offsets()):
            dxpad[:, :, i:i + ho, j:j + wo] += dcols[:, :, n]
        dx = dxpad[:, :, p:p + h, p:p + w] if p else dxpad
        return dx, {"W": dw, "b": db}


class MaxPool2D(Layer):
    """2x2 max pooling with stride 2; an odd last row or column is cropped (gets no gradient)."""

    kind = "pool"

    def forward(self, params, x):
        xp = get_array_module(x)
        b, c, h, w = x.shape
        h2, w2 = h // 2, w // 2
        if h2 < 1 or w2 < 1:
            raise ValueError(f"MaxPool2D: input {h}x{w} is smaller than the 2x2 window")
        # windows: (B, C, H2, W2, 4)
        win = x[:, :, :2 * h2, :2 * w2].reshape(b, c, h2, 2, w2, 2).transpose(0, 1, 2, 4, 3, 5)
        win = win.reshape(b, c, h2, w2, 4)
        arg = win.argmax(axis=-1)
        mask = xp.arange(4) == arg[..., None]  # one winner per window, even on ties
        return win.max(axis=-1), (x.shape, mask)

    def backward(self, params, cache, dout):
        xp = get_array_module(dout)
        (b, c, h, w), mask = cache
        h2, w2 = dout.shape[2:]
        dwin = (mask * dout[..., None]).reshape(b, c, h2, w2, 2, 2).transpose(0, 1, 2, 4, 3, 5)
        dx = xp.zeros((b, c, h, w), dtype=dout.dtype)
        dx[:, :, :2 * h2, :2 * w2] = dwin.reshape(b, c, 2 * h2, 2 * w2)
        return dx, {}


class Sequential:
    """Layers in a chain; variables are named ``<kind><n>/<name>``, e.g. ``dense0/W``, ``conv1/b``."""

    def __init__(self, layers: Sequence[Layer], dtype: str = "float32") -> None:
        self.dtype = dtype
        counts: dict[str, int] = {}
        self.layers: list[tuple[str, Layer]] = []
        for layer in layers:
            n = counts.get(layer.kind, 0)
            counts[layer.kind] = n + 1
            self.layers.append((f"{layer.kind}{n}", layer))
        self.names = [s.name for s in self.specs()]
        #: positions of the ReLUs that follow a dense layer, done with it in one kernel
        self._fused = {n for n, (_, layer) in enumerate(self.layers)
                       if n and type(layer) is ReLU and type(self.layers[n - 1][1]) is Dense}

    def specs(self) -> list[VarSpec]:
        return [s for prefix, layer in self.layers for s in layer.specs(prefix, self.dtype)]

    @staticmethod
    def _local(params: Mapping[str, Any], prefix: str, layer: Layer) -> dict[str, Any]:
        return {k: params[f"{prefix}/{k}"] for k in layer.param_names}

    def forward(self, params: Mapping[str, Any], x: Any) -> tuple[Any, list[Any]]:
        caches: list[Any] = []
        for n, (prefix, layer) in enumerate(self.layers):
            if n in self._fused:  # a ReLU done with the dense layer before it: its output is its cache
                caches.append(x)
                continue
            if n + 1 in self._fused:
                x, cache = layer.forward_relu(self._local(params, prefix, layer), x)
            else:
                x, cache = layer.forward(self._local(params, prefix, layer), x)
            caches.append(cache)
        return x, caches

    def backward(self, params: Mapping[str, Any], caches: list[Any], dout: Any, need_dx: bool = True,
                 on_grad: Callable[[str, Any], None] | None = None) -> tuple[Any, dict[str, Any]]:
        """``(dx, grads)``; without ``need_dx`` the input's gradient is skipped where the first layer can
        (``dx`` is then None): training needs the variables' gradients only.  ``on_grad(name, grad)`` is
        called for each variable as soon as its layer's backward has produced it, last layer first."""
        grads: dict[str, Any] = {}
        first = self.layers[0][1]
        for (prefix, layer), cache in zip(reversed(self.layers), reversed(caches)):
            if layer is first and not need_dx and layer.skips_dx:
                dout, local = layer.backward(self._local(params, prefix, layer), cache, dout, need_dx=False)
            else:
                dout, local = layer.backward(self._local(params, prefix, layer), cache, dout)
            for k, g in local.items():
                grads[f"{prefix}/{k}"] = g
                if on_grad is not None:
                    on_grad(f"{prefix}/{k}", g)
        return dout, {name: grads[name] for name in self.names}  # in spec order
