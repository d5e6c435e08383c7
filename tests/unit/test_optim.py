"""Optimizers and schedules against closed forms worked out by hand.

Every expected value below is written out from the update rule on two-element
tensors, p = [1, -2], g1 = [0.5, 1], g2 = [-1, 0.25], lr = 0.1.  The core
checks take the ``device`` fixture, so they run on CuPy too when a GPU is there.
"""

from __future__ import annotations

import json
import math
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from psgd.compute import backend
from psgd.optim import (
    DEFAULT_LR,
    SGD,
    Adam,
    AdamW,
    Constant,
    Cosine,
    Momentum,
    OptimizerError,
    Share,
    StepDecay,
    Warmup,
    build_optimizer,
    build_schedule,
)

P0 = [1.0, -2.0]
G1 = [0.5, 1.0]
G2 = [-1.0, 0.25]
EPS = 1e-8
NAMES = ["sgd", "momentum", "nesterov", "adam", "adamw"]


def arr(device, values, dtype=np.float64):
    return device.asarray(np.array(values, dtype=dtype))


def host(a):
    return backend.to_host(a)


def close(actual, expected, rtol=1e-12, atol=1e-13):
    np.testing.assert_allclose(host(actual), np.array(expected, dtype=np.float64), rtol=rtol, atol=atol)


def two_steps(opt, device, key="w", dtype=np.float64):
    """Apply g1 then g2 to p0; return the parameter after each step (host copies)."""
    p = arr(device, P0, dtype)
    opt.update(key, p, arr(device, G1, dtype))
    after1 = host(p).copy()
    opt.update(key, p, arr(device, G2, dtype))
    return after1, host(p).copy(), p


# --- schedules ----------------------------------------------------------------


def test_constant():
    s = Constant(0.1)
    assert s(0) == 0.1 and s(1000) == 0.1


def test_step_decay():
    s = StepDecay(1.0, step_size=3, gamma=0.5)
    assert [s(t) for t in range(7)] == [1.0, 1.0, 1.0, 0.5, 0.5, 0.5, 0.25]
    assert StepDecay(0.2, step_size=1)(2) == pytest.approx(0.002)  # gamma defaults to 0.1


def test_cosine_values_and_clamp():
    s = Cosine(1.0, total_steps=4, min_lr=0.2)
    assert s(0) == pytest.approx(1.0)
    assert s(1) == pytest.approx(0.2 + 0.8 * 0.5 * (1 + math.sqrt(0.5)))  # cos(pi/4)
    assert s(2) == pytest.approx(0.6)  # halfway: (1 + 0.2) / 2
    assert s(4) == pytest.approx(0.2)
    assert s(10) == pytest.approx(0.2)  # clamped after total_steps
    assert Cosine(1.0, 8)(8) == pytest.approx(0.0)


def test_warmup_wrapping_cosine():
    s = Warmup(Cosine(1.0, total_steps=8), warmup_steps=4)
    assert s(0) == pytest.approx(1.0 * 1 / 4)  # inner(0) = 1
    assert s(1) == pytest.approx(0.5 * (1 + math.cos(math.pi / 8)) * 2 / 4)  # 0.96193977 * 0.5
    assert s(3) == pytest.approx(0.5 * (1 + math.cos(3 * math.pi / 8)))  # factor 4/4 = 1
    assert s(4) == pytest.approx(0.5)  # warmup over: the inner schedule, unshifted
    assert s(8) == pytest.approx(0.0)


def test_warmup_wrapping_step_decay():
    s = Warmup(StepDecay(1.0, step_size=2, gamma=0.5), warmup_steps=4)
    assert [s(t) for t in range(6)] == pytest.approx([0.25, 0.5, 0.375, 0.5, 0.25, 0.25])


def test_zero_warmup_is_the_inner_schedule():
    assert Warmup(Constant(0.1), 0)(0) == 0.1


