# tanhbyhand.py: the same network, its gradients derived by hand
import numpy as np

from psgd.model import BaseModel, VarSpec, get_array_module
from psgd.model.losses import softmax_cross_entropy


class TanhMLPByHand(BaseModel):
    """x -> tanh(x @ W1 + b1) -> scores = h @ W2 + b2, trained with softmax cross-entropy."""

    def __init__(self, input_shape, num_classes, dtype="float32", width=64):
        self.n_in = int(np.prod(input_shape))  # inputs are flattened
        self.num_classes, self.dtype, self.width = num_classes, dtype, int(width)

    def specs(self):
        # every variable in the job's dtype; initial values come from (seed, name)
        return [
            VarSpec("W1", (self.n_in, self.width), self.dtype, init="glorot_uniform"),
            VarSpec("b1", (self.width,), self.dtype, init="zeros"),
            VarSpec("W2", (self.width, self.num_classes), self.dtype, init="normal", scale=0.01),
            VarSpec("b2", (self.num_classes,), self.dtype, init="zeros"),
        ]

    def forward(self, params, x):
        xp = get_array_module(params["W1"])  # numpy on a CPU, cupy on a GPU
        x = xp.asarray(x, dtype=self.dtype).reshape(len(x), -1)
        h = xp.tanh(x @ params["W1"] + params["b1"])
        return x, h, h @ params["W2"] + params["b2"]

    def loss_and_grads(self, params, x, y):
        x, h, scores = self.forward(params, x)
        loss, dscores = softmax_cross_entropy(scores, y)  # mean over the batch, and its gradient
        dh = (dscores @ params["W2"].T) * (1 - h * h)
        grads = {"W1": x.T @ dh, "b1": dh.sum(axis=0), "W2": h.T @ dscores, "b2": dscores.sum(axis=0)}
        return loss, grads

    def predict(self, params, x):
        return self.forward(params, x)[2]  # (batch, num_classes) scores
