"""Central finite-difference checks of every module, loss and built-in model, in float64.

Each check runs on NumPy and, when a GPU is present, on CuPy (``device`` fixture):
the analytic gradient and every function value are computed on the device.
"""

from __future__ import annotations

import numpy as np
import pytest

from psgd.autodiff import Tensor, backward, no_grad, ops
from psgd.compute import backend
from psgd.model import build_model
from psgd.model.blocks import Conv2d, Flatten, Linear, MaxPool2d, ReLU
from psgd.model.losses import mean_squared_error, softmax_cross_entropy
from psgd.model.module import Binding, Sequential

EPS = 1e-6
TOL = 1e-7  # observed errors are about 1e-9


def numeric_grad(f, arrays, key):
    """d f(arrays) / d arrays[key] by central differences (host float64 arrays)."""
    a = arrays[key]
    grad = np.zeros_like(a)
    for idx in np.ndindex(a.shape):
        old = a[idx]
        a[idx] = old + EPS
        up = f(arrays)
        a[idx] = old - EPS
        down = f(arrays)
        a[idx] = old
        grad[idx] = (up - down) / (2 * EPS)
    return grad


def assert_close(analytic, numeric, what):
    analytic = backend.to_host(analytic)
    assert analytic.shape == numeric.shape, what
    assert analytic.dtype == np.float64, what
    err = np.linalg.norm(analytic - numeric) / max(np.linalg.norm(analytic) + np.linalg.norm(numeric), 1e-12)
    assert err <= TOL, f"{what}: relative error {err:.2e}"


def away_from_zero(rng, shape, margin=0.1):
    """Random values with |v| >= margin, so ReLU kinks are never crossed."""
    v = rng.uniform(margin, 1.0, size=shape)
    return v * rng.choice([-1.0, 1.0], size=shape)


def no_ties(rng, shape):
    """A random permutation of well-separated values: no two inputs to a max are close."""
    n = int(np.prod(shape))
    return (rng.permutation(n) * 0.1 - n * 0.05).reshape(shape)


def check_module(device, module, x, rng):
    """Check the input's and every parameter's gradient of ``module`` on ``sum(module(x) * r)``, on ``device``."""
    declared = list(module.declared())
    host = {name: rng.standard_normal(p.shape) for name, _, _, p in declared}
    host["x"] = x

    def run(arrays, tape):
        leaves = {k: Tensor(device.asarray(v), requires_grad=tape) for k, v in arrays.items()}
        binding = Binding(training=tape)
        binding.values.update({(id(owner), attr): leaves[name] for name, owner, attr, _ in declared})
        with binding:
            return module(leaves["x"]), leaves

    out, _ = run(host, False)
    assert backend.get_array_module(out.data) is device.xp
    r = device.asarray(rng.standard_normal(out.shape))

    def f(arrays):
        with no_grad():
            return float(backend.to_host((run(arrays, False)[0].data * r).sum()))

    out, leaves = run(host, True)
    backward(ops.sum(ops.mul(out, r)))
    what = type(module).__name__
    for name, leaf in leaves.items():
        assert_close(leaf.grad, numeric_grad(f, host, name), f"{what} d{name}")


def test_dense(device, rng):
    check_module(device, Linear(4, 3), rng.standard_normal((5, 4)), rng)


def test_dense_with_its_relu(device, rng):
    check_module(device, Linear(4, 3, relu=True), rng.standard_normal((5, 4)), rng)  # (no kink within 1e-6 here)


def test_relu(device, rng):
    check_module(device, ReLU(), away_from_zero(rng, (4, 6)), rng)


def test_flatten(device, rng):
    check_module(device, Flatten(), rng.standard_normal((3, 2, 2, 3)), rng)


@pytest.mark.parametrize("padding,kernel", [("same", 3), ("valid", 3), (2, 3), (0, 2), ("same", 1)])
def test_conv2d(device, rng, padding, kernel):
    check_module(device, Conv2d(2, 3, kernel, padding=padding), rng.standard_normal((2, 2, 5, 4)), rng)