def test_build_schedule():
    assert isinstance(build_schedule(0.1), Constant)
    step = build_schedule(1.0, "step", step_size=3, gamma=0.5)
    assert isinstance(step, StepDecay) and step(3) == 0.5
    cos = build_schedule(1.0, "Cosine", total_steps=4, min_lr=0.2, warmup_steps=2)
    assert isinstance(cos, Warmup) and cos(0) == pytest.approx(0.5) and cos(2) == pytest.approx(0.6)
    assert isinstance(build_schedule(0.1, "constant", warmup_steps=0), Constant)
    assert build_schedule(0.1, "step", step_size=2, gamma=None).gamma == 0.1  # None counts as not given


# --- closed forms, one and two steps --------------------------------------------


def test_sgd(device):
    after1, after2, _ = two_steps(SGD(0.1), device)
    close(after1, [1 - 0.1 * 0.5, -2 - 0.1 * 1.0])  # [0.95, -2.1]
    close(after2, [0.95 + 0.1, -2.1 - 0.1 * 0.25])  # [1.05, -2.125]


def test_sgd_weight_decay(device):
    after1, after2, _ = two_steps(SGD(0.1, weight_decay=0.5), device)
    # g1 + 0.5 p0 = [1.0, 0.0]
    close(after1, [0.9, -2.0])
    # g2 + 0.5 p1 = [-1 + 0.45, 0.25 - 1.0] = [-0.55, -0.75]
    close(after2, [0.9 + 0.055, -2.0 + 0.075])


def test_momentum(device):
    opt = Momentum(0.1, momentum=0.9)
    after1, after2, _ = two_steps(opt, device)
    close(after1, [0.95, -2.1])  # v1 = g1
    # v2 = 0.9 v1 + g2 = [0.45 - 1, 0.9 + 0.25] = [-0.55, 1.15]
    close(opt.state("w")["v"], [-0.55, 1.15])
    close(after2, [0.95 + 0.055, -2.1 - 0.115])


def test_nesterov(device):
    opt = build_optimizer("nesterov", lr=0.1, momentum=0.9)
    assert isinstance(opt, Momentum) and opt.nesterov
    after1, after2, _ = two_steps(opt, device)
    # v1 = g1; p -= 0.1 (g1 + 0.9 v1) = 0.1 [0.95, 1.9]
    close(after1, [0.905, -2.19])
    # v2 = [-0.55, 1.15]; g2 + 0.9 v2 = [-1 - 0.495, 0.25 + 1.035] = [-1.495, 1.285]
    close(after2, [0.905 + 0.1495, -2.19 - 0.1285])


def test_momentum_weight_decay(device):
    opt = Momentum(0.1, momentum=0.9, weight_decay=0.5)
    after1, after2, _ = two_steps(opt, device)
    # g1' = [1, 0]; v1 = [1, 0]
    close(after1, [0.9, -2.0])
    # g2' = g2 + 0.5 p1 = [-0.55, -0.75]; v2 = 0.9 [1, 0] + g2' = [0.35, -0.75]
    close(opt.state("w")["v"], [0.35, -0.75])
    close(after2, [0.9 - 0.035, -2.0 + 0.075])


def test_nesterov_weight_decay(device):
    opt = Momentum(0.1, momentum=0.9, nesterov=True, weight_decay=0.5)
    after1, after2, _ = two_steps(opt, device)
    # g1' = [1, 0], v1 = [1, 0]; p -= 0.1 (g1' + 0.9 v1) = 0.1 [1.9, 0]
    close(after1, [0.81, -2.0])
    # g2' = g2 + 0.5 p1 = [-0.595, -0.75]; v2 = [0.305, -0.75]; g2' + 0.9 v2 = [-0.3205, -1.425]
    close(opt.state("w")["v"], [0.305, -0.75])
    close(after2, [0.81 + 0.03205, -2.0 + 0.1425])


# Adam on g1, g2 with b1 = 0.9, b2 = 0.999, worked out by hand:
# m1 = 0.1 g1 = [0.05, 0.1]          v1 = 0.001 g1^2 = [0.00025, 0.001]
# m1_hat = m1 / 0.1 = [0.5, 1]       v1_hat = v1 / 0.001 = [0.25, 1]
# m2 = 0.9 m1 + 0.1 g2 = [-0.055, 0.115]
# v2 = 0.999 v1 + 0.001 g2^2 = [0.00024975 + 0.001, 0.000999 + 0.0000625] = [0.00124975, 0.0010615]
# bias corrections at t = 2: 1 - 0.9^2 = 0.19, 1 - 0.999^2 = 0.001999
ADAM_STEP1 = [0.1 * 0.5 / (0.5 + EPS), 0.1 * 1.0 / (1.0 + EPS)]
M2 = [-0.055, 0.115]
V2 = [0.00124975, 0.0010615]
ADAM_STEP2 = [0.1 * (m / 0.19) / (math.sqrt(v / 0.001999) + EPS) for m, v in zip(M2, V2)]


