"""An optimizer's updates inside a step captured as a CUDA graph: the values that change each step read on the device.

``psgd train`` on a GPU captures its step as a graph (:mod:`psgd.compute.graphs`).  With the gradient alone in the
graph,
each step's updates ran after it from Python, one launch and its checks a variable: the largest part of a small
model's step.  :class:`InGraph` puts the updates into the graph too.  What changes from step to step (the rate the
schedule gives, what is made of it, Adam's bias corrections) cannot be a number baked into the graph: the rule works
it out on the host in float64 each step (``Optimizer._scalars``), as an update outside a graph does, and it is
copied from a small page-locked buffer to the device just before each launch (CuPy allows no copy from the host
inside a capture), where every update's kernel reads its values.  A replayed update so gives the bits of the same
update launched kernel by kernel.

Each key's count ``t`` moves on the host after each replay, as :meth:`Optimizer.update` moves it, so a checkpoint
or a later update outside the graph sees the same state either way.  The graph holds the state buffers it was
captured with: :meth:`InGraph.current` says whether they are still the optimizer's (a state restored replaces
them), and a graph that is not current is dropped and captured again.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from psgd.compute import backend
from psgd.optim.base import WHOLE, Optimizer, _move


class InGraph:
    """``optimizer``'s update of each of ``params`` (the caller's weights, updated in place, on one GPU), to be
    captured after the gradient, one of these a graph: :meth:`prepare` before the capture, :meth:`capture` inside
    it, :meth:`before` and :meth:`after` around each launch of the graph.  Every key must have been updated once
    before (its state made, outside the graph), and all trained keys the same number of times, as in one process's
    training."""

    def __init__(self, optimizer: Optimizer, params: Mapping[str, Any], device: backend.Device):
        self.optimizer, self.params, self.device = optimizer, params, device
        self._slots: dict[str, Any] = {}
        self._buffers: dict[str, list] = {}  # by key: the state arrays captured
        self._host: dict[str, Any] = {}  # dtype -> page-locked scalars, written before each launch
        self._device: dict[str, Any] = {}  # dtype -> the same on the device, copied before each launch
        self._values: dict[str, tuple] = {}  # dtype -> those on the device, one 0-d view each
        self._copied: Any = None  # an event after the last launch: the page-locked buffer is free again

    def why_not(self, grads: Mapping[str, Any]) -> str | None:
        """Why the updates of ``grads`` cannot be captured now, or None."""
        opt = self.optimizer
        if set(grads) != set(self.params):
            return "the step's gradients are not one a variable"
        trained = [k for k in grads if not opt.is_state(k)]
        missing = [k for k in trained if opt.step_count(k) == 0]
        if missing:
            return f"{missing[0]!r} has not been updated before"
        if len({opt.step_count(k) for k in trained}) > 1:
            return "the variables have taken different numbers of updates"
        return None

    def prepare(self, grads: Mapping[str, Any]) -> None:
        """Before the capture: ``grads`` (a step's, of the shapes the graph's will have) checked as
        :meth:`Optimizer.update` checks them, the buffers of this step's values made, the kernels compiled."""
        opt, xp = self.optimizer, backend.get_array_module(next(iter(self.params.values())))
        for key, grad in grads.items():
            opt._check(key, self.params[key], grad, 1.0)
        trained = [k for k in grads if not opt.is_state(k)]
        count = len(opt._scalars(*opt._rate(0, 1.0, WHOLE), WHOLE))
        for name in {self.params[k].dtype.name for k in trained}:
            self._host[name] = backend.host_empty((count,), name, self.device)
            self._device[name] = xp.zeros(count, dtype=name)
            self._values[name] = tuple(self._device[name][i] for i in range(count))  # 0-d views the kernels read
        self._slots = {k: opt._slots[k] for k in trained}
        self._buffers = {k: list(slot.state.values()) for k, slot in self._slots.items()}
        for name, values in self._values.items():  # each kernel compiled off the graph, on two values of scratch
            scratch = {field: xp.zeros(2, dtype=name) for field in opt.state_names}
            opt._apply(xp.zeros(2, dtype=name), xp.zeros(2, dtype=name), scratch, values, WHOLE)

    def capture(self, grads: Mapping[str, Any]) -> None:
        """Launch every update of ``grads`` into the capture in progress, their changing values read on the device."""
        for key, grad in grads.items():
            if key in self._slots:
                self.optimizer._apply(
                    self.params[key], grad, self._slots[key].state, self._values[self.params[key].dtype.name], WHOLE
                )
            else:
                _move(self.params[key], grad, 1.0)

    def current(self) -> bool:
        """Whether the state the graph was captured with is still the optimizer's, all keys at one count."""
        slots = self.optimizer._slots
        return (
            all(
                slots.get(k) is slot and all(a is b for a, b in zip(slot.state.values(), self._buffers[k]))
                for k, slot in self._slots.items()
            )
            and len({slot.t for slot in self._slots.values()}) <= 1
        )

    def before(self, stream: Any) -> None:
        """The next update's values copied on ``stream`` to where the graph's kernels read them (launched next on
        the same stream: the copy is done before they run)."""
        if self._copied is not None:
            self._copied.synchronize()  # the last copy has read the buffer (long since, as a rule)
        if not self._slots:
            return
        opt = self.optimizer
        values = opt._scalars(*opt._rate(next(iter(self._slots.values())).t, 1.0, WHOLE), WHOLE)
        for name, host in self._host.items():
            host[...] = values
            self._device[name].set(host, stream=stream)

    def after(self, stream: Any) -> None:
        """The update counted, as :meth:`Optimizer.update` counts it; an event marks when the buffer is free."""
        for slot in self._slots.values():
            slot.t += 1
        self._copied = stream.record(self._copied)
