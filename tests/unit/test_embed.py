"""The embed model: ids looked up in a table beside dense features; its gradients, the table's summed over the
lookups of a row, against central differences in float64, and the model checker on models with tables."""

from __future__ import annotations

import numpy as np
import pytest

from psgd.model import ModelError, build_model, check_model
from psgd.model.table import Rows, initial_rows, unique_lookups


def batch(model, n=6, fields=4, dense=3, seed=0):
    rng = np.random.default_rng(seed)
    ids = rng.choice(np.array([11, -5, 2**60, 7], np.int64), size=(n, fields))  # rows looked up many times
    unique, index = unique_lookups(model.lookups(ids)["emb"])
    params = model.init(1)
    params["emb"] = Rows(unique, initial_rows(model.table, 1, unique) * 30, index)  # rows of some size
    return params, rng.standard_normal((n, dense)), rng.integers(0, 3, n)


@pytest.mark.parametrize("combine", ["concat", "sum", "mean"])
def test_every_gradient_of_embed_is_its_losss_in_float64(combine):
    model = build_model("embed", (3,), 3, "float64", id_shape=(4,), dim=2, hidden=[5], combine=combine)
    params, x, y = batch(model)
    loss, grads = model.loss_and_grads(params, x, y)
    assert isinstance(grads["emb"], Rows) and np.array_equal(grads["emb"].ids, params["emb"].ids)

    def at(name, flat, delta):
        changed = {k: (v.copy() if k != "emb" else v.copy()) for k, v in params.items()}
        target = changed[name].values if name == "emb" else changed[name]
        target.reshape(-1)[flat] += delta
        return float(model.loss_and_grads(changed, x, y)[0])

    eps = 1e-6
    for name, grad in grads.items():
        analytic = (grad.values if name == "emb" else grad).reshape(-1)
        numeric = np.array([(at(name, i, eps) - at(name, i, -eps)) / (2 * eps) for i in range(analytic.size)])
        np.testing.assert_allclose(analytic, numeric, rtol=1e-5, atol=1e-8, err_msg=name)


def test_the_model_checker_checks_a_models_tables():
    model = build_model("embed", (13,), 2, "float32", id_shape=(26,), dim=4, hidden=[8])
    checks = check_model(model, (13,), 2, "float32", id_shape=(26,), name="embed", options=dict(dim=4, hidden=[8]))
    assert [c.status for c in checks] == ["ok"] * 6, checks
    assert "one per table" in checks[3].lines[0] and "5 gradients" in checks[5].lines[0]  # the table's checked

    class Forgetful(type(model)):  # hands back a gradient for other rows than the batch's
        def loss_and_grads(self, params, x, y, on_grad=None):
            loss, grads = super().loss_and_grads(params, x, y)
            rows = grads["emb"]
            grads["emb"] = Rows(rows.ids[:-1], rows.values[:-1], rows.index)
            return loss, grads

    bad = Forgetful((13,), 2, "float32", id_shape=(26,), dim=4, hidden=[8])
    with pytest.raises(ModelError, match="gradient for table 'emb' is .*it must be the batch's Rows"):
        check_model(bad, (13,), 2, "float32", id_shape=(26,))
    with pytest.raises(ModelError, match="the dataset gives no ids"):
        check_model(model, (13,), 2, "float32")


def test_embed_says_what_it_needs():
    with pytest.raises(ModelError, match="needs a dataset with one id per categorical field"):
        build_model("embed", (13,), 2)
    model = build_model("embed", (13,), 2, id_shape=(26,))
    with pytest.raises(ModelError, match=r"expected ids of shape \(B, 26\)"):
        model.lookups(np.zeros((4, 3), np.int64))
    with pytest.raises(ModelError, match="option 'combine' must be one of concat, sum, mean"):
        build_model("embed", (13,), 2, id_shape=(26,), combine="max")
