# tanhnet.py: a network with one tanh hidden layer, for psgd: only its forward pass
import math

from psgd.autodiff import ops
from psgd.model import Linear, Network


class TanhMLP(Network):
    """x -> tanh(x @ W + b) -> scores; trained with softmax cross-entropy, the default criterion."""

    def __init__(self, input_shape, num_classes, dtype="float32", width=64):
        super().__init__(dtype)  # first: then every module set here declares its variables
        self.hidden = Linear(math.prod(input_shape), int(width), init="glorot_uniform")
        self.out = Linear(int(width), num_classes, init="glorot_uniform")

    def forward(self, x):
        h = ops.tanh(self.hidden(x.reshape(len(x), -1)))  # x: (batch, 8, 8) for the digits
        return self.out(h)  # (batch, num_classes) scores
