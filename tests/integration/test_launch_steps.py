"""psgd.launch says how many steps its workers made: each one's (``worker_steps``, in rank order) and all of them
together (``steps``), in all-reduce mode as in parameter-server mode (docs/howto/python.md's launch_blobs.py)."""

from __future__ import annotations

import json

import pytest

import psgd


@pytest.mark.slow
def test_an_allreduce_launch_says_each_ranks_steps(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = psgd.launch(
        "softmax",
        "digits",
        mode="allreduce",
        workers=2,
        epochs=1,
        run_dir=tmp_path / "run",
        progress=False,
        timeout=240,
    )
    done = [json.loads(line) for line in (tmp_path / "run" / "allreduce.jsonl").read_text().splitlines()][-1]
    assert done["event"] == "done" and done["clock"] > 0
    assert result.worker_steps == (done["clock"], done["clock"])  # ranks in lockstep: rank 0's are each one's
    assert result.steps == 2 * done["clock"]
