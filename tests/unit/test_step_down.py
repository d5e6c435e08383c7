"""A process of a pair that steps down says what it held that its peer does not (found by the chaos suite, seed 7
run 22: a network cut split a pair; the primary went on alone, acknowledging a push without a copy, while the
replica took over; the old primary stepped down one update ahead, and the push was lost without a word)."""

from __future__ import annotations

import logging

from test_shard_core import make_core

from psgd.server.durable.replica import Replication


def test_a_primary_that_steps_down_ahead_of_its_peer_says_how_many_updates_are_lost(caplog, monkeypatch):
    core, _ = make_core("async", 1)
    core.version = 419
    pair = Replication(core, "127.0.0.1:1", "127.0.0.1:2", second=False)
    monkeypatch.setattr(pair, "_follow", lambda: None)  # no peer to follow here
    with caplog.at_level(logging.WARNING, logger="psgd.server.durable.replica"):
        pair._step_down(418)
    lost = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(lost) == 1 and "1 update(s) applied here are not at its peer" in lost[0].getMessage()
    assert "are lost" in lost[0].getMessage() and core.role == "replica"
    caplog.clear()
    pair._step_down(419)  # nothing applied here that the peer lacks: only the usual line
    assert not [r for r in caplog.records if r.levelno == logging.ERROR]