def test_adam(device):
    opt = Adam(0.1)
    p = arr(device, P0)
    opt.update("w", p, arr(device, G1))
    close(opt.state("w")["m"], [0.05, 0.1])
    close(opt.state("w")["v"], [0.00025, 0.001])
    close(p, [1 - ADAM_STEP1[0], -2 - ADAM_STEP1[1]])
    opt.update("w", p, arr(device, G2))
    close(opt.state("w")["m"], M2)
    close(opt.state("w")["v"], V2)
    close(p, [1 - ADAM_STEP1[0] - ADAM_STEP2[0], -2 - ADAM_STEP1[1] - ADAM_STEP2[1]])
    assert opt.step_count("w") == 2


def test_adam_l2_weight_decay(device):
    opt = Adam(0.1, weight_decay=0.5)
    p = arr(device, P0)
    opt.update("w", p, arr(device, G1))
    # g1' = g1 + 0.5 p0 = [1, 0]: m1 = [0.1, 0], v1 = [0.001, 0], m1_hat = [1, 0], v1_hat = [1, 0]
    close(opt.state("w")["m"], [0.1, 0.0])
    close(opt.state("w")["v"], [0.001, 0.0])
    p1 = [1 - 0.1 / (1 + EPS), -2.0]
    close(p, p1)
    opt.update("w", p, arr(device, G2))
    # g2' = g2 + 0.5 p1 = [-0.55, -0.75]: m2 = [0.09 - 0.055, -0.075], v2 = [0.000999 + 0.0003025, 0.0005625]
    g2 = [G2[0] + 0.5 * p1[0], G2[1] + 0.5 * p1[1]]
    m2 = [0.9 * 0.1 + 0.1 * g2[0], 0.1 * g2[1]]
    v2 = [0.999 * 0.001 + 0.001 * g2[0] ** 2, 0.001 * g2[1] ** 2]
    close(m2, [0.035, -0.075], rtol=1e-7)  # the hand values, to the eps in p1
    close(v2, [0.0013015, 0.0005625], rtol=1e-7)
    close(opt.state("w")["m"], m2)
    close(opt.state("w")["v"], v2)
    step = [0.1 * (m / 0.19) / (math.sqrt(v / 0.001999) + EPS) for m, v in zip(m2, v2)]
    close(p, [p1[0] - step[0], p1[1] - step[1]])


def test_adamw_decoupled_decay(device):
    opt = AdamW(0.1, weight_decay=0.5)
    p = arr(device, P0)
    opt.update("w", p, arr(device, G1))
    # p1 = p0 - 0.1 * 0.5 * p0 - adam step: decay leaves m, v as in plain Adam
    p1 = [0.95 * 1.0 - ADAM_STEP1[0], 0.95 * -2.0 - ADAM_STEP1[1]]  # ~ [0.85, -2.0]
    close(p, p1)
    close(opt.state("w")["m"], [0.05, 0.1])
    opt.update("w", p, arr(device, G2))
    close(opt.state("w")["m"], M2)
    close(opt.state("w")["v"], V2)
    close(p, [0.95 * p1[0] - ADAM_STEP2[0], 0.95 * p1[1] - ADAM_STEP2[1]])


def test_adamw_default_weight_decay_and_adam_defaults():
    assert AdamW().weight_decay == 0.01 and AdamW().lr == 1e-3
    adam = Adam()
    assert (adam.lr, adam.beta1, adam.beta2, adam.eps, adam.weight_decay) == (1e-3, 0.9, 0.999, 1e-8, 0.0)


# --- learning rates -------------------------------------------------------------


