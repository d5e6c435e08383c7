"""Overlap of communication with backward ([cluster] overlap): the models hand each gradient over as
backward produces it, last layer first, and the all-reduce starts a bucket's reduction as soon as the
bucket is full, with the same result as reducing everything at the end."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from helpers import Mirror

from psgd.collective.base import Bucketer, CollectiveError
from psgd.model import build_model, hands_over_gradients


def test_the_built_in_models_hand_each_gradient_over_last_layer_first(rng):
    model = build_model("mlp", (6,), 3, hidden=(5, 4))
    assert hands_over_gradients(model)
    params = model.init(0)
    handed = []
    loss, grads = model.loss_and_grads(
        params,
        rng.standard_normal((4, 6)).astype(np.float32),
        np.array([0, 1, 2, 1]),
        on_grad=lambda name, g: handed.append((name, g)),
    )
    assert [name for name, _ in handed] == ["dense2/W", "dense2/b", "dense1/W", "dense1/b", "dense0/W", "dense0/b"]
    assert all(g is grads[name] for name, g in handed)  # the very arrays returned
    x = rng.standard_normal((4, 6)).astype(np.float32)
    _, with_hook = model.loss_and_grads(params, x, np.array([0, 1, 2, 1]), on_grad=lambda name, g: None)
    _, without = model.loss_and_grads(params, x, np.array([0, 1, 2, 1]))
    for name in without:
        np.testing.assert_array_equal(with_hook[name], without[name])


def test_a_model_without_on_grad_is_seen_as_such():
    class Plain:
        def loss_and_grads(self, params, x, y):
            return 0.0, {}

    assert not hands_over_gradients(Plain())


def grads_for(shapes, rng):
    return {name: rng.standard_normal(shape).astype(np.float64) for name, shape in shapes.items()}


SHAPES = {"a/W": (40, 30), "a/b": (30,), "big/W": (64, 64), "c/W": (30, 10), "c/b": (10,)}


@pytest.mark.parametrize("order", ["backward", "forward", "some, rest at the end"])
def test_a_round_fed_gradient_by_gradient_equals_the_reduction_at_the_end(rng, order):
    bucketer = Bucketer(SHAPES, np.float64, np, bucket_bytes=8000, direct_bytes=30000)
    assert set(bucketer.direct) == {"big/W"} and len(bucketer.layout) > 1
    grads = grads_for(SHAPES, rng)
    reference = {
        k: v.copy()
        for k, v in Bucketer(SHAPES, np.float64, np, bucket_bytes=8000, direct_bytes=30000)
        .allreduce_mean(Mirror(2), {k: v.copy() for k, v in grads.items()})
        .items()
    }
    names = list(SHAPES)[::-1] if order == "backward" else list(SHAPES)
    if order.startswith("some"):
        names = names[::2]
    with ThreadPoolExecutor(1) as comm:
        collective = Mirror(2)
        round_ = bucketer.round(collective, comm.submit)
        for name in names:
            round_.add(name, grads[name])
        mean = round_.finish(grads)
    assert set(mean) == set(SHAPES)
    for name in SHAPES:
        np.testing.assert_array_equal(mean[name], reference[name])  # the same sums: equal to the bit
    at_the_end = Mirror(2)  # the same reductions, of the same sizes, as without overlap
    Bucketer(SHAPES, np.float64, np, bucket_bytes=8000, direct_bytes=30000).allreduce_mean(
        at_the_end, {k: v.copy() for k, v in grads.items()}
    )
    assert sorted(collective.sizes) == sorted(at_the_end.sizes)


def test_a_failed_reduction_surfaces_in_the_step_that_owns_it(rng):
    bucketer = Bucketer(SHAPES, np.float64, np, bucket_bytes=8000, direct_bytes=30000)
    grads = grads_for(SHAPES, rng)
    with ThreadPoolExecutor(1) as comm:
        round_ = bucketer.round(Mirror(2, fail_on=1), comm.submit)
        round_.add("c/b", grads["c/b"])
        round_.add("c/W", grads["c/W"])
        with pytest.raises(CollectiveError, match="rank 1 died"):
            round_.finish(grads)
