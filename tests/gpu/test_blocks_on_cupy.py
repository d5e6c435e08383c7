"""The sequence modules' network of ``tests/unit/test_blocks.py`` on CuPy: the same loss, gradients and scores as on
NumPy, to float64 rounding (the operations under it are each checked on the device by test_autodiff_on_cupy.py)."""

from __future__ import annotations

import importlib.util
import pathlib

import numpy as np
import pytest

from psgd.compute import backend

pytestmark = pytest.mark.gpu

_spec = importlib.util.spec_from_file_location(
    "psgd_unit_blocks", pathlib.Path(__file__).parents[1] / "unit" / "test_blocks.py"
)
unit = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(unit)


@pytest.mark.parametrize("causal", [True, False])
def test_the_sequence_modules_give_numpys_loss_gradients_and_scores_on_cupy(causal):
    cp = backend.get_device("cuda").xp
    net = unit.SignalNet(causal=causal)
    params = net.init(1)
    rng = np.random.default_rng(3)
    x, y = rng.standard_normal((4, unit.T, unit.FEATURES)), rng.integers(0, unit.CLASSES, 4)
    loss, grads = net.loss_and_grads(params, x, y)
    on_device = {n: cp.asarray(v) for n, v in params.items()}
    got_loss, got_grads = net.loss_and_grads(on_device, cp.asarray(x), cp.asarray(y))
    assert backend.get_array_module(got_loss) is cp
    np.testing.assert_allclose(backend.to_host(got_loss), loss, rtol=1e-9)
    for name, g in grads.items():
        np.testing.assert_allclose(backend.to_host(got_grads[name]), g, rtol=1e-9, atol=1e-12, err_msg=name)
    np.testing.assert_allclose(
        backend.to_host(net.predict(on_device, cp.asarray(x))), net.predict(params, x), rtol=1e-9, atol=1e-12
    )
