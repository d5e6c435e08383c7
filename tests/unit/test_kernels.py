"""The fused steps (psgd.compute.kernels) and the graphed step (psgd.compute.graphs).

On NumPy the fused steps are the ufuncs they replace; on a GPU (tests marked ``gpu``) each kernel must give
what NumPy gives for the same inputs: the optimizer updates and the ReLU steps to the bit (their kernels are
built without multiply-add contraction), softmax cross-entropy within rounding.  A step replayed as a CUDA
graph must give the eager step's loss and gradients for new batches and new weights.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from psgd.autodiff import Tensor, backward, nn, ops
from psgd.compute import backend, kernels
from psgd.model import build_model
from psgd.model.losses import softmax_cross_entropy
from psgd.optim import SGD, Adam, AdamW, Momentum, Share


def poisoned(rng, shape, dtype):
    """Random values with a NaN, an infinity, zeros of both signs and values of both signs."""
    a = (rng.standard_normal(shape) * 3).astype(dtype)
    flat = a.reshape(-1)
    flat[:4] = [np.nan, np.inf, 0.0, -0.0]
    return a


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_relu_steps_keep_the_mask_products_they_replace(device, rng, dtype):
    """x * (x > 0) everywhere (a NaN stays a NaN, as in the product), the bias added first, the gradient
    passed where the output is positive; to the bit on every device."""
    h = poisoned(rng, (37, 19), dtype)
    b = rng.standard_normal(19).astype(dtype)
    d = rng.standard_normal((37, 19)).astype(dtype)
    on = device.asarray
    out = backend.to_host(kernels.relu(on(h)))
    np.testing.assert_array_equal(out, h * (h > 0))
    assert np.isnan(out.reshape(-1)[0])
    hb = on(h.copy())  # on the CPU asarray would not copy
    assert kernels.bias_relu_(hb, on(b)) is hb  # in place
    np.testing.assert_array_equal(backend.to_host(hb), (h + b) * ((h + b) > 0))
    np.testing.assert_array_equal(backend.to_host(kernels.relu_grad(on(d), on(out))), d * (out > 0))


RULES = {
    "sgd": lambda: SGD(0.1),
    "sgd-wd": lambda: SGD(0.1, weight_decay=0.01),
    "momentum": lambda: Momentum(0.1, 0.9),
    "momentum-wd": lambda: Momentum(0.1, 0.9, weight_decay=0.01),
    "nesterov": lambda: Momentum(0.05, 0.8, nesterov=True),
    "nesterov-wd": lambda: Momentum(0.1, 0.9, nesterov=True, weight_decay=0.01),
    "adam": lambda: Adam(0.01),
    "adam-wd": lambda: Adam(0.01, weight_decay=0.01),
    "adamw": lambda: AdamW(0.01),
}
SHARES = (Share(), Share(updates=4), Share(updates=4, implicit_momentum=0.5))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("rule", sorted(RULES))
def test_each_update_on_the_gpu_is_numpys_to_the_bit(rng, dtype, rule):
    """Three updates of every rule and share, from the same start, on CuPy (one kernel) and NumPy (ufuncs)."""
    gpu = backend.get_device("cuda")
    for share in SHARES:
        on_cpu, on_gpu = RULES[rule](), RULES[rule]()
        p = rng.standard_normal((65, 33)).astype(dtype)
        host, dev = p.copy(), gpu.asarray(p)
        for _ in range(3):
            g = rng.standard_normal(p.shape).astype(dtype)
            on_cpu.update("w", host, g, share=share)
            on_gpu.update("w", dev, gpu.asarray(g), share=share)
        np.testing.assert_array_equal(backend.to_host(dev), host, err_msg=f"{rule} {share}")
        for field, buf in on_gpu.state("w").items():
            np.testing.assert_array_equal(backend.to_host(buf), on_cpu.state("w")[field], err_msg=f"{rule} {field}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,rtol", [(np.float32, 1e-5), (np.float64, 1e-13)])
def test_softmax_cross_entropy_kernel_is_the_ufuncs(rng, dtype, rtol):
    """Loss and gradient of the one-kernel form against NumPy's, labels out of range picking nothing, and a
    NaN logit making its row's gradient and the loss NaN."""
    gpu = backend.get_device("cuda")
    logits = (rng.standard_normal((300, 13)) * 20).astype(dtype)
    y = rng.integers(0, 13, 300)
    y[:2] = [-1, 13]
    want_loss, want_grad = softmax_cross_entropy(logits, y)
    loss, grad = softmax_cross_entropy(gpu.asarray(logits), gpu.asarray(y))
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=rtol)
    np.testing.assert_allclose(backend.to_host(grad), want_grad, rtol=rtol * 10, atol=rtol / 300)
    logits[5, 3] = np.nan
    loss, grad = softmax_cross_entropy(gpu.asarray(logits), gpu.asarray(y))
    assert np.isnan(float(loss)) and np.isnan(backend.to_host(grad)[5]).all()
    assert not np.isnan(backend.to_host(grad)[6]).any()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_matmul_is_the_product_for_every_layout(device, rng, dtype):
    """C-ordered, transposed (Fortran-ordered) and strided operands, and a row or a column alone."""
    for m, k, n in ((37, 19, 23), (1, 8, 5), (6, 8, 1), (64, 1, 3)):
        a, b = rng.standard_normal((m, k)).astype(dtype), rng.standard_normal((k, n)).astype(dtype)
        at, bt = np.ascontiguousarray(a.T), np.ascontiguousarray(b.T)
        wide = np.repeat(a, 2, axis=1)
        for left, right, want in (
            (a, b, a @ b),
            (at.T, b, a @ b),
            (a, bt.T, a @ b),
            (at.T, bt.T, a @ b),
            (wide[:, ::2], b, a @ b),
        ):
            got = kernels.matmul(device.asarray(left), device.asarray(right))
            assert got.shape == (m, n) and got.dtype == dtype
            np.testing.assert_allclose(
                backend.to_host(got),
                want,
                rtol=1e-5 if dtype == np.float32 else 1e-12,
                atol=1e-5 if dtype == np.float32 else 1e-12,
            )


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_matmul_is_the_product_for_stacks_of_matrices(device, rng, dtype):
    """A stack times a matrix, a matrix times a stack, and two stacks; each stack C-ordered, its matrices transposed,
    strided, or reversed; a stack of one."""
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == np.float32 else dict(rtol=1e-12, atol=1e-12)
    for s, m, k, n in ((5, 7, 3, 4), (1, 6, 9, 2), (3, 1, 4, 1)):
        a3, b3 = rng.standard_normal((s, m, k)).astype(dtype), rng.standard_normal((s, k, n)).astype(dtype)
        a2, b2 = rng.standard_normal((m, k)).astype(dtype), rng.standard_normal((k, n)).astype(dtype)
        views = {
            "as is": lambda x: x,
            "transposed": lambda x: x.transpose(0, 2, 1).copy().transpose(0, 2, 1),
            "strided": lambda x: x.repeat(2, axis=2)[:, :, ::2],
            "reversed": lambda x: x[::-1],
        }
        for (left, right), view in itertools.product(((a3, b2), (a2, b3), (a3, b3)), views):
            on = [views[view](device.asarray(v)) if v.ndim == 3 else device.asarray(v) for v in (left, right)]
            got = kernels.matmul(*on)
            want = backend.to_host(on[0]) @ backend.to_host(on[1])
            assert got.shape == want.shape and got.dtype == dtype
            np.testing.assert_allclose(backend.to_host(got), want, **tol)


