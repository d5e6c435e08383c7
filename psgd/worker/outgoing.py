"""A gradient as it leaves a worker: each shard's slices, encoded by the job's codec (:mod:`psgd.wire.codec`).

Uncompressed, a shard's part is views of the gradient arrays (on the device too: :mod:`psgd.link.shm` copies it
from there); compressed, it is written into a 16-bit buffer made once per shard and reused every step, so no
model-sized buffer is built per push.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from psgd.compute import backend
from psgd.partition import Slice
from psgd.wire.codec import Codec


class Outgoing:
    """Shard ``k``'s part of a gradient, for the shards whose slices are ``shard_slices[k]``."""

    def __init__(self, codec: Codec, shard_slices: Sequence[Sequence[Slice]]):
        self.codec, self.shard_slices = codec, shard_slices
        self._packed: list[np.ndarray | None] = [None] * len(shard_slices)

    def slices(self, k: int, flat: Mapping[str, np.ndarray]) -> list:
        """Shard ``k``'s slices of the gradient ``flat`` (a flat array per variable) as the codec writes them: views
        of it (device arrays stay on the device), or of the reused 16-bit buffer."""
        slices = self.shard_slices[k]
        if not self.codec.compresses:
            views = [flat[s.var][s.start : s.stop] for s in slices]
            return views if views and backend.is_device_array(views[0]) else [memoryview(v).cast("B") for v in views]
        packed = self._packed[k]
        if packed is None:
            packed = self._packed[k] = np.empty(sum(s.size for s in slices), dtype=np.uint16)
        parts, at = [], 0
        for s in slices:
            dst = packed[at : at + s.size]
            self.codec.encode(flat[s.var][s.start : s.stop], dst)
            parts.append(memoryview(dst).cast("B"))
            at += s.size
        return parts

    def rows(self, values: np.ndarray) -> np.ndarray:
        """Row gradients as the codec writes them (16 bits a value where it compresses)."""
        if not self.codec.compresses:
            return values
        out = np.empty(values.shape, dtype=np.uint16)
        self.codec.encode(np.ascontiguousarray(values, dtype=np.float32).reshape(-1), out.reshape(-1))
        return out
