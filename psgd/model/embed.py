"""``embed``: categorical ids looked up in an embedding table, beside dense features, into an MLP.

An example is the ids of its categorical fields (the dataset's ``id_shape``, one per field, int64 of any range:
hashed feature values) and the dense features the dataset's ``input_shape`` describes.  Each id's row of the table
``emb`` (``dim`` values,
made the first time the id is used) is looked up; the rows are joined (``combine = "concat"``, a vector per
field) or pooled over the fields (``"sum"`` or ``"mean"``, one vector for all), put beside the dense features,
and an MLP of ``hidden`` widths (ReLU) maps them to the class scores.  The batch's rows arrive in ``params["emb"]``
as :class:`~psgd.model.table.Rows` (the training loop gathers them: :meth:`Embed.lookups` says which), and the
table's gradient leaves as ``Rows`` too, one summed gradient per distinct row.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from psgd.autodiff import nn, ops
from psgd.model.blocks import Linear
from psgd.model.errors import ModelError
from psgd.model.module import Network, Table, chain
from psgd.model.nets import ALLOWED, _positive_int, _positive_ints
from psgd.model.table import TableSpec

COMBINE = ("concat", "sum", "mean")
TABLE = "emb"


class Embed(Network):
    name = "embed"
    OPTIONS = ("dim", "hidden", "combine", "scale")

    def __init__(
        self,
        input_shape: Any,
        num_classes: int,
        dtype: str = "float32",
        loss: str = "cross_entropy",
        id_shape: Any = None,
        dim: Any = 16,
        hidden: Any = (64,),
        combine: str = "concat",
        scale: Any = 0.01,
        **unknown: Any,
    ) -> None:
        if unknown:
            bad = ", ".join(repr(k) for k in sorted(unknown))
            raise ModelError(f"{self.name}: unknown option(s) {bad} (options: {', '.join(('loss',) + self.OPTIONS)})")
        shape = (input_shape,) if isinstance(input_shape, (int, np.integer)) else tuple(input_shape)
        dense_dim = math.prod(_positive_int(self.name, "input_shape", d) for d in shape) if shape else 0
        classes = _positive_int(self.name, "num_classes", num_classes)
        if id_shape is None or len(tuple(id_shape)) != 1:
            raise ModelError(
                f"{self.name}: needs a dataset with one id per categorical field (such as clicks), "
                f"got id_shape {id_shape!r}"
            )
        fields = _positive_int(self.name, "id_shape", tuple(id_shape)[0])
        dim = _positive_int(self.name, "dim", dim)
        hidden = _positive_ints(self.name, "hidden", hidden)
        if combine not in COMBINE:
            raise ModelError(f"{self.name}: option 'combine' must be one of {', '.join(COMBINE)} (got {combine!r})")
        if loss not in ALLOWED["classes"]:  # its targets are classes (a click or not)
            raise ModelError(
                f"{self.name}: option 'loss' must be one of {', '.join(ALLOWED['classes'])} (got {loss!r})"
            )
        if np.dtype(dtype).kind != "f":
            raise ModelError(f"{self.name}: dtype must be a float type (got {dtype!r})")
        try:
            TableSpec(TABLE, dim, dtype, "normal", float(scale))
        except (TypeError, ValueError) as exc:
            raise ModelError(f"{self.name}: {exc}") from None
        super().__init__(dtype)
        self.dense_dim, self.num_classes, self.fields, self.dim, self.hidden = dense_dim, classes, fields, dim, hidden
        self.combine, self.loss_name = combine, loss
        self.emb = Table(dim, "normal", float(scale))
        self.looked_up = fields * dim if combine == "concat" else dim
        widths = (self.looked_up + dense_dim,) + hidden
        layers = [Linear(n_in, n_out, "he_normal", relu=True) for n_in, n_out in zip(widths, widths[1:])]
        self.chain = chain(self, layers + [Linear(widths[-1], classes, "glorot_uniform")])

    @property
    def table(self) -> TableSpec:
        return self.tables()[0]

    def lookups(self, ids: Any) -> dict[str, np.ndarray]:
        """The ids each example of a batch looks up, per table: ``ids`` is ``[B, fields]``."""
        ids = np.asarray(ids)
        if ids.ndim != 2 or ids.shape[1] != self.fields or not np.issubdtype(ids.dtype, np.integer):
            raise ModelError(
                f"{self.name}: expected ids of shape (B, {self.fields}) of integers, got {ids.shape} {ids.dtype}"
            )
        return {TABLE: ids}

    def forward(self, x: Any) -> Any:
        looked = self.emb()  # [B, fields, dim]
        b = looked.shape[0]
        if self.combine == "concat":
            joined = looked.reshape(b, self.looked_up)
        else:
            joined = looked.sum(axis=1) if self.combine == "sum" else looked.mean(axis=1)
        dense = x.reshape(b, -1)
        if dense.shape[1] != self.dense_dim:
            raise ModelError(f"{self.name}: expected {self.dense_dim} dense features, got {dense.shape[1]}")
        h = ops.concatenate([joined, dense], axis=1)
        for module in self.chain:
            h = module.forward(h)
        return h

    def criterion(self, scores: Any, y: Any) -> Any:
        return nn.mse(scores, y, self.num_classes) if self.loss_name == "mse" else nn.cross_entropy(scores, y)
