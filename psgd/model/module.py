"""Networks written as a forward pass: modules whose parameters declare the job's variables, and whose gradients
psgd derives (:mod:`psgd.autodiff`).

A :class:`Module` declares its :class:`Parameter`\\ s and child modules as attributes; a variable is named by the
attribute path to it (``block/fc/W``; a :class:`Sequential`'s children are ``<kind><n>``: ``dense0``, ``conv1``).
A :class:`Network` is a model (:class:`psgd.model.base.Model`): its ``specs()`` are its parameters, and
``loss_and_grads`` runs ``forward`` on the tape with each parameter bound to its weights (inside ``forward``,
``self.W`` is that tensor), takes ``criterion(scores, y)`` (softmax cross-entropy unless overridden) and hands
each gradient to ``on_grad`` as soon as it is complete.  ``predict`` records nothing.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from psgd.autodiff import Tensor, backward, nn, no_grad
from psgd.compute.backend import get_array_module
from psgd.model.base import BaseModel, VarSpec
from psgd.model.errors import ModelError
from psgd.model.table import Rows, TableSpec


class Parameter:
    """A trainable variable a module declares: its shape and how it starts (see :class:`VarSpec`); its dtype is its
    network's."""

    def __init__(
        self,
        shape: Sequence[int],
        init: str = "he_normal",
        fan_in: int | None = None,
        fan_out: int | None = None,
        scale: float = 0.01,
    ):
        self.shape, self.init, self.fan_in, self.fan_out, self.scale = tuple(shape), init, fan_in, fan_out, scale

    def spec(self, name: str, dtype: str) -> VarSpec:
        return VarSpec(name, self.shape, dtype, self.init, self.fan_in, self.fan_out, self.scale)


class State(Parameter):
    """A value a module keeps that training moves but does not train (batch norm's running statistics): a variable of
    the model all the same (shards hold it, pulls bring it, checkpoints and exports keep it), whose "gradient" is the
    change a training step made to it (:meth:`Module.move`), added as it is, averaged over the workers."""

    def __init__(self, shape: Sequence[int], init: str = "zeros"):
        super().__init__(shape, init)

    def spec(self, name: str, dtype: str) -> VarSpec:
        return VarSpec(name, self.shape, dtype, self.init, state=True)


class Table:
    """An embedding table a module declares (see :class:`psgd.model.table.TableSpec`): rows of ``dim`` values keyed
    by int64 ids.  Inside ``forward``, calling it gives the batch's rows, looked up in the shape of the batch's
    lookups (the network's ``lookups(ids)`` says which ids those are); its gradient leaves as rows."""

    def __init__(self, dim: int, init: str = "normal", scale: float = 0.01):
        self.dim, self.init, self.scale = dim, init, scale

    def spec(self, name: str, dtype: str) -> TableSpec:
        return TableSpec(name, self.dim, dtype, self.init, self.scale)


class LookedUp:
    """A table bound to a batch's rows (:class:`~psgd.model.table.Rows`): ``values`` on the tape; calling it looks
    the batch's lookups up."""

    def __init__(self, rows: Rows, values: Tensor):
        self.rows, self.values = rows, values

    def __call__(self) -> Tensor:
        return nn.lookup(self.values, self.rows.index)


class Binding:
    """What a network's declarations stand for during one call, on the thread that makes it: each parameter's
    tensor and each table's rows (by module and attribute), and whether it trains.  Inside ``with binding:``, on
    that thread, modules read their declarations from it (see :class:`_Declared`): a network predicting on
    one thread and training on another each see their own weights."""

    __slots__ = ("values", "training", "leaves", "rows", "states", "moved", "seed", "draws", "_before")

    def __init__(self, training: bool, seed: int = 0):
        self.values: dict[tuple[int, str], Any] = {}
        self.training = training
        self.leaves: list[Tensor] = []  # the tensors whose gradients the call wants, in declaration order
        self.rows: dict[str, Rows] = {}  # a table's name -> the batch's rows
        self.states: list[tuple[str, tuple[int, str]]] = []  # each state variable: (name, (module id, attribute))
        self.moved: dict[tuple[int, str], Any] = {}  # a state's new value, where the call moved it
        self.seed, self.draws = int(seed), 0

    def draw(self) -> int:
        """A seed for the next random mask of this call: the call's seed and how many were drawn before it."""
        self.draws += 1
        return (self.seed * 1_000_003 + self.draws) & 0xFFFFFFFF

    def __enter__(self) -> Binding:
        self._before = _binding.now
        _binding.now = self
        return self

    def __exit__(self, *exc: Any) -> None:
        _binding.now = self._before


