"""The proofs with which a call shows that its maker holds the job's token without sending it (psgd.wire.proofs),
checked by the shard (psgd.server.net.tokens): each good once, for one purpose, with one token, at the address it was
made for, for a while; an answer's proof covers what it says."""

from __future__ import annotations

import time

import pytest

from psgd.server.net import tokens
from psgd.server.net.tokens import Here, Proofs
from psgd.wire import proofs as wire_proofs
from psgd.wire.proofs import Prover, answer, answered

HERE = "127.0.0.1:5000"


def _proofs(token: str = "s3cret") -> Proofs:
    return Proofs(token, Here("127.0.0.1"), lambda: 5000)


def test_a_proof_is_good_once_for_its_purpose_and_token():
    proofs, prover = _proofs(), Prover("s3cret", HERE)
    proof = prover.prove("follow")
    assert "s3cret" not in proof
    assert not _proofs().check(Prover("another", HERE).prove("follow"), "follow")
    assert not proofs.check(proof, "/psgd.v1.ParameterServer/Status")  # another purpose
    assert proofs.check(proof, "follow")
    assert not proofs.check(proof, "follow")  # replayed
    assert proofs.check(prover.prove("follow"), "follow")  # a fresh one


JOB = ["127.0.0.1:5000", "192.0.2.7:5000", "192.0.2.8:5002"]  # this process, and two others of its job


@pytest.mark.parametrize("to", ["127.0.0.1:5001", "192.0.2.7:5000", "192.0.2.8:5000", ":5000", "127.0.0.1"])
def test_a_proof_made_for_another_process_of_the_job_is_refused(to):
    """What a stranger heard at another process's address (a dead shard's port taken) is no good here: not at
    another port, nor at the same port of another machine of the job."""
    here = Proofs("s3cret", Here("127.0.0.1", lambda: JOB), lambda: 5000)
    assert not here.check(Prover("s3cret", to).prove("follow"), "follow")


@pytest.mark.parametrize("to", ["192.0.2.1:5000", "gateway.example:5000"])
def test_a_proof_made_for_a_forwarded_address_of_this_port_is_good(to):
    """A shard reached through a published or forwarded port (Docker, a load balancer) is called at an address
    that is neither its machine's nor another process's of the job: the proof names its port, and is good."""
    here = Proofs("s3cret", Here("127.0.0.1", lambda: JOB), lambda: 5000)
    assert here.check(Prover("s3cret", to).prove("follow"), "follow")


@pytest.mark.parametrize("to", ["localhost:5000", "[::1]:5000", "127.0.0.2:5000"])
def test_a_proof_made_for_this_machine_by_another_name_is_good(to):
    here = Proofs("s3cret", Here("0.0.0.0"), lambda: 5000)
    proof = Prover("s3cret", to).prove("follow")
    try:
        local = tokens.Here()._is_local(to.rpartition(":")[0].strip("[]"))
    except OSError:
        local = False
    if not local:
        pytest.skip(f"{to} does not name this machine here")
    assert here.check(proof, "follow")


def test_calls_in_flight_may_arrive_in_any_order_but_each_once():
    proofs, prover = _proofs(), Prover("s3cret", HERE)
    made = [prover.prove("hello") for _ in range(10)]
    for proof in reversed(made):
        assert proofs.check(proof, "hello")
    assert not any(proofs.check(proof, "hello") for proof in made)


def test_a_proof_too_far_behind_its_sessions_newest_is_refused(monkeypatch):
    monkeypatch.setattr(tokens, "WINDOW", 8)
    proofs, prover = _proofs(), Prover("s3cret", HERE)
    late = prover.prove("hello")
    made = [prover.prove("hello") for _ in range(8)]
    assert proofs.check(made[-1], "hello")
    assert proofs.check(made[0], "hello")  # 7 behind: still told apart
    assert not proofs.check(late, "hello")  # 8 behind: cannot be told from a replay


@pytest.mark.parametrize(
    "bad",
    [
        "",
        "x",
        "1 2 3 4 5",
        "1.2.3",
        "notanumber " + "0" * 32 + " 1 127.0.0.1:5000 00",
        "1 " + "0" * 32 + " 1 127.0.0.1:5000",
        "1 " + "0" * 32 + " 0 127.0.0.1:5000 00",
    ],
)
def test_what_is_not_a_proof_is_refused(bad):
    assert not _proofs().check(bad, "follow")


def test_a_proof_made_long_ago_or_far_ahead_is_refused(monkeypatch):
    made = Prover("s3cret", HERE).prove("follow")
    later = time.time() + wire_proofs.PROOF_SECONDS + 5
    monkeypatch.setattr(tokens.time, "time", lambda: later)
    assert not _proofs().check(made, "follow")
    monkeypatch.setattr(wire_proofs.time, "time", lambda: later)
    ahead = Prover("s3cret", HERE).prove("follow")  # made "later": far ahead of a clock at now
    monkeypatch.undo()
    assert not _proofs().check(ahead, "follow")


def test_a_shard_remembers_a_bounded_number_of_sessions(monkeypatch):
    monkeypatch.setattr(tokens, "MOST_SESSIONS", 3)
    proofs = _proofs()
    assert all(proofs.check(Prover("s3cret", HERE).prove("follow"), "follow") for _ in range(3))
    assert not proofs.check(Prover("s3cret", HERE).prove("follow"), "follow")  # full of sessions within their time
    later = time.time() + wire_proofs.PROOF_SECONDS + 5
    monkeypatch.setattr(tokens.time, "time", lambda: later)
    monkeypatch.setattr(wire_proofs.time, "time", lambda: later)
    assert proofs.check(Prover("s3cret", HERE).prove("follow"), "follow")  # the old ones expired, and are forgotten


def test_without_a_token_nothing_is_proven():
    assert Prover("", HERE).prove("hello") == ""


def test_an_answers_proof_covers_the_challenge_and_what_it_says():
    proof = answer("s3cret", "c" * 32, 0, "primary", 7)
    assert answered("s3cret", "c" * 32, proof, 0, "primary", 7)
    assert not answered("s3cret", "c" * 32, proof, 0, "primary", 8)  # another claim
    assert not answered("s3cret", "d" * 32, proof, 0, "primary", 7)  # an old answer to another question
    assert not answered("another", "c" * 32, proof, 0, "primary", 7)
    assert not answered("s3cret", "c" * 32, "", 0, "primary", 7)
    assert answered("", "c" * 32, "", 0, "primary", 7)  # a job without a token: nothing to prove
