"""A loop of one's own under ``psgd.join()`` draws its random masks as psgd's own loop does: each step its own
(from the job's seed, the worker and the step), and the same again when the same job runs again.  The worker
joins shards served in this process; the network's dropout is the only thing that changes its loss here."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import make_job, shards

import psgd
from psgd.config import to_toml
from psgd.model.module import step_seed

pytestmark = pytest.mark.usefixtures("keep_signal_handlers")  # psgd.join() takes the stop signals

NETWORK = """
from psgd.model import Dropout, Linear, Network


class Dropped(Network):
    def __init__(self, input_shape, num_classes, dtype="float32"):
        super().__init__(dtype)
        self.hidden = Linear(input_shape[0], 16)
        self.drop = Dropout(0.5)
        self.out = Linear(16, num_classes)

    def forward(self, x):
        return self.out(self.drop(self.hidden(x)))
"""


def own_loop(tmp_path, module: str, steps: int) -> tuple[list[float], list[float], list[float]]:
    """The losses a loop of one's own under psgd.join() got for the same weights and batch at each of its first
    ``steps`` steps, by its first call of each step and by a second, and what ``seed=`` of psgd's own loop's
    derivation gives at those steps, from fresh shards."""
    rng = np.random.default_rng(3)
    y = rng.integers(0, 3, 120)
    np.savez(tmp_path / "data.npz", x=(rng.normal(size=(120, 4)) + np.eye(3, 4)[y]).astype("float32"), y=y)
    job = make_job(
        f"model.name={module}:Dropped",
        f"data.name=npz:{tmp_path / 'data.npz'}",
        "cluster.workers=1",
        "cluster.shards=1",
        "train.seed=5",
        "train.batch_size=8",
    )
    with shards(job) as (job, _):
        (tmp_path / "job.toml").write_text(to_toml(job.to_dict()))
        environ = {"PSGD_JOB_FILE": str(tmp_path / "job.toml"), "PSGD_RANK": "0"}  # (shards served here want no token)
        own, second, derived = [], [], []
        with psgd.join(environ) as w:
            fixed = w.model.init(0)
            x, y = w.batch(0)
            while w.clock < steps:
                w.pull()
                loss, grads = w.model.loss_and_grads(fixed, x, y)  # the masks are all that differ step to step
                own.append(float(loss))
                second.append(float(w.model.loss_and_grads(fixed, x, y)[0]))
                derived.append(float(w.model.loss_and_grads(fixed, x, y, seed=step_seed(5, 0, w.clock))[0]))
                w.push(grads, loss=loss)
        w.stop.set()  # ends its client's stop watcher, which outlives the client (a thread of this process)
    return own, second, derived


def test_each_step_of_ones_own_loop_draws_its_own_masks_and_the_same_run_again_the_same(tmp_path, user_module):
    module = user_module(NETWORK)
    first, second, derived = own_loop(tmp_path, module, 3)
    assert len(set(first)) == 3, first  # no two steps share a mask
    assert first == derived  # the step's masks are the ones psgd's own loop draws for that step
    assert all(a != b for a, b in zip(first, second))  # nor do two training calls of one step
    assert own_loop(tmp_path, module, 3)[:2] == (first, second)  # the same run twice: the same masks
