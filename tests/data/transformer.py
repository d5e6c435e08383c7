# transformer.py: a small transformer for psgd's sequence tasks (--dataset sequences): only its forward pass
import math

from psgd.autodiff import nn, ops
from psgd.model import LayerNorm, Linear, Module, Network, Parameter


class SelfAttention(Module):
    """Multi-head self-attention over (batch, length, dim), heads of dim / heads each."""

    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.qkv = Linear(dim, 3 * dim, init="glorot_uniform")
        self.out = Linear(dim, dim, init="glorot_uniform")

    def forward(self, x):
        b, n, d = x.shape
        h = self.heads
        qkv = self.qkv(x.reshape(b * n, d)).reshape(b, n, 3, h, d // h).transpose(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]  # each (batch, heads, length, dim / heads)
        weights = nn.softmax(q @ k.transpose(0, 1, 3, 2) * (1 / math.sqrt(d // h)))  # (batch, heads, length, length)
        mixed = (weights @ v).transpose(0, 2, 1, 3).reshape(b * n, d)
        return self.out(mixed).reshape(b, n, d)


class Block(Module):
    """x + attention(norm(x)), then + mlp(norm(x)): a pre-norm transformer block."""

    def __init__(self, dim, heads, hidden):
        super().__init__()
        self.norm1, self.attend = LayerNorm(dim), SelfAttention(dim, heads)
        self.norm2 = LayerNorm(dim)
        self.up, self.down = Linear(dim, hidden, relu=True), Linear(hidden, dim, init="glorot_uniform")

    def forward(self, x):
        x = x + self.attend(self.norm1(x))
        b, n, d = x.shape
        return x + self.down(self.up(self.norm2(x).reshape(b * n, d))).reshape(b, n, d)


class Transformer(Network):
    """Tokens (batch, length) -> embeddings + positions -> blocks -> the first position's scores (head="first"),
    or every position's (head="each": a class per position, shape (batch, length, classes))."""

    def __init__(
        self, input_shape, num_classes, dtype="float32", dim=32, heads=2, hidden=64, depth=1, vocab=None, head="first"
    ):
        super().__init__(dtype)
        self.every = {"first": False, "each": True}[head]
        (length,) = input_shape
        self.tokens = Parameter((int(vocab or num_classes), dim), init="normal", scale=0.5)
        self.positions = Parameter((length, dim), init="normal", scale=0.5)
        for i in range(int(depth)):
            setattr(self, f"block{i}", Block(dim, heads, hidden))
        self.depth = int(depth)
        self.norm, self.head = LayerNorm(dim), Linear(dim, num_classes, init="glorot_uniform")

    def forward(self, x):
        x = ops.take(self.tokens, x.astype("int64"), axis=0) + self.positions  # (batch, length, dim)
        for i in range(self.depth):
            x = getattr(self, f"block{i}")(x)
        if self.every:  # a class per position
            b, n, d = x.shape
            return self.head(self.norm(x).reshape(b * n, d)).reshape(b, n, -1)
        return self.head(self.norm(x[:, 0]))  # what the first position gathered
