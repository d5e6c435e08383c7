"""The divergence guard: which losses and evaluations make a divergence, that it is told once, and the
advice it gives for each mode and policy."""

from __future__ import annotations

import math

import numpy as np
import pytest

from psgd.config import JobConfig
from psgd.training.divergence import BLOWUP, CHANCE_MARGIN, EVALUATIONS, DivergenceGuard, advice, chance
from psgd.training.loop import Exchange, Exchanged

GUESS = math.log(10)


def guard() -> DivergenceGuard:
    return DivergenceGuard("worker 0", 0.1, 10, "lower it")


@pytest.mark.parametrize("loss", [float("nan"), float("inf")])
def test_a_loss_that_is_not_finite_is_a_divergence_at_once(loss):
    g = guard()
    assert g.step(0, 0, 2.3) is None
    verdict = g.step(1, 0, loss)
    assert verdict is not None and verdict.step == 1 and verdict.why == f"the training loss is {loss}"
    assert verdict.line() == f"worker 0: training diverged at step 1 (epoch 0): the training loss is {loss}; lower it"


def test_a_loss_that_blows_up_is_a_divergence():
    g = guard()
    g.step(0, 0, 2.0)
    assert g.step(1, 0, BLOWUP * GUESS * 0.99) is None  # under ln(10) times ten: not yet
    verdict = g.step(2, 0, BLOWUP * GUESS * 1.01)
    assert verdict is not None and "times its first value (2)" in verdict.why


def test_a_late_worker_starting_from_a_small_loss_is_not_alarmed_by_a_noisy_minibatch():
    """Minibatch losses near 0 vary by more than ten times; a run blows up above a uniform guess's loss."""
    g = guard()
    g.step(40, 3, 0.01)
    for step, loss in enumerate([0.5, 1.2, 2.0, 0.02], start=41):
        assert g.step(step, 3, loss) is None


def test_a_test_loss_above_its_first_value_for_several_evaluations_in_a_row():
    g = guard()
    losses = [1.0, 1.5, 1.2, 0.9, 1.1, 1.3]  # above 1.0 twice, a fall resets, then above it again
    for i, loss in enumerate(losses):
        assert g.evaluation(10 * i, i, loss, 0.5) is None
    verdict = g.evaluation(60, 6, 1.4, 0.5)
    assert EVALUATIONS == 3 and verdict is not None
    assert verdict.why == "the test loss (1.4) has been above its first value (1) for 3 evaluations"


def test_accuracy_at_chance_for_several_evaluations_in_a_row():
    g = guard()
    at_chance = 0.1 + CHANCE_MARGIN
    assert g.evaluation(10, 1, 2.3, at_chance) is None
    assert g.evaluation(20, 2, 2.2, 0.3) is None  # learning: starts again
    assert g.evaluation(30, 3, 2.1, at_chance) is None
    assert g.evaluation(40, 4, 2.0, 0.05) is None
    verdict = g.evaluation(50, 5, 1.9, 0.1)
    assert verdict is not None and verdict.step == 50 and verdict.epoch == 5
    assert "test accuracy (0.100) has stayed at chance (0.100, the commonest class) for 3 evaluations" in verdict.why


