"""Optimizers and learning-rate schedules, written once against ``xp``.

Parameter-server shards update *slices* of variables, each under a string key
such as ``"dense0/W#0"``; the all-reduce trainer updates whole variables.  Both
call :meth:`Optimizer.update` with a parameter and its gradient, NumPy or CuPy
arrays, and the parameter is changed in place.  Per-key state (moment buffers
and the step count ``t``) is created on a key's first update.

Every optimizer implements two hooks: ``_scalars(lr, t, share)``, the values
of an update that change from update to update (worked out on the host), and
``_apply(param, grad, state, scalars, share)``, the update itself: one fused
kernel on CuPy, in-place ufuncs (``out=``) on NumPy that allocate at most one
parameter-sized temporary (NumPy has no fused ``axpy``).

Learning rates come from a schedule, a callable ``schedule(t) -> float`` where
``t`` is the number of updates already applied to the key (0-based).

Threads: different keys may be updated concurrently; one key must not be.
``state_dict``/``load_state_dict`` are not atomic with respect to updates in
flight, so a caller that checkpoints while training holds its own lock.
CuPy: the parameter, gradient and state of a key live on one GPU, and that GPU
must be the calling thread's current device (``Device.use()``).

Where things live:

- ``validation.py``: :class:`OptimizerError` and the checks of hyperparameter values;
- ``schedules.py``: the learning-rate schedules and :func:`build_schedule`;
- ``base.py``: :class:`Optimizer`, the per-key state, the checked update and checkpoints,
  and :class:`Share`, the part of a round one update is;
- ``rules.py``: the update rules, :class:`SGD`, :class:`Momentum`, :class:`Adam`, :class:`AdamW`;
- ``ingraph.py``: :class:`~psgd.optim.ingraph.InGraph`, the updates of a step captured as a CUDA graph;
- ``registry.py``: the optimizers by name and :func:`build_optimizer`.

This package only re-exports their public names.
"""

from psgd.optim.base import WHOLE, Optimizer, Share
from psgd.optim.registry import DEFAULT_LR, OPTIMIZERS, build_optimizer
from psgd.optim.rules import SGD, Adam, AdamW, Momentum
from psgd.optim.schedules import (
    SCHEDULE_OPTIONS,
    SCHEDULES,
    Constant,
    Cosine,
    Schedule,
    StepDecay,
    Warmup,
    build_schedule,
)
from psgd.optim.validation import OptimizerError

__all__ = [
    "OptimizerError",
    "Schedule",
    "Constant",
    "StepDecay",
    "Cosine",
    "Warmup",
    "build_schedule",
    "Optimizer",
    "Share",
    "WHOLE",
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
