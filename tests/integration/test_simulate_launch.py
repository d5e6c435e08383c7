"""The simulator's measurements of a real launch (psgd bench simulate --validate, its calibration): each process's
CPU a step from /proc, the job's steps/s over the window, the watching psgd launch chose, and nothing left
running."""

from __future__ import annotations

import glob

import pytest

from psgd.bench.simulate.calibrate import as_in, in_a_launch
from psgd.bench.simulate.job import Costs, Layout, simulate


@pytest.mark.slow
def test_a_launch_is_measured_as_it_runs_and_stopped_after():
    before = set(glob.glob("/tmp/psgd-sim-launch-*"))
    launch = in_a_launch(64, 1, "sync", workers=2, window=1.0, busy_poll_us=None)
    assert launch["steps_per_s"] > 50
    assert launch["busy_poll_us"] in (0, 1000)  # psgd launch's own choice, read from the run's job.toml
    assert launch["worker-0"] > 0 and launch["worker-1"] > 0 and launch["server-0"] > 0
    assert set(glob.glob("/tmp/psgd-sim-launch-*")) == before  # its run folder is gone
    base = Costs(
        compute=100e-6,
        shard_request=0.0,
        shard_per_byte=0.0,
        joint_request=50e-6,
        joint_per_byte=0.0,
        worker_request=0.0,
        worker_per_byte=0.0,
        wake=0.0,
        cores=2.0,
        worker_joint=50e-6,
    )
    own = as_in(base, launch, Layout(2, 1, "sync", 19_240))
    assert own.compute + own.worker_joint == pytest.approx(launch["worker-0"] + launch["worker-1"])
    assert simulate(own, Layout(2, 1, "sync", 19_240))["steps_per_s"] > 0
