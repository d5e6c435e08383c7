"""A benchmark's side in a long-lived process of its own, asked to time chunks of steps in turn with another: it
says what it built in one JSON line, then answers each line it is sent with one line (the seconds a chunk took).
``benchmarks/autodiff_step.py`` (two versions of psgd) and ``benchmarks/torch_step.py`` (psgd and PyTorch) take
turns through it."""

from __future__ import annotations

import json
import select
import subprocess
import tempfile
from collections.abc import Mapping, Sequence

#: the longest a side may take to answer (a chunk of steps, or building what it times)
ANSWER_S = 300


class Side:
    """The process ``argv`` (in ``cwd``, with ``env``), answering within ``ANSWER_S`` or failing with what it wrote
    on stderr; ``facts``: what it said of ``what`` it times, once built."""

    def __init__(self, label: str, argv: Sequence[str], env: Mapping[str, str], cwd: str, what: str = "its model"):
        self.label = label
        self.errors = tempfile.TemporaryFile(mode="w+")  # what it says on stderr, read back where it fails
        self.proc = subprocess.Popen(
            list(argv),
            env=dict(env),
            cwd=cwd,
            text=True,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.errors,
        )
        self.facts = json.loads(self._answer(f"{what} built"))

    def _answer(self, what: str) -> str:
        ready, _, _ = select.select([self.proc.stdout], [], [], ANSWER_S)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            self.proc.kill()
            self.proc.wait(timeout=ANSWER_S)
            self.errors.seek(0)
            raise RuntimeError(
                f"the {self.label} process gave no answer ({what}) within {ANSWER_S} s: {self.errors.read()[-2000:]}"
            )
        return line

    def seconds(self, asked: str, what: str) -> float:
        """The seconds the chunk ``asked`` (one line) took, as the side answers."""
        self.proc.stdin.write(f"{asked}\n")
        self.proc.stdin.flush()
        return float(self._answer(what))

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=ANSWER_S)
        self.errors.close()