def test_lr_scale(device):
    opt = SGD(0.1)
    p = arr(device, P0)
    opt.update("w", p, arr(device, G1), lr_scale=0.5)
    close(p, [1 - 0.05 * 0.5, -2 - 0.05 * 1.0])
    opt.update("w", p, arr(device, G1), lr_scale=0.0)  # counted, but no change
    close(p, [0.975, -2.05])
    assert opt.step_count("w") == 2


def test_schedule_follows_each_keys_own_step_count(device):
    opt = SGD(StepDecay(0.1, step_size=1, gamma=0.5))
    a, b = arr(device, [1.0]), arr(device, [1.0])
    opt.update("a", a, arr(device, [1.0]))  # t=0: lr 0.1
    opt.update("a", a, arr(device, [1.0]))  # t=1: lr 0.05
    opt.update("b", b, arr(device, [1.0]))  # b's t=0: lr 0.1
    close(a, [1 - 0.1 - 0.05])
    close(b, [0.9])


def test_warmup_cosine_drives_adam_lr(device):
    sched = build_schedule(0.1, "cosine", total_steps=4, warmup_steps=2)
    opt = Adam(sched)
    p = arr(device, P0)
    opt.update("w", p, arr(device, G1))  # lr = 0.1 * 1/2; step 1 moves each entry by ~lr
    close(p, [1 - 0.5 * ADAM_STEP1[0], -2 - 0.5 * ADAM_STEP1[1]])


# --- per-key state, in place, dtypes -----------------------------------------------


def test_keys_are_independent(device):
    opt = Momentum(0.1, momentum=0.9)
    w0, w1 = arr(device, P0), arr(device, [3.0, 4.0, 5.0])
    opt.update("dense0/W#0", w0, arr(device, G1))
    opt.update("dense0/W#0", w0, arr(device, G2))
    opt.update("dense0/W#1", w1, arr(device, [1.0, 1.0, 1.0]))
    assert opt.keys() == ["dense0/W#0", "dense0/W#1"]
    assert opt.step_count("dense0/W#0") == 2 and opt.step_count("dense0/W#1") == 1
    assert opt.step_count("never") == 0
    close(opt.state("dense0/W#0")["v"], [-0.55, 1.15])
    close(opt.state("dense0/W#1")["v"], [1.0, 1.0, 1.0])  # untouched by the other key
    close(w1, [2.9, 3.9, 4.9])


@pytest.mark.parametrize("name", NAMES)
def test_update_is_in_place(device, name):
    opt = build_optimizer(name, lr=0.1, weight_decay=0.1)
    p = arr(device, P0)
    before = p.__array_interface__["data"][0] if isinstance(p, np.ndarray) else p.data.ptr
    same = p
    for _ in range(3):
        assert opt.update("w", p, arr(device, G1)) is None
    after = p.__array_interface__["data"][0] if isinstance(p, np.ndarray) else p.data.ptr
    assert p is same and after == before
    assert not np.allclose(host(p), P0)


@pytest.mark.parametrize("name", NAMES)
def test_float32_stays_float32(device, name):
    opt32, opt64 = (build_optimizer(name, lr=0.1, weight_decay=0.1) for _ in range(2))
    _, p32, dev32 = two_steps(opt32, device, dtype=np.float32)
    _, p64, _ = two_steps(opt64, device, dtype=np.float64)
    assert dev32.dtype == np.float32 and p32.dtype == np.float32
    assert all(buf.dtype == np.float32 for buf in opt32.state("w").values())
    np.testing.assert_allclose(p32, p64, rtol=1e-5)


def test_state_buffers_created_lazily_like_param(device):
    opt = Adam()
    assert opt.keys() == []
    p = arr(device, np.ones((2, 3)), np.float32)
    opt.update("w", p, arr(device, np.ones((2, 3)), np.float32))
    state = opt.state("w")
    assert set(state) == {"m", "v"}
    assert all(b.shape == (2, 3) and b.dtype == np.float32 and type(b) is type(p) for b in state.values())
    assert SGD(0.1).state_names == () and Momentum(0.1).state_names == ("v",)


