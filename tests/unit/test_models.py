"""Built-in models: specs, grads, init, a training sanity check, and every ModelError path."""

from __future__ import annotations

import numpy as np
import pytest

from psgd.compute import backend
from psgd.model import (
    MODELS,
    BaseModel,
    Model,
    ModelError,
    VarSpec,
    build_model,
    init_variable,
    load_model_class,
)
from psgd.model.nets import CNN, MLP, SoftmaxRegression

EXPECTED_SPECS = {
    ("softmax", (28, 28), ()): [("dense0/W", (784, 10)), ("dense0/b", (10,))],
    ("mlp", (784,), ()): [
        ("dense0/W", (784, 128)),
        ("dense0/b", (128,)),
        ("dense1/W", (128, 64)),
        ("dense1/b", (64,)),
        ("dense2/W", (64, 10)),
        ("dense2/b", (10,)),
    ],
    ("cnn", (8, 8), ()): [
        ("conv0/W", (8, 1, 3, 3)),
        ("conv0/b", (8,)),
        ("conv1/W", (16, 8, 3, 3)),
        ("conv1/b", (16,)),
        ("dense0/W", (64, 64)),
        ("dense0/b", (64,)),
        ("dense1/W", (64, 10)),
        ("dense1/b", (10,)),
    ],
    ("cnn", (3, 9, 7), (("channels", (4,)), ("kernel", 5), ("hidden", 6))): [
        ("conv0/W", (4, 3, 5, 5)),
        ("conv0/b", (4,)),
        ("dense0/W", (4 * 4 * 3, 6)),
        ("dense0/b", (6,)),
        ("dense1/W", (6, 10)),
        ("dense1/b", (10,)),
    ],
}


def test_registry():
    from psgd.model.embed import Embed

    assert MODELS == {"softmax": SoftmaxRegression, "mlp": MLP, "cnn": CNN, "embed": Embed}
    assert issubclass(ModelError, ValueError)
    assert all(load_model_class(name) is cls for name, cls in MODELS.items())
    assert callable(init_variable) and VarSpec


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("key", list(EXPECTED_SPECS), ids=str)
def test_specs(key, dtype):
    name, input_shape, options = key
    model = build_model(name, input_shape, 10, dtype=dtype, **dict(options))
    assert isinstance(model, Model) and isinstance(model, BaseModel)
    specs = model.specs()
    assert [(s.name, s.shape) for s in specs] == EXPECTED_SPECS[key]
    assert {s.dtype for s in specs} == {dtype}
    assert {s.init for s in specs if s.name.endswith("/b")} == {"zeros"}


@pytest.mark.parametrize(
    "name,input_shape,options",
    [
        ("softmax", (6,), {}),
        ("mlp", (2, 3), {"hidden": (5,)}),
        ("cnn", (4, 4), {"channels": (2,), "hidden": 3}),
        ("cnn", (2, 4, 4), {"channels": (2, 2), "hidden": 3}),
    ],
)
def test_float32_grads_on_device(device, rng, name, input_shape, options):
    model = build_model(name, input_shape, 3, **options)
    params = {k: device.asarray(v) for k, v in model.init(0).items()}
    x = device.asarray(rng.standard_normal((4,) + input_shape))  # float64 inputs are cast to the model dtype
    loss, grads = model.loss_and_grads(params, x, device.asarray(np.array([0, 1, 2, 1])))
    # a scalar on the device, not yet read: reading it would wait for the GPU in the middle of the step
    assert loss.shape == () and loss.dtype == np.float32 and np.isfinite(float(loss))
    assert backend.get_array_module(loss) is device.xp
    assert list(grads) == [s.name for s in model.specs()]
    for spec in model.specs():
        g = grads[spec.name]
        assert backend.get_array_module(g) is device.xp
        assert g.shape == spec.shape and g.dtype == np.float32
    logits = model.predict(params, x)
    assert logits.shape == (4, 3) and logits.dtype == np.float32
    assert backend.get_array_module(logits) is device.xp
    flat = model.predict(params, x.reshape(4, -1))  # flattened inputs are accepted too
    np.testing.assert_allclose(backend.to_host(flat), backend.to_host(logits), rtol=1e-6)


def test_init_is_deterministic_and_per_variable():
    model = build_model("cnn", (8, 8), 10)
    full = model.init(seed=3)
    again = model.init(seed=3)
    other = model.init(seed=4)
    assert list(full) == [s.name for s in model.specs()]
    for spec in model.specs():
        assert full[spec.name].shape == spec.shape and full[spec.name].dtype == np.float32
        np.testing.assert_array_equal(full[spec.name], again[spec.name])
        (one,) = model.init(seed=3, names=[spec.name]).values()
        np.testing.assert_array_equal(one, full[spec.name])
        if spec.init != "zeros":
            assert not np.array_equal(full[spec.name], other[spec.name])
        else:
            assert not full[spec.name].any()
    # he_normal on conv0/W: std sqrt(2 / fan_in) with fan_in = C*k*k = 9
    assert full["conv1/W"].std() == pytest.approx(np.sqrt(2 / (8 * 9)), rel=0.2)
    with pytest.raises(KeyError):
        model.init(seed=3, names=["nope/W"])