def test_a_dense_layer_and_the_relu_after_it_are_one_step(device, rng):
    """The fused dense layer and ReLU (nn.linear(relu=True): the bias and the ReLU one kernel on a GPU, and the ReLU's
    gradient one) gives the unfused operations' output and gradients, to the bit."""
    x = device.asarray(rng.standard_normal((11, 7)))
    w, b = (device.asarray(rng.standard_normal(shape)) for shape in ((7, 5), (5,)))
    r = device.asarray(rng.standard_normal((11, 5)))
    fused = [Tensor(w, requires_grad=True), Tensor(b, requires_grad=True)]
    out = nn.linear(x, *fused, relu=True)
    backward(ops.sum(ops.mul(out, r)))
    apart = [Tensor(w, requires_grad=True), Tensor(b, requires_grad=True)]
    h = ops.relu(ops.add(ops.matmul(x, apart[0]), apart[1]))
    backward(ops.sum(ops.mul(h, r)))
    np.testing.assert_array_equal(backend.to_host(out.data), backend.to_host(h.data))
    for one, other in zip(fused, apart):
        np.testing.assert_array_equal(backend.to_host(one.grad), backend.to_host(other.grad))


def attention_network(dtype: str = "float64"):
    """A network of one's own with products of stacks of matrices (an attention's scores and mixing)."""
    from psgd.model.blocks import Linear
    from psgd.model.module import Network

    class Attend(Network):
        static_step = True

        def __init__(self):
            super().__init__(dtype)
            self.q, self.k, self.out = Linear(4, 4), Linear(4, 4), Linear(4, 5)

        def forward(self, x):
            b, t, d = x.shape
            flat = ops.reshape(x, (b * t, d))
            q, k = (ops.reshape(m.forward(flat), (b, t, d)) for m in (self.q, self.k))
            mixed = nn.softmax(q @ ops.transpose(k, (0, 2, 1))) @ x
            return self.out.forward(ops.mean(mixed, axis=1))

    return Attend()


