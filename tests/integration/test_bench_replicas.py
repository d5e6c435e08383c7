"""psgd bench replicas: steps/s with and without a replica of every shard, and a primary SIGKILLed, through the
benchmark's own path (psgd launch, and processes as a user starts them)."""

from __future__ import annotations

import argparse

import pytest

from psgd.bench import replicas


def test_a_round_measures_both_kinds_and_a_kill_loses_no_push(tmp_path):
    (row,) = replicas.throughput(["loopback"], hidden=32, epochs=2, repeats=1, folder=tmp_path, say=lambda line: None)
    assert row["without"] > 0 and row["with"] > 0 and row["ratio"] == pytest.approx(row["with"] / row["without"])
    assert row["runs"][1][0]["failed_over"] == {} and len(set(row["runs"][1][0]["versions"])) == 1
    kill = replicas.failover(tmp_path / "failover", epochs=2, at=0.3)
    assert kill["lost"] == 0 and kill["final_version"] == kill["pushes"] and kill["failovers"] == 1
    assert 0 < kill["kill_to_next_push_seconds"] < 2.0  # the bound: a push applied again within 2 s


@pytest.mark.slow
def test_a_silent_follower_at_the_replicas_address_is_cut_off_and_the_job_goes_on(tmp_path):
    alone = replicas.lagging(tmp_path / "none", "none", window=3.0, hidden=32)
    silent = replicas.lagging(tmp_path / "silent", "silent", window=3.0, hidden=32)
    assert alone["cut_off"] == 0 and silent["cut_off"] >= 1  # a line each time
    assert alone["versions_per_second"] > 0 and silent["versions_per_second"] > 0  # the job went on
    assert silent["unreplicated"] > 0


def test_bad_arguments_are_refused(capsys):
    args = argparse.Namespace(
        hidden=0,
        epochs=2,
        repeats=1,
        at=0.3,
        network=["loopback"],
        overlap=False,
        json=None,
        parts=["throughput"],
        window=40.0,
    )
    assert replicas.run_from_args(args) == 2
    assert "must be >= 1" in capsys.readouterr().out
    args = argparse.Namespace(
        hidden=8,
        epochs=2,
        repeats=1,
        at=0.3,
        network=["loopback"],
        overlap=False,
        json=None,
        parts=["fallover"],
        window=40.0,
    )
    assert replicas.run_from_args(args) == 2
    assert "unknown part(s) fallover" in capsys.readouterr().out
