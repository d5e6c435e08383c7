"""Optimizers and learning-rate schedules, written once against ``xp``.

Parameter-server shards update *slices* of variables, each under a string key
such as ``"dense0/W#0"``; the all-reduce trainer updates whole variables.  Both
call :meth:`Optimizer.update` with a parameter and its gradient, NumPy or CuPy
arrays, and the parameter is changed in place.  Per-key state (moment buffers
and the step count ``t``) is created on a key's first update.

Every optimizer implements one hook, ``_step(param, grad, state, lr, t)``.
Updates are written with in-place ufuncs (``out=``), so a step allocates at
most one parameter-sized temporary (NumPy has no fused ``axpy``).

Learning rates come from a schedule, a callable ``schedule(t) -> float`` where
``t`` is the number of updates already applied to the key (0-based).

Threads: different keys may be updated concurrently; one key must not be.
``state_dict``/``load_state_dict`` are not atomic with respect to updates in
flight, so a caller that checkpoints while training holds its own lock.
CuPy: the parameter, gradient and state of a key live on one GPU, and that GPU
must be the calling thread's current device (``Device.use()``).
"""

from __future__ import annotations

import math
import numbers
import threading
from typing import Any, Mapping

import numpy as np

from psgd import xp as backend

__all__ = [
    "OptimizerError",
    "Schedule",
    "Constant",
    "StepDecay",
    "Cosine",
    "Warmup",
    "build_schedule",
    "Optimizer",
    "SGD",
    "Momentum",
    "Adam",
    "AdamW",
    "build_optimizer",
    "OPTIMIZERS",
    "SCHEDULES",
    "SCHEDULE_OPTIONS",
    "DEFAULT_LR",
]

SEP = "::"  # state_dict names are "<key>::<field>"; keys may themselves contain "::"


class OptimizerError(ValueError):
    """A bad optimizer or schedule name, option or value, or a bad update."""


# --- validation ---------------------------------------------------------------


