"""Collectives for the all-reduce mode: NCCL on GPUs, MPI on CPUs, one small interface."""

from psgd.collective.base import BackendUnavailable, Bucketer, Collective, CollectiveError

BACKENDS = ("mpi", "nccl")

__all__ = ["BACKENDS", "BackendUnavailable", "Bucketer", "Collective", "CollectiveError", "make_collective"]


def make_collective(
    backend: str,
    *,
    rank: int | None = None,
    world_size: int | None = None,
    device=None,
    rendezvous: str | None = None,
    timeout: float = 300.0,
) -> Collective:
    """A collective of the named backend (mpi takes rank and size from MPI; nccl needs them given)."""
    if backend == "mpi":
        from psgd.collective.mpi import MpiCollective

        return MpiCollective()
    if backend == "nccl":
        from psgd.collective.nccl import NcclCollective

        if rank is None or world_size is None:
            raise CollectiveError("the nccl backend needs --rank and the world size (cluster.workers)")
        return NcclCollective(
            rank, world_size, device, rendezvous=rendezvous or "file:/tmp/psgd-nccl-id.json", timeout=timeout
        )
    raise CollectiveError(f"unknown all-reduce backend {backend!r}: use one of {', '.join(BACKENDS)}")
