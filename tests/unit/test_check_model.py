"""check_model: every way a model can be wrong gives its own one-line message; good models pass, quickly.

The faulty models are small variations of the documentation's example model with its gradients by hand
(``tests/data/tanhbyhand.py``, kept identical to docs/howto/your-model.md by
``tests/integration/test_check_model_cli.py``).
"""

from __future__ import annotations

import re
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from psgd.compute import backend
from psgd.compute.backend import get_array_module
from psgd.config import JobConfig
from psgd.job import build_job
from psgd.model import BaseModel, ModelError, VarSpec, build_model, check_model, run_checks
from psgd.model.losses import softmax_cross_entropy
from psgd.training.local import train_local

DATA = Path(__file__).resolve().parents[1] / "data"
SHAPE, CLASSES = (8, 8), 10  # the digits


@pytest.fixture
def tanhnet(monkeypatch):
    """The documentation's example module with gradients by hand, importable as ``tanhbyhand``."""
    monkeypatch.syspath_prepend(str(DATA))
    import tanhbyhand

    yield tanhbyhand
    sys.modules.pop("tanhbyhand", None)


@pytest.fixture
def user_module(user_module, monkeypatch):
    """conftest's ``user_module``, with the documentation's example (tests/data/tanhbyhand.py) importable too."""
    monkeypatch.syspath_prepend(str(DATA))
    yield user_module
    sys.modules.pop("tanhbyhand", None)


def failures(model, dtype="float32", name="net", **kwargs) -> list[str]:
    """The lines of the ModelError that check_model raises (it must raise)."""
    with pytest.raises(ModelError) as info:
        check_model(model, SHAPE, CLASSES, dtype, name=name, budget=None, **kwargs)
    return str(info.value).splitlines()


# -- models that pass --------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize(
    "name,options",
    [
        ("softmax", {}),
        ("mlp", {}),
        ("cnn", {}),
        ("mlp", {"loss": "mse"}),
        ("cnn", {"channels": (4,), "kernel": 5, "hidden": 8}),
    ],
    ids=str,
)
def test_builtin_models_pass(name, options, dtype):
    model = build_model(name, SHAPE, CLASSES, dtype=dtype, **options)
    checks = check_model(model, SHAPE, CLASSES, dtype, name=name, options=options, budget=None)
    assert [c.name for c in checks] == ["specs", "init", "loss_and_grads", "gradients", "predict", "finite differences"]
    assert all(c.status == "ok" and len(c.lines) == 1 for c in checks)
    assert "in float64" in checks[-1].lines[0]


def test_arrays_on_the_device(device, tanhnet):
    """The check runs where training runs: NumPy on the CPU, CuPy on a GPU (gpu-marked)."""
    for name, options in [("cnn", {}), ("tanhbyhand:TanhMLPByHand", {"width": 8})]:
        model = build_model(name, SHAPE, CLASSES, **options)
        checks = check_model(model, SHAPE, CLASSES, "float32", name=name, options=options, device=device, budget=None)
        assert "in float64" in checks[-1].lines[0]

    class HostGradients(tanhnet.TanhMLPByHand):
        def loss_and_grads(self, params, x, y):
            loss, grads = super().loss_and_grads(params, x, y)
            return loss, {k: np.asarray(backend.to_host(g)) for k, g in grads.items()}

    if device.is_gpu:
        lines = failures(HostGradients(SHAPE, CLASSES), device=device)
        assert lines[0].startswith(
            "model 'net': gradients: the gradient for 'W1' is a numpy.ndarray, but the weights are on cuda:0"
        )
    else:
        check_model(HostGradients(SHAPE, CLASSES), SHAPE, CLASSES, "float32", device=device, budget=None)


@pytest.mark.parametrize("name", ["softmax", "mlp", "cnn"])
def test_check_is_cheap(name):
    model = build_model(name, SHAPE, CLASSES)
    check_model(model, SHAPE, CLASSES, "float32", name=name)  # warm up
    best = float("inf")
    for _ in range(3):
        began = time.perf_counter()
        check_model(model, SHAPE, CLASSES, "float32", name=name)
        best = min(best, time.perf_counter() - began)
    assert best < 0.2, f"{name}: {best:.3f} s"


