"""psgd bench rollback: a sync job with cuts, undisturbed and with a shard SIGKILLed, through the benchmark's own
path (processes as a user starts them)."""

from __future__ import annotations

import argparse

import pytest

from psgd.bench import rollback


@pytest.mark.slow
def test_a_killed_run_measures_its_cost_and_ends_with_the_undisturbed_weights(tmp_path):
    rows = rollback.measure([0, 5], epochs=3, kill_at=0.5, folder=tmp_path, say=lambda line: None)
    plain, cut = rows
    assert "killed_seconds" not in plain and plain["versions"] == [plain["rounds"]] * 2
    assert cut["same_weights"] and cut["killed_versions"] == [[cut["rounds"]] * 2]
    assert cut["restored_versions"][0] % 5 == 0 and cut["rounds_repeated"] >= 0 and cut["kill_to_next_round_seconds"] > 0
    assert "weights the same" in rollback._line(cut)


def test_bad_arguments_are_refused(capsys):
    args = argparse.Namespace(intervals=[-1], at=0.4, epochs=2, repeats=1, json=None)
    assert rollback.run_from_args(args) == 2
    assert "intervals must be >= 0" in capsys.readouterr().out