def step_seed(seed: int, rank: int, step: int, call: int = 0) -> int:
    """The seed of the random masks (dropout) of worker ``rank``'s step ``step`` in a job seeded ``seed``: psgd's
    loop and a loop of one's own under ``psgd.join()`` both seed a step with it, so that no two steps share a mask
    and the same run draws the same ones again.  ``call``: the step's n-th training call, where a loop makes
    several (0: the first, the one psgd's loop makes)."""
    first = ((seed * 1_000_003 + rank + 1) * 1_000_033 + step) & 0x7FFFFFFF
    return first if call == 0 else (first * 1_000_037 + call) & 0x7FFFFFFF


class _Now(threading.local):
    """This thread's binding (:class:`Binding`), None outside a call; a default on the class, so that reading it
    costs no failed lookup."""

    now: Binding | None = None


_binding = _Now()
_layout = 0  # counts changes to any module's declarations


class _Declared:
    """What a parameter or table attribute reads as, set on the module's class under the attribute's name: inside a
    call, on the thread that makes it, the binding's tensor (or rows) for this module; outside one, the declaration;
    an instance that set an ordinary value under the name (``self.b = None``) has that value.  A data descriptor, so
    that reading a bound parameter costs one call and no failed lookup."""

    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name

    def __get__(self, module: Any, owner: Any = None) -> Any:
        if module is None:
            return self
        name = self.name
        now = _binding.now
        if now is not None:
            value = now.values.get((id(module), name))
            if value is not None:
                return value
        found = module.__dict__
        value = found["_declared"].get(name, found.get(name, _NOTHING))
        if value is _NOTHING:
            raise AttributeError(f"{type(module).__name__!r} has no attribute {name!r}")
        return value

    def __set__(self, module: Any, value: Any) -> None:  # an ordinary value under a name other instances declared
        module.__dict__[self.name] = value

    def __delete__(self, module: Any) -> None:
        module.__dict__.pop(self.name, None)


_NOTHING = object()


def _declare(cls: type, name: str) -> None:
    """``cls.<name>`` a :class:`_Declared` (once): refused where the class has an attribute of that name already."""
    for klass in cls.__mro__:
        found = klass.__dict__.get(name)
        if isinstance(found, _Declared):
            return
        if found is not None:
            raise ModelError(f"{cls.__name__}: cannot declare {name!r}, the class has an attribute of that name")
    setattr(cls, name, _Declared(name))


class Module:
    """Parameters, tables and child modules, found by attribute in the order they were set; ``forward`` is the
    computation, called as ``module(...)``.  Inside a call of its network, a parameter attribute reads as its
    tensor (on the thread of that call) and ``training`` says whether the network trains or predicts."""

    kind = "module"  # what a Sequential names its children after

    def __init__(self) -> None:
        object.__setattr__(self, "_declared", {})

    def __setattr__(self, name: str, value: Any) -> None:
        global _layout
        declared = self.__dict__.get("_declared")
        if declared is None:
            raise ModelError(f"{type(self).__name__}: call super().__init__() before setting {name!r}")
        if name in declared or isinstance(value, (Parameter, Table, Module)):
            _layout += 1  # what networks declare changed: their cached lists are stale (Network._declarations)
        declared.pop(name, None)
        if isinstance(value, (Parameter, Table)):  # read through the class' _Declared: what the call in hand binds
            _declare(type(self), name)
            declared[name] = value
            self.__dict__.pop(name, None)
            return
        if isinstance(value, Module):
            declared[name] = value
        object.__setattr__(self, name, value)

    @property
    def training(self) -> bool:
        """Whether the network trains (True) or predicts, in the call in hand on this thread."""
        now = _binding.now
        return True if now is None else now.training

    def move(self, name: str, value: Any) -> None:
        """Give the state variable ``name`` (a :class:`State` of this module) its new value, in the training call in
        hand: what the step hands over for it is the change."""
        now = _binding.now
        if not isinstance(self._declared.get(name), State):
            raise ModelError(f"{type(self).__name__}.move({name!r}): {name!r} is not a State of this module")
        if now is not None and now.training:
            now.moved[(id(self), name)] = value

    def draw(self) -> int:
        """A seed for a random mask (dropout): new for each draw of a training step, the same for the same step of
        the same worker (each step is seeded from the job's seed, the worker and the step: :func:`step_seed`)."""
        now = _binding.now
        return 0 if now is None else now.draw()

    def modules(self) -> Iterator[Module]:
        """This module and every module below it."""
        yield self
        for value in self._declared.values():
            if isinstance(value, Module):
                yield from value.modules()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:  # pragma: no cover - every module has its own
        raise NotImplementedError(f"{type(self).__name__} must define forward()")

    def declared(self, prefix: str = "") -> Iterator[tuple[str, Module, str, Parameter | Table]]:
        """(name, owning module, attribute, declaration) of every parameter and table here and below, in order."""
        for attr, value in self._declared.items():
            name = f"{prefix}{attr}"
            if isinstance(value, Module):
                yield from value.declared(f"{name}/")
            else:
                yield name, self, attr, value


