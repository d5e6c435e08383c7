"""Optimizers by name: :data:`OPTIMIZERS`, :data:`DEFAULT_LR` and :func:`build_optimizer`."""

from __future__ import annotations

from typing import Any

from psgd.optim.base import Optimizer
from psgd.optim.rules import SGD, Adam, AdamW, Momentum
from psgd.optim.schedules import SCHEDULE_OPTIONS, build_schedule
from psgd.optim.validation import OptimizerError, positive, reject_unknown

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
    reject_unknown(key, options, ("lr",) + accepted + ("schedule",) + SCHEDULE_OPTIONS)
    schedule_options = {k: v for k, v in options.items() if k in SCHEDULE_OPTIONS}
    optimizer_options = {k: v for k, v in options.items() if k in accepted and v is not None}
    lr = DEFAULT_LR[key] if lr is None else positive(key, "lr", lr)
    return cls(build_schedule(lr, schedule, **schedule_options), **fixed, **optimizer_options)
