"""Reading a user's ``.npy``/``.npz`` safely: the header is parsed and checked against the bytes that follow
before any array is allocated, and nothing is ever unpickled.

A header that does not parse, names an object or non-numeric dtype, or a shape whose bytes differ from the file's
(a truncated file, or a shape of terabytes that would be allocated before the read fails) is refused with the
file (and npz member) named.
"""

from __future__ import annotations

import io
import tokenize
import zipfile
from pathlib import Path

import numpy as np

NUMERIC_KINDS = "biuf"  # bool, int, uint, float: the kinds a routes or map reader can name in its own refusal
_PARSE_ERRORS = (
    ValueError,
    SyntaxError,
    tokenize.TokenError,
    OverflowError,
    EOFError,
    TypeError,
    MemoryError,
    KeyError,
    zipfile.BadZipFile,
    OSError,
)


def _check_header(fp, size: int, *, where: str, error) -> None:
    try:
        version = np.lib.format.read_magic(fp)
        read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, _, dtype = read(fp)
        header_end = fp.tell()
    except _PARSE_ERRORS as exc:
        raise error(f"{where}: cannot read as .npy: header: {type(exc).__name__}: {exc}"[:300]) from None
    if dtype.hasobject or dtype.kind not in NUMERIC_KINDS or dtype.fields is not None:
        raise error(
            f"{where}: cannot read as .npy: dtype {dtype} is not a numeric dtype; expected integer ids "
            f"(object arrays are never unpickled)"
        )
    need = int(np.prod(shape, dtype=object)) * dtype.itemsize
    if need != size - header_end:
        raise error(
            f"{where}: cannot read as .npy: header shape {shape} of {dtype} needs {need} bytes, the file "
            f"holds {size - header_end} after the header (truncated or corrupt)"
        )


def load_npy(path: Path, *, error, where: str | None = None) -> np.ndarray:
    """The array of the ``.npy`` at ``path``, its header checked first; ``error`` is the exception class raised."""
    where = where or str(path)
    try:
        with open(path, "rb") as fp:
            _check_header(fp, path.stat().st_size, where=where, error=error)
        return np.load(path, allow_pickle=False)
    except _PARSE_ERRORS as exc:
        raise error(f"{where}: cannot read as .npy: {type(exc).__name__}: {exc}"[:300]) from None


def load_npy_bytes(data: bytes, *, error, where: str) -> np.ndarray:
    """The array of a ``.npy`` held in memory (a decoded base64 payload), its header checked first, as
    ``load_npy`` does for a file; ``error`` is the exception class raised, ``where`` names the payload."""
    try:
        _check_header(io.BytesIO(data), len(data), where=where, error=error)
        return np.load(io.BytesIO(data), allow_pickle=False)
    except _PARSE_ERRORS as exc:
        raise error(f"{where}: cannot read as .npy: {type(exc).__name__}: {exc}"[:300]) from None


def load_npz(path: Path, *, error, order=sorted) -> dict[str, np.ndarray]:
    """``{key: array}`` of the ``.npz`` at ``path`` (keys as ``order`` sorts them), every member's header checked
    before it is read."""
    try:
        with zipfile.ZipFile(path) as zf:
            infos = {info.filename: info for info in zf.infolist()}
            for name, info in infos.items():
                if not name.endswith(".npy"):
                    raise error(
                        f"{path}: npz member {name!r} is not a .npy array; an .npz of routes holds .npy members only"
                    )
                with zf.open(info) as fp:
                    _check_header(fp, info.file_size, where=f"{path}: npz member {name!r}", error=error)
        with np.load(path, allow_pickle=False) as npz:
            return {key: npz[key] for key in order(npz.files)}
    except _PARSE_ERRORS as exc:
        raise error(f"{path}: cannot read as .npz: {type(exc).__name__}: {exc}"[:300]) from None
