"""Every operation of psgd.autodiff checked against central finite differences in float64, on random shapes with
broadcasting (property-based, hypothesis), every input and every coordinate; and the check itself checked: a rule
made slightly wrong is caught, for every operation."""

from __future__ import annotations

import contextlib
import weakref

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from psgd.autodiff import Tensor, backward, nn, no_grad, ops, pool, tensor

EPS, RTOL, ATOL = 1e-6, 1e-5, 1e-7


def numeric(f, arrays: list[np.ndarray], k: int) -> np.ndarray:
    """Central differences of the scalar ``f(*arrays)`` with respect to ``arrays[k]``, every coordinate."""
    grad = np.zeros_like(arrays[k])
    flat, out = arrays[k].reshape(-1), grad.reshape(-1)
    for i in range(flat.size):
        keep = flat[i]
        flat[i] = keep + EPS
        up = f(*arrays)
        flat[i] = keep - EPS
        down = f(*arrays)
        flat[i] = keep
        out[i] = (up - down) / (2 * EPS)
    return grad


def check(fn, *arrays: np.ndarray, seed: int = 0) -> None:
    """The gradient of ``sum(fn(*inputs) * R)`` (R random, fixed) with respect to every input, by the tape and by
    central differences, agree."""
    arrays = [np.array(a, dtype=np.float64) for a in arrays]
    leaves = [Tensor(a.copy(), requires_grad=True) for a in arrays]
    out = fn(*leaves)
    weights = np.random.default_rng(seed).standard_normal(out.shape)
    backward(ops.sum(ops.mul(out, weights)))

    def scalar(*values):
        with no_grad():
            return float((fn(*[Tensor(v) for v in values]).data * weights).sum())

    for k, leaf in enumerate(leaves):
        expected = numeric(scalar, [a.copy() for a in arrays], k)
        assert leaf.grad is not None, f"input {k} got no gradient"
        assert leaf.grad.shape == arrays[k].shape, f"input {k}: gradient of shape {leaf.grad.shape}"
        np.testing.assert_allclose(leaf.grad, expected, rtol=RTOL, atol=ATOL, err_msg=f"input {k}")


# -- shapes ----------------------------------------------------------------------------------------------------------
dims = st.integers(1, 4)
shapes = st.lists(dims, min_size=1, max_size=3).map(tuple)


@st.composite
def broadcast_pair(draw):
    """Two shapes that broadcast together: the second drops leading axes of the first and sets some to 1, or the
    other way round."""
    a = draw(shapes)
    drop = draw(st.integers(0, len(a) - 1))
    b = tuple(1 if draw(st.booleans()) else n for n in a[drop:])
    return (a, b) if draw(st.booleans()) else (b, a)


def values(shape, seed, low=None):
    """Random values; ``low``: their magnitude at least this (away from a kink at 0), positive when low > 0 and a
    domain needs it."""
    x = np.random.default_rng(seed).standard_normal(shape)
    if low is not None:
        x = np.sign(x + 1e-12) * (np.abs(x) + low)
    return x


SEEDS = st.integers(0, 2**16)
QUICK = settings(max_examples=12, deadline=None)

BINARY = {"add": ops.add, "sub": ops.sub, "mul": ops.mul, "div": ops.div, "maximum": ops.maximum}
UNARY = {
    "exp": ops.exp,
    "tanh": ops.tanh,
    "sigmoid": ops.sigmoid,
    "softplus": ops.softplus,
    "gelu": ops.gelu,
    "neg": ops.neg,
    "relu": ops.relu,
    "abs": ops.abs,
}
POSITIVE = {"log": ops.log, "sqrt": ops.sqrt}


@pytest.mark.parametrize("name", sorted(BINARY))
@QUICK
@given(pair=broadcast_pair(), seed=SEEDS)
def test_binary_operations_with_broadcasting(name, pair, seed):
    a, b = values(pair[0], seed), values(pair[1], seed + 1, low=0.5 if name == "div" else None)
    if name == "maximum":
        b = b + 0.01  # no ties
    check(BINARY[name], a, b)


@pytest.mark.parametrize("name", sorted(UNARY) + sorted(POSITIVE))
@QUICK
@given(shape=shapes, seed=SEEDS)
def test_elementwise_functions(name, shape, seed):
    if name in POSITIVE:
        check(POSITIVE[name], np.abs(values(shape, seed)) + 0.5)
    else:
        check(UNARY[name], values(shape, seed, low=0.01 if name in ("relu", "abs") else None))


