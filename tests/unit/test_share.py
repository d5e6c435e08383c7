"""One meaning of the learning rate under every policy, in the optimizer's state too.

An async or ssp push of N workers is applied at lr / N and counts as one of N updates of a round
(:class:`psgd.optim.Share`): momentum and Adam's moments decay by their round's decay to the power 1/N,
a gradient enters them with weight 1/N, and the schedule and Adam's bias correction count rounds.  Each
rule is checked against its update written out by hand in float64, and against what it is for: N such
updates of one steady gradient move the weights as one sync round of it does.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from psgd.config import Remedies
from psgd.optim import SGD, WHOLE, Adam, Momentum, OptimizerError, Share, StepDecay
from psgd.server.state.remedies import PushRemedies

P0 = np.array([1.0, -2.0])
G = [np.array([0.5, 1.0]), np.array([-1.0, 0.25]), np.array([0.75, -0.5]), np.array([0.25, 0.125])]
LR = 0.1


def run(opt, grads, n: int, share: Share) -> np.ndarray:
    p = P0.copy()
    for g in grads:
        opt.update("w", p, g.copy(), lr_scale=1.0 / n, share=share)
    return p


def test_momentum_one_of_n_updates_written_out():
    n, mu = 4, 0.9
    got = run(Momentum(LR, momentum=mu), G, n, Share(n))
    p, v = P0.copy(), np.zeros(2)
    for g in G:
        v = mu**0.25 * v + (1 - mu**0.25) / (1 - mu) * g
        p = p - LR / 4 * v
    np.testing.assert_allclose(got, p, rtol=1e-13, atol=1e-14)


def test_nesterov_one_of_n_updates_looks_ahead_by_a_rounds_momentum():
    n, mu = 2, 0.81
    got = run(Momentum(LR, momentum=mu, nesterov=True), G, n, Share(n))
    p, v = P0.copy(), np.zeros(2)
    for g in G:
        v = 0.9 * v + (1 - 0.9) / (1 - 0.81) * g  # 0.81 ** (1/2) = 0.9 per update
        p = p - LR / 2 * (g + 0.81 * v)
    np.testing.assert_allclose(got, p, rtol=1e-13, atol=1e-14)


def test_momentum_implicit_momentum_written_out():
    """Four workers: asynchrony carries about 0.75 per update; the optimizer keeps the rest of 0.9 ** 0.25."""
    n, mu = 4, 0.9
    got = run(Momentum(LR, momentum=mu), G, n, Share(n, implicit_momentum=0.75))
    kept = 0.9**0.25 - 0.75
    p, v = P0.copy(), np.zeros(2)
    for g in G:
        v = kept * v + (1 - kept) / (1 - mu) * g
        p = p - LR / 4 * v
    np.testing.assert_allclose(got, p, rtol=1e-13, atol=1e-14)


def test_without_momentum_each_push_takes_its_part_of_a_round():
    opt = Momentum(LR, momentum=0.0)
    np.testing.assert_allclose(run(opt, G, 4, Share(4)), P0 - LR / 4 * sum(G), rtol=1e-13)


def test_implicit_momentum_larger_than_the_optimizers_leaves_none():
    opt = Momentum(LR, momentum=0.5)
    run(opt, G[:2], 2, Share(2, implicit_momentum=0.9))  # 0.5 ** 0.5 - 0.9 < 0: no momentum of its own
    np.testing.assert_allclose(opt.state("w")["v"], G[1] / (1 - 0.5), rtol=1e-13)


@pytest.mark.parametrize("implicit", [0.0, 0.75])
def test_n_updates_of_a_steady_gradient_move_as_one_round(implicit):
    """What the accounting is for: once the state is steady, N pushes of g move the weights as one sync
    round of g does, with momentum 0.9 (a step of lr g / (1 - 0.9) per round), and v is sync's v."""
    n, g = 4, np.array([0.5, -1.0])
    sync, pushes = Momentum(LR, momentum=0.9), Momentum(LR, momentum=0.9)
    p_sync, p_push = P0.copy(), P0.copy()
    for _ in range(400):  # rounds: 0.9 ** 400 leaves nothing of the start
        sync.update("w", p_sync, g.copy())
        before = p_push.copy()
        for _ in range(n):
            pushes.update("w", p_push, g.copy(), lr_scale=1 / n, share=Share(n, implicit))
    np.testing.assert_allclose(p_push - before, -LR * g / (1 - 0.9), rtol=1e-9)
    np.testing.assert_allclose(pushes.state("w")["v"], sync.state("w")["v"], rtol=1e-9)