def test_different_keys_from_threads_match_one_thread():
    rng = np.random.default_rng(0)
    grads = {f"layer{i}/W#0": rng.standard_normal((5, 8, 16)) for i in range(8)}

    def run(parallel):
        opt = Adam(0.01)
        params = {k: np.ones((8, 16)) for k in grads}
        start = threading.Barrier(4) if parallel else None

        def train(key):
            if start is not None:
                try:
                    start.wait(timeout=5)
                except threading.BrokenBarrierError:
                    pass
            for g in grads[key]:
                opt.update(key, params[key], g)

        if parallel:
            with ThreadPoolExecutor(4) as pool:
                list(pool.map(train, grads))
        else:
            for key in grads:
                train(key)
        return opt, params

    (opt_a, par_a), (_, par_b) = run(True), run(False)
    assert sorted(opt_a.keys()) == sorted(grads)
    for key in grads:
        assert opt_a.step_count(key) == 5
        np.testing.assert_array_equal(par_a[key], par_b[key])


# --- checkpoints -----------------------------------------------------------------------


def _grads(n, shape=(3, 4), seed=7):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(shape).astype(np.float32) for _ in range(n)]


@pytest.mark.parametrize("name", NAMES)
def test_state_dict_round_trip_continues_identically(device, tmp_path, name):
    options = dict(lr=0.05, weight_decay=0.01, schedule="cosine", total_steps=6, warmup_steps=2)
    grads = {"dense0/W#0": _grads(6, seed=1), "dense0/b#0": _grads(6, shape=(4,), seed=2)}
    start = {k: np.linspace(-1, 1, g[0].size, dtype=np.float32).reshape(g[0].shape) for k, g in grads.items()}

    whole = build_optimizer(name, **options)
    ref = {k: device.asarray(v.copy()) for k, v in start.items()}
    for i in range(6):
        for k in grads:
            whole.update(k, ref[k], device.asarray(grads[k][i]))

    first = build_optimizer(name, **options)
    params = {k: device.asarray(v.copy()) for k, v in start.items()}
    for i in range(3):
        for k in grads:
            first.update(k, params[k], device.asarray(grads[k][i]))
    np.savez(tmp_path / "opt.npz", **first.state_dict())
    with np.load(tmp_path / "opt.npz", allow_pickle=False) as saved:
        second = build_optimizer(**first.describe())
        second.load_state_dict(saved, device=device)
    assert second.keys() == list(grads) and second.step_count("dense0/W#0") == 3
    for i in range(3, 6):
        for k in grads:
            second.update(k, params[k], device.asarray(grads[k][i]))
    for k in grads:
        np.testing.assert_array_equal(host(params[k]), host(ref[k]))
        assert second.step_count(k) == 6
    for k, v in second.state_dict().items():
        np.testing.assert_array_equal(v, whole.state_dict()[k])


def test_state_dict_layout():
    opt = Adam()
    p = np.ones(3, dtype=np.float32)
    opt.update("conv::0/W#1", p, np.ones(3, dtype=np.float32))  # a key may itself hold "::"
    sd = opt.state_dict()
    assert sorted(sd) == ["conv::0/W#1::m", "conv::0/W#1::t", "conv::0/W#1::v"]
    t = sd["conv::0/W#1::t"]
    assert isinstance(t, np.ndarray) and t.shape == () and t.dtype == np.int64 and int(t) == 1
    assert type(opt.step_count("conv::0/W#1")) is int
    assert all(isinstance(v, np.ndarray) for v in sd.values())
    sd["conv::0/W#1::m"][:] = 123.0  # a copy, not the live buffer
    assert float(opt.state("conv::0/W#1")["m"][0]) != 123.0
    restored = Adam()
    restored.load_state_dict(sd)
    assert restored.keys() == ["conv::0/W#1"] and restored.step_count("conv::0/W#1") == 1
    sd["conv::0/W#1::v"][:] = 7.0  # the load copied too
    assert float(restored.state("conv::0/W#1")["v"][0]) != 7.0
    assert SGD(0.1).state_dict() == {}


def test_loaded_host_state_moves_next_to_the_param(device):
    opt = Momentum(0.1, momentum=0.9)
    opt.load_state_dict({"w::t": np.array(1), "w::v": np.array(G1)})  # device=None: NumPy
    p = arr(device, [0.95, -2.1])
    opt.update("w", p, arr(device, G2))
    assert type(opt.state("w")["v"]) is type(p)
    close(p, [1.005, -2.215])  # as the second step of test_momentum


