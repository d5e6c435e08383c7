"""The tape: a :class:`Tensor` remembers the operation that made it, and :func:`backward` runs each operation's
vector-Jacobian rule in reverse, once, from the loss to the tensors that asked for a gradient.

Define-by-run, as Chainer and PyTorch: the forward pass is ordinary Python over NumPy or CuPy arrays, so a model's
own control flow (a loop over layers, a branch on a shape) needs nothing special, and the same code runs on either
array module.  A tensor holds its array (``data``, of the module its inputs were of) and, when it was made by an
operation on tensors that need gradients, a :class:`Node`: the inputs and the rule that maps the gradient of the
output to theirs.  A rule keeps only what it needs (Chainer's ``retain_inputs``); :func:`backward` drops each node's
rule and inputs once it has run, so the intermediate values are released as backward consumes them, and calls
``on_grad(tensor, grad)`` for each leaf as soon as no node that is still to run can add to its gradient.

Nothing is recorded under :func:`no_grad` (evaluation, ``predict``) or where no input needs a gradient.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from psgd.xp import get_array_module, to_host

_state = threading.local()


def recording() -> bool:
    """Whether operations record their rules now (not inside :func:`no_grad`)."""
    return getattr(_state, "recording", True)


@contextlib.contextmanager
def no_grad() -> Iterator[None]:
    """Operations inside record nothing: their results need no gradient and keep nothing alive."""
    before = recording()
    _state.recording = False
    try:
        yield
    finally:
        _state.recording = before


class Node:
    """How a tensor was made: its ``inputs`` (tensors) and ``rule``, which maps the gradient of the output to a
    sequence with one gradient (or None: nothing flows there) per input."""

    __slots__ = ("inputs", "rule", "name")

    def __init__(self, inputs: tuple["Tensor", ...], rule: Callable[[Any], Sequence[Any]], name: str):
        self.inputs, self.rule, self.name = inputs, rule, name


class Tensor:
    """An array on the tape.  ``requires_grad`` marks a leaf whose gradient :func:`backward` computes (a model's
    parameter); a tensor made by an operation needs a gradient when one of its inputs does."""

    __slots__ = ("data", "node", "requires_grad", "grad", "name", "__weakref__")
    __array_priority__ = 1000  # ndarray (op) Tensor goes to the tensor's reflected operator

    def __init__(self, data: Any, requires_grad: bool = False, name: str = "", node: Node | None = None):
        self.data, self.requires_grad, self.name, self.node = data, requires_grad, name, node
        self.grad: Any = None

    # -- what the array is -----------------------------------------------------------------------------------
    shape = property(lambda self: self.data.shape)
    ndim = property(lambda self: self.data.ndim)
    dtype = property(lambda self: self.data.dtype)
    size = property(lambda self: self.data.size)

    def __len__(self) -> int:
        return len(self.data)

    def __repr__(self) -> str:
        made = f", made by {self.node.name}" if self.node is not None else ""
        return f"Tensor({self.name or 'unnamed'}, shape {tuple(self.shape)}, {self.dtype}{made})"

    def numpy(self) -> np.ndarray:
        return to_host(self.data)

    def __float__(self) -> float:
        return float(self.data)

    # the operators (+, -, *, /, **, @, [], .T, .sum() ...) are psgd.autodiff.ops', set there on this class


def data_of(x: Any) -> Any:
    """The array of a tensor, or ``x`` itself (an array or a number)."""
    return x.data if isinstance(x, Tensor) else x


def make(data: Any, inputs: Sequence[Any], rule: Callable[[Any], Sequence[Any]], name: str) -> Tensor:
    """The result of an operation: ``data``, recorded with ``rule`` where one of ``inputs`` (tensors, arrays or
    numbers; the rule returns a gradient for each, in order) needs a gradient and recording is on."""
    if recording() and any(isinstance(x, Tensor) and (x.requires_grad or x.node is not None) for x in inputs):
        tensors = tuple(x if isinstance(x, Tensor) else None for x in inputs)
        return Tensor(data, node=Node(tensors, rule, name))
    return Tensor(data)


def unbroadcast(grad: Any, shape: tuple[int, ...]) -> Any:
    """``grad`` summed over the axes broadcasting added to or stretched in an operand of ``shape``."""
    if grad.shape == tuple(shape):
        return grad
    extra = grad.ndim - len(shape)
    axes = tuple(range(extra)) + tuple(extra + i for i, n in enumerate(shape) if n == 1 and grad.shape[extra + i] != 1)
    out = grad.sum(axis=axes, keepdims=True) if axes else grad
    return out.reshape(shape)


def backward(loss: Tensor, grad: Any = None,
             on_grad: Callable[[Tensor, Any], None] | None = None) -> None:
    """Gradients of ``loss`` (``grad``: the gradient of something with respect to it; 1 for a scalar loss) for every
    leaf tensor that requires one, added to its ``grad``.  ``on_grad(leaf, grad)`` is called for each such leaf as
    soon as its gradient is complete.  Every node on the way is released once its rule has run."""
    first = grad if grad is not None else _ones_like(loss.data)
    if loss.node is None:
        _deliver(loss, first, on_grad)
        return
    order, uses = _topological(loss)
    grads: dict[int, Any] = {id(loss): first}
    for tensor in order:  # the loss first, each tensor after every node that uses it
        node, tensor.node = tensor.node, None  # released: its inputs and whatever the rule kept
        g = grads.pop(id(tensor), None)
        for x, gx in zip(node.inputs, node.rule(g) if g is not None else [None] * len(node.inputs)):
            if x is None:
                continue
            key = id(x)
            if gx is not None:
                grads[key] = gx if key not in grads else grads[key] + gx
            uses[key] -= 1
            if x.node is None and uses[key] == 0 and key in grads:  # a leaf: nothing still to run adds to it
                _deliver(x, grads.pop(key), on_grad)


def _deliver(leaf: Tensor, g: Any, on_grad: Callable[[Tensor, Any], None] | None) -> None:
    if not leaf.requires_grad:
        return
    leaf.grad = g if leaf.grad is None else leaf.grad + g
    if on_grad is not None:
        on_grad(leaf, leaf.grad)


def _ones_like(a: Any) -> Any:
    return get_array_module(a).ones_like(a)


def _topological(loss: Tensor) -> tuple[list[Tensor], dict[int, int]]:
    """The tensors made by nodes that ``loss`` depends on, each before the tensors its node uses, and how many
    uses of each tensor (leaves too) their nodes make."""
    uses: dict[int, int] = {}
    order: list[Tensor] = []
    visited: set[int] = set()
    stack: list[tuple[Tensor, bool]] = [(loss, False)]
    while stack:  # depth first, iteratively: a deep chain of layers needs no recursion
        tensor, done = stack.pop()
        if done:
            order.append(tensor)
            continue
        if id(tensor) in visited:
            continue
        visited.add(id(tensor))
        stack.append((tensor, True))
        for x in tensor.node.inputs:
            if x is None:
                continue
            uses[id(x)] = uses.get(id(x), 0) + 1
            if x.node is not None and id(x) not in visited:
                stack.append((x, False))
    order.reverse()
    return order, uses
