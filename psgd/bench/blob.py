"""A benchmark model: one float32 variable of a chosen size and a free gradient.

It isolates communication: ``loss_and_grads`` costs nothing, so a step's time
is the time to move the weights and the gradient.  Use it as
``--set model.name=psgd.bench.blob:Blob --set model.size=N``.
"""

from __future__ import annotations

import numpy as np

from psgd.model import BaseModel, VarSpec


class Blob(BaseModel):
    # A stand-in for moving bytes: its gradient is a constant, not the derivative of its (zero) loss,
    # so the finite-difference check that every trainer runs first is told to skip it.
    check_gradients = False

    def __init__(self, input_shape, num_classes, dtype="float32", size=1 << 20):
        self.dtype, self.size, self.num_classes = dtype, int(size), num_classes
        self._grad = None

    def specs(self):
        return [VarSpec("blob", (self.size,), self.dtype, "zeros")]

    def loss_and_grads(self, params, x, y):
        w = params["blob"]
        if self._grad is None or self._grad.shape != w.shape:
            self._grad = np.full_like(w, 1e-3)
        return 0.0, {"blob": self._grad}

    def predict(self, params, x):
        return np.zeros((len(x), self.num_classes), dtype=self.dtype)
