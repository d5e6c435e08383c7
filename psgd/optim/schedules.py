"""Learning-rate schedules: a rate as a function of ``t``, the updates already applied to a key.

:class:`Constant`, :class:`StepDecay` and :class:`Cosine`, :class:`Warmup` in
front of any of them, and :func:`build_schedule`, which builds one by name.
"""

from __future__ import annotations

import math
from typing import Any

from psgd.optim.validation import OptimizerError, integer, non_negative, positive, reject_unknown


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
        self.lr = positive("constant schedule", "lr", lr)

    def __call__(self, t: int) -> float:
        return self.lr

    def describe(self) -> dict[str, Any]:
        return {"lr": self.lr, "schedule": "constant"}


class StepDecay(Schedule):
    """``lr * gamma ** (t // step_size)``: the classic piecewise-constant decay."""

    def __init__(self, lr: float, step_size: int, gamma: float = 0.1):
        owner = "step schedule"
        self.lr = positive(owner, "lr", lr)
        self.step_size = integer(owner, "step_size", step_size, 1)
        self.gamma = positive(owner, "gamma", gamma)
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
        self.lr = positive(owner, "lr", lr)
        self.total_steps = integer(owner, "total_steps", total_steps, 1)
        self.min_lr = non_negative(owner, "min_lr", min_lr)
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
        self.warmup_steps = integer("warmup", "warmup_steps", warmup_steps, 0)

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
    reject_unknown(owner, options, accepted + ("warmup_steps",))
    options = {k: v for k, v in options.items() if v is not None}
    required = _REQUIRED.get(name)
    if required and required not in options:
        raise OptimizerError(f"{owner}: needs {required}")
    warmup_steps = options.pop("warmup_steps", 0)
    result = cls(lr, **options)
    warmup_steps = integer("warmup", "warmup_steps", warmup_steps, 0)
    return Warmup(result, warmup_steps) if warmup_steps else result
