"""Readers for files on disk: IDX (the MNIST format), NPZ, and the bundled digits.

Each reader turns every failure (missing file, bad gzip, bad header, wrong
size, pickled content) into one :class:`DataError` line that names the file,
with the low-level exception chained as its cause.  Nothing is unpickled.
"""

from __future__ import annotations

import gzip
import importlib.resources
import io
import os
import zipfile
import zlib
import numpy as np

from psgd.data.base import DataError

# IDX type codes -> big-endian NumPy dtype, and the names the format uses.
IDX_DTYPES: dict[int, np.dtype] = {
    0x08: np.dtype(">u1"),  # unsigned byte
    0x09: np.dtype(">i1"),  # signed byte
    0x0B: np.dtype(">i2"),  # short
    0x0C: np.dtype(">i4"),  # int
    0x0D: np.dtype(">f4"),  # float
    0x0E: np.dtype(">f8"),  # double
}
_IDX_TYPE_NAMES = {0x08: "ubyte", 0x09: "byte", 0x0B: "short", 0x0C: "int", 0x0D: "float", 0x0E: "double"}

_GZIP_MAGIC = b"\x1f\x8b"

DIGITS_RESOURCE = "digits.csv.gz"
DIGITS_ROWS = 1797
DIGITS_COLUMNS = 65  # 8x8 pixels in 0..16, then the label 0..9


def read_bytes(path: str | os.PathLike[str]) -> bytes:
    """The content of ``path``, gunzipped when it starts with the gzip magic."""
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError as exc:
        raise DataError(f"{path}: no such file") from exc
    except IsADirectoryError as exc:
        raise DataError(f"{path}: is a directory, expected a file") from exc
    except OSError as exc:
        raise DataError(f"{path}: cannot read: {exc.strerror or exc}") from exc
    if data[:2] == _GZIP_MAGIC:
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError, zlib.error) as exc:
            raise DataError(f"{path}: corrupt or truncated gzip data ({exc})") from exc
    return data


def parse_idx(data: bytes, name: str = "<bytes>") -> np.ndarray:
    """Parse the IDX format from bytes; ``name`` is used in error messages.

    Header: two zero bytes, a type code (see ``IDX_DTYPES``), the number of
    dimensions, then each dimension as a big-endian uint32; then exactly
    ``prod(dims)`` big-endian values.  Returns a native-endian, writeable array.
    """
    if len(data) < 4:
        raise DataError(f"{name}: {len(data)} bytes is too short for an IDX header (4 bytes at least)")
    magic = int.from_bytes(data[:4], "big")
    code, ndim = data[2], data[3]
    if data[0] != 0 or data[1] != 0 or code not in IDX_DTYPES or ndim == 0:
        raise DataError(
            f"{name}: bad IDX magic number 0x{magic:08X}: expected 0x0000TTNN with type TT in "
            f"{{08, 09, 0B, 0C, 0D, 0E}} and NN >= 1 dimensions (is this an IDX file?)"
        )
    header = 4 + 4 * ndim
    if len(data) < header:
        raise DataError(f"{name}: truncated IDX header: {ndim} dimensions need {header} bytes, file has {len(data)}")
    dims = tuple(int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    dtype = IDX_DTYPES[code]
    expected = int(np.prod(dims, dtype=object)) * dtype.itemsize
    payload = len(data) - header
    if payload != expected:
        what = "truncated" if payload < expected else f"{payload - expected} extra bytes at the end"
        raise DataError(
            f"{name}: IDX payload is {payload} bytes but dims {dims} of {_IDX_TYPE_NAMES[code]} "
            f"need {expected} bytes ({what})"
        )
    arr = np.frombuffer(data, dtype=dtype, offset=header).reshape(dims)
    return arr.astype(dtype.newbyteorder("="))  # native byte order, and a writeable copy


def read_idx(path: str | os.PathLike[str]) -> np.ndarray:
    """Read one IDX file (raw, or gzip-compressed whatever its name) into a NumPy array."""
    return parse_idx(read_bytes(path), os.fspath(path))


def read_npz(path: str | os.PathLike[str]) -> dict[str, np.ndarray]:
    """All arrays of an ``.npz`` archive, loaded with ``allow_pickle=False``.

    An object array (which would need unpickling) is refused with a DataError
    naming the key; so are files that are not ``.npz`` archives.
    """
    path = os.fspath(path)
    if not os.path.exists(path):
        raise DataError(f"{path}: no such file")
    if os.path.isdir(path):
        raise DataError(f"{path}: is a directory, expected an .npz file")
    try:
        with open(path, "rb") as f:
            head = f.read(2)
    except OSError as exc:
        raise DataError(f"{path}: cannot be read ({exc.strerror or exc})") from exc
    if head.startswith(b"\x80"):
        raise DataError(f"{path}: is a Python pickle, which psgd never loads; save plain arrays with numpy.savez")
    try:
        loaded = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
        raise DataError(f"{path}: not a readable .npz archive ({exc})") from exc
    if not isinstance(loaded, np.lib.npyio.NpzFile):
        raise DataError(f"{path}: is a single .npy array, expected an .npz archive of named arrays")
    out: dict[str, np.ndarray] = {}
    with loaded:
        for key in loaded.files:
            try:
                out[key] = loaded[key]
            except ValueError as exc:
                if "allow_pickle" in str(exc) or "Object arrays" in str(exc):
                    raise DataError(
                        f"{path}: array {key!r} is an object array; psgd never unpickles data, "
                        f"save plain numeric arrays"
                    ) from exc
                raise DataError(f"{path}: array {key!r} is unreadable ({exc})") from exc
            except (OSError, EOFError, zipfile.BadZipFile, zlib.error) as exc:
                raise DataError(f"{path}: array {key!r} is corrupt ({exc})") from exc
    return out


def read_digits() -> tuple[np.ndarray, np.ndarray]:
    """The bundled UCI digits: pixels (1797, 8, 8) int64 in 0..16, labels (1797,) int64.

    See ``psgd/data/README.md`` for the file's origin and license.
    """
    name = f"psgd.data/{DIGITS_RESOURCE}"
    try:
        raw = importlib.resources.files("psgd.data").joinpath(DIGITS_RESOURCE).read_bytes()
        with gzip.open(io.BytesIO(raw), "rt", encoding="ascii") as f:
            table = np.loadtxt(f, delimiter=",", dtype=np.int64, ndmin=2)
    except FileNotFoundError as exc:
        raise DataError(f"{name}: bundled file is missing (broken installation?)") from exc
    except (OSError, EOFError, zlib.error, ValueError, UnicodeDecodeError) as exc:
        raise DataError(f"{name}: bundled file is unreadable ({exc})") from exc
    if table.shape != (DIGITS_ROWS, DIGITS_COLUMNS):
        raise DataError(f"{name}: expected {DIGITS_ROWS} rows of {DIGITS_COLUMNS} values, got shape {table.shape}")
    pixels, labels = table[:, :64], table[:, 64]
    if pixels.min() < 0 or pixels.max() > 16 or labels.min() < 0 or labels.max() > 9:
        raise DataError(f"{name}: values out of range (pixels 0..16, labels 0..9 expected)")
    return pixels.reshape(-1, 8, 8), labels.copy()

