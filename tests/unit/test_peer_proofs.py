"""The proofs with which a shard pair's processes show each other that they hold the job's token without sending it
(psgd.server.tokens): each good once, for one purpose, with one token, for a while; an answer's proof covers what it
says."""

from __future__ import annotations

import time

import pytest

from psgd.server import tokens
from psgd.server.tokens import Proofs, answer, answered, prove


def test_a_proof_is_good_once_for_its_purpose_and_token():
    proofs = Proofs("s3cret")
    proof = prove("s3cret", "follow")
    assert "s3cret" not in proof
    assert not Proofs("s3cret").check(prove("another", "follow"), "follow")
    assert not proofs.check(proof, "/psgd.v1.ParameterServer/Status")  # another purpose
    assert proofs.check(proof, "follow")
    assert not proofs.check(proof, "follow")  # replayed
    assert proofs.check(prove("s3cret", "follow"), "follow")  # a fresh one


@pytest.mark.parametrize("bad", ["", "x", "1.2.3", "..", "notanumber." + "0" * 32 + "." + "0" * 64])
def test_what_is_not_a_proof_is_refused(bad):
    assert not Proofs("s3cret").check(bad, "follow")


def test_a_proof_made_long_ago_or_far_ahead_is_refused(monkeypatch):
    made = prove("s3cret", "follow")
    later = time.time() + tokens.PROOF_SECONDS + 5
    monkeypatch.setattr(tokens.time, "time", lambda: later)
    assert not Proofs("s3cret").check(made, "follow")
    ahead = prove("s3cret", "follow")  # made "later": far ahead of a clock at now
    monkeypatch.undo()
    assert not Proofs("s3cret").check(ahead, "follow")


def test_an_answers_proof_covers_the_challenge_and_what_it_says():
    proof = answer("s3cret", "c" * 32, 0, "primary", 7)
    assert answered("s3cret", "c" * 32, proof, 0, "primary", 7)
    assert not answered("s3cret", "c" * 32, proof, 0, "primary", 8)  # another claim
    assert not answered("s3cret", "d" * 32, proof, 0, "primary", 7)  # an old answer to another question
    assert not answered("another", "c" * 32, proof, 0, "primary", 7)
    assert not answered("s3cret", "c" * 32, "", 0, "primary", 7)
    assert answered("", "c" * 32, "", 0, "primary", 7)  # a job without a token: nothing to prove


def test_a_shard_remembers_a_bounded_number_of_proofs(monkeypatch):
    monkeypatch.setattr(tokens, "MOST_REMEMBERED", 3)
    proofs = Proofs("s3cret")
    assert all(proofs.check(prove("s3cret", "follow"), "follow") for _ in range(3))
    assert not proofs.check(prove("s3cret", "follow"), "follow")  # full of proofs still within their time
