import re
import sys

import numpy as np
import pytest
from helpers import Mirror

from psgd.collective import BackendUnavailable, Bucketer, CollectiveError, make_collective
from psgd.errors import install_extra


def test_bucketer_packs_gradients_into_few_reused_buffers():
    shapes = {"a": (3, 4), "b": (4,), "c": (100,), "d": (2,)}
    bucketer = Bucketer(shapes, "float32", np, bucket_bytes=64, direct_bytes=400)
    assert [len(b) for b in bucketer.layout] == [2, 1]  # a+b fill 16 floats; d alone
    assert set(bucketer.direct) == {"c"}  # its 400 bytes are reduced in place, not packed
    group = Mirror(world=4)
    grads = {k: np.random.default_rng(0).standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    first = bucketer.allreduce_mean(group, grads)
    assert group.calls == 3
    for k, s in shapes.items():
        assert first[k].shape == s and first[k].dtype == np.float32
        np.testing.assert_allclose(first[k], grads[k], rtol=1e-6)  # mean of 4 identical ranks
    buffers = [b.__array_interface__["data"][0] for b in bucketer.buffers]
    bucketer.allreduce_mean(group, grads)
    assert buffers == [b.__array_interface__["data"][0] for b in bucketer.buffers]


def test_agreement_check_detects_a_different_text():
    class Split(Mirror):
        def allreduce_(self, array, op="sum"):
            array[:] = np.maximum(array, [12345, -12345])  # another rank brought other values
            return array

    Mirror(2).check_agreement("x", "the model")
    with pytest.raises(CollectiveError, match="disagree on the model"):
        Split(2).check_agreement("x", "the model")


def test_missing_mpi_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "mpi4py", None)
    with pytest.raises(BackendUnavailable, match=re.escape(install_extra("mpi"))):
        make_collective("mpi")


def test_unknown_backend_and_nccl_without_rank():
    with pytest.raises(CollectiveError, match="unknown all-reduce backend 'gloo'"):
        make_collective("gloo")
    with pytest.raises(CollectiveError, match="needs --rank"):
        make_collective("nccl")


def test_large_gradients_are_reduced_in_place():
    bucketer = Bucketer({"big": (256,), "small": (4,)}, "float32", np, bucket_bytes=1 << 20, direct_bytes=1024)
    assert set(bucketer.direct) == {"big"} and len(bucketer.buffers) == 1
    big = np.full(256, 3.0, dtype=np.float32)
    out = bucketer.allreduce_mean(Mirror(world=3), {"big": big, "small": np.ones(4, np.float32)})
    assert out["big"] is big and np.allclose(big, 3.0)  # summed over 3 identical ranks, then averaged
    strided = np.full(512, 2.0, dtype=np.float32)[::2]  # not contiguous: reduced in a copy, input untouched
    out = bucketer.allreduce_mean(Mirror(world=2), {"big": strided, "small": np.ones(4, np.float32)})
    assert out["big"] is not strided and np.allclose(out["big"], 2.0) and np.allclose(strided, 2.0)


def test_long_buffers_are_reduced_in_the_backends_chunks_each_piece_once():
    class Chunked(Mirror):
        chunk_bytes = 40  # 10 float32 values

        def __init__(self):
            super().__init__(world=2)
            self.sizes = []

        def allreduce_(self, array, op="sum"):
            self.sizes.append(array.size)
            array *= 3.0  # the other rank holds twice these values: the sum is 3x, the mean 1.5x
            return array

    shapes = {"big": (5, 5), "a": (7,), "b": (6,)}
    bucketer = Bucketer(shapes, "float32", np, bucket_bytes=1 << 20, direct_bytes=100)
    assert set(bucketer.direct) == {"big"}
    grads = {k: np.arange(1, np.prod(s) + 1, dtype=np.float32).reshape(s) for k, s in shapes.items()}
    expected = {k: g * 1.5 for k, g in grads.items()}
    group = Chunked()
    out = bucketer.allreduce_mean(group, {k: g.copy() for k, g in grads.items()})
    assert group.sizes == [10, 10, 5, 10, 3]  # 25 values of "big", then the 13-value bucket of a and b
    for k in shapes:
        np.testing.assert_array_equal(out[k], expected[k])
    assert Mirror(2).chunk_bytes == 0  # backends reduce whole buffers unless they ask otherwise
    from psgd.collective.mpi import MpiCollective

    assert MpiCollective.chunk_bytes == 4 << 20