@QUICK
@given(pair=broadcast_pair(), seed=SEEDS)
def test_power_by_a_number_and_by_a_tensor(pair, seed):
    base = np.abs(values(pair[0], seed)) + 0.5
    check(lambda a: ops.power(a, 3), base)
    check(lambda a: a**0.5, base)
    check(ops.power, base, values(pair[1], seed + 1))


@QUICK
@given(lead=st.lists(dims, max_size=2).map(tuple), m=dims, k=dims, n=dims, seed=SEEDS)
def test_matmul_of_matrices_stacks_and_vectors(lead, m, k, n, seed):
    check(ops.matmul, values((m, k), seed), values((k, n), seed + 1))
    check(ops.matmul, values(lead + (m, k), seed), values((k, n), seed + 1))
    check(ops.matmul, values((k,), seed), values(lead + (k, n), seed + 1))
    check(ops.matmul, values(lead + (m, k), seed), values((k,), seed + 1))
    check(lambda a, b: a @ b.T, values((m, k), seed), values((n, k), seed + 1))


@pytest.mark.parametrize("reduce", ["sum", "mean", "max"])
@QUICK
@given(shape=shapes, seed=SEEDS, data=st.data())
def test_reductions_over_any_axes(reduce, shape, seed, data):
    axis = data.draw(
        st.one_of(
            st.none(),
            st.integers(-len(shape), len(shape) - 1),
            st.lists(st.integers(0, len(shape) - 1), min_size=1, unique=True).map(tuple),
        )
    )
    keepdims = data.draw(st.booleans())
    check(lambda a: getattr(ops, reduce)(a, axis, keepdims), values(shape, seed))


@QUICK
@given(shape=st.lists(dims, min_size=2, max_size=3).map(tuple), seed=SEEDS, data=st.data())
def test_shapes_and_indexing(shape, seed, data):
    x = values(shape, seed)
    check(lambda a: a.reshape(-1), x)
    check(lambda a: a.T, x)
    order = tuple(data.draw(st.permutations(range(len(shape)))))
    check(lambda a: ops.transpose(a, order), x)
    check(lambda a: a[1:, ::-1], x)
    check(lambda a: a[..., 0], x)
    index = np.random.default_rng(seed).integers(0, shape[0], size=(3, 2))  # repeats: gradients add up
    check(lambda a: ops.take(a, index), x)
    check(lambda a: nn.lookup(a, index), x)
    check(lambda a, b: ops.concatenate([a, b, a], axis=-1), x, values(shape, seed + 1))
    check(lambda a, b: ops.stack([a, b], axis=1), x, values(shape, seed + 1))
    check(lambda a: ops.stack([a[:-1], a[1:], a[:-1]], axis=-1), x)  # overlapping slices: their gradients add up
    check(lambda a: ops.concatenate([a[0], a[-1, ::-1], a[np.int64(0)]]), x)
    check(lambda a: a[..., None, 0] + a[..., None, -1], x)
    mask = values(shape, seed + 2) > 0
    check(lambda a, b: ops.where(mask, a, b), x, values(shape, seed + 1))
    check(lambda a: ops.where(mask, a, 0.0), x)


@QUICK
@given(b=dims, k=st.integers(2, 5), seed=SEEDS)
def test_softmax_and_the_losses(b, k, seed):
    z = values((b, k), seed)
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, k, size=b)
    soft = rng.dirichlet(np.ones(k), size=b)
    check(nn.softmax, z)
    check(nn.log_softmax, z)
    check(lambda a: nn.log_softmax(a, axis=0), z)
    check(lambda a: nn.cross_entropy(a, labels), z)
    check(lambda a: nn.cross_entropy(a, soft), z)
    multi = rng.integers(0, 2, size=(b, k))
    check(lambda a: nn.sigmoid_cross_entropy(a, multi), z)
    check(lambda a: nn.mse(a, labels), z)
    check(lambda a: nn.mse(a, soft), z)


@QUICK
@given(b=dims, n_in=dims, n_out=dims, relu=st.booleans(), seed=SEEDS)
def test_a_dense_layer(b, n_in, n_out, relu, seed):
    x, w, bias = values((b, n_in), seed), values((n_in, n_out), seed + 1), values((n_out,), seed + 2)
    if relu:  # away from the kink
        with no_grad():
            pre = x @ w + bias
        bias = bias + np.where(np.abs(pre) < 0.01, 0.05, 0.0).max(axis=0)
    check(lambda a, c, d: nn.linear(a, c, d, relu=relu), x, w, bias)
    check(lambda c: nn.linear(x, c), w)


