"""Gradient codecs: how a pushed gradient is written on the wire, used by both ends of every link.

``Identity`` sends the variables' own bytes; ``Float16`` and ``BFloat16``
halve the bytes of float32 gradients (round to nearest even; NaN stays NaN,
so the shard still refuses it).  A worker encodes its gradient for each shard
into a reused 16-bit buffer; the shard decodes into its float32 receive
buffer, piece by piece when the bytes come from a socket, so it never holds
a second full-size copy.

``codec_for(name)`` picks one by the name a job file uses (``[cluster]
compression``: none, float16, bfloat16); ``by_code`` and ``by_name`` find the
one a push declares on the TCP data path (a number) or over gRPC (a name).
"""

from __future__ import annotations

import numpy as np

from psgd.errors import InputError


class CodecError(InputError):
    """A codec that does not exist, or cannot carry the variables' dtype."""


class Codec:
    """One way to write float gradients on the wire."""

    name: str = ""  #: the name in job files and gRPC push headers
    code: int = 0  #: the number in a data-path push header
    itemsize: int = 0  #: bytes per value on the wire (0: the variables' own)

    def check(self, dtype: str) -> None:
        """Refuse variables this codec cannot carry."""

    def wire_itemsize(self, dtype: str) -> int:
        return self.itemsize or np.dtype(dtype).itemsize

    @property
    def compresses(self) -> bool:
        return self.itemsize != 0

    def encode(self, src: np.ndarray, out: np.ndarray) -> None:
        """Write float32 ``src`` into ``out`` (uint16, same length)."""
        raise NotImplementedError

    def decode(self, src: np.ndarray, out: np.ndarray) -> None:
        """Widen ``src`` (uint16) into float32 ``out`` (same length)."""
        raise NotImplementedError


class Identity(Codec):
    """The variables' own bytes, as they are."""

    name, code, itemsize = "none", 0, 0


class _Half(Codec):
    itemsize = 2

    def check(self, dtype: str) -> None:
        if dtype != "float32":
            raise CodecError(
                f"gradient compression ({self.name} on the wire) needs float32 variables, the model's are {dtype}"
            )


class Float16(_Half):
    """IEEE half precision: 11 significant bits, range up to 65504 (larger values become inf)."""

    name, code = "float16", 3

    def encode(self, src: np.ndarray, out: np.ndarray) -> None:
        np.copyto(out.view(np.float16), src, casting="same_kind")

    def decode(self, src: np.ndarray, out: np.ndarray) -> None:
        np.copyto(out, src.view(np.float16))


class BFloat16(_Half):
    """The top half of a float32: 8 significant bits, float32's whole range."""

    name, code = "bfloat16", 4

    def encode(self, src: np.ndarray, out: np.ndarray) -> None:
        to_bfloat16(src, out)

    def decode(self, src: np.ndarray, out: np.ndarray) -> None:
        from_bfloat16(src, out)


IDENTITY = Identity()
CODECS: dict[str, Codec] = {c.name: c for c in (IDENTITY, Float16(), BFloat16())}
#: Data-path dtype codes that name the variables' own dtype explicitly (1: float32, 2: float64).
_EXPLICIT = {1: "float32", 2: "float64"}


def codec_for(name: str | None) -> Codec:
    """The codec a job names (None or "none": the variables' own bytes)."""
    codec = CODECS.get(name or "none")
    if codec is None:
        raise CodecError(f"gradient compression {name!r}: use {', '.join(CODECS)}")
    return codec


def by_code(code: int, dtype: str) -> Codec:
    """The codec of a data-path push declaring ``code`` for variables of ``dtype``."""
    if code == 0 or _EXPLICIT.get(code) == dtype:
        return IDENTITY
    for codec in CODECS.values():
        if codec.code == code and codec.compresses:
            codec.check(dtype)
            return codec
    raise CodecError(f"gradient wire dtype code {code} cannot carry {dtype} variables")


def by_name(name: str, dtype: str) -> Codec:
    """The codec of a gRPC push whose header declares ``name`` (the variables' dtype: as they are)."""
    if name == dtype:
        return IDENTITY
    codec = CODECS.get(name)
    if codec is None or not codec.compresses:
        raise CodecError(
            f"gradient dtype {name or '(none)'!r} does not match the model's {dtype!r}: worker "
            "and server must use the same dtype"
        )
    codec.check(dtype)
    return codec


def to_bfloat16(src: np.ndarray, out: np.ndarray) -> np.ndarray:
    """Round float32 ``src`` to bfloat16 bit patterns (uint16) in ``out`` (round to nearest even)."""
    bits = src.view(np.uint32)
    rounded = bits + (np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1)))
    np.right_shift(rounded, np.uint32(16), out=out, casting="unsafe")
    nan = np.isnan(src)
    if nan.any():  # rounding would carry a NaN's payload into inf, 0 or -0: keep it a (quiet) NaN
        out[nan] = (bits[nan] >> np.uint32(16)) | np.uint32(0x0040)
    return out


def from_bfloat16(src: np.ndarray, out: np.ndarray) -> np.ndarray:
    """Widen bfloat16 bit patterns (uint16) in ``src`` to float32 ``out``."""
    wide = out.view(np.uint32)
    np.left_shift(src.astype(np.uint32), np.uint32(16), out=wide)
    return out
