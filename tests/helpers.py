"""Helpers for tests that run shards in this process (real gRPC on 127.0.0.1); import as `helpers`."""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import NoReturn

import numpy as np
import pytest

from psgd.bench.chaos.processes import free_port_pair  # noqa: F401  (re-exported: the one port-pair finder)
from psgd.collective import Collective, CollectiveError
from psgd.config import JobConfig
from psgd.job import describe_job
from psgd.server import build_shard
from psgd.server.net.service import ShardServer

#: The job's token, as a user's shell holds it for the processes of a job they start by hand (psgd-server refuses
#: to start without one): the same for every process a test starts.
TOKEN = secrets.token_urlsafe(16)


def by_hand_env(**extra: str) -> dict[str, str]:
    """The environment of a process a user starts by hand: theirs, with the job's token (and ``extra``)."""
    return {**os.environ, "PSGD_TOKEN": TOKEN, **extra}


def make_job(*sets: str) -> JobConfig:
    return JobConfig().apply_sets(sets)


@contextlib.contextmanager
def shards(job: JobConfig) -> Iterator[tuple[JobConfig, list[ShardServer]]]:
    """Every shard of ``job`` served on 127.0.0.1 (free ports); yields the job with its ``cluster.servers`` filled
    in, and the shards."""
    servers = []
    try:
        for k in range(job.cluster.shards):
            servers.append(
                ShardServer(
                    build_shard(describe_job(job), k), "127.0.0.1:0", transport=job.cluster.links.transport
                ).start()
            )
        yield job.override("cluster.servers", [s.address for s in servers]), servers
    finally:
        for s in servers:
            s.stop(grace=1.0)