def blobs(rng, n=90, dim=10, classes=3):
    centers = rng.standard_normal((classes, dim)) * 3
    y = rng.integers(0, classes, size=n)
    return (centers[y] + rng.standard_normal((n, dim))).astype(np.float32), y


def images(rng, n=60, classes=3):
    """6x6 images whose class is the row of a bright bar."""
    y = rng.integers(0, classes, size=n)
    x = rng.standard_normal((n, 6, 6)).astype(np.float32) * 0.3
    for i, c in enumerate(y):
        x[i, 2 * c : 2 * c + 2, :] += 2.0
    return x, y


def train(model, x, y, lr, steps):
    params = model.init(seed=0)
    first = model.loss(params, x, y)
    for _ in range(steps):
        loss, grads = model.loss_and_grads(params, x, y)
        for k, g in grads.items():
            params[k] -= lr * g
    accuracy = float((model.predict(params, x).argmax(axis=1) == y).mean())
    return first, loss, accuracy


@pytest.mark.parametrize(
    "name,loss,options,lr",
    [
        ("softmax", "cross_entropy", {}, 0.1),
        ("softmax", "mse", {}, 0.01),
        ("mlp", "cross_entropy", {"hidden": (16,)}, 0.05),
        ("mlp", "mse", {"hidden": (16, 8)}, 0.01),
    ],
)
def test_training_reduces_loss(rng, name, loss, options, lr):
    x, y = blobs(rng)
    model = build_model(name, (10,), 3, loss=loss, **options)
    first, last, accuracy = train(model, x, y, lr, steps=300)
    assert last < 0.2 * first, (first, last)
    assert accuracy >= 0.95


def test_cnn_training_reduces_loss(rng):
    x, y = images(rng)
    model = build_model("cnn", (6, 6), 3, channels=(4,), hidden=8)
    first, last, accuracy = train(model, x, y, lr=0.05, steps=150)
    assert last < 0.2 * first, (first, last)
    assert accuracy >= 0.95


def test_string_options_are_parsed():
    assert build_model("mlp", (4,), 2, hidden="16, 8").hidden == (16, 8)
    assert build_model("cnn", (4, 4), 2, channels="3", kernel="3", hidden="5").channels == (3,)


def one_line_error(match, fn, *args, **kwargs):
    with pytest.raises(ModelError, match=match) as info:
        fn(*args, **kwargs)
    assert "\n" not in str(info.value)
    return str(info.value)


@pytest.mark.parametrize(
    "name,input_shape,options,match",
    [
        ("mlp", (4,), {"widths": 3}, r"^mlp: unknown option\(s\) 'widths' \(options: loss, hidden\)"),
        ("softmax", (4,), {"hidden": 3}, r"^softmax: unknown option\(s\) 'hidden' \(options: loss\)"),
        ("mlp", (4,), {"hidden": ()}, r"^mlp: option 'hidden'"),
        ("mlp", (4,), {"hidden": (8, -1)}, r"^mlp: option 'hidden'"),
        ("mlp", (4,), {"hidden": 0}, r"^mlp: option 'hidden'"),
        ("mlp", (4,), {"hidden": "abc"}, r"^mlp: option 'hidden'"),
        ("mlp", (4,), {"hidden": (True,)}, r"^mlp: option 'hidden'"),
        ("mlp", (4,), {"loss": "hinge"}, r"^mlp: option 'loss' must be one of cross_entropy, mse"),
        ("cnn", (8, 8), {"channels": ()}, r"^cnn: option 'channels'"),
        ("cnn", (8, 8), {"kernel": 2}, r"^cnn: option 'kernel' must be odd"),
        ("cnn", (8, 8), {"kernel": -3}, r"^cnn: option 'kernel'"),
        ("cnn", (8, 8), {"hidden": (4, 4)}, r"^cnn: option 'hidden'"),
        (
            "cnn",
            (8, 8),
            {"stride": 2},
            r"^cnn: unknown option\(s\) 'stride' \(options: loss, channels, kernel, hidden\)",
        ),
        ("cnn", (64,), {}, r"^cnn: input_shape must be \(C, H, W\) or \(H, W\)"),
        ("cnn", (1, 2, 8, 8), {}, r"^cnn: input_shape must be"),
        ("cnn", (3, 3), {}, r"^cnn: input 3x3 is too small for 2"),
        ("mlp", (0,), {}, r"^mlp: input_shape must be positive"),
        ("mlp", "abc", {}, r"^mlp: input_shape"),
        ("mlp", (4,), {"num_classes": 1}, r"^mlp: num_classes must be at least 2"),
        ("mlp", (4,), {"dtype": "int32"}, r"^mlp: dtype must be a float type"),
        ("mlp", (4,), {"dtype": "nonsense"}, r"^mlp: dtype must be a float type"),
    ],
)
def test_bad_builtin_options(name, input_shape, options, match):
    kwargs = {"num_classes": 3, **options}
    one_line_error(match, build_model, name, input_shape, **kwargs)
    one_line_error(match, MODELS[name], input_shape, **kwargs)  # direct construction says the same