def mlp_batch(gpu, rng, dtype="float64", name="mlp"):
    """A model (the MLP, the CNN, or a network of one's own with attention: products of 3-D stacks), its weights on
    ``gpu`` and a maker of batches."""
    shape = {"mlp": (16,), "cnn": (1, 8, 8), "attention": (5, 4)}[name]
    if name == "attention":
        model = attention_network(dtype)
    else:
        model = build_model(
            name, input_shape=shape, num_classes=5, dtype=dtype, **({"hidden": [32, 32]} if name == "mlp" else {})
        )
    params = {k: gpu.asarray(v) for k, v in model.init(3).items()}
    return model, params, lambda: (gpu.asarray(rng.standard_normal((64,) + shape)), gpu.asarray(rng.integers(0, 5, 64)))


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["mlp", "cnn", "attention"])
def test_a_graphed_step_gives_the_eager_step(rng, name):
    """Weights updated in place (read by the graph in place) and new weight arrays each step (copied in):
    every step's loss and gradients equal the eager step's on the same batch and weights.  The CNN's convolutions and
    the attention's products of 3-D stacks go through psgd.compute.kernels.matmul, so their steps are captured too."""
    from psgd.compute.graphs import GraphedStep

    gpu = backend.get_device("cuda")
    model, params, batch = mlp_batch(gpu, rng, name=name)
    for fresh in (False, True):
        step = GraphedStep(model, gpu)
        for n in range(5):
            if fresh:
                params = {k: v.copy() for k, v in params.items()}
            x, y = batch()
            loss, grads = step(params, x, y)
            got = float(loss), {k: backend.to_host(g).copy() for k, g in grads.items()}
            want_loss, want = model.loss_and_grads(params, x, y)
            assert got[0] == float(want_loss)
            for k in want:
                np.testing.assert_array_equal(got[1][k], backend.to_host(want[k]), err_msg=f"step {n} {k}")
            for k, g in grads.items():  # a step of SGD, in place, before the next replay
                params[k] -= 0.1 * g
        assert step.failed is None and step.replays == 4
        assert step._graphs and next(iter(step._graphs.values())).shared is (not fresh)


@pytest.mark.gpu
def test_a_step_that_reads_back_is_run_kernel_by_kernel(rng, caplog):
    import logging

    from psgd.compute.graphs import GraphedStep

    caplog.set_level(logging.INFO, logger="psgd")
    gpu = backend.get_device("cuda")
    model, params, batch = mlp_batch(gpu, rng)

    class ReadsBack:
        static_step = True

        def loss_and_grads(self, params, x, y):
            loss, grads = model.loss_and_grads(params, x, y)
            if float(loss) > 1e9:  # a value read back in the middle of a step: cannot be captured
                raise AssertionError
            return loss, grads

    step = GraphedStep(ReadsBack(), gpu)
    for _ in range(3):
        x, y = batch()
        loss, _ = step(params, x, y)
        assert float(loss) == float(model.loss_and_grads(params, x, y)[0])
    assert step.failed and step.replays == 0
    assert "could not be captured" in caplog.text


