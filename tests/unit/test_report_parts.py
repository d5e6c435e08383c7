"""``psgd report RUN`` on a run of several parts (stopped, then resumed with ``--resume``): each part's metrics
lines are appended to the same files, and the report counts the steps and the training time of every part."""

from __future__ import annotations

import json
from pathlib import Path

from psgd.ops.report import summarise


def step(clock: int, wall: float) -> dict:
    return {"event": "step", "clock": clock, "loss": 1.0, "wall": wall, "seconds": {"compute": 0.01}}


def done(steps: int | None, seconds: float, clock: int) -> dict:
    return {"event": "done", "clock": clock, "seconds": seconds, **({} if steps is None else {"steps": steps})}


def part(begin: int, end: int, seconds: float | None, counted: bool = True) -> list[dict]:
    """The lines of a part that took steps ``begin`` to ``end``, ending with its done line (``seconds`` None: none,
    the part was killed); ``counted``: the done line says its steps (psgd's own loop), else not (a script's)."""
    ended = [] if seconds is None else [done(end - begin if counted else None, seconds, end)]
    return [step(c, 0.5 * (c - begin + 1)) for c in range(begin, end)] + ended  # its wall: from its start


def run_of(tmp_path: Path, *parts: list[dict]) -> Path:
    with open(tmp_path / "worker-0.jsonl", "w") as f:
        for line in (line for p in parts for line in p):
            f.write(json.dumps(line) + "\n")
    return tmp_path


def said(run: Path) -> str:
    return summarise(run).lines()[1]


def test_a_resumed_run_counts_the_steps_and_seconds_of_every_part(tmp_path):
    run = run_of(tmp_path, part(0, 3, 1.0), part(3, 8, 3.0))
    worker = summarise(run).workers[0]
    assert (worker.steps, worker.seconds, worker.finished) == (8, 4.0, True)
    assert said(run) == "  worker-0: 8 steps in 4.0s over 2 parts (2 steps/s)"


def test_a_resume_with_nothing_left_to_do_keeps_the_runs_count(tmp_path):
    run = run_of(tmp_path, part(0, 3, 1.0), part(3, 8, 3.0), part(8, 8, 0.01))
    assert said(run) == "  worker-0: 8 steps in 4.0s over 3 parts (2 steps/s)"


def test_a_script_whose_done_lines_count_no_steps_is_counted_by_its_step_lines(tmp_path):
    run = run_of(tmp_path, part(0, 3, 1.0, counted=False), part(3, 8, 3.0, counted=False))
    assert said(run) == "  worker-0: 8 steps in 4.0s over 2 parts (2 steps/s)"


def test_a_resumed_part_killed_before_its_end_is_stopped_with_every_step_counted(tmp_path):
    run = run_of(tmp_path, part(0, 3, 1.0), part(3, 5, None))
    assert said(run) == "  worker-0: 5 steps, stopped before its end"


def test_a_part_killed_before_its_end_then_resumed_counts_its_steps_and_the_time_of_its_last(tmp_path):
    """No done line ends the killed part: the resumed part's clock, starting again, says where it began."""
    run = run_of(tmp_path, part(0, 4, None), part(4, 8, 3.0))
    assert said(run) == "  worker-0: 8 steps in 5.0s over 2 parts (2 steps/s)"


def test_a_run_of_no_steps_says_so_without_a_rate(tmp_path):
    run = run_of(tmp_path, part(0, 0, 0.01))
    assert said(run) == "  worker-0: no steps"
