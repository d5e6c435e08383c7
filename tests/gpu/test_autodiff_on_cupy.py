"""Every property check of ``tests/unit/test_autodiff.py`` run again with the tape on CuPy.

Each check there draws random shapes and values, takes the gradient of ``sum(fn(*inputs) * R)`` by the tape on NumPy
and by central differences in float64, and requires them to agree.  Here each of those checks also runs ``fn`` on
CuPy arrays (its inputs and the NumPy arrays it closes over, such as labels, masks and indices, moved to the device)
and requires the device's output and gradients to equal NumPy's to float64 rounding.  Where the device draws its own
random numbers (dropout's mask), its output differs from NumPy's by design, and its gradient is checked against
central differences taken on the device itself.
"""

from __future__ import annotations

import functools
import importlib.util
import pathlib

import numpy as np
import pytest

from psgd.autodiff import Tensor, backward, no_grad, ops
from psgd.compute import backend

pytestmark = pytest.mark.gpu

_spec = importlib.util.spec_from_file_location(
    "psgd_unit_autodiff_checks", pathlib.Path(__file__).parents[1] / "unit" / "test_autodiff.py"
)
unit = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(unit)

ROUNDING = dict(rtol=1e-9, atol=1e-12)


class _OnDevice:
    """The NumPy arrays ``fn`` closes over, moved to the device while the block runs, and moved back."""

    def __init__(self, fn, cp):
        self.cells = [c for c in (getattr(fn, "__closure__", None) or ()) if isinstance(c.cell_contents, np.ndarray)]
        self.cp = cp

    def __enter__(self):
        self.saved = [c.cell_contents for c in self.cells]
        for cell in self.cells:
            cell.cell_contents = self.cp.asarray(cell.cell_contents)

    def __exit__(self, *exc):
        for cell, value in zip(self.cells, self.saved):
            cell.cell_contents = value


def _tape(fn, arrays, weights, xp):
    leaves = [Tensor(xp.asarray(a), requires_grad=True) for a in arrays]
    out = fn(*leaves)
    assert backend.get_array_module(out.data) is xp
    backward(ops.sum(ops.mul(out, xp.asarray(weights))))
    return backend.to_host(out.data), [None if leaf.grad is None else backend.to_host(leaf.grad) for leaf in leaves]


def _device_xp():
    return backend.get_device("cuda").xp


def check_on_both(fn, *arrays, seed: int = 0, random: bool = False) -> None:
    """``unit.check``, then the same on the device: its output and gradients equal NumPy's, or, where it draws its own
    random numbers (``random``), its gradients equal central differences taken on the device."""
    arrays = [np.array(a, dtype=np.float64) for a in arrays]
    unit_check(fn, *arrays, seed=seed)  # NumPy's tape against central differences, as the CPU suite checks
    cp = _device_xp()
    with no_grad():
        shape = fn(*[Tensor(a) for a in arrays]).shape
    weights = np.random.default_rng(seed).standard_normal(shape)
    host_out, host_grads = _tape(fn, [a.copy() for a in arrays], weights, np)
    with _OnDevice(fn, cp):
        out, grads = _tape(fn, arrays, weights, cp)
        if not random:
            np.testing.assert_allclose(out, host_out, **ROUNDING, err_msg="the output on the device")
            for k, (got, want) in enumerate(zip(grads, host_grads)):
                np.testing.assert_allclose(got, want, **ROUNDING, err_msg=f"input {k} on the device")
            return

        def scalar(*values):
            with no_grad():
                return float((fn(*[Tensor(cp.asarray(v)) for v in values]).data * cp.asarray(weights)).sum())

        for k, got in enumerate(grads):
            expected = unit.numeric(scalar, [a.copy() for a in arrays], k)
            np.testing.assert_allclose(got, expected, rtol=unit.RTOL, atol=unit.ATOL, err_msg=f"input {k}")


unit_check = unit.check
CHECKS = sorted(
    name
    for name in dir(unit)
    if name.startswith("test_")
    and name
    not in ("test_a_rule_made_slightly_wrong_fails_the_check", "test_the_reference_names_every_operation_and_module")
)


def _parameters(test):
    marks = [m for m in getattr(test, "pytestmark", []) if m.name == "parametrize"]
    if not marks:
        return [{}]
    cases = [{}]
    for mark in marks:
        names = [n.strip() for n in mark.args[0].split(",")]
        cases = [
            {**case, **dict(zip(names, value if len(names) > 1 else (value,)))}
            for case in cases
            for value in mark.args[1]
        ]
    return cases


CASES = [
    (name, params)
    for name in CHECKS
    for params in _parameters(getattr(unit, name))
    if "check(" in open(unit.__file__).read().split(f"def {name}(")[1].split("\ndef ")[0]
]


@pytest.mark.parametrize("name,params", CASES, ids=[f"{n}-{'-'.join(map(str, p.values()))}" for n, p in CASES])
def test_the_tape_on_cupy_gives_numpys_gradients(name, params, monkeypatch):
    _device_xp()
    random = name == "test_dropout_is_seeded_scaled_and_off_in_evaluation"  # its mask drawn on the device
    monkeypatch.setattr(unit, "check", functools.partial(check_on_both, random=random))
    getattr(unit, name)(**params)
