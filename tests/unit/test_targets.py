"""Targets of every kind (psgd.data.base.TARGETS): classes (one per example, or one per position of a sequence),
labels (several 0-or-1 per example) and values (regression): how they are read and checked, held out, lost
(the built-in models' matching losses) and scored (accuracy, or R²), and what a run says of them."""

from __future__ import annotations

import math

import numpy as np
import pytest

import psgd
from psgd.autodiff import Tensor, backward, nn
from psgd.compute import backend
from psgd.config import ConfigError
from psgd.data import DataError, Dataset, dataset_from
from psgd.data.base import held_out, read_targets
from psgd.model import ModelError, check_model
from psgd.model.nets import MLP
from psgd.training.divergence import DivergenceGuard, chance
from psgd.training.evaluation import evaluate


def test_the_kind_is_worked_out_from_the_targets_or_taken_as_said():
    assert read_targets(np.array([0, 2, 1]), "y")[1] == "classes"
    assert read_targets(np.array([0.0, 2.0, 1.0]), "y")[1] == "classes"  # whole numbers saved as floats
    y, kind = read_targets(np.array([[0, 1, 3], [2, 2, 0]]), "y")  # a class per position
    assert kind == "classes" and y.dtype == np.int64 and y.shape == (2, 3)
    assert read_targets(np.array([0.5, 1.25]), "y")[1] == "values"
    y, kind = read_targets(np.array([1, 2, 3]), "y", "values")  # whole numbers, but said to be values
    assert kind == "values" and y.dtype.kind == "f"
    y, kind = read_targets(np.array([[1, 0, 1], [0, 0, 0]], bool), "y", "labels")
    assert kind == "labels" and y.dtype == np.float32


@pytest.mark.parametrize(
    "y, target, said",
    [
        (np.eye(3)[[0, 2, 1]], None, "look like one-hot rows; give class indices"),
        (np.array([[0, 2], [1, 1]]), "labels", "labels must be rows of 0s and 1s"),
        (np.array([0.5, np.nan]), None, "NaN or infinite"),
        (np.array([0.5, 1.0]), "classes", "class labels must be integers"),
        (np.array([0, -1]), None, "class labels must be >= 0"),
        (np.array(["a", "b"]), None, "targets must be numbers"),
        (np.array([0, 1]), "regression", "target must be one of classes, labels, values"),
    ],
)
def test_targets_that_cannot_be_read_as_asked_are_one_clear_error(y, target, said):
    with pytest.raises(DataError, match=said):
        read_targets(y, "mine", target)


def test_a_dataset_checks_its_targets_against_its_kind_and_width():
    x = np.zeros((4, 3), np.float32)
    with pytest.raises(DataError, match="holds 2 values per example, but num_classes .* is 3"):
        Dataset("d", x, np.zeros((4, 2), np.float32), x, np.zeros((4, 2), np.float32), 3, (3,), target="values")
    with pytest.raises(DataError, match="must hold 3 labels per example"):
        Dataset("d", x, np.zeros((4, 2), np.float32), x, np.zeros((4, 2), np.float32), 3, (3,), target="labels")
    with pytest.raises(DataError, match="integer class indices"):
        Dataset("d", x, np.zeros(4, np.float32), x, np.zeros(4, np.float32), 3, (3,))
    with pytest.raises(DataError, match=r"y_test has shape \(4, 5\), expected \(4, \*\(6,\)\)"):
        Dataset("d", x, np.zeros((4, 6), np.int64), x, np.zeros((4, 5), np.int64), 3, (3,))
    ds = Dataset("d", x, np.zeros((4, 6), np.int64), x, np.zeros((4, 6), np.int64), 3, (3,))
    assert ds.target_shape == (6,) and ds.metric == "accuracy" and "3 classes per position" in ds.describe()


def test_values_and_labels_take_the_jobs_dtype_and_are_held_out_by_the_fixed_permutation():
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(50, 3)), rng.normal(size=(50, 2))
    ds = dataset_from((x, y), dtype="float64", test_fraction=0.2)
    assert ds.target == "values" and ds.num_classes == 2 and ds.y_train.dtype == np.float64 and ds.n_test == 10
    train, test = held_out(y, 0.2, "values")
    assert sorted(np.concatenate([train, test])) == list(range(50)) and len(test) == 10
    assert np.array_equal(test, held_out(y, 0.2, "values")[1])  # the same every time: no seed of the run's
    np.testing.assert_array_equal(ds.y_test, y[test])
    labels = dataset_from((x, (y > 0).astype(int)), target="labels")
    assert labels.num_classes == 2 and labels.y_test.dtype == np.float32 and labels.metric == "accuracy"


class Fixed:
    """A model whose scores are given: what evaluate makes of them."""

    def __init__(self, scores):
        self.scores = scores

    def loss_and_grads(self, params, x, y):
        return np.float64(0.5), {}

    def predict(self, params, x):
        return self.scores[x[:, 0].astype(int)]


