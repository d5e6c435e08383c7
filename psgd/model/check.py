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
- ``predict(params, x)``: scores of shape ``(batch, num_classes)``;
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
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
import traceback
import zlib
from typing import Any, Callable, Mapping

import numpy as np

from psgd import xp as backend
from psgd.model.base import VarSpec, VarSpecError
from psgd.model.errors import ModelError

OK, FAIL, SKIP = "ok", "FAIL", "skip"
BATCH = 4
FD_COORDINATES = 3         # coordinates checked per variable
FD_EPS = 1e-6              # central-difference step in float64
FD_RTOL = 1e-4             # relative tolerance in float64
LOOSE_EPS, LOOSE_RTOL = 3e-3, 2e-2   # when the model cannot compute in float64
#: Finite differences within a budget (``budget=None``: no limit, as ``psgd check-model`` does): the
#: float64 copies of the weights are skipped past FD_MAX_PARAMETERS, and the number of steps taken
#: shrinks to fit FD_BUDGET_SECONDS (one coordinate per variable, then none) when a step is slow.
FD_MAX_PARAMETERS = 1 << 24
FD_BUDGET_SECONDS = 0.25


class _Skip(Exception):
    """A check that cannot run here; its message says why."""


@dataclasses.dataclass
class Check:
    """One check's outcome: ``status`` is ok, FAIL or skip; ``lines`` says what was found, one per failure."""

    name: str
    status: str
    lines: list[str]


def check_model(model: Any, input_shape: Any, num_classes: int, dtype: str, seed: int = 0, *,
                name: str | None = None, options: Mapping[str, Any] | None = None,
                device: backend.Device | None = None, batch: int = BATCH,
                budget: float | None = FD_BUDGET_SECONDS) -> list[Check]:
    """Check ``model`` (see the module docstring); raise :class:`ModelError`, one line per failure.

    ``name`` and ``options`` (how the model was built, e.g. ``"mypkg.nets:Net"``
    and ``{"width": 64}``) name it in messages and let the finite-difference
    check build a float64 twin; ``device`` is where the arrays live (default CPU).
    ``budget`` bounds the finite differences' time and memory for large models
    (None: check them in full). Returns the checks, all passed or skipped.
    """
    checks = run_checks(model, input_shape, num_classes, dtype, seed, name=name, options=options,
                        device=device, batch=batch, budget=budget)
    label = name or _class_name(model)
    failures = [f"model {label!r}: {c.name}: {line}" for c in checks if c.status == FAIL for line in c.lines]
    if failures:
        raise ModelError("\n".join(failures))
    return checks


def run_checks(model: Any, input_shape: Any, num_classes: int, dtype: str, seed: int = 0, *,
               name: str | None = None, options: Mapping[str, Any] | None = None,
               device: backend.Device | None = None, batch: int = BATCH,
               budget: float | None = FD_BUDGET_SECONDS) -> list[Check]:
    """Every check's outcome, in order: specs, init, loss_and_grads, gradients, predict, finite differences."""
    return _Checker(model, input_shape, num_classes, dtype, seed, name, options, device, batch, budget).run()


def _class_name(model: Any) -> str:
    cls = type(model)
    return f"{cls.__module__}:{cls.__qualname__}"


def _names(names: list[str]) -> str:
    return ", ".join(repr(n) for n in names)


def _kind(value: Any) -> str:
    """A few words for what ``value`` is: 'a dict', 'a float', 'an array of shape (3,)'."""
    if value is None:
        return "None"
    shape = getattr(value, "shape", None)
    if shape is not None and not isinstance(value, (np.generic,)):
        return f"an array of shape {tuple(shape)}"
    name = type(value).__name__
    return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"


def _where(exc: BaseException) -> str:
    """' (at file.py:LINE)' for the innermost frame outside NumPy, CuPy and this module."""
    here = os.path.abspath(__file__)
    frames = traceback.extract_tb(exc.__traceback__)
    for frame in reversed(frames):
        path = os.path.abspath(frame.filename)
        parts = path.split(os.sep)
        if path != here and "numpy" not in parts and "cupy" not in parts:
            return f" (at {os.path.basename(path)}:{frame.lineno})"
    return ""


def _raised(call: str, exc: BaseException) -> str:
    """'CALL raised KeyError: 'b2' (at net.py:12)' on one line; CALL may be empty."""
    text = " ".join(str(exc).split())
    return f"{call} raised {type(exc).__name__}".lstrip() + (f": {text}" if text else "") + _where(exc)