class Sequential(Module):
    """Modules applied in order; the n-th of a kind is named ``<kind><n>`` (``dense0``, ``conv1``, ``relu0``)."""

    kind = "sequential"

    def __init__(self, *modules: Module) -> None:
        super().__init__()
        self.chain = chain(self, modules)

    def forward(self, x: Any) -> Any:
        for module in self.chain:
            x = module.forward(x)
        return x


def chain(owner: Module, modules: Sequence[Module]) -> list[Module]:
    """``modules`` set on ``owner`` as ``<kind><n>`` (counted per kind), in order; returns them."""
    counts: dict[str, int] = {}
    for module in modules:
        n = counts.get(module.kind, 0)
        counts[module.kind] = n + 1
        setattr(owner, f"{module.kind}{n}", module)
    return list(modules)


# -- a network is a model --------------------------------------------------------------------------------------------
class Network(Module, BaseModel):
    """A model written as its forward pass.  Subclasses set their modules in ``__init__`` (after
    ``super().__init__(dtype)``) and define ``forward(x)`` -> scores (B, num_classes); ``criterion(scores, y)`` is
    softmax cross-entropy unless overridden.  ``static_step``: the same kernels every step, nothing read back to the
    host (a step may then be a CUDA graph); off unless a network says so."""

    kind = "network"
    static_step = False
    #: where ``loss_and_grads`` without a ``seed`` takes one: ``psgd.join()``'s worker sets it to hand out the step
    #: in hand's (:func:`step_seed`); None: seed 0, the same masks each call (as check-model's checks need)
    step_seeds: Callable[[], int] | None = None

    def __init__(self, dtype: str = "float32") -> None:
        Module.__init__(self)
        try:
            kind = np.dtype(dtype).kind
        except TypeError:
            kind = ""
        if kind != "f":
            raise ModelError(
                f"{type(self).__name__}: dtype must be a float type such as float32 or float64 (got {dtype!r})"
            )
        self.dtype = np.dtype(dtype).name
        object.__setattr__(self, "_dtype", np.dtype(dtype))  # what inputs() casts to, parsed once

    def specs(self) -> list[VarSpec]:
        return [p.spec(name, self.dtype) for name, _, _, p in self.declared() if isinstance(p, Parameter)]

    def tables(self) -> list[TableSpec]:
        return [t.spec(name, self.dtype) for name, _, _, t in self.declared() if isinstance(t, Table)]

    def criterion(self, scores: Any, y: Any) -> Tensor:
        """The batch's mean loss from the scores ``forward`` gave."""
        return nn.cross_entropy(scores, y)

    def inputs(self, params: Mapping[str, Any], x: Any) -> Any:
        """``x`` as an array of the weights' module and the network's dtype (what ``forward`` receives)."""
        first = next(iter(params.values()), x)
        if type(first) is np.ndarray:  # weights on the host (the array module known without asking)
            return np.asarray(x, dtype=self._dtype)
        return get_array_module(getattr(first, "values", first)).asarray(x, dtype=self._dtype)

    @property
    def random_step(self) -> bool:
        """Whether a training step draws random numbers (a :class:`Dropout` in it): psgd's loop then seeds each step,
        and never captures one as a CUDA graph."""
        return any(getattr(m, "random", False) for m in self.modules())

    def _declarations(self) -> list[tuple[str, tuple[int, str], str]]:
        """(name, (owning module's id, attribute), "table" | "state" | "parameter") of every declaration, made again
        only once a module's declarations changed."""
        cached = self.__dict__.get("_cached")
        if cached is None or cached[0] != _layout:
            cached = (
                _layout,
                [
                    (
                        name,
                        (id(owner), attr),
                        "table" if isinstance(d, Table) else "state" if isinstance(d, State) else "parameter",
                    )
                    for name, owner, attr, d in self.declared()
                ],
            )
            object.__setattr__(self, "_cached", cached)
        return cached[1]

    def _binding(self, params: Mapping[str, Any], training: bool, seed: int = 0) -> Binding:
        """Each parameter as a tensor of the tape holding its weights, each table as the batch's rows
        (:class:`LookedUp`), each state as its array (off the tape)."""
        binding = Binding(training, seed)
        values, leaves = binding.values, binding.leaves
        for name, key, kind in self._declarations():
            value = params.get(name)
            if value is None:
                raise ModelError(f"{type(self).__name__}: no weights for variable {name!r}")
            if kind == "parameter":
                leaves.append(Tensor(value, training, name))
                values[key] = leaves[-1]
            elif kind == "state":
                values[key] = value
                binding.states.append((name, key))
            else:  # a table
                if not isinstance(value, Rows):
                    raise ModelError(f"{type(self).__name__}: params[{name!r}] must be the batch's Rows of the table")
                binding.rows[name] = value
                leaves.append(Tensor(value.values, training, name))
                values[key] = LookedUp(value, leaves[-1])
        return binding

    def loss_and_grads(
        self,
        params: Mapping[str, Any],
        x: Any,
        y: Any,
        on_grad: Callable[[str, Any], None] | None = None,
        seed: int | None = None,
    ) -> tuple[Any, dict[str, Any]]:
        """The mean loss (a 0-d array on the weights' device) and every variable's gradient (a table's as its
        rows, a state's as the change the step made to it), ``on_grad(name, grad)`` called for each as soon as
        backward has completed it.  ``seed``: the step's, for its random masks (:meth:`Module.draw`); by default
        the one :attr:`step_seeds` hands out (under ``psgd.join()``: the step in hand's), else 0."""
        if seed is None:
            seed = 0 if self.step_seeds is None else self.step_seeds()
        with self._binding(params, training=True, seed=seed) as binding:
            loss = self.criterion(self.forward(self.inputs(params, x)), y)
        rows = binding.rows
        if on_grad is None:
            heard = None
        elif rows:

            def heard(leaf: Tensor, g: Any) -> None:
                on_grad(leaf.name, rows[leaf.name].with_values(g) if leaf.name in rows else g)
        else:

            def heard(leaf: Tensor, g: Any) -> None:
                on_grad(leaf.name, g)

        backward(loss, on_grad=heard)
        grads = {}
        for leaf in binding.leaves:
            if leaf.grad is None:  # a variable the loss does not depend on
                leaf.grad = get_array_module(leaf.data).zeros_like(leaf.data)
                if heard is not None:
                    heard(leaf, leaf.grad)
            grads[leaf.name] = rows[leaf.name].with_values(leaf.grad) if rows and leaf.name in rows else leaf.grad
        for name, key in binding.states:  # what the step moved each state by (nothing: zeros)
            old = binding.values[key]
            new = binding.moved.get(key)
            grads[name] = get_array_module(old).zeros_like(old) if new is None else new - old
            if on_grad is not None:
                on_grad(name, grads[name])
        return loss.data, grads

    def predict(self, params: Mapping[str, Any], x: Any) -> Any:
        with self._binding(params, training=False), no_grad():
            out = self.forward(self.inputs(params, x))
        return out.data if isinstance(out, Tensor) else out
