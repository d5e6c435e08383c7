"""The GPU paths against CuPy 14 as it really is, without a GPU: a fake CuPy 14 (tests/fake_cupy.py)
and CuPy-shaped arrays stand in for the device."""

from __future__ import annotations

import tomllib
import types
from pathlib import Path

import fake_cupy
import numpy as np
import pytest
from helpers import Mirror

from psgd.collective.base import Bucketer
from psgd.compute import backend
from psgd.config import JobConfig
from psgd.data import load_dataset
from psgd.job import build_job

REPO = Path(__file__).resolve().parents[2]


class CupyShaped(np.ndarray):
    """A NumPy array whose ``flags`` are CuPy's: c_contiguous, f_contiguous and owndata, no writeable."""

    @property
    def flags(self):
        real = np.ndarray.flags.__get__(self)
        return types.SimpleNamespace(
            c_contiguous=real.c_contiguous, f_contiguous=real.f_contiguous, owndata=real.owndata
        )


def test_bucketer_reduces_a_large_gradient_that_has_cupy_flags():
    shapes = {"big": (64, 64), "small": (3,)}
    bucketer = Bucketer(shapes, np.float32, np, direct_bytes=1024)
    assert set(bucketer.direct) == {"big"}
    big = np.arange(64 * 64, dtype=np.float32).reshape(64, 64).view(CupyShaped)
    strided = np.arange(128 * 64, dtype=np.float32).reshape(128, 64)[::2].view(CupyShaped)
    for grad in (big, strided):
        out = bucketer.allreduce_mean(Mirror(1), {"big": grad, "small": np.ones(3, np.float32)})
        np.testing.assert_array_equal(np.asarray(out["big"]), np.asarray(grad))
        np.testing.assert_array_equal(out["small"], np.ones(3, np.float32))


def job_on(device: str) -> JobConfig:
    return JobConfig.from_dict({"train": {"device": device, "batch_size": 8}, "model": {"name": "mlp", "hidden": [4]}})


def test_the_job_device_is_made_current_before_anything_is_built(monkeypatch):
    fake = fake_cupy.install(monkeypatch, fake_cupy.FakeCupy(devices=2))
    dataset = load_dataset("digits", dtype="float32")
    assert fake.current() == 0
    built = build_job(job_on("cuda:1"), dataset)
    assert str(built.device) == "cuda:1" and fake.current() == 1
    with fake.cuda.Device(0):  # a copy to another device's context comes back to this one
        assert fake.current() == 0
    assert fake.current() == 1


def test_use_device_parses_checks_and_makes_current(monkeypatch):
    fake = fake_cupy.install(monkeypatch, fake_cupy.FakeCupy(devices=2))
    assert backend.use_device("cuda:1") == backend.Device("cuda", 1) and fake.current() == 1
    assert backend.use_device("cpu") == backend.CPU and fake.current() == 1
    with pytest.raises(backend.DeviceError, match="cuda:2 was requested but this machine has 2"):
        backend.use_device("cuda:2")


def test_a_gpu_whose_kernels_cannot_be_built_is_not_available(monkeypatch):
    # CuPy 14's wheel brings neither NVRTC nor cuBLAS: on a host with a driver and no CUDA toolkit
    # it sees the GPU and fails at the first kernel.  psgd must say so when the device is asked for.
    fake_cupy.install(
        monkeypatch,
        fake_cupy.FakeCupy(
            devices=1,
            broken="CuPy failed to load libnvrtc.so.12: OSError: libnvrtc.so.12: cannot open shared object file",
        ),
    )
    assert not backend.cuda_available()
    with pytest.raises(backend.DeviceError) as info:
        backend.get_device("cuda:0")
    text = str(info.value)
    assert "libnvrtc.so.12" in text and "pip install 'cupy-cuda12x[ctk]' nvidia-nccl-cu12" in text
    assert "--device cpu" in text


def test_the_cuda_hint_names_packages_that_exist():
    """The packages of pyproject.toml's cuda12 and cuda13 extras, which the package index has; not psgd[cuda12],
    a name psgd does not have there (it installs from its folder)."""
    import re
    import tomllib
    from pathlib import Path

    extras = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    for extra in ("cuda12", "cuda13"):
        names = [re.match(r"[\w.\[\]-]+", requirement)[0] for requirement in extras[extra]]
        command = "pip install " + " ".join(f"'{n}'" if "[" in n else n for n in names)
        assert command in backend.INSTALL_HINT, (command, backend.INSTALL_HINT)
    assert "psgd[" not in backend.INSTALL_HINT


def test_a_working_fake_gpu_is_available(monkeypatch):
    fake_cupy.install(monkeypatch, fake_cupy.FakeCupy(devices=1))
    assert backend.cuda_available() and backend.get_device("cuda") == backend.Device("cuda", 0)


def test_nccl_needs_cupy_14(monkeypatch):
    fake_cupy.install(monkeypatch, fake_cupy.FakeCupy(devices=1, version="13.6.0"))
    with pytest.raises(backend.DeviceError, match="needs CuPy 14 or later.*13.6.0.*cupy-cuda12x"):
        backend.nccl_module()


def test_the_cuda_extras_install_cupy_with_its_toolkit_and_nccl():
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for cuda in ("12", "13"):
        wanted = extras[f"cuda{cuda}"]
        assert any(r.startswith(f"cupy-cuda{cuda}x[ctk]>=14") for r in wanted), wanted
        assert any(r.startswith(f"nvidia-nccl-cu{cuda}") for r in wanted), wanted
    pins = {
        line.split("==")[0].strip()
        for line in (REPO / "requirements.lock").read_text().splitlines()
        if "==" in line and not line.lstrip().startswith("#")
    }
    for package in ("cupy-cuda12x", "nvidia-nccl-cu12", "cuda-toolkit", "nvidia-cuda-nvrtc-cu12", "nvidia-cublas-cu12"):
        assert package in pins, f"requirements.lock does not pin {package}"