@pytest.mark.parametrize("shape", [(2, 2, 4, 6), (1, 3, 5, 3)])  # even, and odd (cropped)
def test_maxpool2d(device, rng, shape):
    check_module(device, MaxPool2d(), no_ties(rng, shape), rng)


def test_sequential(device, rng):
    net = Sequential(Conv2d(1, 2, 3), ReLU(), MaxPool2d(), Flatten(), Linear(8, 3))
    assert [name for name, *_ in net.declared()] == ["conv0/W", "conv0/b", "dense0/W", "dense0/b"]
    check_module(device, net, rng.standard_normal((2, 1, 4, 4)), rng)


def check_loss(device, loss_fn, logits, target):
    def f(arrays):
        return float(loss_fn(device.asarray(arrays["z"]), device.asarray(target))[0])

    loss, dz = loss_fn(device.asarray(logits), device.asarray(target))
    # a scalar left on the device: reading it is the caller's choice, once the step's work is queued
    assert loss.shape == () and backend.get_array_module(loss) is device.xp
    assert backend.get_array_module(dz) is device.xp
    assert_close(dz, numeric_grad(f, {"z": logits.copy()}, "z"), loss_fn.__name__)


def test_softmax_cross_entropy(device, rng):
    logits = rng.standard_normal((5, 4)) * 3
    y = rng.integers(0, 4, size=5)
    check_loss(device, softmax_cross_entropy, logits, y)


def test_softmax_cross_entropy_is_stable_and_correct(device):
    logits = np.array([[1000.0, 0.0, -1000.0], [0.0, 0.0, 0.0]])
    loss, dz = softmax_cross_entropy(device.asarray(logits), device.asarray(np.array([0, 2])))
    assert np.isfinite(float(loss))
    assert float(loss) == pytest.approx(np.log(3) / 2)
    np.testing.assert_allclose(backend.to_host(dz).sum(axis=1), 0, atol=1e-12)


def test_mse_with_labels(device, rng):
    outputs = rng.standard_normal((5, 4))
    y = rng.integers(0, 4, size=5)
    check_loss(device, lambda z, t: mean_squared_error(z, t, 4), outputs, y)
    loss, _ = mean_squared_error(device.asarray(outputs), device.asarray(y), 4)
    expected = ((outputs - np.eye(4)[y]) ** 2).sum(axis=1).mean()
    assert float(loss) == pytest.approx(expected)


def test_mse_with_targets(device, rng):
    check_loss(device, mean_squared_error, rng.standard_normal((3, 2)), rng.standard_normal((3, 2)))


MODEL_CASES = [
    ("softmax", (3, 2), {}),
    ("mlp", (5,), {"hidden": (4, 3)}),
    ("cnn", (2, 4, 6), {"channels": (2, 3), "kernel": 3, "hidden": 4}),
    ("cnn", (4, 4), {"channels": (2,), "kernel": 3, "hidden": 3}),
]


@pytest.mark.parametrize("loss", ["cross_entropy", "mse"])
@pytest.mark.parametrize("name,input_shape,options", MODEL_CASES, ids=lambda v: str(v))
def test_model(device, rng, name, input_shape, options, loss):
    model = build_model(name, input_shape, 3, dtype="float64", loss=loss, **options)
    host = {k: v + 0.1 * rng.standard_normal(v.shape) for k, v in model.init(seed=7).items()}  # nonzero biases
    host["x"] = rng.standard_normal((3,) + input_shape)
    y = np.array([0, 2, 1])

    def f(arrays):
        dev = {k: device.asarray(v) for k, v in arrays.items()}
        return float(model.loss_and_grads(dev, dev["x"], device.asarray(y))[0])

    dev = {k: device.asarray(v) for k, v in host.items()}
    loss_value, grads = model.loss_and_grads(dev, dev["x"], device.asarray(y))
    assert float(loss_value) == pytest.approx(f(host), rel=1e-12)
    assert list(grads) == [s.name for s in model.specs()]
    for spec in model.specs():
        assert backend.get_array_module(grads[spec.name]) is device.xp
        assert_close(grads[spec.name], numeric_grad(f, host, spec.name), f"{name} d{spec.name}")