def test_adam_one_of_n_updates_written_out():
    n, b1, b2, eps = 4, 0.9, 0.999, 1e-8
    got = run(Adam(LR), G, n, Share(n))
    p, m, v = P0.copy(), np.zeros(2), np.zeros(2)
    for k, g in enumerate(G, start=1):
        m = b1**0.25 * m + (1 - b1**0.25) * g
        v = b2**0.25 * v + (1 - b2**0.25) * g * g
        t = k / 4  # rounds
        p = p - LR / 4 * (m / (1 - b1**t)) / (np.sqrt(v / (1 - b2**t)) + eps)
    np.testing.assert_allclose(got, p, rtol=1e-12, atol=1e-14)


def test_adam_bias_correction_divides_by_the_weight_the_moments_gathered():
    """With a steady g the corrected moments are g and g^2 from the first push on, as under sync."""
    n, g = 3, np.array([0.5, -2.0])
    opt = Adam(LR, eps=1e-300)
    p = P0.copy()
    for _ in range(7):
        before = p.copy()
        opt.update("w", p, g.copy(), lr_scale=1 / n, share=Share(n))
        np.testing.assert_allclose(before - p, LR / n * np.sign(g), rtol=1e-12)


def test_the_schedule_counts_rounds():
    """A step decay every 2 rounds of 4 pushes: 8 pushes at lr, then at lr * gamma."""
    opt = SGD(StepDecay(LR, step_size=2, gamma=0.5))
    p, g = np.zeros(1), np.ones(1)
    steps = []
    for _ in range(12):
        before = p.copy()
        opt.update("w", p, g.copy(), lr_scale=1 / 4, share=Share(4))
        steps.append(float(before[0] - p[0]))
    assert steps == pytest.approx([LR / 4] * 8 + [LR / 8] * 4, rel=1e-12)
    assert opt.step_count("w") == 12  # the checkpoint keeps updates, not rounds


def test_rounds_are_counted_exactly_for_any_worker_count():
    """k * (1/49) is not k/49 in floating point (49 * (1/49) < 1): rounds are counted by division."""
    opt = SGD(StepDecay(LR, step_size=1, gamma=0.5))
    p, g = np.zeros(1), np.ones(1)
    for _ in range(49):
        opt.update("w", p, g.copy(), share=Share(49))
    before = p.copy()
    opt.update("w", p, g.copy(), share=Share(49))
    assert before[0] - p[0] == pytest.approx(LR / 2, rel=1e-12)


def test_a_whole_share_is_the_plain_update():
    for make in (lambda: Momentum(LR, momentum=0.9, nesterov=True), lambda: Adam(LR)):
        a, b = make(), make()
        pa, pb = P0.copy(), P0.copy()
        for g in G:
            a.update("w", pa, g.copy())
            b.update("w", pb, g.copy(), share=Share(1))
        np.testing.assert_array_equal(pa, pb)
    assert WHOLE == Share(1, 0.0) and WHOLE.fraction == 1.0


@pytest.mark.parametrize(
    "share", [Share(0), Share(-2), Share(2.5), Share(2, implicit_momentum=1.0), Share(2, implicit_momentum=-0.1)]
)
def test_a_bad_share_is_refused_and_changes_nothing(share):
    opt = Momentum(LR)
    p = P0.copy()
    with pytest.raises(OptimizerError, match="whole number of updates >= 1 and 0 <= implicit_momentum < 1"):
        opt.update("w", p, G[0].copy(), share=share)
    np.testing.assert_array_equal(p, P0)
    assert opt.step_count("w") == 0


@pytest.mark.parametrize(
    "accumulates, async_lr, implicit, want_scale, want",
    [
        (False, "divided", False, 0.25, Share(4)),
        (False, "divided", True, 0.25, Share(4, 0.75)),
        (False, "full", False, 1.0, Share(1)),
        (False, "full", True, 1.0, Share(1, 0.75)),
        (True, "divided", True, 1.0, Share(1)),  # a sync round is one update: nothing to share, no asynchrony
    ],
)
def test_a_shard_counts_a_push_as_its_policy_says(accumulates, async_lr, implicit, want_scale, want):
    flat = np.zeros(3)
    remedies = PushRemedies(
        lambda: 4, accumulates, flat, lambda a: {0: a}, Remedies(async_lr=async_lr, implicit_momentum=implicit)
    )
    assert remedies.scale == want_scale and remedies.share == want
    assert math.isclose(remedies.lr_scale(0), want_scale)
