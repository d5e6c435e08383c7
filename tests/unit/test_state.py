"""State variables (batch norm's running statistics) and random masks (dropout) in networks written as their forward
pass: what a step hands over for a state is the change it made, which every optimizer adds as it is; evaluation
uses the running statistics; a dropout mask is the same for the same step's seed and new for another."""

from __future__ import annotations

import numpy as np
import pytest

from psgd.autodiff import ops
from psgd.compute.graphs import can_graph
from psgd.config import JobConfig
from psgd.job import describe_job
from psgd.model import BatchNorm, Dropout, Linear, ModelError, Network, State, check_model
from psgd.optim import build_optimizer
from psgd.partition import PartitionPlan


class Normed(Network):
    def __init__(self, input_shape, num_classes, dtype="float32", rate=0.0):
        super().__init__(dtype)
        self.dense = Linear(int(np.prod(input_shape)), 6)
        self.bn = BatchNorm(6, momentum=0.25)
        self.drop = Dropout(rate)
        self.out = Linear(6, num_classes)

    def forward(self, x):
        return self.out(self.drop(ops.relu(self.bn(self.dense(x.reshape(len(x), -1))))))


def batch(n=16, seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, 4)), rng.integers(0, 3, n)


def test_states_are_variables_that_say_so_and_the_plan_tells_them_apart():
    model = Normed((4,), 3, "float64")
    specs = {s.name: s for s in model.specs()}
    assert specs["bn/mean"].state and specs["bn/var"].state and not specs["bn/g"].state
    assert specs["bn/var"].init == "ones" and model.init(0)["bn/var"].tolist() == [1.0] * 6
    described = PartitionPlan(model.specs(), 1).description()["variables"]
    assert ["bn/mean", [6], "float64", "state"] in described and ["bn/g", [6], "float64"] in described


def test_a_step_hands_over_the_change_it_made_to_a_state_and_leaves_the_weights_alone():
    model = Normed((4,), 3, "float64")
    params = model.init(0)
    params["bn/mean"][:] = 0.5
    before = {k: v.copy() for k, v in params.items()}
    x, y = batch()
    _, grads = model.loss_and_grads(params, x, y)
    assert all(np.array_equal(before[k], params[k]) for k in params)  # nothing moved in the pulled weights
    h = x @ params["dense/W"] + params["dense/b"]
    n = len(h)
    expected_mean = 0.75 * 0.5 + 0.25 * h.mean(axis=0)
    expected_var = 0.75 * 1.0 + 0.25 * h.var(axis=0) * n / (n - 1)
    np.testing.assert_allclose(grads["bn/mean"], expected_mean - 0.5, rtol=1e-12)
    np.testing.assert_allclose(grads["bn/var"], expected_var - 1.0, rtol=1e-12)


def test_evaluation_normalizes_with_the_running_statistics():
    model = Normed((4,), 3, "float64")
    params = model.init(0)
    params["bn/mean"][:] = np.arange(6) * 0.1
    params["bn/var"][:] = 1.0 + np.arange(6)
    x, _ = batch()
    h = x @ params["dense/W"] + params["dense/b"]
    normal = (h - params["bn/mean"]) / np.sqrt(params["bn/var"] + 1e-5)
    relu = np.maximum(normal * params["bn/g"] + params["bn/b"], 0)
    np.testing.assert_allclose(model.predict(params, x), relu @ params["out/W"] + params["out/b"], rtol=1e-12)


@pytest.mark.parametrize("name", ["sgd", "momentum", "adam"])
def test_every_optimizer_adds_a_states_change_as_it_is_and_trains_the_rest(name):
    job = describe_job(JobConfig(), model=Normed((4,), 3, "float64"))
    opt = job.optimizer()
    assert opt.state_vars == {"bn/mean", "bn/var"}
    plain = build_optimizer(name)
    p = np.ones(6)
    opt.update("bn/mean", p, np.full(6, 0.25), lr_scale=0.5)
    assert p.tolist() == [1.125] * 6  # p + change * lr_scale: no rate, no momentum, no decay
    opt.update("bn/var#0", p, np.full(6, -0.125))  # a slice of a state is a state
    assert p.tolist() == [1.0] * 6
    w, w_plain = np.ones(6), np.ones(6)
    job.config = job.config.apply_sets([f"optimizer.name={name}"])
    opt, plain = job.optimizer(), build_optimizer(name)
    opt.update("bn/g", w, np.full(6, 0.5))
    plain.update("bn/g", w_plain, np.full(6, 0.5))
    assert w.tolist() == w_plain.tolist() != [1.0] * 6


@pytest.mark.parametrize("name", ["sgd", "adam"])
def test_a_flat_update_with_states_among_the_keys_is_the_update_key_by_key(name):
    keys = ("a#0", "s#0", "b#0", "c#0", "t#0")
    bounds = ((0, 5), (5, 8), (8, 20), (20, 21), (21, 30))
    rng = np.random.default_rng(2)
    p0, g = rng.standard_normal(30), rng.standard_normal(30)
    flat, by_key = build_optimizer(name, lr=0.1), build_optimizer(name, lr=0.1)
    flat.state_vars = by_key.state_vars = frozenset({"s", "t"})
    p1, p2 = p0.copy(), p0.copy()
    for _ in range(3):
        flat.update_flat(keys, p1, g, bounds, 0.5)
        for k, (a, b) in zip(keys, bounds):
            by_key.update(k, p2[a:b], g[a:b], 0.5)
    assert p1.tobytes() == p2.tobytes()
    np.testing.assert_allclose(p1[5:8], p0[5:8] + 3 * 0.5 * g[5:8])


def test_check_model_leaves_states_out_of_the_finite_differences():
    checks = {c.name: c for c in check_model(Normed((4,), 3), (4,), 3, "float32")}
    # dense W, b; bn g, b; out W, b: 6 gradients checked, the 2 states not
    assert "of 6 gradients agree" in " ".join(checks["finite differences"].lines), checks["finite differences"]


def test_a_dropout_mask_is_the_steps_own():
    model = Normed((4,), 3, "float64", rate=0.5)
    params = model.init(0)
    x, y = batch()
    first = model.loss_and_grads(params, x, y, seed=11)[1]["out/W"]
    again = model.loss_and_grads(params, x, y, seed=11)[1]["out/W"]
    other = model.loss_and_grads(params, x, y, seed=12)[1]["out/W"]
    assert np.array_equal(first, again) and not np.array_equal(first, other)
    assert np.array_equal(model.predict(params, x), Normed((4,), 3, "float64").predict(params, x))  # off in evaluation


def test_a_network_with_dropout_draws_each_step_and_is_never_captured():
    class GPU:
        is_gpu = True

    said = []
    assert Normed((4,), 3, rate=0.1).random_step and not Normed((4,), 3, rate=0.0).random_step
    model = Normed((4,), 3, rate=0.1)
    model.static_step = True
    assert not can_graph(model, GPU(), True, said.append) and "dropout" in said[0]
    plain = Normed((4,), 3)
    plain.static_step = True
    assert can_graph(plain, GPU(), True, said.append)


def test_only_a_state_can_be_moved_and_bad_settings_are_refused():
    model = Normed((4,), 3)
    with pytest.raises(ModelError, match="not a State"):
        model.bn.move("g", np.zeros(6))
    with pytest.raises(ModelError, match="momentum"):
        BatchNorm(3, momentum=0)
    with pytest.raises(ModelError, match="rate"):
        Dropout(1.0)
    assert State((2,)).spec("s", "float32").state