def test_load_replaces_all_state():
    opt = SGD(0.1)
    opt.update("old", np.ones(2), np.ones(2))
    opt.load_state_dict({"new::t": np.array(4, dtype=np.int64)})
    assert opt.keys() == ["new"] and opt.step_count("new") == 4 and opt.step_count("old") == 0


@pytest.mark.parametrize(
    "entries, message",
    [
        ({"w": np.zeros(2)}, "is not '<key>::<field>'"),
        ({"w::t": np.array(1), "w::m": np.zeros(2), "w::v": np.zeros(2), "w::z": np.zeros(2)}, "fields: t, m, v"),
        ({"w::t": np.array(1), "w::m": np.zeros(2)}, "'w': missing v"),
        ({"w::m": np.zeros(2), "w::v": np.zeros(2)}, "'w': missing t"),
        ({"w::t": np.array(1.0), "w::m": np.zeros(2), "w::v": np.zeros(2)}, "t must be"),
        ({"w::t": np.array([1]), "w::m": np.zeros(2), "w::v": np.zeros(2)}, "t must be"),
        ({"w::t": np.array(-1), "w::m": np.zeros(2), "w::v": np.zeros(2)}, "t must be"),
        ({"w::t": np.array(1), "w::m": np.zeros(2), "w::v": np.zeros(3)}, "buffer 'v'"),
        ({"w::t": np.array(1), "w::m": np.zeros(2), "w::v": np.zeros(2, np.float32)}, "buffer 'v'"),
        ({"w::t": np.array(1), "w::m": np.zeros(2, int), "w::v": np.zeros(2, int)}, "floating point"),
        ({"w::t": np.array(1), "w::v": np.zeros(2)}, "'w': missing m"),  # momentum state in adam
    ],
)
def test_bad_state_dict_is_rejected_and_changes_nothing(entries, message):
    opt = Adam()
    opt.update("keep", np.ones(2), np.ones(2))
    with pytest.raises(OptimizerError, match=message):
        opt.load_state_dict(entries)
    assert opt.keys() == ["keep"] and opt.step_count("keep") == 1


# --- describe --------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_describe_is_json_and_rebuilds(name):
    opt = build_optimizer(name, schedule="step", step_size=10, gamma=0.5, warmup_steps=3)
    d = opt.describe()
    assert json.loads(json.dumps(d)) == d
    assert d["name"] == name and d["lr"] == DEFAULT_LR[name] and d["schedule"] == "step"
    assert d["step_size"] == 10 and d["warmup_steps"] == 3
    rebuilt = build_optimizer(**d)
    assert type(rebuilt) is type(opt) and rebuilt.describe() == d
    assert repr(opt).startswith(type(opt).__name__ + "(lr=")


def test_default_lrs():
    assert DEFAULT_LR == {"sgd": 0.05, "momentum": 0.05, "nesterov": 0.05, "adam": 1e-3, "adamw": 1e-3}
    assert build_optimizer("adam").lr == 1e-3 and build_optimizer("SGD").lr == 0.05
    assert build_optimizer("momentum", nesterov=None).nesterov is False  # None counts as not given
    assert Momentum(0.1).describe() == {
        "name": "momentum",
        "lr": 0.1,
        "schedule": "constant",
        "momentum": 0.9,
        "weight_decay": 0.0,
    }


# --- errors ----------------------------------------------------------------------------

OPTIMIZER_OPTIONS = "lr, beta1, beta2, eps, weight_decay, schedule, step_size, gamma, total_steps, min_lr, warmup_steps"