def _real(owner: str, name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise OptimizerError(f"{owner}: {name} must be a number, got {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise OptimizerError(f"{owner}: {name} must be finite, got {value!r}")
    return value


def _positive(owner: str, name: str, value: Any) -> float:
    value = _real(owner, name, value)
    if value <= 0:
        raise OptimizerError(f"{owner}: {name} must be > 0, got {value!r}")
    return value


def _non_negative(owner: str, name: str, value: Any) -> float:
    value = _real(owner, name, value)
    if value < 0:
        raise OptimizerError(f"{owner}: {name} must be >= 0, got {value!r}")
    return value


def _fraction(owner: str, name: str, value: Any) -> float:
    """A value in [0, 1): a momentum or a moment decay rate."""
    value = _real(owner, name, value)
    if not 0 <= value < 1:
        raise OptimizerError(f"{owner}: {name} must be in [0, 1), got {value!r}")
    return value


def _integer(owner: str, name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise OptimizerError(f"{owner}: {name} must be an integer, got {value!r}")
    if value < minimum:
        raise OptimizerError(f"{owner}: {name} must be >= {minimum}, got {value!r}")
    return int(value)


def _reject_unknown(owner: str, given: Mapping[str, Any], accepted: tuple[str, ...]) -> None:
    unknown = [name for name in given if name not in accepted]
    if unknown:
        what = "option" if len(unknown) == 1 else "options"
        raise OptimizerError(
            f"{owner}: unknown {what} {', '.join(repr(u) for u in unknown)}; "
            f"accepted: {', '.join(accepted) or 'none'}"
        )


# --- learning-rate schedules --------------------------------------------------


class Schedule:
    """A learning rate as a function of ``t``, the updates already applied to a key.

    ``lr`` is the base (peak) rate; ``describe()`` returns the flat options that
    :func:`build_schedule` takes to rebuild the schedule.
    """

    lr: float

    def __call__(self, t: int) -> float:
        raise NotImplementedError

    def describe(self) -> dict[str, Any]:
        raise NotImplementedError

    def __repr__(self) -> str:
        options = ", ".join(f"{k}={v!r}" for k, v in self.describe().items())
        return f"{type(self).__name__}({options})"


class Constant(Schedule):
    """``lr`` at every step."""

    def __init__(self, lr: float):
        self.lr = _positive("constant schedule", "lr", lr)

    def __call__(self, t: int) -> float:
        return self.lr

    def describe(self) -> dict[str, Any]:
        return {"lr": self.lr, "schedule": "constant"}


class StepDecay(Schedule):
    """``lr * gamma ** (t // step_size)``: the classic piecewise-constant decay."""

    def __init__(self, lr: float, step_size: int, gamma: float = 0.1):
        owner = "step schedule"
        self.lr = _positive(owner, "lr", lr)
        self.step_size = _integer(owner, "step_size", step_size, 1)
        self.gamma = _positive(owner, "gamma", gamma)
        if self.gamma > 1:
            raise OptimizerError(f"{owner}: gamma must be in (0, 1], got {self.gamma!r}")

    def __call__(self, t: int) -> float:
        return self.lr * self.gamma ** (t // self.step_size)

    def describe(self) -> dict[str, Any]:
        return {"lr": self.lr, "schedule": "step", "step_size": self.step_size, "gamma": self.gamma}


class Cosine(Schedule):
    """Cosine annealing from ``lr`` to ``min_lr`` over ``total_steps``, then ``min_lr``.

    ``min_lr + (lr - min_lr) * (1 + cos(pi * min(t, total_steps) / total_steps)) / 2``:
    SGDR without restarts (Loshchilov & Hutter, "SGDR: Stochastic Gradient
    Descent with Warm Restarts", ICLR 2017, arXiv:1608.03983).
    """

    def __init__(self, lr: float, total_steps: int, min_lr: float = 0.0):
        owner = "cosine schedule"
        self.lr = _positive(owner, "lr", lr)
        self.total_steps = _integer(owner, "total_steps", total_steps, 1)
        self.min_lr = _non_negative(owner, "min_lr", min_lr)
        if self.min_lr > self.lr:
            raise OptimizerError(f"{owner}: min_lr ({self.min_lr!r}) must not exceed lr ({self.lr!r})")

    def __call__(self, t: int) -> float:
        progress = min(t, self.total_steps) / self.total_steps
        return self.min_lr + (self.lr - self.min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))

    def describe(self) -> dict[str, Any]:
        return {"lr": self.lr, "schedule": "cosine", "total_steps": self.total_steps, "min_lr": self.min_lr}


class Warmup(Schedule):
    """Linear warmup in front of any schedule: ``inner(t) * min(1, (t + 1) / warmup_steps)``.

    The first update uses ``inner(0) / warmup_steps`` and update ``warmup_steps``
    (t = warmup_steps - 1) the full ``inner(t)``.  The inner schedule sees the
    same ``t`` (warmup steps count towards a cosine's ``total_steps``).
    ``warmup_steps=0`` is no warmup.  Goyal et al., "Accurate, Large Minibatch
    SGD: Training ImageNet in 1 Hour", 2017, arXiv:1706.02677.
    """

    def __init__(self, inner: Schedule, warmup_steps: int):
        if not isinstance(inner, Schedule):
            raise OptimizerError(f"warmup: inner must be a Schedule, got {inner!r}")
        self.inner = inner
        self.lr = inner.lr
        self.warmup_steps = _integer("warmup", "warmup_steps", warmup_steps, 0)

    def __call__(self, t: int) -> float:
        if t < self.warmup_steps:
            return self.inner(t) * (t + 1) / self.warmup_steps
        return self.inner(t)

    def describe(self) -> dict[str, Any]:
        inner = self.inner.describe()
        if "warmup_steps" in inner:  # a warmup of a warmup: not expressible as flat options
            return {"lr": self.lr, "schedule": "warmup", "warmup_steps": self.warmup_steps, "inner": inner}
        return {**inner, "warmup_steps": self.warmup_steps}


# name -> (class, its options besides lr); warmup_steps applies to every schedule
SCHEDULES: dict[str, tuple[type[Schedule], tuple[str, ...]]] = {
    "constant": (Constant, ()),
    "step": (StepDecay, ("step_size", "gamma")),
    "cosine": (Cosine, ("total_steps", "min_lr")),
}
SCHEDULE_OPTIONS = ("step_size", "gamma", "total_steps", "min_lr", "warmup_steps")
_REQUIRED = {"step": "step_size", "cosine": "total_steps"}


def build_schedule(lr: float, schedule: str = "constant", **options: Any) -> Schedule:
    """The schedule named ``constant``, ``step`` or ``cosine``, with optional warmup.

    ``step`` needs ``step_size`` (``gamma`` defaults to 0.1); ``cosine`` needs
    ``total_steps`` (``min_lr`` defaults to 0).  ``warmup_steps`` > 0 wraps the
    result in :class:`Warmup`.  Options given as ``None`` count as not given.
    """
    if schedule is None:
        schedule = "constant"
    name = schedule.strip().lower() if isinstance(schedule, str) else schedule
    if name not in SCHEDULES:
        raise OptimizerError(f"unknown schedule {schedule!r}: choose {', '.join(SCHEDULES)}")
    cls, accepted = SCHEDULES[name]
    owner = f"{name} schedule"
    _reject_unknown(owner, options, accepted + ("warmup_steps",))
    options = {k: v for k, v in options.items() if v is not None}
    required = _REQUIRED.get(name)
    if required and required not in options:
        raise OptimizerError(f"{owner}: needs {required}")
    warmup_steps = options.pop("warmup_steps", 0)
    result = cls(lr, **options)
    warmup_steps = _integer("warmup", "warmup_steps", warmup_steps, 0)
    return Warmup(result, warmup_steps) if warmup_steps else result


# --- optimizers ---------------------------------------------------------------


class _Slot:
    """One key's state: the update count and the optimizer's buffers."""

    __slots__ = ("t", "state")

    def __init__(self, t: int, state: dict[str, Any]):
        self.t = t
        self.state = state


def _is_array(a: Any) -> bool:
    return isinstance(a, np.ndarray) or backend.is_device_array(a)


def _where(a: Any) -> str:
    return "a CuPy array" if backend.is_device_array(a) else "a NumPy array"


class Optimizer:
    """Per-key optimizer state and the update loop around one ``_step`` hook.

    ``lr`` is a positive number (a constant rate) or a :class:`Schedule`.
    Subclasses set ``name`` and ``state_names`` (buffers created as
    ``zeros_like(param)`` on a key's first update), validate their
    hyperparameters, list them in ``hyperparameters()`` and implement ``_step``.
    """

    name = "optimizer"
    state_names: tuple[str, ...] = ()

    def __init__(self, lr: float | Schedule):
        if isinstance(lr, Schedule):
            self.schedule = lr
        else:
            self.schedule = Constant(_positive(self.name, "lr", lr))
        self._slots: dict[str, _Slot] = {}
        self._lock = threading.Lock()  # guards the key table, not the per-key arithmetic

    def _step(self, param: Any, grad: Any, state: dict[str, Any], lr: float, t: int) -> None:
        """Update ``param`` (and ``state``) in place.

        ``lr`` is this update's learning rate (schedule times ``lr_scale``) and
        ``t`` this update's number counted from 1, as in Adam's bias correction.
        """
        raise NotImplementedError

    def hyperparameters(self) -> dict[str, Any]:
        return {}

    @property
    def lr(self) -> float:
        """The base learning rate (the schedule's peak)."""
        return self.schedule.lr

    # -- the update ----------------------------------------------------------

    def update(self, key: str, param: Any, grad: Any, lr_scale: float = 1.0) -> None:
        """Apply one update to ``param`` in place, with ``grad``, under ``key``.

        The learning rate is ``schedule(t) * lr_scale``, ``t`` being the updates
        already applied to ``key`` (``lr_scale`` carries e.g. 1/staleness).
        """
        self._check(key, param, grad, lr_scale)
        slot = self._slot(key, param)
        lr = self.schedule(slot.t) * lr_scale
        self._step(param, grad, slot.state, lr, slot.t + 1)
        slot.t += 1

    def _check(self, key: str, param: Any, grad: Any, lr_scale: float) -> None:
        if not isinstance(key, str):
            raise OptimizerError(f"{self.name}: key must be a string, got {key!r}")
        where = f"{self.name}: key {key!r}"
        for label, a in (("param", param), ("grad", grad)):
            if not _is_array(a):
                raise OptimizerError(f"{where}: {label} must be a NumPy or CuPy array, got {type(a).__name__}")
        if backend.is_device_array(param) != backend.is_device_array(grad):
            raise OptimizerError(
                f"{where}: param is {_where(param)} but grad is {_where(grad)}; put both on one device"
            )
        if param.shape != grad.shape:
            raise OptimizerError(f"{where}: grad shape {grad.shape} does not match param shape {param.shape}")
        if param.dtype != grad.dtype:
            raise OptimizerError(f"{where}: grad dtype {grad.dtype} does not match param dtype {param.dtype}")
        if param.dtype.kind != "f":
            raise OptimizerError(f"{where}: param dtype {param.dtype} is not floating point")
        if not getattr(param.flags, "writeable", True):
            raise OptimizerError(f"{where}: param is read-only; the optimizer updates it in place")
        if lr_scale != 1.0:
            _non_negative(where, "lr_scale", lr_scale)

    def _slot(self, key: str, param: Any) -> _Slot:
        slot = self._slots.get(key)
        if slot is None:
            xp = backend.get_array_module(param)
            state = {name: xp.zeros_like(param) for name in self.state_names}
            with self._lock:
                return self._slots.setdefault(key, _Slot(0, state))
        for name, buf in slot.state.items():
            if buf.shape != param.shape or buf.dtype != param.dtype:
                raise OptimizerError(
                    f"{self.name}: key {key!r}: param {param.shape} {param.dtype} does not match its "
                    f"optimizer state {buf.shape} {buf.dtype} (a key reused for another variable, "
                    "or state restored from another model?)"
                )
            if backend.is_device_array(buf) != backend.is_device_array(param):  # after load_state_dict(device=None)
                if backend.is_device_array(param):
                    slot.state[name] = backend.get_array_module(param).asarray(buf)
                else:
                    slot.state[name] = backend.to_host(buf)
        return slot

    # -- inspection ----------------------------------------------------------

    def keys(self) -> list[str]:
        """The keys that have state, in the order they were first updated (or loaded)."""
        with self._lock:
            return list(self._slots)

    def step_count(self, key: str) -> int:
        """Updates applied to ``key`` (0 for a key never updated)."""
        slot = self._slots.get(key)
        return 0 if slot is None else slot.t

    def state(self, key: str) -> dict[str, Any]:
        """The live state buffers of ``key`` by name (not copies)."""
        slot = self._slots.get(key)
        if slot is None:
            raise OptimizerError(f"{self.name}: no state for key {key!r}; it has not been updated or loaded")
        return dict(slot.state)

    def describe(self) -> dict[str, Any]:
        """Name, learning rate, schedule and hyperparameters as flat JSON-ready values.

        ``build_optimizer(**opt.describe())`` rebuilds an equivalent optimizer.
        """
        return {"name": self.name, **self.schedule.describe(), **self.hyperparameters()}

    def __repr__(self) -> str:
        options = ", ".join(f"{k}={v!r}" for k, v in self.describe().items() if k != "name")
        return f"{type(self).__name__}({options})"

    # -- checkpoints ---------------------------------------------------------

    def state_dict(self) -> dict[str, np.ndarray]:
        """Host copies of all state: ``"<key>::t"`` (0-d int64) and ``"<key>::<buffer>"``.

        Ready for ``numpy.savez``.
        """
        with self._lock:
            items = list(self._slots.items())
        out: dict[str, np.ndarray] = {}
        for key, slot in items:
            out[f"{key}{SEP}t"] = np.array(slot.t, dtype=np.int64)
            for name, buf in slot.state.items():
                host = backend.to_host(buf)
                out[f"{key}{SEP}{name}"] = host.copy() if host is buf else host
        return out

    def load_state_dict(self, d: Mapping[str, Any], device: backend.Device | str | None = None) -> None:
        """Replace all state with ``d`` (as written by :meth:`state_dict`, or an npz file).

        Buffers go to ``device`` when given; with ``device=None`` they are loaded
        as NumPy arrays and moved next to the parameter on its first update.
        Everything is checked before anything changes.
        """
        target = None if device is None else backend.get_device(device)
        fields_by_key: dict[str, dict[str, Any]] = {}
        expected = ("t",) + self.state_names
        for entry in d:
            if not isinstance(entry, str) or SEP not in entry:
                raise OptimizerError(f"{self.name}: state_dict entry {entry!r} is not '<key>{SEP}<field>'")
            key, field = entry.rsplit(SEP, 1)
            if field not in expected:
                raise OptimizerError(
                    f"{self.name}: state_dict entry {entry!r} is not {self.name} state "
                    f"(fields: {', '.join(expected)})"
                )
            fields_by_key.setdefault(key, {})[field] = d[entry]
        slots: dict[str, _Slot] = {}
        for key, fields in fields_by_key.items():
            where = f"{self.name}: state_dict key {key!r}"
            missing = [f for f in expected if f not in fields]
            if missing:
                raise OptimizerError(f"{where}: missing {', '.join(missing)}")
            t = backend.to_host(fields["t"])
            if t.ndim != 0 or t.dtype.kind not in "iu" or int(t) < 0:
                raise OptimizerError(f"{where}: t must be a non-negative integer scalar, got {t!r}")
            state = {}
            first = backend.to_host(fields[self.state_names[0]]) if self.state_names else None
            for name in self.state_names:
                host = backend.to_host(fields[name])
                if host.dtype.kind != "f" or host.shape != first.shape or host.dtype != first.dtype:
                    raise OptimizerError(
                        f"{where}: buffer {name!r} ({host.shape} {host.dtype}) must be floating point and "
                        f"match {self.state_names[0]!r} ({first.shape} {first.dtype})"
                    )
                if target is not None and target.is_gpu:
                    state[name] = backend.to_device(host, target)
                else:
                    state[name] = host.copy() if host is fields[name] else host
            slots[key] = _Slot(int(t), state)
        with self._lock:
            self._slots = slots


class SGD(Optimizer):
    """Stochastic gradient descent with L2 weight decay: ``p -= lr * (g + wd * p)``.

    Robbins & Monro, "A Stochastic Approximation Method", Ann. Math. Statist. 1951.
    """

    name = "sgd"

    def __init__(self, lr: float | Schedule, weight_decay: float = 0.0):
        super().__init__(lr)
        self.weight_decay = _non_negative(self.name, "weight_decay", weight_decay)

    def hyperparameters(self) -> dict[str, Any]:
        return {"weight_decay": self.weight_decay}

    def _step(self, param, grad, state, lr, t):
        xp = backend.get_array_module(param)
        if self.weight_decay:  # the lr * wd * p part of the update
            xp.multiply(param, 1.0 - lr * self.weight_decay, out=param)
        param -= xp.multiply(grad, lr)


class Momentum(Optimizer):
    """SGD with (Nesterov) momentum, as common frameworks write it.

    ``v = mu * v + g``; ``p -= lr * v``, or with ``nesterov``
    ``p -= lr * (g + mu * v)``; L2 weight decay adds ``wd * p`` to ``g``.
    Sutskever, Martens, Dahl & Hinton, "On the importance of initialization and
    momentum in deep learning", ICML 2013 (after Polyak 1964 and Nesterov 1983).
    The paper scales ``g`` by ``lr`` inside ``v``; for a constant ``lr`` the two
    forms are the same, and this one keeps ``v`` independent of the schedule.
    """

    name = "momentum"
    state_names = ("v",)

    def __init__(self, lr: float | Schedule, momentum: float = 0.9, nesterov: bool = False, weight_decay: float = 0.0):
        if not isinstance(nesterov, bool):
            raise OptimizerError(f"momentum: nesterov must be true or false, got {nesterov!r}")
        self.nesterov = nesterov
        self.name = "nesterov" if nesterov else "momentum"
        super().__init__(lr)
        self.momentum = _fraction(self.name, "momentum", momentum)
        self.weight_decay = _non_negative(self.name, "weight_decay", weight_decay)

    def hyperparameters(self) -> dict[str, Any]:
        return {"momentum": self.momentum, "weight_decay": self.weight_decay}

    def _step(self, param, grad, state, lr, t):
        xp = backend.get_array_module(param)
        v, mu, wd = state["v"], self.momentum, self.weight_decay
        tmp = xp.empty_like(param)
        v *= mu
        v += grad
        if wd:  # L2: the gradient is g + wd * p
            xp.multiply(param, wd, out=tmp)
            v += tmp
        if self.nesterov:  # p -= lr * (g + wd * p + mu * v)
            if wd:
                xp.multiply(param, 1.0 - lr * wd, out=param)
            xp.multiply(v, mu, out=tmp)
            tmp += grad
            tmp *= lr
        else:  # p -= lr * v
            xp.multiply(v, lr, out=tmp)
        param -= tmp


class Adam(Optimizer):
    """Adam with bias correction and L2 weight decay (added to the gradient).

    ``m = b1 m + (1 - b1) g``, ``v = b2 v + (1 - b2) g^2``,
    ``p -= lr * (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)``.
    Kingma & Ba, "Adam: A Method for Stochastic Optimization", ICLR 2015,
    arXiv:1412.6980 (Algorithm 1).
    """

    name = "adam"
    state_names = ("m", "v")
    decoupled = False  # AdamW: weight decay applied to p directly, not through g

    def __init__(
        self,
        lr: float | Schedule = 1e-3,
        beta1: float = 0.9,
        beta2: float = 0.999,
        eps: float = 1e-8,
        weight_decay: float = 0.0,
    ):
        super().__init__(lr)
        self.beta1 = _fraction(self.name, "beta1", beta1)
        self.beta2 = _fraction(self.name, "beta2", beta2)
        self.eps = _positive(self.name, "eps", eps)
        self.weight_decay = _non_negative(self.name, "weight_decay", weight_decay)

    def hyperparameters(self) -> dict[str, Any]:
        return {"beta1": self.beta1, "beta2": self.beta2, "eps": self.eps, "weight_decay": self.weight_decay}

    def _step(self, param, grad, state, lr, t):
        xp = backend.get_array_module(param)
        m, v, b1, b2, wd = state["m"], state["v"], self.beta1, self.beta2, self.weight_decay
        if wd and self.decoupled:  # AdamW: p -= lr * wd * p, on the weights before this step
            xp.multiply(param, 1.0 - lr * wd, out=param)
        if wd and not self.decoupled:  # L2: g + wd * p, in the one temporary
            g = tmp = xp.multiply(param, wd)
            g += grad
        else:
            g, tmp = grad, xp.empty_like(param)
        m -= g  # m = b1 * m + (1 - b1) * g, as b1 * (m - g) + g: no temporary
        m *= b1
        m += g
        xp.multiply(g, g, out=tmp)  # v = b2 * v + (1 - b2) * g^2  (g is not needed after this)
        tmp *= 1.0 - b2
        v *= b2
        v += tmp
        xp.sqrt(v, out=tmp)  # sqrt(v_hat) + eps
        tmp *= 1.0 / math.sqrt(1.0 - b2**t)
        tmp += self.eps
        xp.divide(m, tmp, out=tmp)
        tmp *= lr / (1.0 - b1**t)  # m_hat = m / (1 - b1^t)
        param -= tmp


class AdamW(Adam):
    """Adam with decoupled weight decay: ``p -= lr * wd * p`` besides the Adam step.

    Loshchilov & Hutter, "Decoupled Weight Decay Regularization", ICLR 2019,
    arXiv:1711.05101 (Algorithm 2, with the schedule multiplier folded into lr).
    """

    name = "adamw"
    decoupled = True

    def __init__(
        self,
        lr: float | Schedule = 1e-3,
        beta1: float = 0.9,
        beta2: float = 0.999,
        eps: float = 1e-8,
        weight_decay: float = 0.01,
    ):
        super().__init__(lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay)


# name -> (class, options it accepts besides lr and the schedule's, fixed arguments)
OPTIMIZERS: dict[str, tuple[type[Optimizer], tuple[str, ...], dict[str, Any]]] = {
    "sgd": (SGD, ("weight_decay",), {}),
    "momentum": (Momentum, ("momentum", "nesterov", "weight_decay"), {}),
    "nesterov": (Momentum, ("momentum", "weight_decay"), {"nesterov": True}),
    "adam": (Adam, ("beta1", "beta2", "eps", "weight_decay"), {}),
    "adamw": (AdamW, ("beta1", "beta2", "eps", "weight_decay"), {}),
}

# The learning rate when none is given: 0.05 for the SGD family (the job
# default, suited to the built-in models; with momentum mu the effective step is
# about lr / (1 - mu), so lower it for deep nets), 1e-3 as Kingma & Ba suggest.
DEFAULT_LR = {"sgd": 0.05, "momentum": 0.05, "nesterov": 0.05, "adam": 1e-3, "adamw": 1e-3}


def build_optimizer(name: str, lr: float | None = None, schedule: str = "constant", **options: Any) -> Optimizer:
    """The optimizer ``sgd``, ``momentum``, ``nesterov``, ``adam`` or ``adamw``.

    ``lr`` defaults to ``DEFAULT_LR[name]``.  Schedule options (``step_size``,
    ``gamma``, ``total_steps``, ``min_lr``, ``warmup_steps``) go to
    :func:`build_schedule`, the rest to the optimizer.  Options given as
    ``None`` count as not given.
    """
    key = name.strip().lower() if isinstance(name, str) else name
    if key not in OPTIMIZERS:
        raise OptimizerError(f"unknown optimizer {name!r}: choose {', '.join(OPTIMIZERS)}")
    cls, accepted, fixed = OPTIMIZERS[key]
    _reject_unknown(key, options, ("lr",) + accepted + ("schedule",) + SCHEDULE_OPTIONS)
    schedule_options = {k: v for k, v in options.items() if k in SCHEDULE_OPTIONS}
    optimizer_options = {k: v for k, v in options.items() if k in accepted and v is not None}
    lr = DEFAULT_LR[key] if lr is None else _positive(key, "lr", lr)
    return cls(build_schedule(lr, schedule, **schedule_options), **fixed, **optimizer_options)