@pytest.mark.gpu
@pytest.mark.parametrize("optimizer", ["sgd", "momentum", "nesterov", "adam", "adamw"])
def test_training_with_graphs_ends_where_training_without_ends(optimizer, caplog):
    """psgd train on the GPU in float64, its steps (the optimizer's update inside) replayed as a graph or not: the
    same final weights to the bit, under a schedule that changes the rate every step and with weight decay."""
    import logging

    from psgd.config import JobConfig
    from psgd.training.local import train_local

    caplog.set_level(logging.INFO, logger="psgd")
    results = []
    for graphs in ("true", "false"):
        config = JobConfig()
        config = config.apply_sets(
            [
                "model.name=mlp",
                "model.hidden=[48, 32]",
                "data.name=digits",
                f"optimizer.name={optimizer}",
                "optimizer.weight_decay=0.001",
                "optimizer.schedule=cosine",
                "optimizer.warmup_steps=5",
                "optimizer.total_steps=60",
                "train.epochs=2",
                "train.batch_size=64",
                "train.device=cuda",
                "train.dtype=float64",
                f"train.graphs={graphs}",
            ]
        )
        results.append(train_local(config, progress=False))
    assert "captured as a CUDA graph" in caplog.text and "the optimizer's update inside" in caplog.text
    graphed, eager = results
    assert graphed.steps == eager.steps > 10
    for name, value in eager.params.items():
        np.testing.assert_array_equal(graphed.params[name], value, err_msg=name)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("rule", sorted(RULES))
def test_an_update_reading_its_changing_values_on_the_device_gives_the_same_bits(rng, dtype, rule):
    """What a captured step's update does: the values that change each step (rate, decay, bias corrections) read
    from a device array by the kernel, against the same update given them as numbers."""
    gpu = backend.get_device("cuda")
    for share in SHARES:
        as_numbers, on_device = RULES[rule](), RULES[rule]()
        p = gpu.asarray(rng.standard_normal((65, 33)).astype(dtype))
        numbers, device = p.copy(), p.copy()
        states = [{f: gpu.xp.zeros_like(p) for f in opt.state_names} for opt in (as_numbers, on_device)]
        for t in range(3):
            g = gpu.asarray(rng.standard_normal(p.shape).astype(dtype))
            values = as_numbers._scalars(*as_numbers._rate(t, 1.0, share), share)
            as_numbers._apply(numbers, g, states[0], values, share)
            held = gpu.asarray(np.array(values, dtype=dtype))
            on_device._apply(device, g, states[1], tuple(held[i] for i in range(len(values))), share)
        np.testing.assert_array_equal(backend.to_host(device), backend.to_host(numbers), err_msg=f"{rule} {share}")
        for field in as_numbers.state_names:
            np.testing.assert_array_equal(backend.to_host(states[1][field]), backend.to_host(states[0][field]))


@pytest.mark.gpu
def test_a_graph_holding_the_update_is_captured_again_once_the_optimizer_state_is_replaced(rng):
    """A graph holds the state buffers it was captured with: once a restore replaces them, the step runs eagerly
    (its gradients returned, for the caller to apply) and the next is captured with the new buffers."""
    from psgd.compute.graphs import GraphedStep
    from psgd.optim.ingraph import InGraph

    gpu = backend.get_device("cuda")
    model, params, batch = mlp_batch(gpu, rng)
    opt = Adam(0.01)
    step = GraphedStep(model, gpu, update=lambda: InGraph(opt, params, gpu))
    handed = []
    for n in range(6):
        if n == 3:
            opt.load_state_dict(opt.state_dict(), device=gpu)
        loss, grads = step(params, *batch())
        handed.append(sorted(grads))
        for k, g in grads.items():
            opt.update(k, params[k], g)
    assert handed[0] == handed[3] == sorted(params) and handed[1] == handed[2] == handed[4] == handed[5] == []
    assert {opt.step_count(k) for k in params} == {6} and step.replays == 4 and step.failed is None


def test_graphs_is_a_train_option_of_true_or_false():
    from psgd.config import ConfigError, JobConfig

    config = JobConfig()
    assert config.train.graphs is True
    config = config.apply_sets(["train.graphs=false"])
    config.validate()
    assert config.train.graphs is False
    with pytest.raises(ConfigError, match=r"\[train\] graphs must be true or false"):
        config = config.override("train.graphs", "sometimes")
    assert config.train.graphs is False
