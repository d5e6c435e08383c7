"""Update rules for the rows of an embedding table: only the rows a push touched are updated, each with state of
its own.

A table (:class:`psgd.model.TableSpec`) has rows keyed by int64 ids of unbounded range, made when first needed
(:mod:`psgd.server.state.tables`), so its optimizer cannot keep dense state: every rule here keeps state per row and
updates a batch of touched rows at once, :meth:`RowOptimizer.step` (``rows``, ``grads``, each row's state and
its update count ``t``, all gathered by the table).

- ``sgd``: ``row -= lr * g``.  Exactly what the dense rule does: an untouched row has a zero gradient.
- ``rowwise_adagrad``: one accumulator per row, ``G += mean(g^2)``, ``row -= lr * g / (sqrt(G) + eps)``: the
  usual choice for embeddings (one float of state per row instead of ``dim``; Gupta et al. 2014, as FBGEMM and
  TorchRec use it).  Exact too: an untouched row's accumulator and weights do not move.
- ``lazy_adam``: Adam's moments for the touched rows only, with each row's own update count for the bias
  correction.  *Lazy*: dense Adam would decay every row's moments and keep moving every row whose moments are
  not zero at each step; this rule moves a row only in a step that touches it, so its results differ from dense
  Adam's (apache/mxnet#17728; TensorFlow Addons' LazyAdam does the same).  The name says so.

A rule is one of ``updates`` of a round as dense rules are (:class:`psgd.optim.Share`): async and ssp pushes
arrive with an ``lr_scale`` (lr / N by default), which multiplies the step, and as ``1/N`` of a round:
``lazy_adam`` decays a touched row's moments by ``beta ** (1/N)`` a push and corrects their bias by the row's
rounds (its updates / N), as dense Adam does for every weight.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

from psgd.optim.base import WHOLE, Share
from psgd.optim.validation import OptimizerError, fraction, non_negative, positive, reject_unknown


class RowOptimizer:
    """The interface of a row rule: ``name``, whether it is ``lazy`` (see the module docstring), the state columns
    each row keeps, and :meth:`step`."""

    name: ClassVar[str] = ""
    lazy: ClassVar[bool] = False
    options: ClassVar[tuple[str, ...]] = ()

    def __init__(self, lr: float):
        self.lr = positive(self.name, "lr", lr)

    def state_columns(self, dim: int) -> dict[str, int]:
        """The state each row keeps: name -> number of values."""
        return {}

    def step(
        self,
        rows: np.ndarray,
        grads: np.ndarray,
        state: dict[str, np.ndarray],
        t: np.ndarray,
        lr_scale: float = 1.0,
        share: Share = WHOLE,
    ) -> None:
        """Update ``rows`` ``[k, dim]`` in place by ``grads`` ``[k, dim]``; ``state`` holds each row's state
        ``[k, columns]`` (updated in place), ``t`` ``[k]`` the number of updates of each row, this one counted;
        ``share``: the part of a round this update is."""
        raise NotImplementedError

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "lr": self.lr, "lazy": self.lazy, **{k: getattr(self, k) for k in self.options}}


class RowSGD(RowOptimizer):
    name = "sgd"

    def step(self, rows, grads, state, t, lr_scale=1.0, share=WHOLE):
        rows -= (self.lr * lr_scale) * grads


class RowwiseAdagrad(RowOptimizer):
    name = "rowwise_adagrad"
    options = ("eps", "initial")

    def __init__(self, lr: float = 0.05, eps: float = 1e-8, initial: float = 0.0):
        super().__init__(lr)
        self.eps = positive(self.name, "eps", eps)
        self.initial = non_negative(self.name, "initial", initial)

    def state_columns(self, dim):
        return {"sum": 1}

    def step(self, rows, grads, state, t, lr_scale=1.0, share=WHOLE):
        total = state["sum"]
        fresh = t == 1
        if self.initial and fresh.any():
            total[fresh] = self.initial
        total += np.mean(np.square(grads, dtype=np.float64), axis=1, keepdims=True).astype(total.dtype)
        rows -= (self.lr * lr_scale) * grads / (np.sqrt(total) + self.eps)


class LazyAdam(RowOptimizer):
    name = "lazy_adam"
    lazy = True
    options = ("beta1", "beta2", "eps")

    def __init__(self, lr: float = 1e-3, beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-8):
        super().__init__(lr)
        self.beta1 = fraction(self.name, "beta1", beta1)
        self.beta2 = fraction(self.name, "beta2", beta2)
        self.eps = positive(self.name, "eps", eps)

    def state_columns(self, dim):
        return {"m": dim, "v": dim}

    def step(self, rows, grads, state, t, lr_scale=1.0, share=WHOLE):
        m, v = state["m"], state["v"]
        b1, b2 = self.beta1**share.fraction, self.beta2**share.fraction  # a push's part of a round's decay
        m *= b1
        m += (1.0 - b1) * grads
        v *= b2
        v += (1.0 - b2) * np.square(grads)
        tt = t.astype(np.float64)[:, None] / share.updates  # rounds: bias corrections from the round's decays
        m_hat = m / (1.0 - self.beta1**tt)
        v_hat = v / (1.0 - self.beta2**tt)
        rows -= ((self.lr * lr_scale) * m_hat / (np.sqrt(v_hat) + self.eps)).astype(rows.dtype)


#: The row rules by name.
ROW_OPTIMIZERS: dict[str, type[RowOptimizer]] = {cls.name: cls for cls in (RowSGD, RowwiseAdagrad, LazyAdam)}


def build_row_optimizer(name: str, **options: Any) -> RowOptimizer:
    """The row rule ``name`` (a key of :data:`ROW_OPTIMIZERS`) with its options (``lr`` and the rule's own);
    options given as ``None`` count as not given."""
    if name not in ROW_OPTIMIZERS:
        raise OptimizerError(f"unknown table optimizer {name!r}: choose {', '.join(ROW_OPTIMIZERS)}")
    cls = ROW_OPTIMIZERS[name]
    given = {k: v for k, v in options.items() if v is not None}
    reject_unknown(name, given, ("lr",) + cls.options)
    return cls(**given)
