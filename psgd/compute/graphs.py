"""A training step's gradient replayed as a CUDA graph: one launch instead of one per kernel.

On a GPU a small model's step is bound by the CPU launching its kernels one by one.  Where the model's
``loss_and_grads`` launches the same kernels for the same shapes and reads nothing back to the host (a
model says so with ``static_step = True``; psgd's built-in layered models do), :class:`GraphedStep`
captures it once and replays it: the batch is copied into the graph's own input arrays, the graph is
launched on the caller's stream, and the loss and gradients come back in the graph's own output arrays,
overwritten by the next replay (the loop hands them on before its next step).

The graph reads the weights from the arrays it was captured with.  Where the caller passes the same
arrays every step (psgd train's weights, updated in place) nothing is copied; where each step brings
new ones (a worker's pulled weights), the graph has arrays of its own and each step's weights are
copied into them.  Capture uses a memory pool of its own, so that no array the graph uses is handed to
anyone else.  A capture that fails (a model that reads a value back, say) is said in one line, and
the step runs kernel by kernel from then on.

Where the caller updates the weights the graph reads in place with its own optimizer (psgd train), the graph
holds the optimizer's updates too (:mod:`psgd.optim.ingraph`): the whole step is one launch.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from psgd.compute import backend

log = logging.getLogger(__name__)


class GraphUpdate(Protocol):
    """What a graph needs of the updates it holds after the gradient (an optimizer's own:
    :class:`psgd.optim.ingraph.InGraph`, which the optimizers' package builds on this package)."""

    def why_not(self, grads: Mapping[str, Any]) -> str | None: ...
    def prepare(self, grads: Mapping[str, Any]) -> None: ...
    def capture(self, grads: Mapping[str, Any]) -> None: ...
    def before(self, stream: Any) -> None: ...
    def after(self, stream: Any) -> None: ...
    def current(self) -> bool: ...


#: shapes of batch captured at most (a graph each); further shapes run kernel by kernel
MAX_GRAPHS = 4


def can_graph(model: Any, device: backend.Device, enabled: bool, reason: Callable[[str], None]) -> bool:
    """Whether :class:`GraphedStep` should run ``model``'s steps; ``reason`` is told why not, where it matters."""
    if not (enabled and device.is_gpu):
        return False
    if not getattr(model, "static_step", False):
        reason(
            f"the model {type(model).__name__} does not declare static_step = True (the same kernels for the "
            "same shapes, nothing read back), so its steps run kernel by kernel"
        )
        return False
    if getattr(model, "random_step", False):
        reason(
            f"the model {type(model).__name__} draws random masks each step (dropout), which a captured step "
            "would replay unchanged, so its steps run kernel by kernel"
        )
        return False
    return True


class _Captured:
    """One graph: its input arrays (batch and weights), its outputs, whether the weights are the caller's, and the
    optimizer's updates it holds, if it does."""

    def __init__(
        self,
        graph: Any,
        x: Any,
        y: Any,
        params: dict[str, Any],
        shared: bool,
        outputs: tuple,
        pool: Any,
        stream: Any,
        update: GraphUpdate | None,
    ):
        self.graph, self.x, self.y, self.params, self.shared = graph, x, y, params, shared
        self.loss, self.grads = outputs
        self.pool, self.stream = pool, stream  # kept alive as long as the graph
        self.update = update

    def replay(self, params: Mapping[str, Any], x: Any, y: Any, stream: Any) -> tuple[Any, dict[str, Any]] | None:
        """The step on ``x``, ``y`` and ``params``, launched on ``stream``; None where the graph reads the
        caller's weights in place and ``params`` are other arrays (the caller's old ones are not written)."""
        if self.shared and any(params[name] is not held for name, held in self.params.items()):
            return None
        self.x[...] = x
        self.y[...] = y
        if not self.shared:
            for name, held in self.params.items():
                held[...] = params[name]
        if self.update is None:
            self.graph.launch(stream=stream)
            return self.loss, self.grads
        self.update.before(stream)
        self.graph.launch(stream=stream)
        self.update.after(stream)
        return self.loss, {}  # every gradient applied: none left to hand on


class GraphedStep:
    """``model.loss_and_grads`` for one device, captured as a graph per batch shape after an eager first step.

    Called as ``loss_and_grads(params, x, y)``; ``params`` must map the same names to arrays of the same
    shapes every step.  The returned loss and gradients are the graph's: read or copy them before the next
    call.  ``replays`` counts steps that ran as a graph; ``failed`` says why capture was given up, if it was.

    ``update``, where given, makes an :class:`~psgd.optim.ingraph.InGraph` of the caller's optimizer and weights:
    a graph that reads the weights in place then updates them too, and a replay returns no gradients (none is
    left to apply); a step run eagerly returns its gradients, for the caller to apply as before.
    """

    def __init__(
        self, model: Any, device: backend.Device, name: str = "train", update: Callable[[], GraphUpdate] | None = None
    ):
        self.model, self.device, self.name, self.update = model, device, name, update
        self._graphs: dict[tuple, _Captured] = {}
        self._last: dict[str, Any] | None = None  # the weights of the eager first step, to see if they persist
        self._copying = False  # the weights once changed under a graph that read them in place: copy from then on
        self.replays = 0
        self.failed: str | None = None
        self._said = False  # why the update stays outside the graph, said once

    def __call__(self, params: Mapping[str, Any], x: Any, y: Any) -> tuple[Any, dict[str, Any]]:
        if self.failed is not None:
            return self.model.loss_and_grads(params, x, y)
        key = (x.shape, x.dtype.str, y.shape, y.dtype.str, tuple((k, v.shape) for k, v in params.items()))
        captured = self._graphs.get(key)
        if captured is None:
            if self._last is None or len(self._graphs) >= MAX_GRAPHS:  # the first step runs eagerly
                self._last = dict(params)
                return self.model.loss_and_grads(params, x, y)
            try:
                captured = self._graphs[key] = self._capture(params, x, y)
            except Exception as exc:  # a model that cannot be captured: kernel by kernel from now on
                self.failed = f"{type(exc).__name__}: {exc}"
                log.info(
                    "%s: the step could not be captured as a CUDA graph (%s); it runs kernel by kernel",
                    self.name,
                    self.failed,
                )
                self._graphs.clear()
                return self.model.loss_and_grads(params, x, y)
            log.info(
                "%s: the step is captured as a CUDA graph (batch %s, %s weights %s%s)",
                self.name,
                tuple(x.shape),
                len(params),
                "read in place" if captured.shared else "copied in each step",
                ", the optimizer's update inside" if captured.update is not None else "",
            )
        if captured.update is not None and not captured.update.current():  # the optimizer's state was replaced
            del self._graphs[key]
            return self.model.loss_and_grads(params, x, y)
        done = captured.replay(params, x, y, self.device.xp.cuda.get_current_stream())
        if done is None:  # new weight arrays where the graph read the old ones: captured again, copying them
            del self._graphs[key]
            self._copying = True
            return self.model.loss_and_grads(params, x, y)
        self.replays += 1
        return done

    def _capture(self, params: Mapping[str, Any], x: Any, y: Any) -> _Captured:
        xp = self.device.xp
        last = self._last or {}
        shared = not self._copying and all(last.get(k) is v for k, v in params.items())  # as the step before
        pool = xp.cuda.MemoryPool()
        stream = xp.cuda.Stream(non_blocking=True)
        with xp.cuda.using_allocator(pool.malloc):
            x_in, y_in = xp.empty_like(x), xp.empty_like(y)
            x_in[...] = x
            y_in[...] = y
            held = dict(params) if shared else {k: v.copy() for k, v in params.items()}
            xp.cuda.get_current_stream().synchronize()
            with stream:
                # the kernels compiled, the pool grown, off the graph
                _, grads = self.model.loss_and_grads(held, x_in, y_in)
                update = self._update(grads) if shared else None
                stream.synchronize()
                stream.begin_capture()
                try:
                    outputs = self.model.loss_and_grads(held, x_in, y_in)
                    if update is not None:
                        update.capture(outputs[1])
                finally:
                    graph = stream.end_capture()
        return _Captured(graph, x_in, y_in, held, shared, outputs, pool, stream, update)

    def _update(self, grads: Mapping[str, Any]) -> GraphUpdate | None:
        """The updates of ``grads`` to capture after the gradient, made ready; None (said once) where they cannot be."""
        if self.update is None:
            return None
        update = self.update()
        why = update.why_not(grads)
        if why is None:
            update.prepare(grads)
            return update
        if not self._said:
            self._said = True
            log.info("%s: the optimizer's update runs after the captured step, not inside it: %s", self.name, why)
        return None