@pytest.mark.parametrize(
    "name, options, message",
    [
        ("adan", {}, "unknown optimizer 'adan': choose sgd, momentum, nesterov, adam, adamw"),
        (None, {}, "unknown optimizer None"),
        ("adam", {"betas": (0.9, 0.99)}, f"adam: unknown option 'betas'; accepted: {OPTIMIZER_OPTIONS}"),
        ("sgd", {"momentum": 0.9, "foo": 1}, "sgd: unknown options 'momentum', 'foo'; accepted: lr, weight_decay,"),
        ("nesterov", {"nesterov": False}, "unknown option 'nesterov'"),
        ("sgd", {"lr": 0}, "sgd: lr must be > 0, got 0.0"),
        ("sgd", {"lr": -0.1}, "lr must be > 0"),
        ("sgd", {"lr": float("nan")}, "lr must be finite"),
        ("adam", {"lr": float("inf")}, "lr must be finite"),
        ("sgd", {"lr": "0.1"}, "lr must be a number, got '0.1'"),
        ("sgd", {"lr": True}, "lr must be a number"),
        ("sgd", {"weight_decay": -0.1}, "sgd: weight_decay must be >= 0"),
        ("momentum", {"momentum": 1.0}, r"momentum: momentum must be in \[0, 1\), got 1.0"),
        ("nesterov", {"momentum": -0.1}, r"nesterov: momentum must be in \[0, 1\)"),
        ("momentum", {"nesterov": "yes"}, "nesterov must be true or false"),
        ("momentum", {"weight_decay": float("inf")}, "weight_decay must be finite"),
        ("adam", {"beta1": 1.0}, r"adam: beta1 must be in \[0, 1\)"),
        ("adam", {"beta2": -0.1}, r"adam: beta2 must be in \[0, 1\)"),
        ("adam", {"eps": 0.0}, "adam: eps must be > 0"),
        ("adamw", {"eps": float("nan")}, "adamw: eps must be finite"),
        ("adamw", {"weight_decay": -1}, "adamw: weight_decay must be >= 0"),
        ("sgd", {"schedule": "linear"}, "unknown schedule 'linear': choose constant, step, cosine"),
        ("sgd", {"schedule": "step"}, "step schedule: needs step_size"),
        ("sgd", {"schedule": "step", "step_size": 0}, "step_size must be >= 1, got 0"),
        ("sgd", {"schedule": "step", "step_size": 1.5}, "step_size must be an integer"),
        ("sgd", {"schedule": "step", "step_size": 2, "gamma": 0}, "gamma must be > 0"),
        ("sgd", {"schedule": "step", "step_size": 2, "gamma": 1.5}, r"gamma must be in \(0, 1\]"),
        ("sgd", {"schedule": "step", "step_size": 2, "total_steps": 5}, "step schedule: unknown option 'total_steps'"),
        ("sgd", {"schedule": "cosine"}, "cosine schedule: needs total_steps"),
        ("sgd", {"schedule": "cosine", "total_steps": 0}, "total_steps must be >= 1"),
        ("sgd", {"schedule": "cosine", "total_steps": 5, "min_lr": -0.1}, "min_lr must be >= 0"),
        ("sgd", {"lr": 0.1, "schedule": "cosine", "total_steps": 5, "min_lr": 0.2}, "min_lr .* must not exceed lr"),
        ("sgd", {"gamma": 0.5}, "constant schedule: unknown option 'gamma'; accepted: warmup_steps"),
        ("sgd", {"warmup_steps": -1}, "warmup_steps must be >= 0"),
        ("sgd", {"warmup_steps": 2.5}, "warmup_steps must be an integer"),
    ],
)
def test_bad_options(name, options, message):
    with pytest.raises(OptimizerError, match=message):
        build_optimizer(name, **options)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: SGD(0), "sgd: lr must be > 0"),
        (lambda: Momentum(0.1, momentum=2), "momentum must be in"),
        (lambda: Adam(beta2=1), "beta2 must be in"),
        (lambda: AdamW(weight_decay=-0.01), "weight_decay must be >= 0"),
        (lambda: Constant(-1), "lr must be > 0"),
        (lambda: StepDecay(0.1, 0), "step_size must be >= 1"),
        (lambda: Cosine(0.1, 10, min_lr=1.0), "must not exceed lr"),
        (lambda: Warmup(0.1, 2), "inner must be a Schedule"),
        (lambda: Warmup(Constant(0.1), -2), "warmup_steps must be >= 0"),
        (lambda: build_schedule(0.0, "constant"), "lr must be > 0"),
    ],
)
def test_bad_constructor_values(make, message):
    with pytest.raises(OptimizerError, match=message):
        make()


