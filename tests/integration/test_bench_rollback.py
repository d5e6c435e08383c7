"""psgd bench rollback: a sync job with cuts, undisturbed and with a shard SIGKILLed, through the benchmark's own
path (processes as a user starts them)."""

from __future__ import annotations

import argparse

import pytest

from psgd.bench import rollback

# shard 0's host has a slow disk: each fsync takes 30 ms more, so shard 1 has written its cut and waits there while
# shard 0 still writes its own, and a kill timed from the step records alone often lands on the cut (nothing lost)
SLOW_DISK = '''
import os, sys, time
if "--shard" in sys.argv and sys.argv[sys.argv.index("--shard") + 1] == "0":
    _fsync = os.fsync
    def fsync(fd):
        time.sleep(0.03)
        return _fsync(fd)
    os.fsync = fsync
'''


@pytest.mark.slow
def test_every_killed_run_goes_back_and_ends_with_the_undisturbed_weights(tmp_path, monkeypatch):
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(SLOW_DISK)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "site"))
    rows = rollback.measure([0, 5], epochs=2, kill_at=0.5, folder=tmp_path, say=lambda line: None, repeats=2)
    plain, cut = rows
    assert "killed_seconds" not in plain and plain["versions"] == [plain["rounds"]] * 2
    assert cut["same_weights"] and cut["killed_versions"] == [[cut["rounds"]] * 2] * 2
    assert sorted(p.name for p in tmp_path.glob("k5-killed-*")) == ["k5-killed-0", "k5-killed-1"]  # no run again
    for run in cut["killed_runs"]:  # each first try went back: shard 1 was killed past its cut, not on it
        assert run["restored_version"] % 5 == 0 and run["rounds_repeated"] > 0 and run["kill_to_next_round_seconds"] > 0
    assert "weights the same" in rollback._line(cut)


def test_bad_arguments_are_refused(capsys):
    for intervals in ([-1], [0, 2]):
        args = argparse.Namespace(intervals=intervals, at=0.4, epochs=2, repeats=1, json=None)
        assert rollback.run_from_args(args) == 2
        assert "intervals must be 0 or at least 3" in capsys.readouterr().out