def test_builtin_models_pass_for_many_seeds_and_shapes():
    """No false alarm from ReLU kinks or max-pool ties: the check runs before every training run."""
    for name, shape, options in [("mlp", (64,), {"hidden": (256, 128)}), ("cnn", (3, 8, 8), {"channels": (4, 4)})]:
        model = build_model(name, shape, 7, **options)
        for seed in range(40):
            checks = check_model(model, shape, 7, "float32", seed, name=name, options=options, budget=None)
            assert checks[-1].status == "ok", checks[-1]


def test_readme_model_passes_by_name_and_without(tanhnet):
    model = build_model("tanhbyhand:TanhMLPByHand", SHAPE, CLASSES, width=16)
    checks = check_model(
        model, SHAPE, CLASSES, "float32", name="tanhbyhand:TanhMLPByHand", options={"width": 16}, budget=None
    )
    assert checks[-1].status == "ok" and checks[0].lines == ["4 variables, 1,210 parameters, float32"]
    # without its name: no float64 twin with the same width, so float64 copies of the weights are used
    assert "in float64" in check_model(model, SHAPE, CLASSES, "float32", budget=None)[-1].lines[0]


def test_a_relu_on_its_kink_passes():
    """relu(b) with b = 0: the central difference straddles the kink; the one-sided one agrees."""

    class KinkNet(BaseModel):
        def __init__(self, input_shape, num_classes, dtype="float32"):
            self.n, self.k, self.dtype = int(np.prod(input_shape)), num_classes, dtype

        def specs(self):
            return [
                VarSpec("W", (self.n, self.k), self.dtype, "glorot_uniform"),
                VarSpec("b", (self.k,), self.dtype, "zeros"),
            ]

        def loss_and_grads(self, params, x, y):
            xp = get_array_module(params["W"])
            x = xp.asarray(x, dtype=self.dtype).reshape(len(x), -1)
            loss, d = softmax_cross_entropy(x @ params["W"] + xp.maximum(params["b"], 0), y)
            return loss, {"W": x.T @ d, "b": d.sum(axis=0) * (params["b"] > 0)}

        def predict(self, params, x):
            xp = get_array_module(params["W"])
            return xp.asarray(x, dtype=self.dtype).reshape(len(x), -1) @ params["W"] + xp.maximum(params["b"], 0)

    checks = check_model(KinkNet(SHAPE, CLASSES), SHAPE, CLASSES, "float32", budget=None)
    assert "next to a kink agree one-sided" in checks[-1].lines[0]


# -- one message per fault ---------------------------------------------------------------------------
FAULTS = {
    "missing gradient": (
        "del grads['b2']",
        r"^model 'net': gradients: no gradient for 'b2' \(loss_and_grads must return one for every variable",
    ),
    "two missing gradients": ("del grads['b1'], grads['b2']", r"^model 'net': gradients: no gradient for 'b1', 'b2' "),
    "extra gradient": (
        "grads['W3'] = grads['W2']",
        r"^model 'net': gradients: gradient for 'W3', which specs\(\) does not list$",
    ),
    "wrong shape": (
        "grads['b1'] = grads['b1'][:-1]",
        r"^model 'net': gradients: the gradient for 'b1' has shape \(63,\), but the variable has \(64,\)$",
    ),
    "wrong dtype": (
        "grads['W2'] = grads['W2'].astype('float64')",
        r"^model 'net': gradients: the gradient for 'W2' is float64, but the variable is float32$",
    ),
    "not an array": (
        "grads['b2'] = grads['b2'].tolist()",
        r"^model 'net': gradients: the gradient for 'b2' is a list, not an array$",
    ),
    "non-finite gradient": (
        "grads['b2'][0] = float('inf')",
        r"^model 'net': gradients: the gradient for 'b2' has 1 non-finite value \(nan or inf\)$",
    ),
    "swapped order": (
        "return grads, loss",
        r"^model 'net': loss_and_grads: returned \(gradients, loss\); it must return \(loss, gradients\), "
        r"in that order$",
    ),
    "non-finite loss": (
        "loss = float('nan')",
        r"^model 'net': loss_and_grads: the loss is nan on a batch of 4 random inputs; it must be finite$",
    ),
    "loss per example": (
        "loss = x[:, 0] * 0 + loss",
        r"^model 'net': loss_and_grads: the loss is an array of shape \(4,\), not a scalar \(return the mean",
    ),
    "one value returned": (
        "return loss",
        r"^model 'net': loss_and_grads: returned a float(32)?; it must return a \(loss, gradients\) tuple$",
    ),
    "wrong values": (
        "grads['W2'] = 2 * grads['W2']",
        r"^model 'net': finite differences: the gradient for 'W2' at \[\d+, \d+\] is \S+, but central "
        r"differences of the loss give \S+ \(relative error 5\.0e-01, tolerance 1e-04\) \(3 of 3 coordinates",
    ),
    "raises": (
        "grads['W1'] = params['W9']",
        r"^model 'net': loss_and_grads: raised KeyError: 'W9' \(at test_check_model\.py:\d+\)$",
    ),
}


