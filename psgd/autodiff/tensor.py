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
    for x in inputs:
        if type(x) is Tensor and (x.requires_grad or x.node is not None):
            if not getattr(_state, "recording", True):
                break
            return Tensor(data, False, "", Node(tuple([x if type(x) is Tensor else None for x in inputs]), rule, name))
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
    first = grad if grad is not None else _seed(loss.data)
    if loss.node is None:
        _deliver(loss, first, on_grad)
        return
    order, uses = _topological(loss)
    grads: dict[int, Any] = {id(loss): first}
    while order:  # the loss first, each tensor after every node that uses it; none kept once done
        tensor = order.pop()
        node, tensor.node = tensor.node, None  # released: its inputs and whatever the rule kept
        g = grads.pop(id(tensor), None)
        out = node.rule(g) if g is not None else None
        for i, x in enumerate(node.inputs):
            if x is None:
                continue
            key = id(x)
            gx = out[i] if out is not None else None
            if gx is not None:
                had = grads.get(key)
                grads[key] = gx if had is None else had + gx
            left = uses[key] - 1
            uses[key] = left
            if not left and x.node is None:  # a leaf: nothing still to run adds to it
                got = grads.pop(key, None)
                if got is not None:
                    _deliver(x, got, on_grad)


def _seed(a: Any) -> Any:
    """The gradient of a loss with respect to itself: ones, marked (:func:`scaled` knows it)."""
    seed = np.array(1, a.dtype) if type(a) is np.ndarray and a.ndim == 0 else get_array_module(a).ones_like(a)
    _state.seed = seed
    return seed


def scaled(grad: Any, g: Any) -> Any:
    """``grad * g``: a rule's gradient times its output's; ``grad`` itself where ``g`` is the loss' own ones (a
    loss that is the root of backward, its rule spared a pass over its gradient)."""
    return grad if g is getattr(_state, "seed", None) else grad * g


def _deliver(leaf: Tensor, g: Any, on_grad: Callable[[Tensor, Any], None] | None) -> None:
    if not leaf.requires_grad:
        return
    leaf.grad = g if leaf.grad is None else leaf.grad + g
    if on_grad is not None:
        on_grad(leaf, leaf.grad)


def _topological(loss: Tensor) -> tuple[list[Tensor], dict[int, int]]:
    """The tensors made by nodes that ``loss`` depends on, each after the tensors its node uses (the loss last), and
    how many uses of each tensor (leaves too) their nodes make."""
    uses: dict[int, int] = {}
    order: list[Tensor] = []
    stack: list[Any] = [loss]
    while stack:  # depth first, iteratively (a deep chain of layers needs no recursion); a list marks "done"
        tensor = stack.pop()
        if type(tensor) is list:
            order.append(tensor[0])
            continue
        key = id(tensor)
        if key in uses and uses[key] < 0:
            continue  # visited already
        uses[key] = -1 - uses.get(key, 0)  # negative while visited: -1 - its uses so far
        stack.append([tensor])
        for x in tensor.node.inputs:
            if x is None:
                continue
            k = id(x)
            n = uses.get(k, 0)
            uses[k] = n - 1 if n < 0 else n + 1
            if x.node is not None and n >= 0:
                stack.append(x)
    for k, n in uses.items():
        if n < 0:
            uses[k] = -1 - n
    return order, uses