def test_evaluate_scores_each_kind_of_target_as_it_should():
    x = np.arange(4, dtype=np.float32)[:, None]
    # a class per position: 6 of the 8 positions right
    scores = np.zeros((4, 2, 3))
    scores[..., 0] = 1
    y = np.array([[0, 0], [0, 1], [2, 0], [0, 0]])
    assert evaluate(Fixed(scores), {}, x, y, backend.CPU, batch_size=3)[1] == pytest.approx(6 / 8)
    # labels: yes where the score is above 0; 10 of 12 labels right
    y = np.array([[1, 0, 1], [0, 0, 0], [1, 1, 1], [0, 1, 0]], np.float32)
    scores = np.where(y > 0, 2.0, -2.0)
    scores[1, 0], scores[2, 2] = 1.0, -1.0
    assert evaluate(Fixed(scores), {}, x, y, backend.CPU, batch_size=3, target="labels")[1] == pytest.approx(10 / 12)
    # values: R² is 1 for every value right, 0 for their mean, 1 - SSE / SST in between
    y = np.array([[1.0, 0.0], [2.0, 1.0], [3.0, 0.0], [4.0, 3.0]])
    assert evaluate(Fixed(y.copy()), {}, x, y, backend.CPU, target="values")[1] == 1.0
    assert evaluate(Fixed(np.tile(y.mean(axis=0), (4, 1))), {}, x, y, backend.CPU, target="values")[1] == pytest.approx(
        0.0
    )
    off = y + np.array([[0.5, 0.0], [0.0, 0.0], [0.0, -1.0], [0.0, 0.0]])
    sst = ((y - y.mean(axis=0)) ** 2).sum()
    assert evaluate(Fixed(off), {}, x, y, backend.CPU, batch_size=3, target="values")[1] == pytest.approx(
        1 - 1.25 / sst
    )
    # one value per example, predicted as a column (batch, 1)
    assert evaluate(Fixed(y[:, :1].copy()), {}, x, y[:, 0], backend.CPU, target="values")[1] == 1.0


def test_chance_and_the_guard_speak_of_each_kind():
    assert chance(np.array([[1, 0], [1, 1], [1, 0], [0, 0]], np.float32), "labels") == pytest.approx((0.75 + 0.75) / 2)
    assert chance(np.array([0.3, 2.0]), "values") == 0.0
    assert chance(np.array([[0, 1], [1, 1]])) == 0.75  # a class per position: the commonest of all positions
    guard = DivergenceGuard("w", 0.0, 1, "lower the learning rate", "r2")
    verdict = guard.final(10, 1, 0.4, -0.01)
    assert "the final test R² (-0.010) is at chance (0.000, the targets' mean)" in verdict.line()


def test_cross_entropy_takes_a_class_per_position_as_rows_of_their_own():
    rng = np.random.default_rng(3)
    z, y = rng.normal(size=(3, 4, 5)), rng.integers(0, 5, size=(3, 4))
    leaf, flat = Tensor(z, requires_grad=True), Tensor(z.reshape(12, 5), requires_grad=True)
    loss, same = nn.cross_entropy(leaf, y), nn.cross_entropy(flat, y.reshape(12))
    backward(loss)
    backward(same)
    assert float(loss.data) == pytest.approx(float(same.data), rel=1e-12)
    np.testing.assert_allclose(leaf.grad, flat.grad.reshape(3, 4, 5), rtol=1e-12)
    with pytest.raises(ValueError, match=r"logits \(B, T, K\) and labels \(B, T\)"):
        nn.cross_entropy(Tensor(z), y[:, :3])


@pytest.mark.parametrize(
    "target, loss", [("classes", "cross_entropy"), ("labels", "sigmoid_cross_entropy"), ("values", "mse")]
)
def test_a_built_in_model_takes_the_loss_its_targets_want(target, loss):
    assert MLP((4,), 3, target=target).loss_name == loss
    assert MLP((4,), 3, target=target, loss="mse").loss_name == "mse"
    assert MLP((4,), 1, target="values").num_classes == 1  # one value: one output
    with pytest.raises(ModelError, match="option 'loss' must be one of mse for targets that are values"):
        MLP((4,), 3, target="values", loss="cross_entropy")


def test_check_model_makes_targets_of_the_datasets_kind_and_wants_scores_of_their_shape():
    check_model(MLP((4,), 2, target="values"), (4,), 2, "float32", target="values", target_shape=(2,))
    check_model(MLP((4,), 3, target="labels"), (4,), 3, "float32", target="labels", target_shape=(3,))
    with pytest.raises(ModelError, match=r"scores of shape \(batch, \*positions, num_classes\) = \(4, 6, 3\)"):
        check_model(MLP((4,), 3), (4,), 3, "float32", target="classes", target_shape=(6,))


def test_regression_and_labels_train_with_the_built_in_mlp():
    rng = np.random.default_rng(4)
    x = rng.normal(size=(1500, 6)).astype(np.float32)
    y = np.stack([np.sin(x[:, 0]) + 0.5 * x[:, 1] * x[:, 2], x[:, 3] ** 2 - 1], axis=1)
    values = psgd.train("mlp", (x, y), epochs=12, lr=0.05, progress=False)
    assert values.test_accuracy is None and values.test_r2 > 0.85
    assert [h["test_r2"] for h in values.history][-1] > values.history[0]["test_r2"]
    labels = psgd.dataset_from((x, (x[:, :3] > 0.4).astype(np.int64)), target="labels")
    guess = chance(labels.y_test, "labels")
    result = psgd.train("mlp", labels, epochs=6, progress=False)
    assert result.test_r2 is None and result.test_accuracy > guess + 0.1 > 0.1
    assert math.isfinite(result.test_loss)


def test_a_built_in_model_refuses_a_class_per_position_in_one_line():
    with pytest.raises(
        ConfigError,
        match=r"gives one class per example, but sequences's targets are a class per "
        r"position \(16,\)",
    ):
        psgd.train("mlp", "sequences", settings={"data.task": "sort"}, epochs=1, progress=False)


def test_the_embedding_model_refuses_a_loss_it_would_not_compute():
    """The built-in losses grew sigmoid cross-entropy; the embedding model (classes only) took it from the same list
    and would have trained with softmax cross-entropy instead."""
    from psgd.model.embed import Embed

    with pytest.raises(ModelError, match="option 'loss' must be one of cross_entropy, mse"):
        Embed((4,), 2, id_shape=(3,), loss="sigmoid_cross_entropy")