def faulty(tanhnet, change: str):
    """A TanhMLP whose loss_and_grads has ``change`` applied just before it returns."""
    namespace = {"TanhMLP": tanhnet.TanhMLPByHand}
    body = textwrap.indent(change if change.startswith("return") else change + "\nreturn loss, grads", " " * 8)
    code = (
        "class Faulty(TanhMLP):\n    def loss_and_grads(self, params, x, y):\n"
        "        x, h, scores = self.forward(params, x)\n"
        "        loss, grads = super().loss_and_grads(params, x, y)\n" + body + "\n"
    )
    exec(compile(code, __file__, "exec"), namespace)  # "at test_check_model.py:N" in a traceback
    return namespace["Faulty"](SHAPE, CLASSES)


@pytest.mark.parametrize("fault", list(FAULTS))
def test_each_fault_gives_its_own_line(tanhnet, fault):
    change, pattern = FAULTS[fault]
    lines = failures(faulty(tanhnet, change))
    assert len(lines) == 1, lines
    assert re.match(pattern, lines[0]), lines[0]


def test_several_faults_give_one_line_each(tanhnet):
    lines = failures(faulty(tanhnet, "del grads['b2']\ngrads['W2'] = 2 * grads['W2']\nreturn grads, loss"))
    assert len(lines) == 3, lines
    assert [line.split(": ")[1] for line in lines] == ["loss_and_grads", "gradients", "finite differences"]
    assert all(line.startswith("model 'net': ") for line in lines)


def test_gradient_checks_on_float32_only_models(tanhnet):
    """A model that computes in float32 whatever it is given is checked in float32, loosely, and still caught."""

    class Float32Only(tanhnet.TanhMLPByHand):
        def loss_and_grads(self, params, x, y):
            loss, grads = super().loss_and_grads({k: v.astype("float32") for k, v in params.items()}, x, y)
            return loss, {k: g.astype(params[k].dtype) for k, g in grads.items()}

    class Float32OnlyWrong(Float32Only):
        def loss_and_grads(self, params, x, y):
            loss, grads = super().loss_and_grads(params, x, y)
            return loss, {**grads, "b2": 2 * grads["b2"]}

    for seed in range(5):
        checks = check_model(Float32Only(SHAPE, CLASSES, width=8), SHAPE, CLASSES, "float32", seed, budget=None)
        assert "in float32 with a loose tolerance" in checks[-1].lines[0]
    (line,) = failures(Float32OnlyWrong(SHAPE, CLASSES, width=8))
    assert line.startswith("model 'net': finite differences: the gradient for 'b2' at [")