def run_threads(targets, timeout: float) -> list:
    """Run callables in threads; return their results, re-raising the first error; bounded by ``timeout``."""
    results, errors = [None] * len(targets), []

    def wrap(i, fn):
        try:
            results[i] = fn()
        except BaseException as exc:  # reported to the test below
            errors.append(exc)

    threads = [threading.Thread(target=wrap, args=(i, fn), daemon=True) for i, fn in enumerate(targets)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    if any(t.is_alive() for t in threads):
        pytest.fail(f"threads still running after {timeout}s")
    if errors:
        raise errors[0]
    return results


def net_required() -> bool:
    """``PSGD_REQUIRE_NET=1``: this machine must run every test (network namespaces, tc, a tmpfs, openssl,
    /proc, MPI...), so a test that cannot run here fails instead of skipping."""
    return os.environ.get("PSGD_REQUIRE_NET", "") not in ("", "0")


def skip_or_fail(why: str) -> NoReturn:
    """Skip a test that this machine cannot run, saying ``why``; under ``PSGD_REQUIRE_NET=1`` fail it instead:
    a CI machine that silently skips what it was set up to run proves nothing.  Tests marked
    ``lacks(condition, reason=...)`` come here through conftest when the condition holds."""
    if net_required():
        pytest.fail(f"PSGD_REQUIRE_NET=1 but {why}", pytrace=False)
    pytest.skip(why)


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on ``host`` just now (for a process that must be told its port before it binds)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def wait_for(predicate, timeout: float, what: str):
    """Poll ``predicate`` until it returns something true (returned), failing the test after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)  # polling with a deadline
    pytest.fail(f"timed out after {timeout}s waiting for {what}")


_IDX_CODES = {
    np.dtype("u1"): 0x08,
    np.dtype("i1"): 0x09,
    np.dtype("i2"): 0x0B,
    np.dtype("i4"): 0x0C,
    np.dtype("f4"): 0x0D,
    np.dtype("f8"): 0x0E,
}


def idx_bytes(arr: np.ndarray) -> bytes:
    """The IDX encoding of ``arr``, written independently of the reader."""
    code = _IDX_CODES[arr.dtype.newbyteorder("=")]
    header = struct.pack(">BBBB", 0, 0, code, arr.ndim) + struct.pack(f">{arr.ndim}I", *arr.shape)
    return header + arr.astype(arr.dtype.newbyteorder(">")).tobytes()


class Mirror(Collective):
    """A stand-in group of ``world`` identical ranks: a sum multiplies by the world size.  ``sizes`` lists
    the size of every all-reduce in order; with ``fail_on`` the n-th one (from 1) fails as a dead rank would."""

    backend = "mirror"

    def __init__(self, world: int, rank: int = 0, fail_on: int | None = None):
        self.rank, self.world_size, self.fail_on = rank, world, fail_on
        self.sizes: list[int] = []

    @property
    def calls(self) -> int:
        return len(self.sizes)

    def allreduce_(self, array, op="sum"):
        self.sizes.append(array.size)
        if self.fail_on is not None and self.calls == self.fail_on:
            raise CollectiveError("rank 1 died")
        if op == "sum":
            array *= self.world_size
        return array

    def broadcast_(self, array, root=0):
        return array

    def barrier(self):
        pass


def slice_weights(core) -> Iterator[tuple]:
    """Each slice a shard core holds, with its weights (a view of the live store)."""
    for i, w in core.weights.items():
        yield core.slices[i], w


def refused_at_a_fifo(fifo, call, error: type) -> BaseException:
    """The ``error`` that ``call()`` raised, run in a thread, meeting the FIFO ``fifo``; the test fails where the call
    waited on the FIFO instead (its other end is then opened, so that the thread ends)."""
    said: list[BaseException] = []
    thread = threading.Thread(target=lambda: said.append(pytest.raises(error, call).value), daemon=True)
    thread.start()
    thread.join(10)
    if thread.is_alive():
        for other in (os.O_RDONLY, os.O_WRONLY):
            with contextlib.suppress(OSError):
                os.close(os.open(fifo, other | os.O_NONBLOCK))
        thread.join(10)
        pytest.fail(f"{fifo}: the call opened the FIFO and waited on it")
    return said[0]


def assert_rejoined_at_once(run: Path, err: str) -> None:
    """The resumed launch's workers took the ranks their shards kept for the stopped ones at once: no refusal for
    "a second psgd-worker", and each registered within 3 s of the shard's restart by its log lines' seconds,
    its process's start included (they waited out a 10 s lease)."""
    logs = err + "".join(p.read_text() for p in sorted(run.glob("worker-*.log")))
    assert "ALREADY_EXISTS" not in logs and "WARNING register" not in logs, logs[-3000:]
    shard = (run / "shard-0.log").read_text()
    restored = re.findall(r"^(\d\d):(\d\d):(\d\d) .*restored version", shard, re.M)[-1]
    joined = re.findall(r"^(\d\d):(\d\d):(\d\d) .*worker \d registered", shard, re.M)[-2:]
    seconds = [(int(h) * 60 + int(m)) * 60 + int(s) for h, m, s in (restored, *joined)]
    assert all(0 <= t - seconds[0] <= 3 for t in seconds[1:]), (restored, joined)


def openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_ca(folder: Path, name: str) -> None:
    """A self-signed CA ``name`` (``name.pem``, ``name.key``) in ``folder``, as a user makes one with openssl."""
    openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "2",
        "-subj",
        f"/CN={name}",
        "-keyout",
        f"{name}.key",
        "-out",
        f"{name}.pem",
        cwd=folder,
    )


def make_cert(folder: Path, name: str, ca: str, san: str) -> None:
    """A certificate ``name`` (``name.pem``, ``name.key``) for ``san`` (subjectAltName), signed by the CA ``ca``."""
    openssl(
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-subj",
        f"/CN={name}",
        "-keyout",
        f"{name}.key",
        "-out",
        f"{name}.csr",
        cwd=folder,
    )
    (folder / f"{name}.ext").write_text(f"subjectAltName={san}\n")
    openssl(
        "x509",
        "-req",
        "-in",
        f"{name}.csr",
        "-CA",
        f"{ca}.pem",
        "-CAkey",
        f"{ca}.key",
        "-CAcreateserial",
        "-days",
        "2",
        "-extfile",
        f"{name}.ext",
        "-out",
        f"{name}.pem",
        cwd=folder,
    )
