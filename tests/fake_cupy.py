"""A stand-in for the parts of CuPy 14 that psgd.compute.backend touches, so device handling is tested without a GPU.

It follows CuPy 14's real behaviour where psgd depends on it: ``cuda.Device(i)`` as a context manager
restores the previous device on exit, ``Device(i).use()`` makes ``i`` current for the calling thread,
and arrays are made on the current device.  ``broken`` makes every kernel launch fail the way CuPy
fails when the CUDA toolkit libraries (NVRTC, cuBLAS) cannot be found.
"""

from __future__ import annotations

import threading
import types

import numpy as np


class FakeCupy(types.SimpleNamespace):
    """``FakeCupy(devices=2)``: a CuPy 14 with ``devices`` GPUs; ``.current()`` is this thread's device."""

    def __init__(self, devices: int = 2, version: str = "14.2.0", broken: str | None = None):
        local = threading.local()
        fake = self

        class Device:
            def __init__(self, index: int = 0):
                self.id = index
                self._previous: list[int] = []

            def use(self) -> None:
                local.current = self.id

            def __enter__(self):
                self._previous.append(fake.current())
                local.current = self.id
                return self

            def __exit__(self, *exc) -> None:
                local.current = self._previous.pop()

        def get_device_count() -> int:
            return devices

        def arange(n, dtype=None):
            if fake.broken:
                raise RuntimeError(fake.broken)
            return np.arange(n, dtype=dtype)

        def get_device_properties(index: int) -> dict:
            if not 0 <= index < devices:
                raise RuntimeError("cudaErrorInvalidDevice: invalid device ordinal")
            return {"name": b"Fake GPU", "totalGlobalMem": 80 * 2**30}

        runtime = types.SimpleNamespace(getDeviceCount=get_device_count, getDeviceProperties=get_device_properties)
        super().__init__(
            __version__=version,
            broken=broken,
            float32=np.float32,
            arange=arange,
            cuda=types.SimpleNamespace(Device=Device, runtime=runtime),
        )
        self._local = local

    def current(self) -> int:
        return getattr(self._local, "current", 0)


def install(monkeypatch, fake: FakeCupy) -> FakeCupy:
    """Make ``fake`` psgd.compute.backend's CuPy for one test, with an empty cache of device checks."""
    from psgd.compute import backend

    monkeypatch.setattr(backend, "_cupy", fake)
    monkeypatch.setattr(backend, "_import_error", None)
    monkeypatch.setattr(backend, "_checked_devices", {}, raising=False)
    return fake