def test_specs_and_init_faults(tanhnet):
    TanhMLP = tanhnet.TanhMLPByHand

    class Unknown(TanhMLP):
        def specs(self):
            return [VarSpec("W1", (64, 3), self.dtype, init="he_uniform")]

    class Duplicate(TanhMLP):
        def specs(self):
            return super().specs() + [VarSpec("b2", (10,), self.dtype)]

    class AlwaysFloat32(TanhMLP):
        def specs(self):
            return [VarSpec(s.name, s.shape, "float32", s.init, scale=s.scale) for s in super().specs()]

    class NotSpecs(TanhMLP):
        def specs(self):
            return [("W1", (64, 3))]

    class NoNames(TanhMLP):
        def init(self, seed):
            return super().init(seed)

    assert failures(Unknown(SHAPE, CLASSES)) == [
        "model 'net': specs: variable 'W1': unknown initializer 'he_uniform' "
        "(use one of zeros, ones, he_normal, glorot_uniform, normal)"
    ]
    assert failures(Duplicate(SHAPE, CLASSES)) == [
        "model 'net': specs: variable name 'b2' appears 2 times (names must be unique)"
    ]
    assert failures(AlwaysFloat32(SHAPE, CLASSES, dtype="float64"), dtype="float64") == [
        "model 'net': specs: variables 'W1', 'b1', 'W2', 'b2' are float32 but the job's dtype is float64 "
        "(give each VarSpec the dtype the model was built with)"
    ]
    assert failures(NotSpecs(SHAPE, CLASSES)) == ["model 'net': specs: item 0 of specs() is a tuple, not a VarSpec"]
    (line,) = failures(NoNames(SHAPE, CLASSES))
    assert line.startswith("model 'net': init: init(0, names=['b2']) raised TypeError: ")
    assert "the parameter-server shards call it" in line


def test_init_and_predict_shapes(tanhnet):
    class InitTransposed(tanhnet.TanhMLPByHand):
        def init(self, seed, names=None):
            values = super().init(seed, names)
            return {k: (v.T if k == "W2" else v) for k, v in values.items()}

    class ClassPredictor(tanhnet.TanhMLPByHand):
        def predict(self, params, x):
            return super().predict(params, x).argmax(axis=1)

    assert failures(InitTransposed(SHAPE, CLASSES)) == [
        "model 'net': init: init(0) gives 'W2' the shape (10, 64), but specs() says (64, 10)"
    ]
    assert failures(ClassPredictor(SHAPE, CLASSES)) == [
        "model 'net': predict: returned shape (4,); it must return scores of shape (batch, num_classes) = (4, 10), "
        "one row per example"
    ]


def test_later_checks_are_skipped_not_failed(tanhnet):
    class NoSpecs(tanhnet.TanhMLPByHand):
        def specs(self):
            raise RuntimeError("not written yet")

    checks = run_checks(NoSpecs(SHAPE, CLASSES), SHAPE, CLASSES, "float32")
    assert [(c.status, c.name) for c in checks] == [
        ("FAIL", "specs"),
        ("skip", "init"),
        ("skip", "loss_and_grads"),
        ("skip", "gradients"),
        ("skip", "predict"),
        ("skip", "finite differences"),
    ]
    assert re.fullmatch(r"raised RuntimeError: not written yet \(at test_check_model\.py:\d+\)", checks[0].lines[0])


# -- building: unknown initializers and bad keywords are one-line ModelErrors -----------------------
def test_unknown_initializer_in_the_constructor(user_module):
    mod = user_module("""
        from tanhbyhand import TanhMLPByHand
        from psgd.model import VarSpec

        class Eager(TanhMLPByHand):
            def __init__(self, input_shape, num_classes, dtype="float32"):
                super().__init__(input_shape, num_classes, dtype)
                self._specs = [VarSpec("W1", (self.n_in, 8), dtype, init="xavier")]

            def specs(self):
                return self._specs
    """)
    with pytest.raises(ModelError) as info:
        build_model(f"{mod}:Eager", SHAPE, CLASSES)
    assert str(info.value) == (
        f"model '{mod}:Eager': variable 'W1': unknown initializer 'xavier' "
        "(use one of zeros, ones, he_normal, glorot_uniform, normal)"
    )


def test_bad_constructor_keyword(tanhnet):
    with pytest.raises(ModelError) as info:
        build_model("tanhbyhand:TanhMLPByHand", SHAPE, CLASSES, widht=3)
    assert str(info.value) == (
        "model 'tanhbyhand:TanhMLPByHand': got an unexpected keyword argument 'widht' (options it takes: width)"
    )


# -- every trainer checks before training; the shards do not ------------------------------------------
NO_B2 = """
    from tanhbyhand import TanhMLPByHand

    class NoB2(TanhMLPByHand):
        def loss_and_grads(self, params, x, y):
            loss, grads = super().loss_and_grads(params, x, y)
            del grads["b2"]
            return loss, grads
"""


