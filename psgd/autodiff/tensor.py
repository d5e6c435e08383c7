"""The tape: a :class:`Tensor` remembers the operation that made it, and :func:`backward` runs each operation's
vector-Jacobian rule in reverse, once, from the loss to the tensors that asked for a gradient.

Define-by-run, as Chainer and PyTorch: the forward pass is ordinary Python over NumPy or CuPy arrays, so a model's
own control flow (a loop over layers, a branch on a shape) needs nothing special, and the same code runs on either
array module.  A tensor holds its array (``data``, of the module its inputs were of) and, when it was made by an
operation on tensors that need gradients, a node: the inputs and the rule that maps the gradient of the
output to theirs.  A rule keeps only what it needs (Chainer's ``retain_inputs``); :func:`backward` drops each node's
rule and inputs once it has run, so the intermediate values are released as backward consumes them, and calls
``on_grad(tensor, grad)`` for each leaf as soon as no node that is still to run can add to its gradient.

A rule may hand back a :class:`Part` (indexing by slices does): its gradient at an index of a zero array, which
backward adds into the gradient gathered so far in place, as it does any gradient into an array of its own making.

Nothing is recorded under :func:`no_grad` (evaluation, ``predict``) or where no input needs a gradient.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Callable, Iterator, Sequence
from heapq import heappop, heappush
from typing import Any

import numpy as np

from psgd.compute.backend import get_array_module, to_host


class _State(threading.local):
    """This thread's: whether operations record (off inside :func:`no_grad`), and the seed of the backward in hand
    (:func:`scaled`).  Defaults on the class: reading them costs no failed lookup."""

    recording = True
    seed: Any = None


_state = _State()
_sequence = itertools.count()  # nodes in the order they were made: a node's inputs were all made before it


def recording() -> bool:
    """Whether operations record their rules now (not inside :func:`no_grad`)."""
    return _state.recording


@contextlib.contextmanager
def no_grad() -> Iterator[None]:
    """Operations inside record nothing: their results need no gradient and keep nothing alive."""
    before = recording()
    _state.recording = False
    try:
        yield
    finally:
        _state.recording = before


# How a tensor was made, its node: the tuple (inputs, rule, name, seq).  ``inputs`` are the operation's (tensors,
# arrays or numbers); ``rule`` maps the gradient of the output to a sequence with one gradient (or None: nothing
# flows there) per input; ``seq`` counts the nodes made before it (a node's inputs' nodes all have smaller ones).
# A plain tuple: an operation records itself at the cost of one.
Node = tuple


class Tensor:
    """An array on the tape.  ``requires_grad`` marks a leaf whose gradient :func:`backward` computes (a model's
    parameter); a tensor made by an operation needs a gradient when one of its inputs does."""

    __slots__ = ("data", "node", "requires_grad", "grad", "name", "pending", "__weakref__")
    __array_priority__ = 1000  # ndarray (op) Tensor goes to the tensor's reflected operator

    def __init__(self, data: Any, requires_grad: bool = False, name: str = "", node: Node | None = None):
        self.data, self.requires_grad, self.name, self.node = data, requires_grad, name, node
        self.grad: Any = None
        self.pending: Any = None  # during backward: the gradient gathered so far

    # -- what the array is -----------------------------------------------------------------------------------
    shape = property(lambda self: self.data.shape)
    ndim = property(lambda self: self.data.ndim)
    dtype = property(lambda self: self.data.dtype)
    size = property(lambda self: self.data.size)

    def __len__(self) -> int:
        return len(self.data)

    def __repr__(self) -> str:
        made = f", made by {self.node[2]}" if self.node is not None else ""
        return f"Tensor({self.name or 'unnamed'}, shape {tuple(self.shape)}, {self.dtype}{made})"

    def numpy(self) -> np.ndarray:
        return to_host(self.data)

    def __float__(self) -> float:
        return float(self.data)

    # the operators (+, -, *, /, **, @, [], .T, .sum() ...) are psgd.autodiff.ops', set there on this class


def data_of(x: Any) -> Any:
    """The array of a tensor, or ``x`` itself (an array or a number)."""
    return x.data if isinstance(x, Tensor) else x


def array_module(*xs: Any) -> Any:
    """``cupy`` where any of ``xs`` (tensors, arrays or numbers) is or holds a CuPy array, else ``numpy``."""
    return get_array_module(*(x.data if isinstance(x, Tensor) else x for x in xs))


def make(data: Any, inputs: Sequence[Any], rule: Callable[[Any], Sequence[Any]], name: str) -> Tensor:
    """The result of an operation: ``data``, recorded with ``rule`` where one of ``inputs`` (tensors, arrays or
    numbers; the rule returns a gradient for each, in order) needs a gradient and recording is on."""
    if _state.recording:
        for x in inputs:
            if type(x) is Tensor and (x.requires_grad or x.node is not None):
                return Tensor(data, False, "", (inputs, rule, name, next(_sequence)))
    return Tensor(data)


class Part:
    """A gradient zero but for ``grad`` at ``index`` (basic indexing: integers, slices) of an array of ``shape`` and
    ``dtype``: what indexing by slices hands back.  Backward adds it into the gradient gathered so far in place
    (``gathered[index] += grad``), so that k slices of one array cost k slice additions into one zero array, never
    a zero array and a pass over it each."""

    __slots__ = ("shape", "dtype", "index", "grad")

    def __init__(self, shape: tuple[int, ...], dtype: Any, index: Any, grad: Any):
        self.shape, self.dtype, self.index, self.grad = shape, dtype, index, grad

    def whole(self) -> Any:
        """The gradient as an array of its own."""
        out = get_array_module(self.grad).zeros(self.shape, dtype=self.dtype)
        out[self.index] = self.grad
        return out

    def __mul__(self, factor: Any) -> Part:
        return Part(self.shape, self.dtype, self.index, self.grad * factor)


def _gathered(had: Any, gx: Any, owned: set[int]) -> Any:
    """``had + gx``, in place where ``had`` is an array backward made (``owned``: no one else holds it)."""
    if type(gx) is Part:
        if id(had) not in owned:
            had = had.astype(np.result_type(had.dtype, gx.dtype), copy=True)
            owned.add(id(had))
        had[gx.index] += gx.grad
        return had
    if id(had) in owned and gx.shape == had.shape and gx.dtype == had.dtype:
        had += gx
        return had
    had = had + gx
    owned.add(id(had))
    return had


def unbroadcast(grad: Any, shape: tuple[int, ...]) -> Any:
    """``grad`` summed over the axes broadcasting added to or stretched in an operand of ``shape``."""
    if grad.shape == tuple(shape):
        return grad
    extra = grad.ndim - len(shape)
    axes = tuple(range(extra)) + tuple(extra + i for i, n in enumerate(shape) if n == 1 and grad.shape[extra + i] != 1)
    out = grad.sum(axis=axes, keepdims=True) if axes else grad
    return out.reshape(shape)


def backward(loss: Tensor, grad: Any = None, on_grad: Callable[[Tensor, Any], None] | None = None) -> None:
    """Gradients of ``loss`` (``grad``: the gradient of something with respect to it; 1 for a scalar loss) for every
    leaf tensor that requires one, added to its ``grad``.  ``on_grad(leaf, grad)`` is called for each such leaf as
    soon as its gradient is complete.  Every node a gradient reaches is released once its rule has run."""
    loss.pending = grad if grad is not None else _seed(loss.data)
    if loss.node is None:  # a leaf: its gradient is the one given
        _settle(loss, on_grad, set())
        return
    uses = _uses(loss) if on_grad is not None else None
    # the tensors a gradient has reached whose nodes are still to run, latest made first: each node runs once, after
    # every node that uses it (those were made after it)
    due = [(-loss.node[3], loss)]
    reached: list[Tensor] = []  # the leaves a gradient reached, each once (the first time one did)
    owned: set[int] = set()  # the ids of the gathered gradients backward made itself: added to in place
    while due:
        tensor = heappop(due)[1]
        (inputs, rule, _, _), tensor.node = tensor.node, None  # released: its inputs and whatever the rule kept
        # the rule holds the only reference to its output's gradient, so that it can let go of it as it goes
        out = rule(_taken(tensor, owned))
        rule = None
        for x, gx in zip(inputs, out):
            if type(x) is not Tensor:
                continue
            node = x.node
            if gx is not None:
                had = x.pending
                if had is None:
                    if type(gx) is Part:
                        gx = gx.whole()
                        owned.add(id(gx))
                    x.pending = gx
                    if node is None:
                        reached.append(x)
                    else:
                        heappush(due, (-node[3], x))
                else:
                    x.pending = _gathered(had, gx, owned)
            if uses is not None and node is None:  # on_grad: is this the leaf's last use?
                key = id(x)
                left = uses[key] - 1
                uses[key] = left
                if not left and x.pending is not None:
                    _settle(x, on_grad, owned)
        inputs = out = gx = None  # the next rule runs without this one's gradients held here
    for leaf in reached:  # (with on_grad, those whose every use was on a node no gradient reached)
        if leaf.pending is not None:
            _settle(leaf, on_grad, owned)


def _taken(tensor: Tensor, owned: set[int]) -> Any:
    """The gradient gathered for ``tensor``, which no longer holds it (nor backward: its id may be another's next)."""
    got, tensor.pending = tensor.pending, None
    owned.discard(id(got))
    return got


def _settle(leaf: Tensor, on_grad: Callable[[Tensor, Any], None] | None, owned: set[int]) -> None:
    """A leaf's gradient is complete: added to its ``grad`` where it requires one, and heard of."""
    got = _taken(leaf, owned)
    if leaf.requires_grad:
        leaf.grad = got if leaf.grad is None else leaf.grad + got
        if on_grad is not None:
            on_grad(leaf, leaf.grad)


def _seed(a: Any) -> Any:
    """The gradient of a loss with respect to itself: ones, marked (:func:`scaled` knows it)."""
    if isinstance(a, np.generic) or (type(a) is np.ndarray and a.ndim == 0):  # a NumPy scalar loss: no ones_like
        seed = np.array(1, a.dtype)
    else:
        seed = get_array_module(a).ones_like(a)
    _state.seed = seed
    return seed


def scaled(grad: Any, g: Any) -> Any:
    """``grad * g``: a rule's gradient times its output's; ``grad`` itself where ``g`` is the loss' own ones (a
    loss that is the root of backward, its rule spared a pass over its gradient)."""
    return grad if g is _state.seed else grad * g


def _uses(loss: Tensor) -> dict[int, int]:
    """How many uses of each leaf the nodes ``loss`` depends on make (by the leaf's id)."""
    todo, seen, uses = [loss], {id(loss)}, {}
    for tensor in todo:  # grows as it goes: breadth first, no recursion however deep the chain
        for x in tensor.node[0]:
            if type(x) is not Tensor:
                continue
            if x.node is None:
                uses[id(x)] = uses.get(id(x), 0) + 1
            elif id(x) not in seen:
                seen.add(id(x))
                todo.append(x)
    return uses
