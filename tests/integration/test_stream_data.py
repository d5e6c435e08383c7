"""A dataset larger than the memory a process is given streams from disk and trains (npy:DIR, memory-mapped):
``psgd train`` runs in a memory cgroup whose limit is two thirds of the data, and ends with the accuracy the data
allows; the same limit kills a process that loads the same file whole, so the limit does bind.  Its memory reaches
the limit, and the pages it read are given back as it goes: the training rows are memory-mapped for reading at
random (no read-ahead, which under the limit evicted what it read before use)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from helpers import skip_or_fail

V1, V2 = Path("/sys/fs/cgroup/memory"), Path("/sys/fs/cgroup")
LIMIT = 96 << 20
ROWS, FEATURES, CLASSES = 3072, 16384, 4  # 3072 rows of 64 KiB: 192 MiB of training inputs


def memory_cgroup(name: str, limit: int) -> tuple[Path, Callable[[], bool]]:
    """A memory cgroup of its own with ``limit`` bytes and no swap beyond them; (its folder, whether what ran in
    it reached the limit).  Skipped (failed where required) where this machine gives none."""
    if (V1 / "memory.limit_in_bytes").exists() and os.access(V1, os.W_OK):
        group = V1 / name
        group.mkdir()
        (group / "memory.limit_in_bytes").write_text(str(limit))
        if (group / "memory.memsw.limit_in_bytes").exists():
            (group / "memory.memsw.limit_in_bytes").write_text(str(limit))
        return group, lambda: int((group / "memory.max_usage_in_bytes").read_text()) >= limit
    if "memory" in (V2 / "cgroup.controllers").read_text() if (V2 / "cgroup.controllers").exists() else False:
        group = V2 / name
        group.mkdir()
        (group / "memory.max").write_text(str(limit))
        (group / "memory.swap.max").write_text("0")
        return group, lambda: int(re.search(r"^max (\d+)", (group / "memory.events").read_text(), re.M)[1]) > 0
    skip_or_fail("needs a memory cgroup it may make (cgroup v1 memory controller or v2 with memory)")


def written(folder: Path) -> None:
    """Four classes, each a pattern of FEATURES values under noise, as npy files, evicted from the page cache."""
    rng = np.random.default_rng(0)
    patterns = rng.choice([-0.05, 0.05], size=(CLASSES, FEATURES)).astype(np.float32)
    for split, n in (("train", ROWS), ("test", 256)):
        y = rng.integers(0, CLASSES, n)
        np.save(folder / f"y_{split}.npy", y)
        x = np.lib.format.open_memmap(folder / f"x_{split}.npy", mode="w+", dtype=np.float32, shape=(n, FEATURES))
        for start in range(0, n, 512):
            part = y[start : start + 512]
            x[start : start + 512] = rng.standard_normal((len(part), FEATURES), dtype=np.float32) + patterns[part]
        x.flush()
        del x
    for path in folder.iterdir():  # the process under test reads them from disk, charged to its own group
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def in_group(group: Path, argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """``argv`` run inside ``group`` from its first instruction on (its children too)."""
    script = f'echo $$ > "{group}/cgroup.procs" && exec "$@"'
    return subprocess.run(["sh", "-c", script, "sh", *argv], cwd=cwd, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_a_dataset_larger_than_the_memory_given_streams_from_disk_and_trains(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    written(data)
    size = sum(p.stat().st_size for p in data.iterdir())
    assert size > 1.5 * LIMIT
    group, reached = memory_cgroup(f"psgd-test-{os.getpid()}", LIMIT)
    try:
        done = in_group(
            group,
            [
                sys.executable,
                "-m",
                "psgd.cli.main",
                "train",
                "--dataset",
                f"npy:{data}",
                "--set",
                "model.hidden=[16]",
                "--epochs",
                "1",
                "--set",
                "train.eval_batch_size=256",
                "--lr",
                "0.01",
            ],
            tmp_path,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        accuracy = float(re.search(r"final test accuracy: ([\d.]+)", done.stdout).group(1))
        assert accuracy > 0.9, done.stdout  # chance is 0.25
        assert reached()  # its memory reached the limit, and the pages it had read were given back
        eager = in_group(
            group, [sys.executable, "-c", f"import numpy; numpy.load('{data / 'x_train.npy'}').sum()"], tmp_path
        )
        assert eager.returncode != 0  # loaded whole, the same data does not fit: the limit binds
    finally:
        group.rmdir()
