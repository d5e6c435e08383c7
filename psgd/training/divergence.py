"""The divergence guard: a run that is not training is told so once, with its likely cause and remedy.

Every process of every mode runs its training loop with a :class:`DivergenceGuard`, which watches what
that process sees: the loss of each of its steps, and the evaluations it makes.  A run has diverged when

- a step's loss or an evaluation's test loss is not finite (the weights have blown up);
- a step's loss is more than :data:`BLOWUP` times this process's first step's loss and than the loss of a
  uniform guess, ln(classes) (a worker that joins late may start from a small loss: minibatch losses that
  small vary by more than that);
- the test loss has been above its first value (a resumed run's: the first of its earlier part,
  :meth:`DivergenceGuard.resumed`) for :data:`EVALUATIONS` evaluations in a row, unless the run is
  overfitting: its training loss has fallen to under half its first value and its test accuracy stays within
  :data:`ACCURACY_FALL` of the best it reached (a model that learns its training set by heart, not one that has
  stopped training);
- the test accuracy has stayed at chance (at most the commonest class's share of the test set, plus
  :data:`CHANCE_MARGIN`) for :data:`EVALUATIONS` evaluations in a row.

The first of these is a :class:`Divergence`: one WARNING line from the process that saw it, naming the
remedies for its mode and policy (:func:`advice`), a ``diverged`` metrics line, and a field of the
loop's result.  ``psgd launch`` reads its processes' verdicts (or judges the final weights itself where
none had one), puts them in ``--json``, and with ``--fail-on-divergence`` exits with status
:data:`EXIT_DIVERGED`.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from typing import Any

import numpy as np

from psgd.compute import backend
from psgd.data.base import SCORE_WORDS

#: evaluations in a row that make a growing loss, or accuracy at chance, a divergence
EVALUATIONS = 3
#: how many times its first step's loss a step's loss may reach before the run counts as blown up
BLOWUP = 10.0
#: how far above the commonest class's share an accuracy still counts as chance
CHANCE_MARGIN = 0.02
#: how far below its best a test accuracy may be and the run still be overfitting, not diverging
ACCURACY_FALL = 0.05
#: the exit status of ``psgd launch --fail-on-divergence`` (and ``psgd train``'s) for a run that diverged
EXIT_DIVERGED = 3


@dataclasses.dataclass(frozen=True)
class Divergence:
    """What the guard saw: who, when, why, and what to try."""

    by: str  # "worker 0", "rank 0", "local", "launcher"
    step: int
    epoch: int
    why: str
    advice: str

    def record(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def line(self) -> str:
        return f"{self.by}: training diverged at step {self.step} (epoch {self.epoch}): {self.why}; {self.advice}"


def chance(labels: np.ndarray, target: str = "classes") -> float:
    """The score of a guess that ignores the inputs: the accuracy of always answering the commonest class of
    ``labels`` (host or device arrays), or the commonest answer of each label; for values, R² 0 (their mean)."""
    if target == "values":
        return 0.0
    labels = backend.to_host(labels)
    if labels.size == 0:
        return 0.0
    if target == "labels":
        yes = (labels > 0.5).mean(axis=0)
        return float(np.maximum(yes, 1 - yes).mean())
    return float(np.bincount(labels.astype(np.int64).ravel()).max() / labels.size)


#: how the guard speaks of each score's chance level
_CHANCE_WORDS = {"accuracy": "the commonest class", "r2": "the targets' mean"}


def advice(config: Any, mode: str) -> str:
    """The likely remedies, for a job (:class:`psgd.config.JobConfig`) run in ``mode`` (local, ps, allreduce)."""
    opt = config.optimizer
    lr = opt.get("lr")
    lower = f"lower the learning rate ([optimizer] lr{f' = {lr:g}' if isinstance(lr, (int, float)) else ''})"
    warm = "or warm it up ([optimizer] schedule with warmup_steps)"
    c = config.cluster
    if mode != "ps" or c.policy not in ("async", "ssp"):
        return f"{lower}, {warm}"
    if c.remedies.async_lr == "full":
        return (
            f"under {c.policy} each push is applied at the full learning rate, so {c.workers} workers move "
            f"the weights {c.workers} times as far per round as sync: set [cluster] async_lr = \"divided\" "
            f"(the default), or {lower}"
        )
    remedies = []
    if not c.remedies.staleness_lr:
        remedies.append("staleness_lr = true")
    if not c.remedies.dc_lambda:
        remedies.append("dc_lambda = 0.04 (delay compensation)")
    if opt.get("name") in ("momentum", "nesterov") and not c.remedies.implicit_momentum:
        remedies.append("implicit_momentum = true")
    tried = f", or try [cluster] {', '.join(remedies)}" if remedies else ""
    smaller = f", or a smaller staleness bound (now {c.consistency.staleness})" if c.policy == "ssp" else ""
    return f"under {c.policy} stale gradients add to the step: {lower}{tried}{smaller}"


class DivergenceGuard:
    """Watches one process's losses and evaluations; :attr:`verdict` is the first divergence it saw."""

    def __init__(self, by: str, chance_accuracy: float, classes: int, advice_text: str, metric: str = "accuracy"):
        self.by, self.chance, self.advice = by, chance_accuracy, advice_text
        self.score_words, self.chance_words = SCORE_WORDS[metric], _CHANCE_WORDS[metric]
        self.guess_loss = math.log(max(classes, 2))  # the cross-entropy of a uniform guess
        self.verdict: Divergence | None = None
        self._lock = threading.Lock()  # a loop may evaluate on a thread beside its steps ([train] eval_beside)
        self._first_loss: float | None = None
        self._first_step_loss: float | None = None
        self._trend: float | None = None  # the training loss, smoothed over steps
        self._best_accuracy = 0.0
        self._growing = self._at_chance = 0

    @classmethod
    def of_job(cls, by: str, dataset: Any, config: Any, mode: str) -> DivergenceGuard:
        """The guard of a process of a job (``mode``: "ps" or "allreduce") that trains on ``dataset``: its chance
        score, classes and metric from the dataset's test split, its advice from the job's ``config``."""
        return cls(
            by, chance(dataset.y_test, dataset.target), dataset.num_classes, advice(config, mode), dataset.metric
        )

    def resumed(self, first_step_loss: float | None, first_test_loss: float | None) -> None:
        """A resumed run's baselines, where its earlier part had them: its first step's loss and its first test loss
        (not the resumed part's first, or a run training fine is judged against where it resumed)."""
        with self._lock:
            if first_step_loss is not None:
                self._first_step_loss = first_step_loss
            if first_test_loss is not None:
                self._first_loss = first_test_loss

    def _found(self, step: int, epoch: int, why: str) -> Divergence | None:
        if self.verdict is not None:
            return None  # told once
        self.verdict = Divergence(self.by, step, epoch, why, self.advice)
        return self.verdict

    def step(self, step: int, epoch: int, loss: float) -> Divergence | None:
        """A step's training loss; returns a new divergence, if this is one."""
        with self._lock:
            return self._step(step, epoch, loss)

    def evaluation(self, step: int, epoch: int, test_loss: float, accuracy: float) -> Divergence | None:
        """An evaluation after ``step`` steps; returns a new divergence, if this makes one."""
        with self._lock:
            return self._evaluation(step, epoch, test_loss, accuracy)

    def _step(self, step: int, epoch: int, loss: float) -> Divergence | None:
        if not math.isfinite(loss):
            return self._found(step, epoch, f"the training loss is {loss}")
        self._trend = loss if self._trend is None else 0.95 * self._trend + 0.05 * loss
        if self._first_step_loss is None:
            self._first_step_loss = loss
        elif loss > BLOWUP * max(self._first_step_loss, self.guess_loss):
            return self._found(
                step,
                epoch,
                f"the training loss ({loss:.4g}) is {loss / self._first_step_loss:.0f} "
                f"times its first value ({self._first_step_loss:.4g})",
            )
        return None

    def _evaluation(self, step: int, epoch: int, test_loss: float, accuracy: float) -> Divergence | None:
        if not math.isfinite(test_loss):
            return self._found(step, epoch, f"the test loss is {test_loss}")
        if self._first_loss is None:
            self._first_loss = test_loss
        self._best_accuracy = max(self._best_accuracy, accuracy)
        self._growing = self._growing + 1 if test_loss > self._first_loss and not self._overfitting(accuracy) else 0
        self._at_chance = self._at_chance + 1 if accuracy <= self.chance + CHANCE_MARGIN else 0
        if self._growing >= EVALUATIONS:
            return self._found(
                step,
                epoch,
                f"the test loss ({test_loss:.4g}) has been above its first value "
                f"({self._first_loss:.4g}) for {self._growing} evaluations",
            )
        if self._at_chance >= EVALUATIONS:
            return self._found(
                step,
                epoch,
                f"the {self.score_words} ({accuracy:.3f}) has stayed at chance "
                f"({self.chance:.3f}, {self.chance_words}) for {self._at_chance} "
                "evaluations",
            )
        return None

    def _overfitting(self, accuracy: float) -> bool:
        """Whether a rising test loss is the training set learnt by heart: the training loss well down, the
        accuracy near its best."""
        return (
            self._trend is not None
            and self._first_step_loss is not None
            and self._trend < 0.5 * self._first_step_loss
            and accuracy >= self._best_accuracy - ACCURACY_FALL
        )

    def final(self, step: int, epoch: int, test_loss: float, accuracy: float) -> Divergence | None:
        """The weights a run ended with, judged on their own (one evaluation, so no trend)."""
        if not math.isfinite(test_loss):
            return self._found(step, epoch, f"the final weights' test loss is {test_loss}")
        if accuracy <= self.chance + CHANCE_MARGIN:
            return self._found(
                step,
                epoch,
                f"the final {self.score_words} ({accuracy:.3f}) is at chance ({self.chance:.3f}, {self.chance_words})",
            )
        return None
