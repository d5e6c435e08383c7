"""The ``full-disk`` fault: one shard's checkpoint folder on a disk with no room left, for a while.

The folder gets a tmpfs of its own mounted over it (root only), holding a copy of what the folder held and filled
up to the last page; then the tmpfs goes and the folder is as it was.  Meanwhile the shard's checkpoints (a sync
run's cuts) fail: it must say so once, go on serving, and once there is room again say that it writes them again
(a sync run that draws this fault sets ``on_cut_failure = "continue"``; "stop", which ends the job, is
tests/integration/test_cut_failure.py's).  The next fault waits until the shard holds two checkpoints written after
the disk had room again: until then a shard that restarts may find no cut that every shard holds, which "continue"
accepts, saying so.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from psgd.bench.chaos.settings import REQUEST_TIMEOUT

#: what a shard's log says once its checkpoints fail, and once they are written again
#: (psgd.server.durable.recovery.Failures)
FAILED = "the failures that follow are said at most once a minute"
AGAIN = "checkpoints are written again"
PAGE = 4096


@contextlib.contextmanager
def full(folder: Path) -> Iterator[str]:
    """``folder`` full for the body: yields "" once it is, or why it could not be made so (the body then runs on
    the folder as it is)."""
    if os.geteuid() != 0:
        yield "only root can mount a tmpfs"
        return
    held = [p for p in folder.iterdir() if p.is_file()]
    with tempfile.TemporaryDirectory(prefix="psgd-chaos-disk-") as copy:
        for p in held:
            shutil.copy2(p, copy)
        room = sum(-(-p.stat().st_size // PAGE) for p in held) * PAGE + 16 * PAGE
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={room},mode=0755", "psgd-chaos-full", str(folder)],
            capture_output=True,
            text=True,
            timeout=30,
        )
        if done.returncode:
            yield f"cannot mount a tmpfs here: {done.stderr.strip()}"
            return
        try:
            for p in Path(copy).iterdir():
                shutil.copy2(p, folder)
            with contextlib.suppress(OSError), open(folder / "filler", "wb") as filler:
                while True:  # until the disk is full: ENOSPC ends it (a tmpfs of a few pages, so a few writes)
                    filler.write(b"\0" * PAGE)
                    filler.flush()
            yield ""
        finally:
            if subprocess.run(["umount", str(folder)], capture_output=True, timeout=30).returncode:
                subprocess.run(["umount", "-l", str(folder)], capture_output=True, timeout=30)  # a write still open


def inject(run: Any, k: int, seconds: float) -> str:
    """The fault on shard ``k`` of ``run`` (:class:`psgd.bench.chaos.run.Run`) for ``seconds``, and its checks."""
    c = run.cluster
    if run.spec.namespaces:
        return "skipped: the run's processes live in network namespaces of their own"
    folders = list(c.ckpt.glob(f"*/shard-{k}"))
    if len(folders) != 1:
        return f"skipped: shard {k} has {len(folders)} checkpoint folders"
    log = c.procs[f"shard{k}"].log
    start, before = log.stat().st_size, max(c.checkpoints(k), default=-1)
    with full(folders[0]) as why:
        if why:
            return f"skipped: {why}"
        time.sleep(seconds)  # how long the disk stays full is the fault
    deadline = time.monotonic() + REQUEST_TIMEOUT
    while True:  # room again: the shard must say that it writes its checkpoints again; and before the next fault
        # (a kill, a damaged checkpoint) it holds two written since, as every shard does: the guarantee is back
        said = log.read_bytes()[start:].decode(errors="replace")
        failed, again = said.count(FAILED), said.count(AGAIN)
        training = any(c.alive(f"worker{r}") for r in range(run.spec.workers))
        since = [v for v in c.checkpoints(k) if v > before]
        if (again or not failed) and len(since) >= 2 or not training or time.monotonic() > deadline:
            break
        time.sleep(0.1)  # polling the shard's log and folder, with a deadline
    if failed > 1:
        run.violate(
            "full-disk",
            [
                f"shard {k} said {failed} times in {seconds:.1f}s that its checkpoints failed "
                "(once, then at most once a minute)"
            ],
        )
    if failed and not again and training:
        run.violate(
            "full-disk",
            [
                f"shard {k} did not say within {REQUEST_TIMEOUT:.0f}s of the disk having room "
                "again that it writes its checkpoints again"
            ],
        )
    return f"{'failures said once' if failed else 'no checkpoint due while full'}" + (
        ", written again" if again else ""
    )
