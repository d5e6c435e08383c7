"""The optimizer base class: per-key state, the checked update around two hooks (``_scalars``, ``_apply``), checkpoints.

A subclass (see :mod:`psgd.optim.rules`) sets ``name`` and ``state_names`` and
implements ``_scalars`` and ``_apply``; :class:`Optimizer` creates each key's buffers on its
first update, checks every update's arrays, counts ``t`` and takes the learning
rate from the schedule, and writes and restores the state (``state_dict``).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from psgd.compute import backend
from psgd.optim.schedules import Constant, Schedule
from psgd.optim.validation import OptimizerError, non_negative, positive

SEP = "::"  # state_dict names are "<key>::<field>"; keys may themselves contain "::"


@dataclasses.dataclass(frozen=True)
class Share:
    """How many updates make one round, so that N updates of a round's 1/N train as one round does.

    Under sync a round's gradients are averaged into one update (``updates = 1``).  Under async and
    ssp each of N workers' pushes is an update of its own: applied as one of ``updates = N``, the
    optimizer's state follows the same accounting as the learning rate.  The schedule and Adam's
    bias correction count rounds (``t / updates``), a momentum or moment decay ``d`` acts as
    ``d ** fraction`` per update, and a steady gradient leaves the state that whole rounds of it leave.
    ``implicit_momentum`` is the momentum the stream of updates already carries (asynchrony's, about
    1 - 1/N: Mitliagkas et al. 2016); a momentum optimizer lowers its own per-update momentum by it.
    """

    updates: int = 1
    implicit_momentum: float = 0.0

    @property
    def fraction(self) -> float:
        """The part of a round one update is."""
        return 1.0 / self.updates


WHOLE = Share()  # one update is one round: sync rounds, all-reduce steps, a single process


class _Slot:
    """One key's state: the update count and the optimizer's buffers."""

    __slots__ = ("t", "state")

    def __init__(self, t: int, state: dict[str, Any]):
        self.t = t
        self.state = state


def _is_array(a: Any) -> bool:
    return isinstance(a, np.ndarray) or backend.is_device_array(a)


def _where(a: Any) -> str:
    return "a CuPy array" if backend.is_device_array(a) else "a NumPy array"


def _move(param: Any, grad: Any, lr_scale: float) -> None:
    """A state variable moved by the change a step made to it (scaled as a gradient would be: 1 / workers under
    async, say): ``param += grad * lr_scale``."""
    if lr_scale == 1.0:
        param += grad
    else:
        param += grad * lr_scale


class Optimizer:
    """Per-key optimizer state and the update loop around two hooks, ``_scalars`` and ``_apply``.

    ``lr`` is a positive number (a constant rate) or a :class:`Schedule`.
    Subclasses set ``name`` and ``state_names`` (buffers created as
    ``zeros_like(param)`` on a key's first update), validate their
    hyperparameters, list them in ``hyperparameters()`` and implement ``_scalars`` and ``_apply``.
    """

    name = "optimizer"
    state_names: tuple[str, ...] = ()
    #: whether ``_apply`` works value by value (no norm, no reduction): then keys laid out one after the other in
    #: one array may be updated in one step (:meth:`update_flat`)
    elementwise = False

    def __init__(self, lr: float | Schedule):
        if isinstance(lr, Schedule):
            self.schedule = lr
        else:
            self.schedule = Constant(positive(self.name, "lr", lr))
        self._slots: dict[str, _Slot] = {}
        self._lock = threading.Lock()  # guards the key table, not the per-key arithmetic
        self._fused: dict[tuple[str, ...], tuple[list[_Slot], dict[str, Any]]] = {}  # see update_flat
        #: the variables that are state, not trained (VarSpec.state): a key of one (its name, or a slice's
        #: ``var#start``) takes its "gradient", the change a step made to it, as it is: ``p += g * lr_scale``
        self.state_vars: frozenset[str] = frozenset()

    def _scalars(self, lr: float, t: float, share: Share) -> tuple[float, ...]:
        """The values of one update that change from update to update, worked out on the host in float64.

        ``lr`` is this update's learning rate (schedule times ``lr_scale``) and ``t`` the rounds done once this
        update is applied (the update's number counted from 1 when each update is a round, as in Adam's bias
        correction).  A step captured as a graph writes them where its kernels read them (:class:`InGraph`).
        """
        raise NotImplementedError

    def _apply(self, param: Any, grad: Any, state: dict[str, Any], scalars: tuple, share: Share) -> None:
        """Update ``param`` (and ``state``) in place with ``scalars``, as :meth:`_scalars` made them (numbers, or
        on a GPU 0-d device arrays holding them)."""
        raise NotImplementedError

    def _step(self, param: Any, grad: Any, state: dict[str, Any], lr: float, t: float, share: Share) -> None:
        self._apply(param, grad, state, self._scalars(lr, t, share), share)

    def hyperparameters(self) -> dict[str, Any]:
        return {}

    @property
    def lr(self) -> float:
        """The base learning rate (the schedule's peak)."""
        return self.schedule.lr

    # -- the update ----------------------------------------------------------

    def update(self, key: str, param: Any, grad: Any, lr_scale: float = 1.0, share: Share = WHOLE) -> None:
        """Apply one update to ``param`` in place, with ``grad``, under ``key``.

        The learning rate is ``schedule(t) * lr_scale``, ``t`` being the rounds
        already applied to ``key`` (its updates over ``share.updates``;
        ``lr_scale`` carries e.g. 1/workers or 1/staleness).  A key of :attr:`state_vars` is moved by its change.
        """
        self._check(key, param, grad, lr_scale)
        if self.is_state(key):
            _move(param, grad, lr_scale)
            return
        self._check_share(key, share)
        slot = self._slot(key, param)
        self._step(param, grad, slot.state, *self._rate(slot.t, lr_scale, share), share)
        slot.t += 1

    def is_state(self, key: str) -> bool:
        """Whether ``key`` (a variable's name, or a slice's ``var#start``) is of a state variable."""
        return bool(self.state_vars) and (key in self.state_vars or key.rsplit("#", 1)[0] in self.state_vars)

    def _check_share(self, key: str, share: Share) -> None:
        if share is not WHOLE and not (
            isinstance(share.updates, int) and share.updates >= 1 and 0 <= share.implicit_momentum < 1
        ):
            raise OptimizerError(
                f"{self.name}: key {key!r}: {share!r} must have a whole number of updates "
                ">= 1 and 0 <= implicit_momentum < 1"
            )

    def _rate(self, t: int, lr_scale: float, share: Share) -> tuple[float, float]:
        """The learning rate of the update after ``t`` of a key, and the rounds done once it is applied."""
        per_round = share.updates
        lr = self.schedule(t if per_round == 1 else t / per_round) * lr_scale
        return lr, t + 1 if per_round == 1 else (t + 1) / per_round

    def update_flat(
        self,
        keys: tuple[str, ...],
        param: Any,
        grad: Any,
        bounds: tuple[tuple[int, int], ...],
        lr_scale: float = 1.0,
        share: Share = WHOLE,
        over: Callable[[Callable[[int, int], None]], None] | None = None,
    ) -> None:
        """:meth:`update` of each key of ``keys``, whose parameter is ``param[a:b]`` and gradient ``grad[a:b]`` for
        its ``(a, b)`` of ``bounds`` (one flat array, the keys one after the other): the same values, in one step
        where the rule is :attr:`elementwise` and the keys have taken the same number of updates (their states
        are then laid out the same way, in one array each), else key by key.  ``over``, where given, makes that one
        step piece by piece: it calls the function it is given with ``(a, b)`` for pieces covering the array, each
        once (a shard's update pass, :mod:`psgd.server.state.update`); an elementwise rule's values are the same either
        way."""
        if self.state_vars and any(self.is_state(k) for k in keys):  # each run of keys of one kind apart
            start = 0
            for end in range(1, len(keys) + 1):
                if end == len(keys) or self.is_state(keys[end]) != self.is_state(keys[start]):
                    a, b = bounds[start][0], bounds[end - 1][1]
                    if self.is_state(keys[start]):
                        self._check(keys[start], param[a:b], grad[a:b], lr_scale)
                        _move(param[a:b], grad[a:b], lr_scale)
                    else:
                        self.update_flat(
                            keys[start:end],
                            param[a:b],
                            grad[a:b],
                            tuple((x - a, y - a) for x, y in bounds[start:end]),
                            lr_scale,
                            share,
                        )
                    start = end
            return
        fused = self._fused.get(keys) if self.elementwise else None
        if fused is None or any(self._slots.get(k) is not slot for k, slot in zip(keys, fused[0])):
            fused = self._fuse(keys, param, bounds)
        if fused is None or len({slot.t for slot in fused[0]}) != 1 or param.size != bounds[-1][1]:
            for key, (a, b) in zip(keys, bounds):
                self.update(key, param[a:b], grad[a:b], lr_scale, share)
            return
        slots, state = fused
        self._check(keys[0], param, grad, lr_scale)
        self._check_share(keys[0], share)
        rate = self._rate(slots[0].t, lr_scale, share)
        if over is None:
            self._step(param, grad, state, *rate, share)
        else:
            over(lambda a, b: self._step(param[a:b], grad[a:b], {k: s[a:b] for k, s in state.items()}, *rate, share))
        for slot in slots:
            slot.t += 1

    def _fuse(self, keys: tuple[str, ...], param: Any, bounds: tuple[tuple[int, int], ...]):
        """The slots of ``keys`` with their states moved (copied once) into one array per state buffer, laid out as
        ``param``: (slots, whole states); None where the keys cannot be updated at once."""
        if not self.elementwise or not keys or param.size != bounds[-1][1]:
            return None
        xp = backend.get_array_module(param)
        for key, (a, b) in zip(keys, bounds):
            self._slot(key, param[a:b])  # made, or checked against its parameter
        slots = [self._slots[k] for k in keys]
        if len({slot.t for slot in slots}) != 1:
            return None
        state = {name: xp.empty_like(param) for name in self.state_names}
        for slot, (a, b) in zip(slots, bounds):
            for name in self.state_names:
                state[name][a:b] = slot.state[name]
            slot.state = {name: state[name][a:b] for name in self.state_names}
        self._fused[keys] = (slots, state)
        return slots, state

    def _check(self, key: str, param: Any, grad: Any, lr_scale: float) -> None:
        if not isinstance(key, str):
            raise OptimizerError(f"{self.name}: key must be a string, got {key!r}")
        where = f"{self.name}: key {key!r}"
        for label, a in (("param", param), ("grad", grad)):
            if not _is_array(a):
                raise OptimizerError(f"{where}: {label} must be a NumPy or CuPy array, got {type(a).__name__}")
        if backend.is_device_array(param) != backend.is_device_array(grad):
            raise OptimizerError(
                f"{where}: param is {_where(param)} but grad is {_where(grad)}; put both on one device"
            )
        if param.shape != grad.shape:
            raise OptimizerError(f"{where}: grad shape {grad.shape} does not match param shape {param.shape}")
        if param.dtype != grad.dtype:
            raise OptimizerError(f"{where}: grad dtype {grad.dtype} does not match param dtype {param.dtype}")
        if param.dtype.kind != "f":
            raise OptimizerError(f"{where}: param dtype {param.dtype} is not floating point")
        if not getattr(param.flags, "writeable", True):
            raise OptimizerError(f"{where}: param is read-only; the optimizer updates it in place")
        if lr_scale != 1.0:
            non_negative(where, "lr_scale", lr_scale)

    def _slot(self, key: str, param: Any) -> _Slot:
        slot = self._slots.get(key)
        if slot is None:
            xp = backend.get_array_module(param)
            state = {name: xp.zeros_like(param) for name in self.state_names}
            with self._lock:
                return self._slots.setdefault(key, _Slot(0, state))
        for name, buf in slot.state.items():
            if buf.shape != param.shape or buf.dtype != param.dtype:
                raise OptimizerError(
                    f"{self.name}: key {key!r}: param {param.shape} {param.dtype} does not match its "
                    f"optimizer state {buf.shape} {buf.dtype} (a key reused for another variable, "
                    "or state restored from another model?)"
                )
            if backend.is_device_array(buf) != backend.is_device_array(param):  # after load_state_dict(device=None)
                if backend.is_device_array(param):
                    slot.state[name] = backend.get_array_module(param).asarray(buf)
                else:
                    slot.state[name] = backend.to_host(buf)
        return slot

    # -- inspection ----------------------------------------------------------

    def keys(self) -> list[str]:
        """The keys that have state, in the order they were first updated (or loaded)."""
        with self._lock:
            return list(self._slots)

    def step_count(self, key: str) -> int:
        """Updates applied to ``key`` (0 for a key never updated)."""
        slot = self._slots.get(key)
        return 0 if slot is None else slot.t

    def state(self, key: str) -> dict[str, Any]:
        """The live state buffers of ``key`` by name (not copies)."""
        slot = self._slots.get(key)
        if slot is None:
            raise OptimizerError(f"{self.name}: no state for key {key!r}; it has not been updated or loaded")
        return dict(slot.state)

    def describe(self) -> dict[str, Any]:
        """Name, learning rate, schedule and hyperparameters as flat JSON-ready values.

        ``build_optimizer(**opt.describe())`` rebuilds an equivalent optimizer.
        """
        return {"name": self.name, **self.schedule.describe(), **self.hyperparameters()}

    def __repr__(self) -> str:
        options = ", ".join(f"{k}={v!r}" for k, v in self.describe().items() if k != "name")
        return f"{type(self).__name__}({options})"

    # -- checkpoints ---------------------------------------------------------

    def state_dict(self) -> dict[str, np.ndarray]:
        """Host copies of all state: ``"<key>::t"`` (0-d int64) and ``"<key>::<buffer>"``.

        Ready for ``numpy.savez``.
        """
        with self._lock:
            items = list(self._slots.items())
        out: dict[str, np.ndarray] = {}
        for key, slot in items:
            out[f"{key}{SEP}t"] = np.array(slot.t, dtype=np.int64)
            for name, buf in slot.state.items():
                host = backend.to_host(buf)
                out[f"{key}{SEP}{name}"] = host.copy() if host is buf else host
        return out

    def load_state_dict(self, d: Mapping[str, Any], device: backend.Device | str | None = None) -> None:
        """Replace all state with ``d`` (as written by :meth:`state_dict`, or an npz file).

        Buffers go to ``device`` when given; with ``device=None`` they are loaded
        as NumPy arrays and moved next to the parameter on its first update.
        Everything is checked before anything changes.
        """
        target = None if device is None else backend.get_device(device)
        fields_by_key: dict[str, dict[str, Any]] = {}
        expected = ("t",) + self.state_names
        for entry in d:
            if not isinstance(entry, str) or SEP not in entry:
                raise OptimizerError(f"{self.name}: state_dict entry {entry!r} is not '<key>{SEP}<field>'")
            key, field = entry.rsplit(SEP, 1)
            if field not in expected:
                raise OptimizerError(
                    f"{self.name}: state_dict entry {entry!r} is not {self.name} state (fields: {', '.join(expected)})"
                )
            fields_by_key.setdefault(key, {})[field] = d[entry]
        slots: dict[str, _Slot] = {}
        for key, fields in fields_by_key.items():
            where = f"{self.name}: state_dict key {key!r}"
            missing = [f for f in expected if f not in fields]
            if missing:
                raise OptimizerError(f"{where}: missing {', '.join(missing)}")
            t = backend.to_host(fields["t"])
            if t.ndim != 0 or t.dtype.kind not in "iu" or int(t) < 0:
                raise OptimizerError(f"{where}: t must be a non-negative integer scalar, got {t!r}")
            state = {}
            first = backend.to_host(fields[self.state_names[0]]) if self.state_names else None
            for name in self.state_names:
                host = backend.to_host(fields[name])
                if host.dtype.kind != "f" or host.shape != first.shape or host.dtype != first.dtype:
                    raise OptimizerError(
                        f"{where}: buffer {name!r} ({host.shape} {host.dtype}) must be floating point and "
                        f"match {self.state_names[0]!r} ({first.shape} {first.dtype})"
                    )
                if target is not None and target.is_gpu:
                    state[name] = backend.to_device(host, target)
                else:
                    state[name] = host.copy() if host is fields[name] else host
            slots[key] = _Slot(int(t), state)
        with self._lock:
            self._slots = slots
