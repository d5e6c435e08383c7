"""One gRPC push put back together: its slices' chunks (:class:`PushAssembler`), checked against the plan."""

from __future__ import annotations

import numpy as np

from psgd.partition import Slice
from psgd.server.errors import ShardError
from psgd.server.state.core import ShardCore
from psgd.wire.codec import Codec, CodecError, by_name


class PushAssembler:
    """Collects one gRPC push's chunks into complete, validated gradient arrays.

    Chunks of a slice must arrive in order and cover it exactly, in the wire
    format of the push's codec.  Sizes come from the plan, never from the
    request, so a hostile push cannot make the shard allocate more than the
    slices it holds.
    """

    def __init__(self, core: ShardCore, declared: str):
        try:
            self.codec: Codec = by_name(declared, core.dtype)
        except CodecError as exc:
            raise ShardError("INVALID_ARGUMENT", str(exc)) from None
        self.slices: dict[int, Slice] = core.slices
        self.dtype = core.dtype
        self.itemsize = self.codec.wire_itemsize(core.dtype)
        self._buffers: dict[int, bytearray] = {}
        self._received: dict[int, int] = {}

    def _nbytes(self, sl: Slice) -> int:
        return sl.size * self.itemsize

    def add(self, slice_id: int, offset: int, data: bytes) -> None:
        sl = self.slices.get(slice_id)
        if sl is None:
            raise ShardError(
                "NOT_FOUND", f"slice {slice_id} is not held by this shard: is the worker using the same partition plan?"
            )
        got, nbytes = self._received.get(slice_id, 0), self._nbytes(sl)
        if offset != got:
            raise ShardError(
                "INVALID_ARGUMENT",
                f"slice {slice_id} ({sl.key}): chunk at byte {offset}, "
                f"expected {got} (chunks must arrive in order, without gaps)",
            )
        end = offset + len(data)
        if end > nbytes:
            raise ShardError(
                "INVALID_ARGUMENT",
                f"slice {slice_id} ({sl.key}) holds {nbytes} bytes, the push sent {end} or more: wrong shape or dtype",
            )
        buf = self._buffers.get(slice_id)
        if buf is None:
            buf = self._buffers[slice_id] = bytearray(nbytes)
        buf[offset:end] = data
        self._received[slice_id] = end

    @property
    def received(self) -> int:
        """Bytes of gradient received so far, as they came over the wire."""
        return sum(self._received.values())

    def finish(self) -> dict[int, np.ndarray]:
        missing = [
            f"{sl.key} ({self._received.get(i, 0)} of {self._nbytes(sl)} bytes)"
            for i, sl in self.slices.items()
            if self._received.get(i, 0) != self._nbytes(sl)
        ]
        if missing:
            more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
            raise ShardError("INVALID_ARGUMENT", f"incomplete push: {', '.join(missing[:3])}{more}")
        if not self.codec.compresses:
            return {i: np.frombuffer(buf, dtype=self.dtype) for i, buf in self._buffers.items()}
        out = {}
        for i, buf in self._buffers.items():
            out[i] = np.empty(self.slices[i].size, dtype=self.dtype)
            self.codec.decode(np.frombuffer(buf, dtype=np.uint16), out[i])
        return out
