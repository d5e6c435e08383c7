"""The finite-difference check of a model's gradients, against central differences of its loss.

A few coordinates of each gradient (the largest and some at random) are
compared with central differences of the loss, in float64 when the model can
compute in it (a float64 twin built by name, or float64 copies of its weights),
else in its own dtype with a loose tolerance.  A ReLU kink next to a coordinate
is recognised from the one-sided differences.  Within a ``budget`` (seconds per
process) the check shrinks to one coordinate per variable, or none when a step
is too slow or past :data:`FD_MAX_PARAMETERS` parameters.

:class:`FiniteDifferences` is a part of the model checker (:mod:`psgd.model.check`),
which supplies the model, the inputs, the initial values and the gradients
already found good.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from psgd.compute import backend
from psgd.model.errors import ModelError
from psgd.model.probe import Skip, call_loss_and_grads, raised
from psgd.model.registry import build_model

FD_COORDINATES = 3  # coordinates checked per variable
FD_EPS = 1e-6  # central-difference step in float64
FD_RTOL = 1e-4  # relative tolerance in float64
LOOSE_EPS, LOOSE_RTOL = 3e-3, 2e-2  # when the model cannot compute in float64
#: Finite differences within a budget (``budget=None``: no limit, as ``psgd check-model`` does): the
#: float64 copies of the weights are skipped past FD_MAX_PARAMETERS, and the number of steps taken
#: shrinks to fit FD_BUDGET_SECONDS (one coordinate per variable, then none) when a step is slow.
FD_MAX_PARAMETERS = 1 << 24
FD_BUDGET_SECONDS = 0.25


class FiniteDifferences:
    """The finite-difference check, a part of the model checker.

    It reads the checker's ``model``, ``name``, ``options``, ``input_shape``,
    ``num_classes``, ``dtype``, ``seed``, ``device``, ``x_host``, ``y``,
    ``specs``, ``params``, ``tables`` (each table's rows of the batch, checked like variables),
    ``with_rows``, ``good_grads``, ``step_seconds`` and ``budget``.
    """

    def _float64_twin(self) -> Any:
        """The same model built for float64 (same variables), or None when it cannot be."""
        if self.dtype == "float64":
            return self.model
        makers = []
        if self.name:
            makers.append(
                lambda: build_model(
                    self.name,
                    self.input_shape,
                    self.num_classes,
                    dtype="float64",
                    id_shape=self.id_shape,
                    target=self.target,
                    **self.options,
                )
            )
        ids = {"id_shape": self.id_shape} if self.id_shape is not None else {}
        makers.append(
            lambda: type(self.model)(
                input_shape=self.input_shape, num_classes=self.num_classes, dtype="float64", **ids, **self.options
            )
        )
        want = [(s.name, s.shape, "float64") for s in self.specs]
        for make in makers:
            try:
                twin = make()
                if [(s.name, s.shape, s.dtype) for s in twin.specs()] == want:
                    return twin
            except Exception:
                continue
        return None

    def _candidates(self) -> list[tuple[Any, str, bool]]:
        """(model, dtype, trusted) to take finite differences with, the most precise first.

        A float64 twin (or the model itself in a float64 job) is trusted: what it finds is reported.
        Otherwise the model gets float64 copies of its weights, which only helps if it computes in the
        weights' dtype; when that disagrees, its own dtype with a loose tolerance has the last word.
        """
        twin = self._float64_twin()
        if twin is not None:
            return [(twin, "float64", True)]
        return [(self.model, "float64", False), (self.model, self.dtype, True)]

    def _loss_function(self, model: Any, dt: str, host: dict[str, np.ndarray]) -> Callable[..., tuple[float, Any]]:
        """``f(changed=None)``: loss and gradients at the weights in ``host``, of which only ``changed``
        has changed since the first call (only that one is copied to the device again)."""
        x = self.device.asarray(self.x_host.astype(dt))
        base = {n: self.device.asarray(a) for n, a in host.items() if n not in self.tables}

        def f(changed: str | None = None) -> tuple[float, Any]:
            params = dict(base)
            if changed is not None and changed not in self.tables:
                params[changed] = self.device.asarray(host[changed])
            params = self.with_rows(params, dt, host)  # a table's rows: its values in host
            loss, grads, problems = call_loss_and_grads(model, params, x, self.y)
            if loss is None or grads is None:
                raise ModelError("; ".join(p for p in problems if "order" not in p))
            return loss, {n: getattr(g, "values", g) for n, g in grads.items()}

        return f

    def check_finite_differences(self, fail: list[str]) -> str:
        if self.budget is not None and sum(s.size for s in self.specs) > FD_MAX_PARAMETERS:
            raise Skip(
                f"over {FD_MAX_PARAMETERS:,} parameters: float64 copies of the weights would cost too much "
                "memory in every process (psgd check-model checks them)"
            )
        self._coordinates(self.step_seconds)  # skip before copying anything when even the job's dtype is slow
        for model, dt, trusted in self._candidates():
            host = {n: backend.to_host(v).astype(dt) for n, v in self.params.items()}
            host.update({n: first.astype(dt) for n, (_, first, _) in self.tables.items()})
            found: list[str] = []
            try:
                f = self._loss_function(model, dt, host)
                began = time.perf_counter()
                loss0, grads = f()
                step = time.perf_counter() - began
                if not trusted and not all(
                    np.dtype(getattr(grads.get(n), "dtype", "O")).name == dt for n in self.good_grads
                ):
                    continue
                again = f()[0]
                if abs(again - loss0) > 1e-12 * max(1.0, abs(loss0)):
                    raise Skip(
                        f"two calls at the same weights gave the losses {loss0:.10g} and {again:.10g} "
                        "(random dropout?); finite differences need the same loss for the same weights"
                    )
                summary = self._compare(f, host, loss0, grads, dt, self._coordinates(step), found)
            except Skip:
                raise
            except Exception as exc:
                found = [raised("loss_and_grads", exc)]
                summary = ""
            if found and not trusted:
                continue
            fail.extend(found)
            return summary
        return ""  # pragma: no cover - the last candidate is always trusted

    def _coordinates(self, step: float) -> int:
        """Coordinates per variable that fit the budget, two steps each; :class:`Skip` when not even one does."""
        calls = 2 * len(self.good_grads)
        if self.budget is None or calls * FD_COORDINATES * step <= self.budget:
            return FD_COORDINATES
        if calls * step <= self.budget:
            return 1
        raise Skip(
            f"a step takes {step:.2f} s here, too long to take {calls} more at the start of every process "
            "(psgd check-model checks them)"
        )

    def _compare(
        self,
        f: Callable[..., tuple[float, Any]],
        host: dict[str, np.ndarray],
        loss0: float,
        grads: Mapping[str, Any],
        dt: str,
        coordinates: int,
        fail: list[str],
    ) -> str:
        """Compare a few coordinates of each good gradient with central differences of ``f``."""
        eps, rtol = (FD_EPS, FD_RTOL) if dt == "float64" else (LOOSE_EPS, LOOSE_RTOL)
        # what rounding alone can put into a central difference (with room to spare)
        atol = 100 * np.finfo(dt).eps * max(1.0, abs(loss0)) / eps
        checked, worst, kinks = 0, 0.0, 0
        for n in self.good_grads:
            analytic = backend.to_host(grads[n]).astype(np.float64)
            arr = host[n]
            rng = np.random.default_rng([self.seed & 0xFFFFFFFF, zlib.crc32(n.encode())])
            picks = [int(np.argmax(np.abs(analytic)))]  # the largest, and a few at random
            for i in rng.integers(0, arr.size, size=4 * coordinates).tolist():
                if len(picks) < min(coordinates, arr.size) and i not in picks:
                    picks.append(i)
            bad: list[tuple[tuple[int, ...], float, float, float]] = []
            for flat in picks:
                idx = np.unravel_index(flat, arr.shape)
                old = arr[idx]
                try:
                    arr[idx] = old + eps
                    up = f(n)[0]
                    arr[idx] = old - eps
                    down = f(n)[0]
                finally:
                    arr[idx] = old
                a = float(analytic[idx])
                central = (up - down) / (2 * eps)
                # relative error, with rounding noise (atol) as the floor of the scale
                err = abs(a - central) / max(abs(a), abs(central), atol / rtol)
                # a ReLU kink or a max inside [p - eps, p + eps] spoils the central difference; the side
                # without it still agrees with the gradient, to first order in eps
                one_sided = min(abs(a - (up - loss0) / eps), abs(a - (loss0 - down) / eps))
                checked += 1
                if err <= rtol:
                    worst = max(worst, err)
                elif one_sided <= 10 * rtol * abs(a) + atol + eps:
                    kinks += 1
                else:
                    bad.append((tuple(int(i) for i in idx), a, central, err))
            if bad:
                idx, a, central, err = max(bad, key=lambda b: b[3])
                at = ", ".join(map(str, idx))
                more = f" ({len(bad)} of {len(picks)} coordinates disagree)" if len(bad) > 1 else ""
                fail.append(
                    f"the gradient for {n!r} at [{at}] is {a:.6g}, but central differences of the loss give "
                    f"{central:.6g} (relative error {err:.1e}, tolerance {rtol:.0e}){more}"
                )
        if fail:
            return ""
        how = (
            "in float64"
            if dt == "float64"
            else f"in {dt} with a loose tolerance (the model does not compute in float64)"
        )
        kinked = f"; {kinks} next to a kink agree one-sided" if kinks else ""
        return (
            f"{checked} coordinates of {len(self.good_grads)} gradient{'s' * (len(self.good_grads) != 1)} agree "
            f"with central differences {how} (largest relative error {worst:.1e}, tolerance {rtol:.0e}{kinked})"
        )