def test_optimizer_error_is_a_value_error():
    assert issubclass(OptimizerError, ValueError)


@pytest.mark.parametrize(
    "param, grad, message",
    [
        (np.zeros(3), np.zeros(4), r"key 'dense0/W#0': grad shape \(4,\) does not match param shape \(3,\)"),
        (np.zeros((2, 3)), np.zeros((3, 2)), "grad shape"),
        (np.zeros(3, np.float32), np.zeros(3), "'dense0/W#0': grad dtype float64 does not match param dtype float32"),
        (np.zeros(3, int), np.zeros(3, int), "not floating point"),
        ([0.0, 0.0], np.zeros(2), "param must be a NumPy or CuPy array"),
        (np.zeros(2), [0.0, 0.0], "grad must be a NumPy or CuPy array"),
    ],
)
def test_bad_update(param, grad, message):
    opt = Adam()
    with pytest.raises(OptimizerError, match=message):
        opt.update("dense0/W#0", param, grad)
    assert opt.keys() == [] and opt.step_count("dense0/W#0") == 0


def test_other_bad_updates():
    opt = Adam()
    frozen = np.zeros(2)
    frozen.flags.writeable = False
    with pytest.raises(OptimizerError, match="key 'w': param is read-only"):
        opt.update("w", frozen, np.zeros(2))
    with pytest.raises(OptimizerError, match="key must be a string"):
        opt.update(3, np.zeros(2), np.zeros(2))
    for scale, message in ((-1.0, "lr_scale must be >= 0"), (float("nan"), "lr_scale must be finite")):
        with pytest.raises(OptimizerError, match=message):
            opt.update("w", np.zeros(2), np.zeros(2), lr_scale=scale)
    opt.update("w", np.zeros(2), np.ones(2))
    with pytest.raises(OptimizerError, match=r"key 'w': param \(3,\) float64 does not match its optimizer state"):
        opt.update("w", np.zeros(3), np.ones(3))
    assert opt.step_count("w") == 1
    with pytest.raises(OptimizerError, match="no state for key 'nope'"):
        opt.state("nope")


@pytest.mark.gpu
def test_numpy_grad_for_cupy_param_is_rejected():
    device = backend.get_device("cuda")
    with pytest.raises(OptimizerError, match="param is a CuPy array but grad is a NumPy array"):
        SGD(0.1).update("w", device.asarray(np.zeros(2)), np.zeros(2))


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("share", [Share(), Share(updates=4, implicit_momentum=0.25)], ids=["whole", "quarter"])
def test_keys_laid_out_in_one_array_are_updated_at_once_to_the_same_bits(name, share):
    """A shard updates its slices (laid out one after the other in one array) in one step: the values, the state
    and the step counts are those of updating each key on its own, and a state restored or made key by key is
    gathered into one array once, without a change."""
    rng = np.random.default_rng(0)
    bounds, keys = ((0, 5), (5, 6), (6, 17)), ("a", "b", "c")
    flat = rng.standard_normal(17).astype(np.float32)
    each, at_once = flat.copy(), flat.copy()
    by_key, fused = build_optimizer(name, 0.05), build_optimizer(name, 0.05)
    for step in range(4):
        grad = rng.standard_normal(17).astype(np.float32)
        for key, (a, b) in zip(keys, bounds):
            by_key.update(key, each[a:b], grad[a:b], 0.5, share)
        if step == 1:  # one update key by key first: its state is gathered when the keys are next updated at once
            for key, (a, b) in zip(keys, bounds):
                fused.update(key, at_once[a:b], grad[a:b], 0.5, share)
        else:
            fused.update_flat(keys, at_once, grad, bounds, 0.5, share)
        np.testing.assert_array_equal(at_once, each)
    for key, value in by_key.state_dict().items():
        np.testing.assert_array_equal(fused.state_dict()[key], value)
    restored = build_optimizer(name, 0.05)
    restored.load_state_dict(fused.state_dict())
    grad = rng.standard_normal(17).astype(np.float32)
    restored.update_flat(keys, at_once, grad, bounds)
    for key, (a, b) in zip(keys, bounds):
        by_key.update(key, each[a:b], grad[a:b])
    np.testing.assert_array_equal(at_once, each)
