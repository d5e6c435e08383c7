"""The same-host link on a real GPU: host memory registered with the driver (psgd.compute.backend.register_host), and a
GPU
worker pulling from and pushing to a real ``psgd-server`` shard through registered shared memory, straight
between the segments and the device, ending where the same job ends over TCP and in one CPU process.

    PSGD_REQUIRE_GPU=1 python -m pytest -q -p no:cacheprovider tests/gpu/test_shm_registered.py
"""

from __future__ import annotations

import mmap
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import TOKEN, by_hand_env, make_job, shards, wait_for

from psgd.compute import backend
from psgd.config import to_toml
from psgd.job import build_job
from psgd.training.local import train_local
from psgd.wire import segment
from psgd.worker.client import fetch_weights
from psgd.worker.exchange import run_worker


@pytest.fixture
def gpu():
    return backend.use_device("cuda:0")


def _address(buffer) -> tuple[int, int]:
    whole = np.frombuffer(buffer, dtype=np.uint8)
    return whole.ctypes.data, whole.nbytes


@pytest.mark.gpu
def test_registered_host_memory_goes_to_the_device_and_back(gpu):
    n = 1 << 20
    memory = mmap.mmap(-1, n * 4)  # page-aligned, as a segment's mapping is
    host = np.frombuffer(memory, dtype=np.float32)
    host[:] = np.arange(n, dtype=np.float32) * 0.5
    registered = backend.register_host(*_address(memory), gpu)
    assert registered is not None, "the driver refused to register plain anonymous memory (see the INFO line)"
    try:
        assert backend.registered_host_bytes() == n * 4
        dev = gpu.xp.empty(n, dtype=np.float32)
        backend.copy_to_device([(dev, host)], gpu)
        assert float(dev[n - 1]) == (n - 1) * 0.5
        back = np.frombuffer(memory, dtype=np.float32)
        back[:] = 0
        backend.copy_to_host([(dev * 2, back)], gpu)
        np.testing.assert_array_equal(back, np.arange(n, dtype=np.float32))
    finally:
        registered.close()
    assert backend.registered_host_bytes() == 0


@pytest.mark.gpu
def test_a_read_only_mapping_of_a_weights_segment_is_registered_read_only(gpu):
    seg = segment.create("gputest", 0, "weights", 1 << 22, slots=2)
    readonly = mmap.mmap(seg.fd, segment.HEADER + 2 * seg.size, prot=mmap.PROT_READ)  # as a worker maps it
    try:
        np.frombuffer(seg.slot(1), dtype=np.float64)[:] = 3.25
        registered = backend.register_host(*_address(readonly), gpu, read_only=True)
        assert registered is not None, "cudaHostRegisterReadOnly refused (see the INFO line): pulls run unregistered"
        try:
            src = np.frombuffer(readonly, dtype=np.float64, count=seg.size // 8, offset=segment.HEADER + seg.size)
            dev = gpu.xp.empty(src.size, dtype=np.float64)
            backend.copy_to_device([(dev, src)], gpu)
            assert float(dev.min()) == float(dev.max()) == 3.25
            del src
        finally:
            registered.close()
    finally:
        readonly.close()
        seg.close()


def _job(transport: str, overlap: bool):
    return make_job(
        "model.name=mlp",
        "model.hidden=[48]",
        "train.dtype=float64",
        "train.device=cuda:0",
        "train.epochs=1",
        "train.batch_size=32",
        "optimizer.name=sgd",
        "optimizer.lr=0.1",
        "cluster.policy=sync",
        "cluster.workers=1",
        "cluster.shards=1",
        "cluster.slice_bytes=4096",
        f"cluster.transport={transport}",
        f"cluster.overlap={str(overlap).lower()}",
        "cluster.request_timeout=30",
    )


def _server(job_path: Path, port_file: Path, log: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "psgd.cli.server",
            "-c",
            str(job_path),
            "--shard",
            "0",
            "--bind",
            "127.0.0.1:0",
            "--port-file",
            str(port_file),
        ],
        stdout=subprocess.DEVNULL,
        stderr=log.open("w"),
        start_new_session=True,
        env=by_hand_env(),
    )


@pytest.mark.gpu
@pytest.mark.parametrize("overlap", [False, True])
def test_a_gpu_worker_over_registered_shared_memory_ends_where_tcp_and_one_cpu_process_do(gpu, tmp_path, overlap):
    job = _job("shm", overlap)
    job_path = tmp_path / "job.toml"
    job_path.write_text(to_toml(job.to_dict()))
    plan = build_job(job).plan
    shard = _server(job_path, tmp_path / "port", tmp_path / "shard.log")
    held: list[int] = []
    try:

        def address() -> str:
            assert shard.poll() is None, (tmp_path / "shard.log").read_text()
            return (tmp_path / "port").exists() and (tmp_path / "port").read_text().strip()

        servers = [wait_for(address, 60, "the shard's port file")]
        result = run_worker(
            job,
            0,
            servers,
            progress=False,
            token=TOKEN,
            on_step=lambda point: held.append(backend.registered_host_bytes()),
        )
        over_shm = fetch_weights(servers, plan, token=TOKEN)
    finally:
        os.killpg(shard.pid, signal.SIGKILL)
        shard.wait(30)
    assert result.steps >= 3 and len(held) == result.steps
    # the weights segment (two slots and a header) and the push segment (one), registered while the worker ran
    assert min(held) == (segment.HEADER + 2 * plan.total_bytes) + (segment.HEADER + plan.total_bytes), held
    assert backend.registered_host_bytes() == 0  # unregistered with the connections

    tcp = _job("tcp", overlap)
    with shards(tcp) as (tcp, _):
        run_worker(tcp, 0, tcp.cluster.servers, progress=False)
        over_tcp = fetch_weights(tcp.cluster.servers, plan)
    one = job.override("train.device", "cpu")
    reference = train_local(one, progress=False).params
    for name, ref in reference.items():
        assert over_shm[name].dtype == np.float64
        for got in (over_shm[name], over_tcp[name]):
            rel = np.linalg.norm(got - ref) / np.linalg.norm(ref)
            assert rel <= 1e-5, f"{name}: relative error {rel:.2e}"
        np.testing.assert_allclose(over_shm[name], over_tcp[name], rtol=1e-12, atol=1e-12)
