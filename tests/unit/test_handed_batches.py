"""The batches of a job with a range of workers (psgd.data.blocks): over any joins, leaves, crashes and pauses past
a lease, every block of the job is trained once, none twice and none lost; a retried ask gets the same block."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from psgd.data.base import DataError
from psgd.data.blocks import NONE_LEFT, Blocks, HandedBatches, blocks_per_epoch
from psgd.data.sharding import epoch_permutation

EVENTS = st.lists(
    st.tuples(
        st.sampled_from(["step", "step", "step", "join", "leave", "crash", "half", "pause", "resume"]),
        st.integers(0, 7),
    ),
    max_size=300,
)


def drain(blocks: Blocks, clocks: dict[int, int], trained: list[int]) -> None:
    """The workers still there train until no block is left (one that joins where none is); those paused never
    come back (their blocks go once no other is left)."""
    if not clocks:
        clocks[99] = 0
    for _ in range(10_000):  # bounded: a job of at most a few hundred blocks
        taken = {w: blocks.take(w, c) for w, c in clocks.items()}
        if all(b == NONE_LEFT for b in taken.values()):
            return
        for w, b in taken.items():
            if b != NONE_LEFT:
                trained.append(b)
                clocks[w] += 1
    raise AssertionError("the job never ran out of blocks")


@settings(max_examples=200, deadline=None)
@given(total=st.integers(1, 120), events=EVENTS, first=st.integers(1, 4))
def test_every_block_is_trained_once_whoever_joins_leaves_or_crashes(total, events, first):
    blocks = Blocks()
    assert blocks.check_total(total) == ""
    clocks = {w: 0 for w in range(first)}  # the workers training now, at their clocks
    paused: dict[int, tuple[int, int]] = {}  # paused past their lease: their clock, and the block in hand
    trained: list[int] = []
    fresh = first
    for kind, pick in events:
        if kind == "join":
            clocks[fresh], fresh = 0, fresh + 1
            continue
        if kind == "resume" and paused:  # came back: registers again, pushes the step in hand
            w = sorted(paused)[pick % len(paused)]
            if str(w) not in blocks.describe()["lapsed"]:  # too late: no other block was left, its went to others
                continue  # (docs/howto/elastic.md: it would push its last batch a second time; here it stays away)
            clock, block = paused.pop(w)
            blocks.came_back(w)
            if block != NONE_LEFT:
                trained.append(block)
            clocks[w] = clock + 1
            continue
        if not clocks:
            continue
        w = sorted(clocks)[pick % len(clocks)]
        if kind == "step":  # takes the block of its clock, trains it, pushes: next clock
            b = blocks.take(w, clocks[w])
            if b != NONE_LEFT:
                assert blocks.take(w, clocks[w]) == b  # asked again (a retry): the same block
                trained.append(b)
                clocks[w] += 1
        elif kind == "half":  # took a block, stopped before its push, then left (SIGTERM mid-step)
            blocks.take(w, clocks[w])
            blocks.give_back(w, clocks.pop(w))
        elif kind == "pause":  # took a block, then was paused past its lease mid-step
            clock = clocks.pop(w)
            paused[w] = (clock, blocks.take(w, clock))
            blocks.lapsed(w, clock)
        elif kind == "crash":  # died mid-step: its lease runs out, and it never comes back
            blocks.take(w, clocks[w])
            blocks.lapsed(w, clocks.pop(w))
        else:  # left between steps
            blocks.give_back(w, clocks.pop(w))
    for w, (clock, _) in paused.items():  # paused for good: as a crash
        blocks.lapsed(w, clock)
    drain(blocks, clocks, trained)
    assert Counter(trained) == Counter(range(total)), "a block lost or trained twice"
    assert blocks.left() == 0


def test_a_block_is_the_epochs_permutation_cut_in_batches():
    n, batch, seed = 103, 10, 5
    per = blocks_per_epoch(n, batch)
    assert per == 10
    handed = iter([*range(per), per + 3, NONE_LEFT])  # what shard 0 answers, step after step
    asked = []
    batches = HandedBatches(n, batch, seed, epochs=2, fewest=1, ask=lambda c, t: asked.append((c, t)) or next(handed))
    seen = [batches.at(step) for step in range(per)]
    assert all(epoch == 0 for epoch, _ in seen)
    assert (np.concatenate([idx for _, idx in seen]) == epoch_permutation(n, 0, seed)[: per * batch]).all()
    epoch, idx = batches.at(per)
    assert epoch == 1 and (idx == epoch_permutation(n, 1, seed)[30:40]).all()
    assert batches.at(per + 1) is None and batches.ahead(per + 2) is None
    assert asked == [(c, 2 * per) for c in range(per + 2)]  # each step's clock, and the job's batches
    with pytest.raises(DataError, match="does not fit"):
        blocks_per_epoch(5, 10)


def test_a_worker_with_other_data_is_told_why_and_the_state_survives_a_checkpoint():
    blocks = Blocks()
    assert blocks.check_total(50) == "" and "the job's first worker said 50" in blocks.check_total(40)
    for clock in range(3):
        blocks.take(0, clock)
        blocks.take(1, clock)
    blocks.give_back(1, 2)  # worker 1 left before pushing clock 2
    again = Blocks()
    again.load_state_dict(blocks.state_dict({0: 2, 1: 2}))
    assert again.take(0, 2) == blocks.take(0, 2)  # its block for a clock not pushed yet is kept
    assert again.take(2, 0) == blocks.take(2, 0) == 5  # the block given back goes first
    assert again.left() == blocks.left()
    with pytest.raises(DataError, match="malformed"):
        Blocks().load_state_dict({"total": 3})
