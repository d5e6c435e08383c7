"""Check a built model before it trains: one readable line for each thing that is wrong.

``check_model(model, input_shape, num_classes, dtype)`` calls the model the way
every trainer will, on a small batch of random inputs of the right shape, and
raises :class:`ModelError` with one line per failure:

- ``specs()``: a list of :class:`VarSpec` with unique names, valid shapes and
  the job's dtype;
- ``init(seed)``: exactly those variables, with their shapes and dtypes, and
  ``init(seed, names=[...])`` only the ones asked for (the shards ask so);
- ``loss_and_grads(params, x, y)``: a ``(loss, gradients)`` tuple in that
  order, a finite scalar loss, one finite gradient per variable with the
  variable's shape and dtype, and no gradient for an unknown name;
- ``predict(params, x)``: scores of shape ``(batch, num_classes)`` (``(batch, *positions, num_classes)`` for a
  class per position; for values, predictions of the targets' shape);
- finite differences: a few coordinates of each gradient against central
  differences of the loss, in float64.

It runs once at the start of every training process, so it is cheap: a batch
of 4 and 3 coordinates per variable (milliseconds to tens of milliseconds for
the built-in models).  For a large model the finite differences shrink to fit
``budget`` (one coordinate per variable, or none past 16M parameters or when a
step is too slow); ``psgd check-model`` checks them in full (``budget=None``).
A model whose gradient is deliberately not its loss's (a benchmark stand-in)
says ``check_gradients = False``.  :func:`run_checks` returns every check's
outcome instead of raising; ``psgd check-model`` prints them.  Arrays live on
``device`` (NumPy on the CPU, CuPy on a GPU); nothing here imports CuPy.

This module holds the entry points and the checks of the model protocol;
:mod:`psgd.model.gradcheck` the finite differences, and :mod:`psgd.model.probe`
the calls into the model and the words for what came back.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from psgd.compute import backend
from psgd.model.base import VarSpec, VarSpecError, model_tables
from psgd.model.errors import ModelError
from psgd.model.gradcheck import FD_BUDGET_SECONDS, FiniteDifferences
from psgd.model.probe import Skip, call_loss_and_grads, kind, quoted, raised
from psgd.model.table import Rows, initial_rows, unique_lookups

OK, FAIL, SKIP = "ok", "FAIL", "skip"
BATCH = 4


@dataclasses.dataclass
class Check:
    """One check's outcome: ``status`` is ok, FAIL or skip; ``lines`` says what was found, one per failure."""

    name: str
    status: str
    lines: list[str]


def check_model(
    model: Any,
    input_shape: Any,
    num_classes: int,
    dtype: str,
    seed: int = 0,
    *,
    name: str | None = None,
    options: Mapping[str, Any] | None = None,
    device: backend.Device | None = None,
    batch: int = BATCH,
    budget: float | None = FD_BUDGET_SECONDS,
    id_shape: Any = None,
    target: str = "classes",
    target_shape: Any = (),
) -> list[Check]:
    """Check ``model`` (see the module docstring); raise :class:`ModelError`, one line per failure.

    ``name`` and ``options`` (how the model was built, e.g. ``"mypkg.nets:Net"``
    and ``{"width": 64}``) name it in messages and let the finite-difference
    check build a float64 twin; ``device`` is where the arrays live (default CPU).
    ``budget`` bounds the finite differences' time and memory for large models
    (None: check them in full); ``id_shape``, the ids each example carries (a dataset with categorical ids),
    is what a model of embedding tables looks up; ``target`` and ``target_shape`` what the dataset's targets are
    (:attr:`psgd.data.Dataset.target`): the batch's targets are made so. Returns the checks, all passed or
    skipped.
    """
    checks = run_checks(
        model,
        input_shape,
        num_classes,
        dtype,
        seed,
        name=name,
        options=options,
        device=device,
        batch=batch,
        budget=budget,
        id_shape=id_shape,
        target=target,
        target_shape=target_shape,
    )
    label = name or _class_name(model)
    failures = [f"model {label!r}: {c.name}: {line}" for c in checks if c.status == FAIL for line in c.lines]
    if failures:
        raise ModelError("\n".join(failures))
    return checks