def test_wrong_input_shape_at_call_time(rng):
    model = build_model("mlp", (4,), 3, hidden=(2,))
    one_line_error(
        r"^mlp: expected inputs of shape \(B, 4\), got \(2, 5\)",
        model.loss_and_grads,
        model.init(0),
        rng.standard_normal((2, 5)),
        np.array([0, 1]),
    )


@pytest.mark.parametrize("name", ["nope", "resnet50", "a:b:c", ":Net", "pkg.mod:", "pkg mod:Net"])
def test_unknown_model_name(name):
    msg = one_line_error(r"^unknown model", build_model, name, (4,), 3)
    assert "softmax, mlp, cnn" in msg and "package.module:Class" in msg


GOOD_MODULE = """
    import numpy as np
    from psgd.model import BaseModel, VarSpec
    from psgd.model.losses import softmax_cross_entropy
    from psgd.model.nets import MLP
    from psgd.compute.backend import get_array_module

    class TinyLinear(BaseModel):
        '''A user model written from scratch: logits = scale * x @ W.'''

        def __init__(self, input_shape, num_classes, dtype="float32", scale=1.0):
            self.n_in, self.k, self.dtype, self.scale = int(np.prod(input_shape)), num_classes, dtype, scale

        def specs(self):
            return [VarSpec("W", (self.n_in, self.k), self.dtype, "glorot_uniform")]

        def _x(self, params, x):
            xp = get_array_module(params["W"])
            return xp.asarray(x, dtype=self.dtype).reshape(len(x), -1)

        def loss_and_grads(self, params, x, y):
            x = self._x(params, x)
            loss, dz = softmax_cross_entropy(self.scale * x @ params["W"], y)
            return loss, {"W": self.scale * x.T @ dz}

        def predict(self, params, x):
            return self.scale * self._x(params, x) @ params["W"]

    class WideMLP(MLP):
        def __init__(self, input_shape, num_classes, dtype="float32", width=32, **options):
            super().__init__(input_shape, num_classes, dtype, hidden=(width, width), **options)

    class NeedsPositiveScale(TinyLinear):
        def __init__(self, input_shape, num_classes, dtype="float32", scale=1.0):
            if scale <= 0:
                raise ValueError("scale must be positive")
            super().__init__(input_shape, num_classes, dtype, scale)

    def not_a_class():
        pass

    CONSTANT = 3

    class NotAModel:
        def specs(self):
            return []
"""


def test_user_model_builds_and_trains(user_module, rng):
    mod = user_module(GOOD_MODULE)
    x, y = blobs(rng)
    model = build_model(f"{mod}:TinyLinear", (10,), 3, scale=0.5)
    assert isinstance(model, Model) and model.scale == 0.5
    first, last, accuracy = train(model, x, y, lr=0.1, steps=200)
    assert last < 0.2 * first and accuracy >= 0.95
    wide = build_model(f"{mod}:WideMLP", (10,), 3, width=4, loss="mse")
    assert wide.hidden == (4, 4) and wide.loss_name == "mse"


@pytest.mark.parametrize(
    "attr,options,match",
    [
        ("Missing", {}, r"module '{mod}' has no attribute 'Missing'"),
        ("not_a_class", {}, r"'not_a_class' is a function, not a class"),
        ("CONSTANT", {}, r"'CONSTANT' is a int, not a class"),
        ("NotAModel", {}, r"class 'NotAModel' lacks the model method\(s\) init, loss_and_grads, predict"),
        ("TinyLinear", {"depth": 2}, r"unexpected keyword argument 'depth' \(options it takes: scale\)"),
        ("NeedsPositiveScale", {"scale": -1}, r"ValueError: scale must be positive \(options it takes: scale\)"),
        ("WideMLP", {"width": 0}, r"^mlp: option 'hidden'"),  # a ModelError from inside passes through
    ],
)
def test_user_model_errors(user_module, attr, options, match):
    mod = user_module(GOOD_MODULE)
    one_line_error(match.format(mod=mod), build_model, f"{mod}:{attr}", (4,), 3, **options)


def test_user_module_that_does_not_import(user_module):
    msg = one_line_error(
        r"^model 'psgd_no_such_module_xyz:Net': cannot import module 'psgd_no_such_module_xyz' "
        r"\(ModuleNotFoundError: No module named 'psgd_no_such_module_xyz'\)",
        build_model,
        "psgd_no_such_module_xyz:Net",
        (4,),
        3,
    )
    assert msg
    broken = user_module("class Net(:\n    pass\n")
    one_line_error(rf"cannot import module '{broken}' \(SyntaxError: ", build_model, f"{broken}:Net", (4,), 3)
    raising = user_module("import numpy\nraise RuntimeError('no GPU here\\nsecond line')\n")
    one_line_error(
        rf"cannot import module '{raising}' \(RuntimeError: no GPU here second line\)",
        build_model,
        f"{raising}:Net",
        (4,),
        3,
    )
    missing_dep = user_module("import psgd_missing_dependency_xyz\n")
    one_line_error(r"No module named 'psgd_missing_dependency_xyz'", build_model, f"{missing_dep}:Net", (4,), 3)