def broken_job(user_module) -> JobConfig:
    job = JobConfig()
    job = job.apply_sets([f"model.name='{user_module(NO_B2)}:NoB2'", "train.epochs=1"])
    return job


MISSING_B2 = "gradients: no gradient for 'b2'"


def test_train_local_stops_before_training(user_module):
    with pytest.raises(ModelError, match=MISSING_B2):
        train_local(broken_job(user_module), progress=False)


def test_parameter_server_worker_stops_before_connecting(user_module):
    from psgd.worker.exchange import run_worker

    with pytest.raises(ModelError, match=MISSING_B2):  # nothing listens on port 9: it never got that far
        run_worker(broken_job(user_module), 0, ["127.0.0.1:9", "127.0.0.1:9"], progress=False)


def test_allreduce_rank_stops_before_the_collective(user_module):
    from psgd.collective.exchange import run_allreduce

    with pytest.raises(ModelError, match=MISSING_B2):
        run_allreduce(broken_job(user_module), collective=None, progress=False)


def test_build_job_checks_only_when_asked(user_module):
    job = broken_job(user_module)
    assert build_job(job).model.specs()  # the shards, the launcher's evaluation: no check
    with pytest.raises(ModelError, match=MISSING_B2):
        build_job(job, check=True)


# -- large or slow models: the finite differences stay within a budget ------------------------------
def test_finite_differences_fit_the_budget(tanhnet, monkeypatch):
    model = tanhnet.TanhMLPByHand(SHAPE, CLASSES)
    assert "12 coordinates" in check_model(model, SHAPE, CLASSES, "float32", budget=None)[-1].lines[0]
    skipped = check_model(model, SHAPE, CLASSES, "float32", budget=0.0)[-1]
    assert skipped.status == "skip"
    assert re.fullmatch(
        r"a step takes \d+\.\d\d s here, too long to take 8 more at the start of every process "
        r"\(psgd check-model checks them\)",
        skipped.lines[0],
    )
    monkeypatch.setattr("psgd.model.gradcheck.FD_MAX_PARAMETERS", 1000)
    (line,) = check_model(model, SHAPE, CLASSES, "float32")[-1].lines
    assert line.startswith("over 1,000 parameters: float64 copies of the weights would cost too much memory")
    assert check_model(model, SHAPE, CLASSES, "float32", budget=None)[-1].status == "ok"


def test_one_coordinate_per_variable_when_a_step_is_slow(tanhnet):
    class Slow(tanhnet.TanhMLPByHand):
        def loss_and_grads(self, params, x, y):
            time.sleep(0.02)  # the case under test: a model whose every step is slow
            return super().loss_and_grads(params, x, y)

    checks = check_model(Slow(SHAPE, CLASSES), SHAPE, CLASSES, "float32", budget=0.3)  # 8 steps fit, 24 do not
    assert checks[-1].lines[0].startswith("4 coordinates of 4 gradients agree")


def test_a_model_can_opt_out_of_finite_differences(tanhnet):
    class StandIn(tanhnet.TanhMLPByHand):
        check_gradients = False  # e.g. a benchmark's stand-in whose gradient is not the loss's

        def loss_and_grads(self, params, x, y):
            loss, grads = super().loss_and_grads(params, x, y)
            return 0.0, grads

    checks = check_model(StandIn(SHAPE, CLASSES), SHAPE, CLASSES, "float32")
    assert (checks[-1].status, checks[-1].lines) == ("skip", ["the model says check_gradients = False"])


def test_a_random_loss_skips_finite_differences(tanhnet):
    class Dropout(tanhnet.TanhMLPByHand):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.rng = np.random.default_rng(0)

        def loss_and_grads(self, params, x, y):
            loss, grads = super().loss_and_grads(params, x, y)
            return loss + 0.01 * self.rng.random(), grads

    (line,) = check_model(Dropout(SHAPE, CLASSES), SHAPE, CLASSES, "float32", budget=None)[-1].lines
    assert re.fullmatch(
        r"two calls at the same weights gave the losses \S+ and \S+ \(random dropout\?\); "
        r"finite differences need the same loss for the same weights",
        line,
    )