def run_checks(
    model: Any,
    input_shape: Any,
    num_classes: int,
    dtype: str,
    seed: int = 0,
    *,
    name: str | None = None,
    options: Mapping[str, Any] | None = None,
    device: backend.Device | None = None,
    batch: int = BATCH,
    budget: float | None = FD_BUDGET_SECONDS,
    id_shape: Any = None,
    target: str = "classes",
    target_shape: Any = (),
) -> list[Check]:
    """Every check's outcome, in order: specs, init, loss_and_grads, gradients, predict, finite differences."""
    return _Checker(
        model,
        input_shape,
        num_classes,
        dtype,
        seed,
        name,
        options,
        device,
        batch,
        budget,
        id_shape,
        target,
        target_shape,
    ).run()


def _class_name(model: Any) -> str:
    cls = type(model)
    return f"{cls.__module__}:{cls.__qualname__}"


class _Checker(FiniteDifferences):
    """The state the checks share: inputs, specs and initial values once they are known good."""

    def __init__(
        self,
        model,
        input_shape,
        num_classes,
        dtype,
        seed,
        name,
        options,
        device,
        batch,
        budget,
        id_shape=None,
        target="classes",
        target_shape=(),
    ):
        self.model, self.name, self.options, self.budget = model, name, dict(options or {}), budget
        if isinstance(input_shape, (int, np.integer)):
            input_shape = (input_shape,)
        self.input_shape = tuple(int(d) for d in input_shape)
        self.num_classes, self.seed, self.batch = int(num_classes), int(seed), int(batch)
        self.dtype = np.dtype(dtype).name
        self.device = device or backend.CPU
        rng = np.random.default_rng([self.seed & 0xFFFFFFFF, 1])
        self.x_host = rng.standard_normal((self.batch,) + self.input_shape).astype(self.dtype)
        self.target, self.target_shape = target, tuple(int(d) for d in target_shape)
        rows = (self.batch,) + self.target_shape
        self.y_host = (
            rng.integers(0, self.num_classes, size=rows, dtype=np.int64)
            if target == "classes"
            else rng.integers(0, 2, size=rows).astype(self.dtype)
            if target == "labels"
            else rng.standard_normal(rows).astype(self.dtype)
        )
        self.x, self.y = self.device.asarray(self.x_host), self.device.asarray(self.y_host)
        self.id_shape = tuple(id_shape) if id_shape is not None else None
        # ids from a pool of 3 per field position: a batch of 4 looks some rows up twice (their gradients add up)
        self.ids_host = (
            rng.integers(-(2**62), 2**62, size=(3,) + self.id_shape)[rng.integers(0, 3, size=self.batch)]
            if self.id_shape
            else None
        )
        self.tables: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}  # name -> (ids, values, index)
        self.specs: list[VarSpec] | None = None
        self.params: dict[str, Any] | None = None
        self.result: tuple[float, Mapping[str, Any]] | None = None  # (loss, gradients) once they were returned
        self.good_grads: list[str] = []  # variables whose gradient has the right shape, dtype and values
        self.step_seconds = 0.0  # one loss_and_grads in the job's dtype

    def run(self) -> list[Check]:
        checks = [self._run("specs", self.check_specs)]
        checks.append(
            self._run("init", self.check_init) if self.specs is not None else Check("init", SKIP, ["needs valid specs"])
        )
        if self.params is None:
            return checks + [
                Check(n, SKIP, ["needs the initial values"])
                for n in ("loss_and_grads", "gradients", "predict", "finite differences")
            ]
        checks.append(self._run("loss_and_grads", self.check_loss))
        checks.append(
            self._run("gradients", self.check_grads)
            if self.result is not None
            else Check("gradients", SKIP, ["needs loss_and_grads to return them"])
        )
        checks.append(self._run("predict", self.check_predict))
        if self.result is None or not math.isfinite(self.result[0]):
            checks.append(Check("finite differences", SKIP, ["needs a finite loss"]))
        elif not self.good_grads:
            checks.append(Check("finite differences", SKIP, ["needs at least one good gradient"]))
        elif getattr(self.model, "check_gradients", True) is False:
            checks.append(Check("finite differences", SKIP, ["the model says check_gradients = False"]))
        else:
            checks.append(self._run("finite differences", self.check_finite_differences))
        return checks

    @staticmethod
    def _run(name: str, body: Callable[[list[str]], str]) -> Check:
        failures: list[str] = []
        try:
            summary = body(failures)
        except Skip as skip:
            return Check(name, SKIP, [str(skip)])
        return Check(name, FAIL, failures) if failures else Check(name, OK, [summary])

    # -- specs and init -----------------------------------------------------------------------------
    def check_specs(self, fail: list[str]) -> str:
        try:
            specs = self.model.specs()
        except VarSpecError as exc:
            fail.append(str(exc))
            return ""
        except Exception as exc:
            fail.append(raised("", exc))
            return ""
        if not isinstance(specs, (list, tuple)):
            fail.append(f"specs() returned {kind(specs)}, not a list of VarSpec")
            return ""
        if not specs:
            fail.append("specs() returned no variables")
            return ""
        for i, spec in enumerate(specs):
            if not isinstance(spec, VarSpec):
                fail.append(f"item {i} of specs() is {kind(spec)}, not a VarSpec")
        if fail:
            return ""
        seen: dict[str, int] = {}
        for spec in specs:
            if not isinstance(spec.name, str) or not spec.name:
                fail.append(f"variable name {spec.name!r} is not a non-empty string")
            else:
                seen[spec.name] = seen.get(spec.name, 0) + 1
        for var, count in seen.items():
            if count > 1:
                fail.append(f"variable name {var!r} appears {count} times (names must be unique)")
        for spec in specs:
            if not all(isinstance(d, int) and d > 0 for d in spec.shape):
                fail.append(f"variable {spec.name!r} has shape {spec.shape}: dimensions must be positive integers")
        wrong: dict[str, list[str]] = {}
        for spec in specs:
            if spec.dtype != self.dtype:
                wrong.setdefault(spec.dtype, []).append(spec.name)
        for dt, names in wrong.items():
            which = "variable" if len(names) == 1 else "variables"
            fail.append(
                f"{which} {quoted(names)} {'is' if len(names) == 1 else 'are'} {dt} but the job's dtype "
                f"is {self.dtype} (give each VarSpec the dtype the model was built with)"
            )
        if fail:
            return ""
        self.specs = list(specs)
        total = sum(s.size for s in specs)
        return f"{len(specs)} variable{'s' * (len(specs) != 1)}, {total:,} parameters, {self.dtype}"

    def _check_values(self, what: str, values: Any, names: list[str], fail: list[str]) -> bool:
        if not isinstance(values, Mapping):
            fail.append(f"{what} returned {kind(values)}, not a dict of arrays by variable name")
            return False
        missing = [n for n in names if n not in values]
        extra = [n for n in values if n not in names]
        if missing:
            fail.append(f"{what} gives no value for {quoted(missing)}")
        if extra:
            fail.append(
                f"{what} gives a value for {quoted(extra)}, which "
                + ("it was not asked for" if len(names) < len(self.specs) else "specs() does not list")
            )
        by_name = {s.name: s for s in self.specs}
        for n in names:
            if n not in values:
                continue
            value, spec = values[n], by_name[n]
            if getattr(value, "shape", None) is None or getattr(value, "dtype", None) is None:
                fail.append(f"{what} gives {kind(value)} for {n!r}, not an array")
            elif tuple(value.shape) != spec.shape:
                fail.append(f"{what} gives {n!r} the shape {tuple(value.shape)}, but specs() says {spec.shape}")
            elif np.dtype(value.dtype).name != spec.dtype:
                fail.append(f"{what} gives {n!r} as {np.dtype(value.dtype).name}, but specs() says {spec.dtype}")
            elif not np.isfinite(backend.to_host(value)).all():
                fail.append(f"{what} gives {n!r} non-finite values")
        return not fail

    def check_init(self, fail: list[str]) -> str:
        names = [s.name for s in self.specs]
        try:
            values = self.model.init(self.seed)
        except Exception as exc:
            fail.append(raised(f"init({self.seed})", exc))
            return ""
        if not self._check_values(f"init({self.seed})", values, names, fail):
            return ""
        one = min(self.specs, key=lambda spec: spec.size).name  # the smallest: cheap for big models
        what = f"init({self.seed}, names=[{one!r}])"
        try:
            some = self.model.init(self.seed, names=[one])
        except Exception as exc:
            fail.append(
                raised(what, exc) + "; the parameter-server shards call it to create only their own "
                "variables (subclass psgd.model.BaseModel to get it)"
            )
            return ""
        if not self._check_values(what, some, [one], fail):
            return ""
        del some
        self.params = {n: self.device.asarray(values[n]) for n in names}
        self._table_rows(fail)
        if fail:
            self.params = None
            return ""
        return (
            f"{len(names)} array{'s' * (len(names) != 1)} with the specs' shapes and dtypes, "
            "and only the variables asked for with names=[...]"
        )

    def _table_rows(self, fail: list[str]) -> None:
        """The rows the random batch looks up in each of the model's tables, at their first values."""
        try:
            tables = model_tables(self.model)
        except Exception as exc:
            fail.append(raised("tables()", exc))
            return
        if not tables:
            return
        if self.ids_host is None:
            fail.append("the model has embedding tables, but the dataset gives no ids to look up in them")
            return
        try:
            lookups = self.model.lookups(self.ids_host)
        except Exception as exc:
            fail.append(raised("lookups(ids)", exc))
            return
        specs = {t.name: t for t in tables}
        if not isinstance(lookups, Mapping) or set(lookups) - set(specs):
            fail.append(
                f"lookups(ids) returned {kind(lookups)}; it must be a dict of ids by table name ({', '.join(specs)})"
            )
            return
        for name, wanted in lookups.items():
            ids, index = unique_lookups(wanted)
            self.tables[name] = (ids, initial_rows(specs[name], self.seed, ids), index)

    def with_rows(
        self, params: Mapping[str, Any], dt: str | None = None, values: Mapping[str, np.ndarray] | None = None
    ) -> dict[str, Any]:
        """``params`` with each table's :class:`Rows` for the batch, in ``dt`` (or the job's dtype), taking a
        table's values from ``values`` where given."""
        out = dict(params)
        for name, (ids, first, index) in self.tables.items():
            rows = values[name] if values is not None and name in values else first.astype(dt or self.dtype)
            out[name] = Rows(ids, self.device.asarray(rows), self.device.asarray(index))
        return out

    # -- loss_and_grads, gradients, predict ---------------------------------------------------------
    def check_loss(self, fail: list[str]) -> str:
        try:
            began = time.perf_counter()
            loss, grads, problems = call_loss_and_grads(self.model, self.with_rows(self.params), self.x, self.y)
            self.step_seconds = time.perf_counter() - began
        except Exception as exc:
            fail.append(raised("", exc))
            return ""
        fail.extend(problems)
        if loss is not None and not math.isfinite(loss):
            fail.append(f"the loss is {loss} on a batch of {self.batch} random inputs; it must be finite")
        if grads is not None and loss is not None:
            self.result = (loss, grads)
        if fail:
            return ""
        return f"returns (loss, gradients); loss {loss:.4g} on a batch of {self.batch} random inputs"

    def check_grads(self, fail: list[str]) -> str:
        grads = dict(self.result[1])
        for name, (ids, first, _) in self.tables.items():  # a table's gradient: Rows of the batch's ids
            g = grads.pop(name, None)
            if not isinstance(g, Rows) or not np.array_equal(np.asarray(g.ids), ids):
                fail.append(
                    f"the gradient for table {name!r} is {kind(g)}; it must be the batch's Rows with the "
                    "gradient of each row as values (rows.with_values(...))"
                )
                continue
            values = g.values
            if tuple(getattr(values, "shape", ())) != first.shape:
                fail.append(
                    f"the gradient for table {name!r} has shape {tuple(getattr(values, 'shape', ()))}, "
                    f"but the batch looks up {first.shape[0]} rows of {first.shape[1]}"
                )
            elif not np.isfinite(backend.to_host(values)).all():
                fail.append(f"the gradient for table {name!r} has non-finite values")
            else:
                self.good_grads.append(name)
        names = [s.name for s in self.specs]
        missing = [n for n in names if n not in grads]
        unknown = [n for n in grads if n not in names]
        if missing:
            fail.append(
                f"no gradient for {quoted(missing)} (loss_and_grads must return one for every variable "
                "in specs(), zeros included)"
            )
        if unknown:
            fail.append(f"gradient{'s' * (len(unknown) != 1)} for {quoted(unknown)}, which specs() does not list")
        xp = self.device.xp
        for spec in self.specs:
            if spec.name not in grads:
                continue
            g, n = grads[spec.name], spec.name
            if getattr(g, "shape", None) is None or getattr(g, "dtype", None) is None:
                fail.append(f"the gradient for {n!r} is {kind(g)}, not an array")
            elif tuple(g.shape) != spec.shape:
                fail.append(f"the gradient for {n!r} has shape {tuple(g.shape)}, but the variable has {spec.shape}")
            elif np.dtype(g.dtype).name != spec.dtype:
                fail.append(f"the gradient for {n!r} is {np.dtype(g.dtype).name}, but the variable is {spec.dtype}")
            elif backend.get_array_module(g) is not xp:
                fail.append(
                    f"the gradient for {n!r} is a {type(g).__module__}.{type(g).__name__}, but the weights "
                    f"are on {self.device} (compute with the array module of the params)"
                )
            else:
                bad = int(backend.to_host((~xp.isfinite(g)).sum()))
                if bad:
                    fail.append(f"the gradient for {n!r} has {bad} non-finite value{'s' * (bad != 1)} (nan or inf)")
                elif not spec.state:  # a state's is the change a step made to it: no derivative to check
                    self.good_grads.append(n)
        if fail:
            return ""
        rows = ", and one per table for the rows the batch looks up" if self.tables else ""
        return f"one per variable, with its shape and dtype, all finite{rows}"

    def scores_shape(self) -> tuple[tuple[int, ...], str]:
        """The shape ``predict`` must return for this target, and the words for it."""
        if self.target == "classes" and self.target_shape:
            want = (self.batch, *self.target_shape, self.num_classes)
            return want, f"scores of shape (batch, *positions, num_classes) = {want}, a row per position"
        if self.target == "values":
            want = (self.batch, *self.target_shape)
            return want, f"predictions of the targets' shape (batch, *values) = {want}"
        want = (self.batch, self.num_classes)
        return want, f"scores of shape (batch, num_classes) = {want}, one row per example"

    def check_predict(self, fail: list[str]) -> str:
        try:
            scores = self.model.predict(self.with_rows(self.params), self.x)
        except Exception as exc:
            fail.append(raised("", exc))
            return ""
        want, said = self.scores_shape()
        if getattr(scores, "shape", None) is None:
            fail.append(f"returned {kind(scores)}, not an array of scores")
        elif tuple(scores.shape) != want and not (
            self.target == "values"
            and len(scores.shape) >= 1
            and scores.shape[0] == self.batch
            and scores.size == math.prod(want)
        ):
            fail.append(f"returned shape {tuple(scores.shape)}; it must return {said}")
        elif backend.get_array_module(scores) is not self.device.xp:
            fail.append(
                f"returned a {type(scores).__module__}.{type(scores).__name__}, but the weights are on {self.device}"
            )
        else:
            host = backend.to_host(scores)
            if host.dtype.kind not in "fiu":
                fail.append(f"returned {host.dtype} scores, not numbers")
            elif not np.isfinite(host).all():
                fail.append("returned non-finite scores")
        return "" if fail else f"scores of shape {want}"
