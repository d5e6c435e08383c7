"""A killed shard changes nothing under sync with cuts ([cluster] checkpoint_rounds): the job goes back to the cut the
shard restarted from and repeats the rounds it lost, ending with the weights of an undisturbed run, to the bit.

Without cuts a shard SIGKILLed and restarted from its last checkpoint ended 24 rounds behind the other (526
against 550), the model a mix of two versions (test_lost_updates, test_reliability)."""

from __future__ import annotations

import json
import signal

import numpy as np
import pytest
from helpers import make_job, wait_for
from test_reliability import Cluster

K = 10  # rounds between cuts
BASE = (
    "cluster.policy=sync",
    "cluster.workers=2",
    "cluster.shards=2",
    "train.epochs=8",
    "train.dtype=float64",
    "cluster.request_timeout=30",
)
SETS = (*BASE, f"cluster.checkpoint_rounds={K}")
TOTAL = 8 * (1438 // 2 // 32)  # rounds


def run(tmp, kill: bool, sets=SETS, at=lambda step: step >= TOTAL // 3 and step % K in (K // 2, K // 2 + 1)):
    """Train ``sets`` with shard and worker processes; with ``kill``, SIGKILL shard 1 once worker 0's step is ``at``
    (by default half-way between two cuts a third of the way in) and start it again.  Returns (each shard's status,
    the final weights, worker 0's steps)."""
    tmp.mkdir()
    cluster = Cluster(make_job(*sets), tmp)
    try:
        cluster.start_shard(0)
        shard1 = cluster.start_shard(1)
        workers = [cluster.start_worker(r, "--delay", "fixed:0.02") for r in range(2)]  # rounds a kill can land between
        if kill:
            wait_for(lambda: at(len(cluster.steps(0))), 60, "the step to kill shard 1 at")
            shard1.send_signal(signal.SIGKILL)
            shard1.wait(10)
            cluster.start_shard(1, "shard1-restarted.log")
        for r, w in enumerate(workers):
            assert w.wait(120) == 0, (tmp / f"w{r}.log").read_text()[-3000:]
        statuses, weights = cluster.status()
    finally:
        cluster.close()
    return statuses, weights, cluster.steps(0)


@pytest.fixture(scope="module")
def undisturbed(tmp_path_factory):
    """The final weights of the job undisturbed (with cuts every K rounds or every 100, the same sums: each round
    adds its pushes in the order of the workers)."""
    return run(tmp_path_factory.mktemp("rollback") / "undisturbed", kill=False)[1]


@pytest.mark.slow
def test_a_sigkilled_shard_costs_rounds_again_never_the_result(tmp_path, undisturbed):
    total = TOTAL
    statuses, weights, steps = run(tmp_path / "killed", kill=True)
    assert [s.version for s in statuses] == [total, total]  # no round lost on either shard
    counters = [json.loads(s.counters_json) for s in statuses]
    restored = counters[1]["restored_version"]
    assert restored % K == 0 and 0 < restored < total
    assert counters[0]["rollbacks"] == 1 and counters[0]["rounds_undone"] >= 1  # the other shard went back too
    for name, value in undisturbed.items():
        np.testing.assert_array_equal(weights[name], value, err_msg=name)
    went_back = [s for s in steps if s.get("event") == "rewound"]
    assert went_back and all(s["clock"] == restored for s in went_back)
    logs = {name: (tmp_path / "killed" / name).read_text() for name in ("w0.log", "w1.log", "shard0.log")}
    assert "the job went back to version" in logs["w0.log"] + logs["w1.log"]
    assert f"to the cut at version {restored}" in logs["shard0.log"]
    assert "comes back at clock" in (tmp_path / "killed" / "shard1-restarted.log").read_text()


@pytest.mark.slow
def test_sync_with_a_checkpoint_folder_has_cuts_without_being_asked(tmp_path, undisturbed):
    """A sync job with a checkpoint folder but no checkpoint_rounds lost 24 rounds of 550 when a shard was killed,
    and ended with exit 0 and a warning: cuts are the default under sync (every 100 rounds)."""
    statuses, weights, _ = run(tmp_path / "killed", kill=True, sets=BASE, at=lambda step: step >= 120)
    assert [s.version for s in statuses] == [TOTAL, TOTAL]
    assert json.loads(statuses[1].counters_json)["restored_version"] == 100
    for name, value in undisturbed.items():
        np.testing.assert_array_equal(weights[name], value, err_msg=name)
