"""A GPU worker's same-host link without a GPU: host memory registration (psgd.compute.backend.register_host) and the
shm
link's copies straight between device arrays and the segments, against a fake CuPy whose device arrays are NumPy
arrays of their own type (tests/fake_cupy.py, with what these copies use added here).  The real thing is
tests/gpu/test_shm_registered.py."""

from __future__ import annotations

import logging
import types

import fake_cupy
import numpy as np
import pytest
from helpers import make_job, shards

from psgd.compute import backend
from psgd.config import Deadlines, Links
from psgd.job import build_job
from psgd.wire import segment
from psgd.worker.client import PSClient

pytestmark = pytest.mark.lacks(not segment.host_id(), reason="this machine's /proc does not say who shares memory")

GPU = backend.Device("cuda", 0)
LR = 0.1


class DeviceArray(np.ndarray):
    """A fake CuPy array: CuPy's ``set`` and ``get(out=...)``, which the shm link copies with."""

    def set(self, arr, stream=None):
        assert isinstance(arr, np.ndarray) and not isinstance(arr, DeviceArray) and arr.shape == self.shape
        self.view(np.ndarray)[...] = arr

    def get(self, stream=None, out=None, blocking=True):
        assert isinstance(out, np.ndarray) and out.flags.writeable and out.shape == self.shape
        np.copyto(out, self.view(np.ndarray))
        return out


@pytest.fixture
def gpu(monkeypatch):
    """A fake CuPy with one GPU; ``.calls`` lists its hostRegister and hostUnregister calls, ``.refuse`` makes the
    next registrations fail as a driver does."""
    fake = fake_cupy.FakeCupy(devices=1)
    fake.calls, fake.refuse = [], None

    def host_register(address, nbytes, flags):
        if fake.refuse:
            raise RuntimeError(fake.refuse)
        fake.calls.append(("register", address, nbytes, flags))

    fake.cuda.runtime.hostRegister = host_register
    fake.cuda.runtime.hostUnregister = lambda address: fake.calls.append(("unregister", address))
    fake.cuda.get_current_stream = lambda: types.SimpleNamespace(synchronize=lambda: None)
    fake.ndarray = DeviceArray
    fake.get_array_module = lambda *arrays: fake if any(isinstance(a, DeviceArray) for a in arrays) else np
    fake.ascontiguousarray = lambda a: np.ascontiguousarray(a).view(DeviceArray)
    monkeypatch.setattr(backend, "_registered", {})
    monkeypatch.setattr(backend, "_refusal_said", "")
    return fake_cupy.install(monkeypatch, fake)


def test_on_a_cpu_nothing_is_registered():
    buf = np.zeros(4096, np.uint8)
    assert backend.register_host(buf.ctypes.data, buf.nbytes, backend.CPU) is None
    assert backend.registered_host_bytes() == 0


def test_a_registration_is_undone_once_and_a_refusal_is_said_once(gpu, caplog):
    buf = np.zeros(8192, np.uint8)
    done = backend.register_host(buf.ctypes.data, 4096, GPU, read_only=True)
    assert gpu.calls == [("register", buf.ctypes.data, 4096, backend.HOST_REGISTER_READ_ONLY)]
    assert backend.registered_host_bytes() == 4096
    done.close()
    done.close()
    assert gpu.calls[1:] == [("unregister", buf.ctypes.data)] and backend.registered_host_bytes() == 0
    gpu.refuse = "cudaErrorNotSupported: operation not supported"
    with caplog.at_level(logging.INFO, logger="psgd.compute.backend"):
        assert backend.register_host(buf.ctypes.data, 4096, GPU) is None
        assert backend.register_host(buf.ctypes.data, 4096, GPU) is None
    said = [r for r in caplog.records if "could not be registered" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.INFO and "not supported" in said[0].getMessage()


@pytest.mark.parametrize("refused", [False, True])
def test_a_gpu_worker_pulls_into_and_pushes_from_device_arrays_through_registered_segments(gpu, refused):
    job = make_job(
        "model.name=softmax",
        "train.dtype=float64",
        "optimizer.name=sgd",
        f"optimizer.lr={LR}",
        "cluster.policy=async",
        "cluster.workers=1",
        "cluster.shards=2",
        "cluster.slice_bytes=2048",
        "cluster.transport=shm",
    )
    gpu.refuse = "cudaErrorHostMemoryAlreadyRegistered" if refused else None
    plan = build_job(job).plan
    with shards(job) as (job, _):
        client = PSClient(
            job.cluster.servers,
            plan,
            0,
            deadlines=Deadlines(request_timeout=10),
            links=Links(transport="shm"),
            config=job,
            device=GPU,
        )
        with client:
            clock = client.register()
            host = {s.name: np.zeros(s.shape, s.dtype) for s in plan.specs}
            client.pull(clock, host)  # over the segments, into host arrays: the reference
            assert all(link.direct for link in client.links)
            on_device = {s.name: np.full(s.shape, np.nan, s.dtype).view(DeviceArray) for s in plan.specs}
            staging = {s.name: np.zeros(s.shape, s.dtype) for s in plan.specs}
            client.pull(clock, staging, device=on_device)
            for s in plan.specs:
                np.testing.assert_array_equal(on_device[s.name], host[s.name])
                assert not staging[s.name].any()  # straight to the device: nothing staged on the host
            grads = {
                s.name: np.arange(s.size, dtype=s.dtype).reshape(s.shape).view(DeviceArray) / 1000 for s in plan.specs
            }
            client.push(clock, grads)
            after = {s.name: np.zeros(s.shape, s.dtype) for s in plan.specs}
            client.pull(clock + 1, after)
            for s in plan.specs:
                np.testing.assert_allclose(after[s.name], host[s.name] - LR * np.asarray(grads[s.name]), rtol=1e-12)
            registered = [c for c in gpu.calls if c[0] == "register"]
            # each shard's weights (read-only) and push segment, mapped once each: registered, or refused
            assert sorted(c[3] for c in registered) == ([] if refused else [0, 0, 8, 8])
            assert backend.registered_host_bytes() == sum(c[2] for c in registered)
        assert backend.registered_host_bytes() == 0  # closed with the connections
        assert sorted(c[1] for c in gpu.calls if c[0] == "unregister") == sorted(c[1] for c in registered)