def _scalar(value: Any) -> tuple[float | None, str]:
    """``(float(value), "")`` for a real scalar, or ``(None, why not)``."""
    if isinstance(value, (bool, np.bool_)):
        return None, "a bool, not a number"
    if isinstance(value, (int, float, np.integer, np.floating)):
        return float(value), ""
    shape = getattr(value, "shape", None)
    if shape is None:
        return None, f"{_kind(value)}, not a number"
    if tuple(shape) != ():
        return None, f"an array of shape {tuple(shape)}, not a scalar (return the mean over the batch)"
    host = backend.to_host(value)
    if host.dtype.kind not in "fiu":
        return None, f"an array of {host.dtype}, not a real number"
    return float(host), ""


class _Checker:
    """The state the checks share: inputs, specs and initial values once they are known good."""

    def __init__(self, model, input_shape, num_classes, dtype, seed, name, options, device, batch, budget):
        self.model, self.name, self.options, self.budget = model, name, dict(options or {}), budget
        if isinstance(input_shape, (int, np.integer)):
            input_shape = (input_shape,)
        self.input_shape = tuple(int(d) for d in input_shape)
        self.num_classes, self.seed, self.batch = int(num_classes), int(seed), int(batch)
        self.dtype = np.dtype(dtype).name
        self.device = device or backend.CPU
        rng = np.random.default_rng([self.seed & 0xFFFFFFFF, 1])
        self.x_host = rng.standard_normal((self.batch,) + self.input_shape).astype(self.dtype)
        self.y_host = rng.integers(0, self.num_classes, size=self.batch, dtype=np.int64)
        self.x, self.y = self.device.asarray(self.x_host), self.device.asarray(self.y_host)
        self.specs: list[VarSpec] | None = None
        self.params: dict[str, Any] | None = None
        self.result: tuple[float, Mapping[str, Any]] | None = None  # (loss, gradients) once they were returned
        self.good_grads: list[str] = []   # variables whose gradient has the right shape, dtype and values
        self.step_seconds = 0.0           # one loss_and_grads in the job's dtype

    def run(self) -> list[Check]:
        checks = [self._run("specs", self.check_specs)]
        checks.append(self._run("init", self.check_init) if self.specs is not None
                      else Check("init", SKIP, ["needs valid specs"]))
        if self.params is None:
            return checks + [Check(n, SKIP, ["needs the initial values"])
                             for n in ("loss_and_grads", "gradients", "predict", "finite differences")]
        checks.append(self._run("loss_and_grads", self.check_loss))
        checks.append(self._run("gradients", self.check_grads) if self.result is not None
                      else Check("gradients", SKIP, ["needs loss_and_grads to return them"]))
        checks.append(self._run("predict", self.check_predict))
        if self.result is None or not math.isfinite(self.result[0]):
            checks.append(Check("finite differences", SKIP, ["needs a finite loss"]))
        elif not self.good_grads:
            checks.append(Check("finite differences", SKIP, ["needs at least one good gradient"]))
        elif getattr(self.model, "check_gradients", True) is False:
            checks.append(Check("finite differences", SKIP, ["the model says check_gradients = False"]))
        elif self.budget is not None and sum(s.size for s in self.specs) > FD_MAX_PARAMETERS:
            checks.append(Check("finite differences", SKIP, [
                f"over {FD_MAX_PARAMETERS:,} parameters: float64 copies of the weights would cost too much memory "
                "in every process (psgd check-model checks them)"]))
        else:
            checks.append(self._run("finite differences", self.check_finite_differences))
        return checks

    @staticmethod
    def _run(name: str, body: Callable[[list[str]], str]) -> Check:
        failures: list[str] = []
        try:
            summary = body(failures)
        except _Skip as skip:
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
            fail.append(_raised("", exc))
            return ""
        if not isinstance(specs, (list, tuple)):
            fail.append(f"specs() returned {_kind(specs)}, not a list of VarSpec")
            return ""
        if not specs:
            fail.append("specs() returned no variables")
            return ""
        for i, spec in enumerate(specs):
            if not isinstance(spec, VarSpec):
                fail.append(f"item {i} of specs() is {_kind(spec)}, not a VarSpec")
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
            fail.append(f"{which} {_names(names)} {'is' if len(names) == 1 else 'are'} {dt} but the job's dtype "
                        f"is {self.dtype} (give each VarSpec the dtype the model was built with)")
        if fail:
            return ""
        self.specs = list(specs)
        total = sum(s.size for s in specs)
        return f"{len(specs)} variable{'s' * (len(specs) != 1)}, {total:,} parameters, {self.dtype}"

    def _check_values(self, what: str, values: Any, names: list[str], fail: list[str]) -> bool:
        if not isinstance(values, Mapping):
            fail.append(f"{what} returned {_kind(values)}, not a dict of arrays by variable name")
            return False
        missing = [n for n in names if n not in values]
        extra = [n for n in values if n not in names]
        if missing:
            fail.append(f"{what} gives no value for {_names(missing)}")
        if extra:
            fail.append(f"{what} gives a value for {_names(extra)}, which "
                        + ("it was not asked for" if len(names) < len(self.specs) else "specs() does not list"))
        by_name = {s.name: s for s in self.specs}
        for n in names:
            if n not in values:
                continue
            value, spec = values[n], by_name[n]
            if getattr(value, "shape", None) is None or getattr(value, "dtype", None) is None:
                fail.append(f"{what} gives {_kind(value)} for {n!r}, not an array")
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
            fail.append(_raised(f"init({self.seed})", exc))
            return ""
        if not self._check_values(f"init({self.seed})", values, names, fail):
            return ""
        one = min(self.specs, key=lambda spec: spec.size).name  # the smallest: cheap for big models
        what = f"init({self.seed}, names=[{one!r}])"
        try:
            some = self.model.init(self.seed, names=[one])
        except Exception as exc:
            fail.append(_raised(what, exc) + "; the parameter-server shards call it to create only their own "
                        "variables (subclass psgd.model.BaseModel to get it)")
            return ""
        if not self._check_values(what, some, [one], fail):
            return ""
        del some
        self.params = {n: self.device.asarray(values[n]) for n in names}
        return (f"{len(names)} array{'s' * (len(names) != 1)} with the specs' shapes and dtypes, "
                "and only the variables asked for with names=[...]")

    # -- loss_and_grads, gradients, predict ---------------------------------------------------------
    def _call(self, model: Any, params: Mapping[str, Any], x: Any) -> tuple[float | None, Any, list[str]]:
        """Call loss_and_grads; ``(loss or None, gradients, problems)`` with the order sorted out."""
        result = model.loss_and_grads(dict(params), x, self.y)
        if not isinstance(result, (tuple, list)) or len(result) != 2:
            return None, None, [f"returned {_kind(result)}; it must return a (loss, gradients) tuple"]
        first, second = result
        problems = []
        if isinstance(first, Mapping) and not isinstance(second, Mapping):
            problems.append("returned (gradients, loss); it must return (loss, gradients), in that order")
            first, second = second, first
        loss, why = _scalar(first)
        if loss is None:
            problems.append(f"the loss is {why}")
        if not isinstance(second, Mapping):
            problems.append(f"the gradients are {_kind(second)}, not a dict of arrays by variable name")
            second = None
        return loss, second, problems

    def check_loss(self, fail: list[str]) -> str:
        try:
            began = time.perf_counter()
            loss, grads, problems = self._call(self.model, self.params, self.x)
            self.step_seconds = time.perf_counter() - began
        except Exception as exc:
            fail.append(_raised("", exc))
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
        grads = self.result[1]
        names = [s.name for s in self.specs]
        missing = [n for n in names if n not in grads]
        unknown = [n for n in grads if n not in names]
        if missing:
            fail.append(f"no gradient for {_names(missing)} (loss_and_grads must return one for every variable "
                        "in specs(), zeros included)")
        if unknown:
            fail.append(f"gradient{'s' * (len(unknown) != 1)} for {_names(unknown)}, which specs() does not list")
        xp = self.device.xp
        for spec in self.specs:
            if spec.name not in grads:
                continue
            g, n = grads[spec.name], spec.name
            if getattr(g, "shape", None) is None or getattr(g, "dtype", None) is None:
                fail.append(f"the gradient for {n!r} is {_kind(g)}, not an array")
            elif tuple(g.shape) != spec.shape:
                fail.append(f"the gradient for {n!r} has shape {tuple(g.shape)}, but the variable has {spec.shape}")
            elif np.dtype(g.dtype).name != spec.dtype:
                fail.append(f"the gradient for {n!r} is {np.dtype(g.dtype).name}, but the variable is {spec.dtype}")
            elif backend.get_array_module(g) is not xp:
                fail.append(f"the gradient for {n!r} is a {type(g).__module__}.{type(g).__name__}, but the weights "
                            f"are on {self.device} (compute with the array module of the params)")
            else:
                bad = int(backend.to_host((~xp.isfinite(g)).sum()))
                if bad:
                    fail.append(f"the gradient for {n!r} has {bad} non-finite value{'s' * (bad != 1)} (nan or inf)")
                else:
                    self.good_grads.append(n)
        if fail:
            return ""
        return "one per variable, with its shape and dtype, all finite"

    def check_predict(self, fail: list[str]) -> str:
        try:
            scores = self.model.predict(dict(self.params), self.x)
        except Exception as exc:
            fail.append(_raised("", exc))
            return ""
        want = (self.batch, self.num_classes)
        if getattr(scores, "shape", None) is None:
            fail.append(f"returned {_kind(scores)}, not an array of scores")
        elif tuple(scores.shape) != want:
            fail.append(f"returned shape {tuple(scores.shape)}; it must return scores of shape "
                        f"(batch, num_classes) = {want}, one row per example")
        elif backend.get_array_module(scores) is not self.device.xp:
            fail.append(f"returned a {type(scores).__module__}.{type(scores).__name__}, but the weights "
                        f"are on {self.device}")
        else:
            host = backend.to_host(scores)
            if host.dtype.kind not in "fiu":
                fail.append(f"returned {host.dtype} scores, not numbers")
            elif not np.isfinite(host).all():
                fail.append("returned non-finite scores")
        return "" if fail else f"scores of shape {want}"

    # -- finite differences -------------------------------------------------------------------------
    def _float64_twin(self) -> Any:
        """The same model built for float64 (same variables), or None when it cannot be."""
        if self.dtype == "float64":
            return self.model
        makers = []
        if self.name:
            from psgd.model import build_model

            makers.append(lambda: build_model(self.name, self.input_shape, self.num_classes, dtype="float64",
                                              **self.options))
        makers.append(lambda: type(self.model)(input_shape=self.input_shape, num_classes=self.num_classes,
                                               dtype="float64", **self.options))
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
        base = {n: self.device.asarray(a) for n, a in host.items()}

        def f(changed: str | None = None) -> tuple[float, Any]:
            params = dict(base)
            if changed is not None:
                params[changed] = self.device.asarray(host[changed])
            loss, grads, problems = self._call(model, params, x)
            if loss is None or grads is None:
                raise ModelError("; ".join(p for p in problems if "order" not in p))
            return loss, grads

        return f

    def check_finite_differences(self, fail: list[str]) -> str:
        self._coordinates(self.step_seconds)  # skip before copying anything when even the job's dtype is slow
        for model, dt, trusted in self._candidates():
            host = {n: backend.to_host(v).astype(dt) for n, v in self.params.items()}
            found: list[str] = []
            try:
                f = self._loss_function(model, dt, host)
                began = time.perf_counter()
                loss0, grads = f()
                step = time.perf_counter() - began
                if not trusted and not all(np.dtype(getattr(grads.get(n), "dtype", "O")).name == dt
                                           for n in self.good_grads):
                    continue
                again = f()[0]
                if abs(again - loss0) > 1e-12 * max(1.0, abs(loss0)):
                    raise _Skip(f"two calls at the same weights gave the losses {loss0:.10g} and {again:.10g} "
                                "(random dropout?); finite differences need the same loss for the same weights")
                summary = self._compare(f, host, loss0, grads, dt, self._coordinates(step), found)
            except _Skip:
                raise
            except Exception as exc:
                found = [_raised("loss_and_grads", exc)]
                summary = ""
            if found and not trusted:
                continue
            fail.extend(found)
            return summary
        return ""  # pragma: no cover - the last candidate is always trusted

    def _coordinates(self, step: float) -> int:
        """Coordinates per variable that fit the budget, two steps each; :class:`_Skip` when not even one does."""
        calls = 2 * len(self.good_grads)
        if self.budget is None or calls * FD_COORDINATES * step <= self.budget:
            return FD_COORDINATES
        if calls * step <= self.budget:
            return 1
        raise _Skip(f"a step takes {step:.2f} s here, too long to take {calls} more at the start of every process "
                    "(psgd check-model checks them)")

    def _compare(self, f: Callable[..., tuple[float, Any]], host: dict[str, np.ndarray],
                 loss0: float, grads: Mapping[str, Any], dt: str, coordinates: int, fail: list[str]) -> str:
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
                fail.append(f"the gradient for {n!r} at [{at}] is {a:.6g}, but central differences of the loss give "
                            f"{central:.6g} (relative error {err:.1e}, tolerance {rtol:.0e}){more}")
        if fail:
            return ""
        how = ("in float64" if dt == "float64"
               else f"in {dt} with a loose tolerance (the model does not compute in float64)")
        kinked = f"; {kinks} next to a kink agree one-sided" if kinks else ""
        return (f"{checked} coordinates of {len(self.good_grads)} gradient{'s' * (len(self.good_grads) != 1)} agree "
                f"with central differences {how} (largest relative error {worst:.1e}, tolerance {rtol:.0e}{kinked})")
