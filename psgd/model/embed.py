"""``embed``: categorical ids looked up in an embedding table, beside dense features, into an MLP.

An example is the ids of its categorical fields (the dataset's ``id_shape``, one per field, int64 of any range:
hashed feature values) and the dense features the dataset's ``input_shape`` describes.  Each id's row of the table ``emb`` (``dim`` values,
made the first time the id is used) is looked up; the rows are joined (``combine = "concat"``, a vector per
field) or pooled over the fields (``"sum"`` or ``"mean"``, one vector for all), put beside the dense features,
and an MLP of ``hidden`` widths (ReLU) maps them to the class scores.  The batch's rows arrive in ``params["emb"]``
as :class:`~psgd.model.table.Rows` (the training loop gathers them: :meth:`Embed.lookups` says which), and the
table's gradient leaves as ``Rows`` too, one summed gradient per distinct row.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping

import numpy as np

from psgd.model.base import BaseModel, VarSpec
from psgd.model.errors import ModelError
from psgd.model.layers import Dense, Layer, ReLU, Sequential
from psgd.model.losses import mean_squared_error, softmax_cross_entropy
from psgd.model.nets import LOSSES, _positive_int, _positive_ints
from psgd.model.table import Rows, TableSpec
from psgd.xp import get_array_module, scatter_add

COMBINE = ("concat", "sum", "mean")
TABLE = "emb"


class Embed(BaseModel):
    name = "embed"
    OPTIONS = ("dim", "hidden", "combine", "scale")

    def __init__(self, input_shape: Any, num_classes: int, dtype: str = "float32", loss: str = "cross_entropy",
                 id_shape: Any = None, dim: Any = 16, hidden: Any = (64,), combine: str = "concat",
                 scale: Any = 0.01, **unknown: Any) -> None:
        if unknown:
            bad = ", ".join(repr(k) for k in sorted(unknown))
            raise ModelError(f"{self.name}: unknown option(s) {bad} (options: {', '.join(('loss',) + self.OPTIONS)})")
        shape = (input_shape,) if isinstance(input_shape, (int, np.integer)) else tuple(input_shape)
        self.dense_dim = math.prod(_positive_int(self.name, "input_shape", d) for d in shape) if shape else 0
        self.num_classes = _positive_int(self.name, "num_classes", num_classes)
        if id_shape is None or len(tuple(id_shape)) != 1:
            raise ModelError(f"{self.name}: needs a dataset with one id per categorical field (such as clicks), "
                             f"got id_shape {id_shape!r}")
        self.fields = _positive_int(self.name, "id_shape", tuple(id_shape)[0])
        self.dim = _positive_int(self.name, "dim", dim)
        self.hidden = _positive_ints(self.name, "hidden", hidden)
        if combine not in COMBINE:
            raise ModelError(f"{self.name}: option 'combine' must be one of {', '.join(COMBINE)} (got {combine!r})")
        if loss not in LOSSES:
            raise ModelError(f"{self.name}: option 'loss' must be one of {', '.join(LOSSES)} (got {loss!r})")
        if np.dtype(dtype).kind != "f":
            raise ModelError(f"{self.name}: dtype must be a float type (got {dtype!r})")
        self.dtype, self.combine, self.loss_name = np.dtype(dtype).name, combine, loss
        try:
            self.table = TableSpec(TABLE, self.dim, self.dtype, "normal", float(scale))
        except (TypeError, ValueError) as exc:
            raise ModelError(f"{self.name}: {exc}") from None
        self.looked_up = self.fields * self.dim if combine == "concat" else self.dim
        widths = (self.looked_up + self.dense_dim,) + self.hidden
        layers: list[Layer] = []
        for n_in, n_out in zip(widths, widths[1:]):
            layers += [Dense(n_in, n_out, init="he_normal"), ReLU()]
        self.net = Sequential(layers + [Dense(widths[-1], self.num_classes, init="glorot_uniform")], self.dtype)

    def specs(self) -> list[VarSpec]:
        return self.net.specs()

    def tables(self) -> list[TableSpec]:
        return [self.table]

    def lookups(self, ids: Any) -> dict[str, np.ndarray]:
        """The ids each example of a batch looks up, per table: ``ids`` is ``[B, fields]``."""
        ids = np.asarray(ids)
        if ids.ndim != 2 or ids.shape[1] != self.fields or not np.issubdtype(ids.dtype, np.integer):
            raise ModelError(f"{self.name}: expected ids of shape (B, {self.fields}) of integers, got "
                             f"{ids.shape} {ids.dtype}")
        return {TABLE: ids}

    def _inputs(self, params: Mapping[str, Any], x: Any) -> tuple[Any, Any]:
        rows = params[TABLE]
        if not isinstance(rows, Rows):
            raise ModelError(f"{self.name}: params[{TABLE!r}] must be the batch's Rows of the table")
        xp = get_array_module(rows.values)
        looked = rows.values[rows.index]  # [B, fields, dim]
        b = looked.shape[0]
        if self.combine == "concat":
            joined = looked.reshape(b, self.looked_up)
        else:
            joined = looked.sum(axis=1) if self.combine == "sum" else looked.mean(axis=1)
        dense = xp.asarray(x, dtype=self.dtype).reshape(b, -1)
        if dense.shape[1] != self.dense_dim:
            raise ModelError(f"{self.name}: expected {self.dense_dim} dense features, got {dense.shape[1]}")
        return xp.concatenate([joined, dense], axis=1), looked.shape

    def loss_and_grads(self, params: Mapping[str, Any], x: Any, y: Any,
                       on_grad: Callable[[str, Any], None] | None = None) -> tuple[Any, dict[str, Any]]:
        rows = params[TABLE]
        h, shape = self._inputs(params, x)
        out, caches = self.net.forward(params, h)
        if self.loss_name == "mse":
            loss, dout = mean_squared_error(out, y, self.num_classes)
        else:
            loss, dout = softmax_cross_entropy(out, y)
        dh, grads = self.net.backward(params, caches, dout, need_dx=True, on_grad=on_grad)
        xp = get_array_module(dh)
        d_looked = dh[:, :self.looked_up]
        if self.combine == "concat":
            d_looked = d_looked.reshape(shape)
        else:
            d_looked = xp.broadcast_to(d_looked[:, None, :] / (shape[1] if self.combine == "mean" else 1), shape)
        row_grads = xp.zeros_like(rows.values)
        scatter_add(row_grads, rows.index, d_looked)
        grads[TABLE] = rows.with_values(row_grads)
        if on_grad is not None:
            on_grad(TABLE, grads[TABLE])
        return loss, grads

    def predict(self, params: Mapping[str, Any], x: Any) -> Any:
        return self.net.forward(params, self._inputs(params, x)[0])[0]
