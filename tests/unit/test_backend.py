import numpy as np
import pytest

from psgd.compute import backend


def test_cpu_device_parses_and_uses_numpy():
    dev = backend.get_device("cpu")
    assert dev == backend.CPU and dev.xp is np and not dev.is_gpu and str(dev) == "cpu"
    assert backend.get_device(None) == backend.CPU
    assert backend.get_device(dev) is dev


@pytest.mark.parametrize("spec", ["tpu", "cuda:x", "cpu:1", "cuda:-1", ""])
def test_bad_device_names_are_refused(spec):
    if spec == "":
        assert backend.get_device(spec) == backend.CPU
        return
    with pytest.raises(backend.DeviceError, match="device"):
        backend.get_device(spec)


def test_asking_for_a_missing_gpu_says_what_to_install():
    if backend.cuda_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(backend.DeviceError) as info:
        backend.get_device("cuda")
    text = str(info.value)
    assert "--device cpu" in text
    assert ("CuPy" in text and "pip install" in text) or "CUDA" in text


def test_host_round_trip_on_numpy():
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    assert backend.to_device(a, "cpu") is a or np.shares_memory(backend.to_device(a, "cpu"), a)
    out = np.empty_like(a)
    assert backend.to_host(a, out=out) is out and np.array_equal(out, a)
    assert backend.to_device(a, backend.CPU, dtype=np.float64).dtype == np.float64
    assert backend.get_array_module(a) is np


@pytest.mark.gpu
def test_gpu_round_trip():
    device = backend.get_device("cuda")
    a = np.random.default_rng(0).standard_normal((3, 4))
    d = backend.to_device(a, device)
    assert backend.is_device_array(d) and backend.get_array_module(d) is device.xp
    out = np.empty_like(a)
    backend.to_host(d * 2, out=out)
    np.testing.assert_array_equal(out, a * 2)
    backend.synchronize(device)


def test_cupy_imported_only_by_the_backend():
    import pathlib

    root = pathlib.Path(backend.__file__).parent
    offenders = [
        str(p.relative_to(root))
        for p in root.rglob("*.py")
        if p.name != "backend.py"
        and any(line.strip().startswith(("import cupy", "from cupy")) for line in p.read_text().splitlines())
    ]
    assert offenders == []