@QUICK
@given(
    b=st.integers(1, 2),
    c=st.integers(1, 2),
    o=st.integers(1, 3),
    hw=st.integers(3, 5),
    k=st.sampled_from([1, 3]),
    pad=st.integers(0, 1),
    seed=SEEDS,
)
def test_convolution(b, c, o, hw, k, pad, seed):
    check(
        lambda x, w, bias: nn.conv2d(x, w, bias, pad),
        values((b, c, hw, hw), seed),
        values((o, c, k, k), seed + 1),
        values((o,), seed + 2),
    )


@QUICK
@given(
    b=st.integers(1, 2),
    groups=st.integers(1, 2),
    c=st.integers(1, 2),
    o=st.integers(1, 2),
    n=st.integers(4, 9),
    k=st.integers(1, 3),
    stride=st.integers(1, 3),
    pad=st.integers(0, 2),
    dilation=st.integers(1, 2),
    seed=SEEDS,
)
def test_convolution_with_stride_dilation_and_groups(b, groups, c, o, n, k, stride, pad, dilation, seed):
    c, o = c * groups, o * groups
    if n + 2 * pad < dilation * (k - 1) + 1:
        n = dilation * (k - 1) + 1
    x1, w1 = values((b, c, n), seed), values((o, c // groups, k), seed + 1)
    check(lambda x, w, bias: nn.conv1d(x, w, bias, stride, pad, dilation, groups), x1, w1, values((o,), seed + 2))
    x2, w2 = values((b, c, n, n - 1 + k), seed + 3), values((o, c // groups, k, 2), seed + 4)
    check(lambda x, w: nn.conv2d(x, w, None, pad, stride, dilation, groups), x2, w2)


@pytest.mark.parametrize("pool", ["max", "avg"])
@QUICK
@given(b=st.integers(1, 2), c=st.integers(1, 2), h=st.integers(2, 5), w=st.integers(2, 5), seed=SEEDS)
def test_pooling(pool, b, c, h, w, seed):
    check(getattr(nn, f"{pool}_pool2d"), values((b, c, h, w), seed))
    check(getattr(nn, f"{pool}_pool1d"), values((b, c, h + w), seed + 1))
    check(lambda x: getattr(nn, f"{pool}_pool1d")(x, 3), values((b, c, h + w), seed + 2))


@QUICK
@given(shape=shapes, seed=SEEDS, data=st.data())
def test_padding(shape, seed, data):
    widths = [data.draw(st.tuples(st.integers(0, 2), st.integers(0, 2))) for _ in shape]
    check(lambda a: ops.pad(a, widths), values(shape, seed))
    check(lambda a: ops.pad(a, 1, value=2.5), values(shape, seed))


@QUICK
@given(b=dims, n_in=dims, size=dims, bias=st.booleans(), seed=SEEDS)
def test_recurrent_cells(b, n_in, size, bias, seed):
    x, h, c = values((b, n_in), seed), values((b, size), seed + 1), values((b, size), seed + 2)
    for cell, gates in ((nn.gru_cell, 3), (nn.lstm_cell, 4)):
        state = (h,) if cell is nn.gru_cell else (h, c)
        weights = [values((n_in, gates * size), seed + 3), values((size, gates * size), seed + 4)]
        if bias:
            weights += [values((gates * size,), seed + 5), values((gates * size,), seed + 6)]
        check(lambda *a: ops.concatenate(cell(*a), axis=-1) if cell is nn.lstm_cell else cell(*a), x, *state, *weights)


@QUICK
@given(lead=st.lists(dims, max_size=2).map(tuple), tq=dims, tk=dims, d=dims, causal=st.booleans(), seed=SEEDS)
def test_attention(lead, tq, tk, d, causal, seed):
    tk = tq if causal else tk
    check(
        lambda q, k, v: nn.attention(q, k, v, causal),
        values(lead + (tq, d), seed),
        values(lead + (tk, d), seed + 1),
        values(lead + (tk, d + 1), seed + 2),
    )


@QUICK
@given(shape=st.sampled_from([(3, 4), (2, 3, 5)]), seed=SEEDS)
def test_layer_norm(shape, seed):
    check(nn.layer_norm, values(shape, seed), values(shape[-1:], seed + 1), values(shape[-1:], seed + 2))


@pytest.mark.parametrize("training", [True, False])
@QUICK
@given(shape=st.sampled_from([(4, 3), (2, 3, 2, 2)]), seed=SEEDS)
def test_batch_norm(training, shape, seed):
    c = shape[1]
    mean, var = values((c,), seed + 3), np.abs(values((c,), seed + 4)) + 0.5
    check(
        lambda x, g, b: nn.batch_norm(x, g, b, mean.copy(), var.copy(), training),
        values(shape, seed),
        values((c,), seed + 1),
        values((c,), seed + 2),
    )


def test_batch_norm_moves_its_running_statistics_in_training_only():
    x = values((8, 3), 1) * 2 + 5
    mean, var = np.zeros(3), np.ones(3)
    nn.batch_norm(x, np.ones(3), np.zeros(3), mean, var, training=True, momentum=0.5)
    np.testing.assert_allclose(mean, 0.5 * x.mean(axis=0))
    np.testing.assert_allclose(var, 0.5 + 0.5 * x.var(axis=0, ddof=1))
    before = (mean.copy(), var.copy())
    out = nn.batch_norm(x, np.ones(3), np.zeros(3), mean, var, training=False)
    np.testing.assert_array_equal(mean, before[0])
    np.testing.assert_allclose(out.data, (x - mean) / np.sqrt(var + 1e-5))


def test_dropout_is_seeded_scaled_and_off_in_evaluation():
    x = np.ones((200, 50))
    a, b, c = (nn.dropout(x, 0.25, seed).data for seed in (7, 7, 8))
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    assert set(np.unique(a)) == {0.0, 1 / 0.75} and abs((a == 0).mean() - 0.25) < 0.02
    assert nn.dropout(x, 0.25, 7, training=False) is x
    check(lambda t: nn.dropout(t, 0.25, 7), values((20, 5), 3))  # the same mask on every call


def test_slices_add_their_gradients_in_place_and_stack_and_concatenate_hand_back_views(monkeypatch):
    """Indexing by slices and integers scatters nothing: k slices of one array add into one gradient in place; the
    gradients stack and concatenate hand back are views of theirs, not copies."""

    def refuse(*args):
        raise AssertionError("a scatter for a plain slice")

    monkeypatch.setattr(ops, "scatter_add", refuse)
    x = Tensor(values((4, 6), 1), requires_grad=True)
    r = values((3, 4, 4), 2)
    backward(ops.sum(ops.mul(ops.stack([x[:, i : i + 4] for i in range(3)]), r)))
    want = np.zeros((4, 6))
    for i in range(3):
        want[:, i : i + 4] += r[i]
    np.testing.assert_allclose(x.grad, want, rtol=1e-15)
    a, b, c = (Tensor(values((2, 3), n), requires_grad=True) for n in range(3))
    backward(ops.sum(ops.mul(ops.stack([a, b], axis=1), values((2, 2, 3), 4))))
    backward(ops.sum(ops.mul(ops.concatenate([a, c], axis=1), values((2, 6), 5))))
    assert b.grad.base is not None and c.grad.base is not None


# -- the engine ------------------------------------------------------------------------------------------------------
def test_a_tensor_used_twice_gets_both_gradients_and_on_grad_fires_once_each_when_complete():
    w = Tensor(values((3, 3), 1), requires_grad=True, name="w")
    v = Tensor(values((3,), 2), requires_grad=True, name="v")
    h = ops.tanh(ops.matmul(w, v))
    loss = ops.sum(ops.mul(ops.matmul(w, h), h))  # w and h each used twice
    heard = []
    backward(loss, on_grad=lambda leaf, g: heard.append((leaf.name, g.copy())))
    assert sorted(name for name, _ in heard) == ["v", "w"]
    for name, g in heard:
        np.testing.assert_array_equal(g, {"v": v, "w": w}[name].grad)


def test_on_grad_hears_of_a_leaf_whose_uses_include_a_node_no_gradient_reaches():
    """A rule may send nothing to an input (as ``where`` to its condition): the nodes below it never run, and a leaf
    they use is heard of once, with the gradient the other uses gave it, when backward ends."""
    w = Tensor(values((3,), 1), requires_grad=True, name="w")
    v = Tensor(values((3,), 2), requires_grad=True, name="v")
    blocked = tensor.make(np.zeros(3), (ops.mul(w, v),), lambda g: (None,), "blocked")
    loss = ops.sum(ops.add(ops.mul(w, 3.0), blocked))
    heard = []
    backward(loss, on_grad=lambda leaf, g: heard.append((leaf.name, g.copy())))
    assert [name for name, _ in heard] == ["w"]
    np.testing.assert_array_equal(heard[0][1], np.full(3, 3.0))
    assert v.grad is None


def test_backward_releases_every_node_and_no_grad_records_nothing():
    w = Tensor(values((4, 4), 1), requires_grad=True)
    h = ops.exp(ops.matmul(w, w))
    loss = ops.sum(h)
    assert h.node is not None
    backward(loss)
    assert h.node is None and loss.node is None
    with no_grad():
        assert ops.exp(ops.matmul(w, w)).node is None
    assert ops.exp(values((2,), 1)).node is None  # nothing needs a gradient


def test_backward_lets_go_of_each_tensor_once_its_rule_has_run():
    w = Tensor(values((4, 4), 1), requires_grad=True)
    middle = ops.exp(ops.tanh(w))
    gone = weakref.ref(middle)
    loss = ops.sum(ops.exp(middle))
    del middle
    alive_when_w_was_done = []
    backward(loss, on_grad=lambda leaf, g: alive_when_w_was_done.append(gone() is not None))
    assert alive_when_w_was_done == [False]  # tanh's rule (the last to run) came after exp(middle)'s let it go


def test_a_rule_that_replaces_its_gradient_lets_go_of_the_one_it_was_given():
    """As a fused ReLU's rule does (``g = relu_grad(g, out)``): backward holds no reference to the gradient it handed
    the rule, nor to the gradients of the rule before, so the old one is freed as the rule replaces it (the peak of a
    dense network's backward is then the hand-written code's)."""
    freed = []

    def doubled(a):
        def rule(g):
            given = weakref.ref(g)
            g = g * 2.0
            freed.append(given() is None)
            return (g,)

        return tensor.make(a.data * 2.0, (a,), rule, "doubled")

    w = Tensor(values((3, 4), 1), requires_grad=True)
    backward(ops.sum(ops.mul(doubled(doubled(w)), values((3, 4), 2))))
    assert freed == [True, True]
    np.testing.assert_allclose(w.grad, 4 * values((3, 4), 2))


# -- the check, checked: a wrong rule is caught, for every operation ---------------------------------------------------
CASES = {
    **{name: (fn, [(2, 3), (1, 3)]) for name, fn in BINARY.items()},
    **{name: (fn, [(2, 3)]) for name, fn in UNARY.items()},
    "log": (ops.log, [(2, 3)]),
    "sqrt": (ops.sqrt, [(2, 3)]),
    "power": (ops.power, [(2, 3), (2, 3)]),
    "matmul": (ops.matmul, [(2, 3, 4), (4, 2)]),
    "sum": (lambda a: ops.sum(a, 1), [(2, 3)]),
    "mean": (lambda a: ops.mean(a, 0), [(2, 3)]),
    "max": (lambda a: ops.max(a, 1), [(2, 3)]),
    "reshape": (lambda a: a.reshape(3, 2), [(2, 3)]),
    "transpose": (lambda a: a.T, [(2, 3)]),
    "getitem": (lambda a: a[np.array([0, 0, 1])], [(2, 3)]),
    "concatenate": (lambda a, b: ops.concatenate([a, b]), [(2, 3), (1, 3)]),
    "stack": (lambda a, b: ops.stack([a, b]), [(2, 3), (2, 3)]),
    "where": (lambda a, b: ops.where(np.array([True, False, True]), a, b), [(2, 3), (2, 3)]),
    "linear": (lambda a, b, c: nn.linear(a, b, c), [(2, 3), (3, 2), (2,)]),
    "softmax": (nn.softmax, [(2, 3)]),
    "log_softmax": (nn.log_softmax, [(2, 3)]),
    "cross_entropy": (lambda a: nn.cross_entropy(a, np.array([0, 2])), [(2, 3)]),
    "sigmoid_cross_entropy": (lambda a: nn.sigmoid_cross_entropy(a, np.ones((2, 3))), [(2, 3)]),
    "mse": (lambda a: nn.mse(a, np.array([0, 2])), [(2, 3)]),
    "conv2d": (lambda a, b: nn.conv2d(a, b, None, 1), [(1, 2, 3, 3), (2, 2, 3, 3)]),
    "conv1d": (lambda a, b, c: nn.conv1d(a, b, c, 2, 1, 2, 2), [(2, 4, 7), (2, 2, 3), (2,)]),
    "max_pool2d": (nn.max_pool2d, [(1, 1, 4, 4)]),
    "avg_pool2d": (nn.avg_pool2d, [(1, 1, 4, 4)]),
    "max_pool1d": (nn.max_pool1d, [(2, 2, 5)]),
    "avg_pool1d": (nn.avg_pool1d, [(2, 2, 5)]),
    "layer_norm": (nn.layer_norm, [(2, 3), (3,), (3,)]),
    "pad": (lambda a: ops.pad(a, [(1, 0), (0, 2)]), [(2, 3)]),
    "gru_cell": (nn.gru_cell, [(2, 3), (2, 2), (3, 6), (2, 6), (6,), (6,)]),
    "lstm_cell": (
        lambda *a: ops.concatenate(nn.lstm_cell(*a), axis=-1),
        [(2, 3), (2, 2), (2, 2), (3, 8), (2, 8), (8,), (8,)],
    ),
    "attention": (lambda q, k, v: nn.attention(q, k, v, causal=True), [(2, 3, 2), (2, 3, 2), (2, 3, 4)]),
}


NODES = {"layer_norm": "normalize", "attention": "softmax"}  # the node a composite operation's own rule makes


@contextlib.contextmanager
def rule_off_by(op: str, factor: float):
    """The rule of the operation ``op`` (its nodes' name) returns its gradients times ``factor``: slightly wrong."""
    made = tensor.make

    def wrong(data, inputs, rule, name):
        if name != op:
            return made(data, inputs, rule, name)
        return made(data, inputs, lambda g: [None if gx is None else gx * factor for gx in rule(g)], name)

    for module in (ops, nn, pool):
        module.make = wrong
    try:
        yield
    finally:
        for module in (ops, nn, pool):
            module.make = made


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_rule_made_slightly_wrong_fails_the_check(name):
    fn, shapes = CASES[name]
    inputs = [np.abs(values(s, n)) + 0.5 for n, s in enumerate(shapes)]
    check(fn, *inputs)  # right
    with rule_off_by(NODES.get(name, name), 1.001), pytest.raises(AssertionError):
        check(fn, *inputs)


def test_the_reference_names_every_operation_and_module():
    """docs/reference/autodiff.md lists every public operation of ops and nn, and every module psgd.model offers."""
    import inspect
    from pathlib import Path

    import psgd.model
    from psgd.model import blocks, module

    page = (Path(__file__).resolve().parents[2] / "docs" / "reference" / "autodiff.md").read_text()
    public = [
        name
        for source in (ops, nn, pool)
        for name, f in vars(source).items()
        if inspect.isfunction(f) and f.__module__ == source.__name__ and not name.startswith("_")
    ]
    public += [
        name
        for name in psgd.model.__all__
        if getattr(getattr(psgd.model, name), "__module__", "") in (module.__name__, blocks.__name__)
    ]
    assert len(public) > 40
    missing = [name for name in public if f"`{name}(" not in page and f"`{name}`" not in page]
    assert missing == [], missing


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_the_built_in_mlp_derives_the_gradients_its_hand_written_backward_gave(dtype):
    """The MLP is written as its forward pass now; its loss and gradients are those of the backward written by hand
    before (the same arithmetic, in the same order), to the bit."""
    from psgd.model import build_model

    model = build_model("mlp", (8, 8), 10, dtype=dtype, hidden=[16, 12])
    p = model.init(3)
    rng = np.random.default_rng(5)
    x = rng.standard_normal((9, 8, 8)).astype(dtype).reshape(9, 64)
    y = rng.integers(0, 10, 9)
    loss, grads = model.loss_and_grads(p, x, y)

    hs = [x]
    for k in range(2):  # dense + ReLU, the bias and the ReLU in place
        h = hs[-1] @ p[f"dense{k}/W"]
        h += p[f"dense{k}/b"]
        h *= h > 0
        hs.append(h)
    z = hs[-1] @ p["dense2/W"]
    z += p["dense2/b"]
    shifted = z - z.max(axis=1, keepdims=True)
    e = np.exp(shifted)
    total = e.sum(axis=1, keepdims=True)
    hot = np.arange(10) == y[:, None]
    want = {"loss": (np.log(total).sum() - (shifted * hot).sum()) / 9}
    d = (e / total - hot) / 9
    for k in (2, 1, 0):
        want[f"dense{k}/W"], want[f"dense{k}/b"] = hs[k].T @ d, d.sum(axis=0)
        if k:
            d = (d @ p[f"dense{k}/W"].T) * (hs[k] > 0)
    np.testing.assert_array_equal(loss, want.pop("loss"))
    for name, g in want.items():
        np.testing.assert_array_equal(grads[name], g, err_msg=name)