def test_a_run_that_trains_is_never_told():
    g = guard()
    rng = np.random.default_rng(0)
    for step in range(1000):
        assert g.step(step, step // 100, 2.3 * math.exp(-step / 200) * rng.uniform(0.2, 3)) is None
        if step % 100 == 99:
            assert (
                g.evaluation(step + 1, step // 100, 2.3 * math.exp(-step / 300), 1 - 0.9 * math.exp(-step / 300))
                is None
            )
    assert g.verdict is None


def test_told_once():
    g = guard()
    first = g.step(3, 0, float("nan"))
    assert first is not None
    assert g.step(4, 0, float("nan")) is None and g.evaluation(5, 0, float("nan"), 0.1) is None
    assert g.verdict is first
    assert first.record() == {
        "by": "worker 0",
        "step": 3,
        "epoch": 0,
        "why": "the training loss is nan",
        "advice": "lower it",
    }


def test_the_final_weights_on_their_own():
    assert guard().final(100, 10, 0.2, 0.95) is None
    assert "final test accuracy (0.110) is at chance" in guard().final(100, 10, 2.3, 0.11).why
    assert guard().final(100, 10, float("nan"), 0.5).why == "the final weights' test loss is nan"


def test_chance_is_the_commonest_class():
    assert chance(np.array([0, 1, 1, 2, 1, 0, 3, 3])) == pytest.approx(3 / 8)
    assert chance(np.array([], dtype=np.int64)) == 0.0


def job(*sets: str) -> JobConfig:
    config = JobConfig()
    config = config.apply_sets(list(sets))
    return config


@pytest.mark.parametrize(
    "mode, sets, words, absent",
    [
        (
            "local",
            ["optimizer.lr=0.5"],
            ["lower the learning rate ([optimizer] lr = 0.5)", "warmup_steps"],
            ["cluster"],
        ),
        ("allreduce", [], ["lower the learning rate", "warmup_steps"], ["cluster"]),
        ("ps", ["cluster.policy=\"sync\""], ["lower the learning rate", "warmup_steps"], ["cluster"]),
        (
            "ps",
            ["cluster.policy=\"async\"", "cluster.async_lr=\"full\"", "cluster.workers=4"],
            ["full learning rate", "4 workers move the weights 4 times as far", "async_lr = \"divided\""],
            [],
        ),
        (
            "ps",
            ["cluster.policy=\"async\""],
            ["staleness_lr = true", "dc_lambda = 0.04", "implicit_momentum = true"],
            ["staleness bound"],
        ),
        (
            "ps",
            ["cluster.policy=\"ssp\"", "cluster.staleness=3", "cluster.dc_lambda=0.1", "optimizer.name=\"adam\""],
            ["staleness_lr = true", "smaller staleness bound (now 3)"],
            ["dc_lambda", "implicit_momentum"],
        ),
    ],
)
def test_the_advice_fits_the_mode_and_policy(mode, sets, words, absent):
    said = advice(job(*sets), mode)
    for w in words:
        assert w in said
    for w in absent:
        assert w not in said


def test_overfitting_is_not_divergence():
    """The test loss rising above its first value while the training loss falls and the accuracy stays near its
    best (MNIST-1D's MLP at its paper's settings: 68%, yet told 'training diverged at step 920') is not a
    divergence; the same rise with the accuracy falling away is."""
    g = guard()
    for step in range(300):
        g.step(step, 0, 2.3 * math.exp(-step / 50))  # the training set learnt by heart
    for i, (loss, acc) in enumerate([(1.0, 0.60), (1.2, 0.66), (1.4, 0.68), (1.7, 0.67), (2.1, 0.66)]):
        assert g.evaluation(300 + 10 * i, i, loss, acc) is None
    assert g.verdict is None
    for i, acc in enumerate([0.55, 0.5, 0.45]):  # now the accuracy falls with it
        verdict = g.evaluation(400 + 10 * i, 9 + i, 2.5 + i, acc)
    assert verdict is not None and "above its first value" in verdict.why


class Worsening(Exchange):
    """A resumed part whose weights drift a little further from ``params`` each step (the test loss creeps up, the
    accuracy stays): a run still training, as far as the first test loss of the whole run goes."""

    def __init__(self, params, resumed_at: int):
        self.params, self.resumed_at, self.rng = params, resumed_at, np.random.default_rng(0)
        self.noise = {name: self.rng.normal(size=v.shape) for name, v in params.items()}

    def begin(self) -> int:
        return self.resumed_at

    def weights(self, step, lookups=None):
        far = 0.005 * (step - self.resumed_at)
        return {name: v + far * self.noise[name] for name, v in self.params.items()}

    def exchange(self, step, grads):
        return Exchanged(step + 1)


def test_a_resumed_run_is_judged_against_the_first_test_loss_of_the_whole_run(tmp_path):
    """The stopped part's metrics lines hold the run's first test loss; the resumed part's first evaluation is not
    the run's (it was the baseline, and a test loss creeping up from it made a false "training diverged")."""
    from helpers import make_job

    from psgd.job import build_job
    from psgd.training.local import LocalExchange
    from psgd.training.loop import run_loop

    job = build_job(make_job("model.name=softmax", "train.epochs=2", "train.batch_size=64"))
    metrics = str(tmp_path / "local.jsonl")
    stopped = run_loop(job, LocalExchange(job), progress=False, metrics_path=metrics, final_evaluation=False)
    assert stopped.history and stopped.divergence is None
    job.config = job.config.override("train.epochs", 3)
    resumed = run_loop(
        job,
        Worsening(stopped.params, stopped.final_clock),
        progress=False,
        metrics_path=metrics,
        evaluate_every=1,
        final_evaluation=False,
    )
    losses = [e["test_loss"] for e in resumed.history]
    assert losses[-1] > losses[0] and losses[-1] < stopped.history[0]["test_loss"], losses  # creeping, but below
    assert resumed.divergence is None, resumed.divergence


def test_a_resumed_runs_first_values_skip_other_roles_cut_lines_and_what_is_not_a_file(tmp_path):
    from psgd.observe.progress import first_values

    wanted = {"step": "loss", "eval": "test_loss"}
    path = tmp_path / "worker-0.jsonl"
    path.write_text(
        '{"role": "worker:1", "event": "eval", "test_loss": 5.0}\n{"role": "worker:0", "ev\n'
        '[1, 2]\n{"role": "worker:0", "event": "step", "loss": null}\n'
        '{"role": "worker:0", "event": "step", "loss": 2.5}\n'
        '{"role": "worker:0", "event": "eval", "test_loss": 0.9}\n'
        '{"role": "worker:0", "event": "eval", "test_loss": 0.5}\n'
    )
    assert first_values(path, "worker:0", wanted) == {"step": 2.5, "eval": 0.9}
    assert first_values(tmp_path / "none.jsonl", "worker:0", wanted) == {}
    assert first_values(tmp_path, "worker:0", wanted) == {}  # a folder
