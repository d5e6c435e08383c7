"""What a shard does to an async or ssp push before it applies it: the push's learning rate and share of a
round, the momentum it leaves to asynchrony, and delay compensation.

**The rate.** Under sync a round of N workers' gradients is averaged into one update; under async and ssp
each push is an update of its own, so by default (``async_lr = "divided"``) each is applied at lr / N and
counts as 1/N of a round in the optimizer's state (:class:`psgd.optim.Share`: momentum decays by mu^(1/N)
per push, Adam's moments likewise, the schedule counts rounds): without staleness, N pushes move the weights
as one sync round does.  ``staleness_lr`` divides the rate again by the push's staleness (Zhang et al.,
"Staleness-aware async-SGD for distributed deep learning", IJCAI 2016).

**Implicit momentum** (Mitliagkas, Zhang, Hadjis & Ré, "Asynchrony begets momentum, with an application to
deep learning", Allerton 2016).  N asynchronous workers act on the weights like momentum of about 1 − 1/N
per update, on top of the optimizer's own.  ``implicit_momentum`` lowers a momentum optimizer's per-push
momentum by that much (not below 0), so that the two together come to about the momentum the job asked for.

**Delay compensation** (DC-ASGD: Zheng et al., "Asynchronous Stochastic Gradient Descent with Delay
Compensation", ICML 2017).  A worker's gradient g was computed on the weights it pulled, w_pulled; by the
time it arrives, other pushes have moved the weights to w_now.  The first-order Taylor correction, with
the Hessian approximated by λ·g⊙g, applies g + λ·g⊙g⊙(w_now − w_pulled) instead.  λ is constant
(``dc_lambda``), or adaptive (``dc_adaptive``, the paper's DC-ASGD-a): λ / √MeanSquare per weight, with
MeanSquare ← m·MeanSquare + (1 − m)·g⊙g (m = 0.95) over every applied gradient.  To know w_pulled the shard
copies its weights for each worker at each of its pulls: N copies of the shard's weights in memory (one
more for MeanSquare), and one more copy of the shard per pull.  A push whose worker has no copy of the
version it names (its pull came before a restart, or went to another process) is applied uncompensated,
and counted.

**Rows of embedding tables** get the same remedies, row by row: the push's rate and share of a round
(:mod:`psgd.tables.rules`), and delay compensation against the rows the worker's last pull read (the shard keeps
those rows, not the table: a few thousand rows a worker), with DC-ASGD-a's MeanSquare kept per row in the table
(a column of ``dim`` values beside the rule's state, checkpointed with it) and decayed at each gradient the row
receives.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np

from psgd.config import Remedies
from psgd.optim import Share
from psgd.tables.held import RowTable

#: DC-ASGD-a's decay of the mean square of the gradients (Zheng et al. 2017)
MEAN_SQUARE_DECAY = 0.95
#: added to √MeanSquare so that a weight whose gradients were all zero gets a finite λ
EPSILON = 1e-7
#: the state column a table keeps each row's MeanSquare in (adaptive compensation)
MEAN_SQUARE_COLUMN = "dc_mean_square"


class PushRemedies:
    """The rate and the compensation of a shard's pushes (sync pushes, averaged into a round, get neither)."""

    def __init__(
        self,
        workers: Callable[[], int],
        accumulates: bool,
        flat: Callable[[], np.ndarray],
        views: Callable[[np.ndarray], dict[int, np.ndarray]],
        settings: Remedies,
    ):
        # the workers training now, read when a push is applied (a job with a range grows and shrinks)
        self._workers, self._accumulates, self._settings = workers, accumulates, settings
        self.staleness_lr = settings.staleness_lr
        self.dc_lambda = 0.0 if accumulates else float(settings.dc_lambda)
        self._flat, self._views = flat, views
        self._pulled: dict[int, tuple[int, np.ndarray, dict[int, np.ndarray]]] = {}  # worker -> version, copy
        self._mean_square = np.zeros_like(flat()) if self.dc_lambda and settings.dc_adaptive else None
        self._ms = views(self._mean_square) if self._mean_square is not None else {}
        self.uncompensated = 0  # pushes applied without a copy of the weights their worker pulled
        self._pulled_rows: dict[int, tuple[int, dict[str, tuple[np.ndarray, np.ndarray]]]] = {}
        self.uncompensated_rows = 0  # pushes whose rows were applied without the rows their worker pulled

    @property
    def share(self) -> Share:
        """How the optimizer counts a push: one of N updates a round with "divided", N the workers training now."""
        n, settings = max(1, self._workers()), self._settings
        per_round = n if settings.async_lr == "divided" and not self._accumulates else 1
        implicit = 1.0 - 1.0 / n if settings.implicit_momentum and not self._accumulates else 0.0
        return Share(per_round, implicit)

    @property
    def scale(self) -> float:
        """The learning rate's factor for a push: 1 / N with "divided" (async, ssp), else 1."""
        return self.share.fraction

    def lr_scale(self, staleness: int) -> float:
        """The learning rate's factor for a push applied ``staleness`` updates late."""
        return self.scale / max(1, staleness) if self.staleness_lr else self.scale

    def pulled(self, worker: int | None, version: int) -> None:
        """``worker`` (None: an observer) has just read the weights at ``version`` (under the shard's lock)."""
        if not self.dc_lambda or worker is None:
            return
        if worker not in self._pulled:
            copy = np.empty_like(self._flat())
            self._pulled[worker] = (version, copy, self._views(copy))
        _, copy, views = self._pulled[worker]
        np.copyto(copy, self._flat())
        self._pulled[worker] = (version, copy, views)

    def compensate(
        self, worker: int, base_version: int, grads: Mapping[int, np.ndarray], weights: Mapping[int, np.ndarray]
    ) -> Mapping[int, np.ndarray]:
        """The gradients to apply in place of ``grads`` (new arrays: the pushed ones are left as they came)."""
        if not self.dc_lambda:
            return grads
        if self._mean_square is not None:
            for i, g in grads.items():
                self._ms[i] *= MEAN_SQUARE_DECAY
                self._ms[i] += (1.0 - MEAN_SQUARE_DECAY) * g * g
        held = self._pulled.get(worker)
        if held is None or held[0] != base_version:
            self.uncompensated += 1
            return grads
        out = {}
        for i, g in grads.items():
            lam = self.dc_lambda if self._mean_square is None else self.dc_lambda / (np.sqrt(self._ms[i]) + EPSILON)
            out[i] = g + lam * g * g * (weights[i] - held[2][i])
        return out

    # -- rows of embedding tables --------------------------------------------------------------------------------
    def watch_tables(self, tables: Mapping[str, RowTable]) -> None:
        """With adaptive compensation, each table keeps the mean square of its rows' gradients."""
        if self.dc_lambda and self._mean_square is not None:
            for table in tables.values():
                table.add_column(MEAN_SQUARE_COLUMN, table.spec.dim)

    def pulled_rows(self, worker: int | None, version: int, rows: Mapping[str, tuple[np.ndarray, np.ndarray]]) -> None:
        """``worker`` has just read ``rows`` (ids and values, by table) at ``version``: kept for its push."""
        if self.dc_lambda and worker is not None:
            self._pulled_rows[worker] = (version, dict(rows))

    def compensate_rows(
        self,
        worker: int,
        base_version: int,
        rows: Mapping[str, tuple[np.ndarray, np.ndarray]],
        tables: Mapping[str, RowTable],
    ) -> Mapping[str, tuple[np.ndarray, np.ndarray]]:
        """The row gradients to apply in place of ``rows``' (new arrays), compensated as the dense ones are."""
        if not self.dc_lambda or not rows:
            return rows
        held = self._pulled_rows.get(worker)
        if held is None or held[0] != base_version:
            self.uncompensated_rows += 1
            held = None
        out = {}
        for name, (ids, grads) in rows.items():
            table, grads = tables[name], np.array(grads)
            lam = np.full(grads.shape, self.dc_lambda, dtype=np.float64)
            if self._mean_square is not None:  # each row's own MeanSquare, of the rows that exist
                have, square = table.column(MEAN_SQUARE_COLUMN, ids)
                square *= MEAN_SQUARE_DECAY
                square += (1.0 - MEAN_SQUARE_DECAY) * grads[have] * grads[have]
                table.set_column(MEAN_SQUARE_COLUMN, ids[have], square)
                lam[have] = self.dc_lambda / (np.sqrt(square) + EPSILON)
            pulled_ids, pulled = held[1].get(name, (None, None)) if held is not None else (None, None)
            if pulled_ids is not None and pulled_ids.size:
                order = np.argsort(pulled_ids, kind="stable")
                at = np.minimum(np.searchsorted(pulled_ids, ids, sorter=order), pulled_ids.size - 1)
                found = pulled_ids[order[at]] == ids
                then = pulled[order[at[found]]]
                grads[found] += lam[found] * grads[found] * grads[found] * (table.peek(ids[found]) - then)
            out[name] = (ids, grads)
        return out
