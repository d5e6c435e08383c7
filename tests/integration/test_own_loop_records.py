"""A loop of one's own under ``psgd.join()`` keeps the records a worker of ``psgd launch`` keeps: its evaluations
in the metrics lines (before the first step of each epoch, and of the weights its last step left), in TensorBoard's
event files (read back with TensorBoard's own reader) and in ``psgd report``.  The worker joins shards served in
this process."""

from __future__ import annotations

import json
import signal

import pytest
from helpers import make_job, shards

import psgd
from psgd.config import to_toml
from psgd.ops.report import summarise

pytestmark = pytest.mark.usefixtures("keep_signal_handlers")  # psgd.join() takes the stop signals


def test_a_loop_of_ones_own_records_its_evaluations_as_a_launched_worker_does(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    job = make_job(
        "model.name=softmax", "cluster.workers=1", "cluster.shards=1", "train.epochs=2", "train.batch_size=64"
    )
    run = tmp_path / "run"
    run.mkdir()
    with shards(job) as (job, _):
        (run / "job.toml").write_text(to_toml(job.to_dict()))
        environ = {
            "PSGD_JOB_FILE": str(run / "job.toml"),
            "PSGD_RANK": "0",
            "PSGD_METRICS": str(run / "worker-0.jsonl"),
        }
        with psgd.join(environ) as w:
            while w.clock < w.steps:
                params = w.pull()
                x, y = w.batch()
                loss, grads = w.model.loss_and_grads(params, x, y)
                w.push(grads, loss=loss)
            steps, per_epoch = w.steps, w.steps // 2
        w.stop.set()  # ends its client's stop watcher, which outlives the client (a thread of this process)
    records = [json.loads(line) for line in (run / "worker-0.jsonl").read_text().splitlines()]
    evals = [r for r in records if r["event"] == "eval"]
    assert [e["step"] for e in evals] == [per_epoch, steps]  # each epoch's start but the first, and the end
    assert all(0.5 < e["test_accuracy"] <= 1.0 and e["test_loss"] > 0 for e in evals), evals
    done = records[-1]
    assert done["event"] == "done" and done["test_accuracy"] == evals[-1]["test_accuracy"]
    board = EventAccumulator(str(run / "tensorboard" / "worker-0"))
    board.Reload()
    assert [(a.step, round(a.value, 6)) for a in board.Scalars("eval/test_accuracy")] == [
        (e["step"], round(e["test_accuracy"], 6)) for e in evals
    ]
    assert summarise(run).workers[0].accuracy == evals[-1]["test_accuracy"]


def test_a_resumed_loop_of_ones_own_judges_its_test_loss_against_the_runs_first(tmp_path, monkeypatch):
    """psgd run --resume: the worker starts at the clock its shards hold, and its divergence guard takes the run's
    first test loss from the stopped part's metrics lines, not its own first evaluation after the resume."""
    from psgd.worker.exchange import ParameterServerExchange

    job = make_job("model.name=softmax", "cluster.workers=1", "cluster.shards=1", "train.epochs=2")
    run = tmp_path / "run"
    run.mkdir()
    earlier = [
        {"time": 1.0, "role": "worker:0", "event": "step", "clock": 0, "loss": 2.3},
        {"time": 2.0, "role": "worker:0", "event": "eval", "step": 22, "test_loss": 0.9, "test_accuracy": 0.8},
    ]
    (run / "worker-0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in earlier))
    monkeypatch.setattr(ParameterServerExchange, "begin", lambda self: 30)  # where the stopped part left it
    with shards(job) as (job, _):
        (run / "job.toml").write_text(to_toml(job.to_dict()))
        environ = {
            "PSGD_JOB_FILE": str(run / "job.toml"),
            "PSGD_RANK": "0",
            "PSGD_METRICS": str(run / "worker-0.jsonl"),
        }
        with psgd.join(environ) as w:
            assert w.clock == 30
            said = [w._guard.evaluation(44 + i, 2, loss, 0.95) for i, loss in enumerate([0.30, 0.31, 0.32, 0.33])]
            w.stop.signalled(signal.SIGINT)  # paused: the shards are not told it left
        w.stop.set()
    assert said == [None] * 4  # under 0.9, the run's first: training (was "diverged" against 0.30)
