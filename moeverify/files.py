"""Files that are whole or absent: write to a temporary file beside the target, fsync, rename over it.

A reader, or a run that dies mid-write, sees the previous complete file or the new one, never a part.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from moeverify.errors import UsageError


def atomic_write(path: Path | str, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (temp file in the same directory, fsync, rename, fsync dir)."""
    with atomic_writer(path) as f:
        f.write(data)


@contextlib.contextmanager
def atomic_writer(path: Path | str) -> Iterator[BinaryIO]:
    """A binary file object whose content becomes ``path`` atomically when the block ends without an error (temp
    file in the same directory, fsync, rename, fsync dir); on an error nothing is left behind."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def atomic_write_json(path: Path | str, obj: object) -> None:
    atomic_write(path, (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode())


def check_output_file(flag: str, value: str) -> Path:
    """The resolved path of an output file named by ``flag``; ``UsageError`` if it cannot be (over)written:
    a directory, a device or other non-regular file, a missing or unwritable directory."""
    path = Path(value)
    resolved = path.resolve()
    if resolved.exists() and not resolved.is_file():
        kind = "a directory" if resolved.is_dir() else "not a regular file"
        raise UsageError(f"{flag} {value}: {resolved} is {kind}; give the path of a file to (over)write")
    parent = resolved.parent
    if not parent.is_dir():
        raise UsageError(f"{flag} {value}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} {value}: directory {parent} is not writable")
    return resolved
