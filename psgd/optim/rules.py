"""The optimizers themselves, each its update with its paper: SGD, Momentum (and Nesterov), Adam, AdamW.

Each rule says which of its values change from update to update (``_scalars``: the learning rate, and what is
made of it and of the update's count, in float64 on the host) and applies one update with them (``_apply``).

Each update is one call of :mod:`psgd.compute.kernels`: one fused kernel on CuPy, in-place ufuncs (``out=``) on
NumPy that allocate at most one parameter-sized temporary, the same arithmetic either way.
"""

from __future__ import annotations

import math
from typing import Any

from psgd.compute import kernels
from psgd.optim.base import Optimizer
from psgd.optim.schedules import Schedule
from psgd.optim.validation import OptimizerError, fraction, non_negative, positive


class SGD(Optimizer):
    """Stochastic gradient descent with L2 weight decay: ``p -= lr * (g + wd * p)``.

    Robbins & Monro, "A Stochastic Approximation Method", Ann. Math. Statist. 1951.
    """

    name = "sgd"
    elementwise = True

    def __init__(self, lr: float | Schedule, weight_decay: float = 0.0):
        super().__init__(lr)
        self.weight_decay = non_negative(self.name, "weight_decay", weight_decay)

    def hyperparameters(self) -> dict[str, Any]:
        return {"weight_decay": self.weight_decay}

    def _scalars(self, lr, t, share):
        return lr, 1.0 - lr * self.weight_decay

    def _apply(self, param, grad, state, scalars, share):
        lr, keep = scalars
        kernels.sgd_(param, grad, lr, keep if self.weight_decay else None)


class Momentum(Optimizer):
    """SGD with (Nesterov) momentum, as common frameworks write it.

    ``v = mu * v + g``; ``p -= lr * v``, or with ``nesterov``
    ``p -= lr * (g + mu * v)``; L2 weight decay adds ``wd * p`` to ``g``.
    An update that is one of ``n`` of a round (:class:`~psgd.optim.base.Share`)
    decays ``v`` by ``mu' = mu ** (1/n)``, less the stream's implicit momentum
    ``i`` (Mitliagkas et al. 2016) and not below 0, and adds ``g (1 - mu') / (1 - mu)``:
    the ``v`` of a steady ``g`` is ``g / (1 - mu)`` as after whole rounds, so that
    ``n`` updates at ``lr / n`` take a round's step, with ``mu' ** n`` of it carried
    into the next round.
    Sutskever, Martens, Dahl & Hinton, "On the importance of initialization and
    momentum in deep learning", ICML 2013 (after Polyak 1964 and Nesterov 1983).
    The paper scales ``g`` by ``lr`` inside ``v``; for a constant ``lr`` the two
    forms are the same, and this one keeps ``v`` independent of the schedule.
    """

    name = "momentum"
    state_names = ("v",)
    elementwise = True

    def __init__(self, lr: float | Schedule, momentum: float = 0.9, nesterov: bool = False, weight_decay: float = 0.0):
        if not isinstance(nesterov, bool):
            raise OptimizerError(f"momentum: nesterov must be true or false, got {nesterov!r}")
        self.nesterov = nesterov
        self.name = "nesterov" if nesterov else "momentum"
        super().__init__(lr)
        self.momentum = fraction(self.name, "momentum", momentum)
        self.weight_decay = non_negative(self.name, "weight_decay", weight_decay)

    def hyperparameters(self) -> dict[str, Any]:
        return {"momentum": self.momentum, "weight_decay": self.weight_decay}

    def _scalars(self, lr, t, share):
        return lr, 1.0 - lr * self.weight_decay

    def _apply(self, param, grad, state, scalars, share):
        (lr, keep), v, mu, wd, s = scalars, state["v"], self.momentum, self.weight_decay, 1.0
        lookahead = mu  # nesterov's look ahead: a round's momentum
        if share.updates != 1 or share.implicit_momentum:
            # a round's decay spread over its updates, less what the stream of updates carries by itself
            applied = max(0.0, mu**share.fraction - share.implicit_momentum)
            lookahead = applied**share.updates
            s = (1.0 - applied) / (1.0 - mu)  # the gradient's weight: v of a steady g is g / (1 - mu), as in a round
            mu = applied
        kernels.momentum_(
            param, v, grad, lr=lr, keep=keep, mu=mu, s=s, weight_decay=wd, nesterov=self.nesterov, lookahead=lookahead
        )


class Adam(Optimizer):
    """Adam with bias correction and L2 weight decay (added to the gradient).

    ``m = b1 m + (1 - b1) g``, ``v = b2 v + (1 - b2) g^2``,
    ``p -= lr * (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)``.
    An update that is one of ``n`` of a round (:class:`~psgd.optim.base.Share`)
    uses ``b1 ** (1/n)`` and ``b2 ** (1/n)``, and ``t`` counts rounds, so
    that the bias correction divides by exactly the weight the moments have gathered.
    Kingma & Ba, "Adam: A Method for Stochastic Optimization", ICLR 2015,
    arXiv:1412.6980 (Algorithm 1).
    """

    name = "adam"
    state_names = ("m", "v")
    elementwise = True
    decoupled = False  # AdamW: weight decay applied to p directly, not through g
    default_weight_decay = 0.0

    def __init__(
        self,
        lr: float | Schedule = 1e-3,
        beta1: float = 0.9,
        beta2: float = 0.999,
        eps: float = 1e-8,
        weight_decay: float | None = None,
    ):
        super().__init__(lr)
        self.beta1 = fraction(self.name, "beta1", beta1)
        self.beta2 = fraction(self.name, "beta2", beta2)
        self.eps = positive(self.name, "eps", eps)
        self.weight_decay = non_negative(
            self.name, "weight_decay", self.default_weight_decay if weight_decay is None else weight_decay
        )

    def hyperparameters(self) -> dict[str, Any]:
        return {"beta1": self.beta1, "beta2": self.beta2, "eps": self.eps, "weight_decay": self.weight_decay}

    def _scalars(self, lr, t, share):
        # the weights kept by decay, and the bias corrections from the round's decays: rate and 1 / sqrt(1 - b2^t)
        return 1.0 - lr * self.weight_decay, lr / (1.0 - self.beta1**t), 1.0 / math.sqrt(1.0 - self.beta2**t)

    def _apply(self, param, grad, state, scalars, share):
        (keep, rate, unbias2), b1, b2 = scalars, self.beta1, self.beta2
        if share.updates != 1:
            b1, b2 = b1**share.fraction, b2**share.fraction
        kernels.adam_(
            param,
            state["m"],
            state["v"],
            grad,
            keep=keep,
            rate=rate,
            unbias2=unbias2,
            b1=b1,
            b2=b2,
            eps=self.eps,
            weight_decay=self.weight_decay,
            decoupled=self.decoupled,
        )


class AdamW(Adam):
    """Adam with decoupled weight decay: ``p -= lr * wd * p`` besides the Adam step.

    Loshchilov & Hutter, "Decoupled Weight Decay Regularization", ICLR 2019,
    arXiv:1711.05101 (Algorithm 2, with the schedule multiplier folded into lr).
    """

    name = "adamw"
    decoupled = True
    default_weight_decay = 0.01
