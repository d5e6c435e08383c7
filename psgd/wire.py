"""What client and server agree on about moving tensors: chunk sizes and message limits."""

from __future__ import annotations

from typing import Iterator

CHUNK_BYTES = 2 << 20
#: Largest message either side accepts: one chunk plus its envelope.  Anything
#: bigger is refused by gRPC itself with RESOURCE_EXHAUSTED.
MAX_MESSAGE_BYTES = CHUNK_BYTES + (64 << 10)

CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.so_reuseport", 0),
]


def chunks(data: bytes | memoryview, size: int = CHUNK_BYTES) -> Iterator[tuple[int, memoryview]]:
    """(offset, piece) pairs covering ``data``; an empty buffer still yields one empty piece."""
    view = memoryview(data).cast("B")
    if len(view) == 0:
        yield 0, view
        return
    for offset in range(0, len(view), size):
        yield offset, view[offset:offset + size]
