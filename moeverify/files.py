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
    if parent.exists() and not parent.is_dir():
        raise UsageError(f"{flag} {value}: {parent} is not a directory")
    if not parent.is_dir():
        raise UsageError(f"{flag} {value}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} {value}: directory {parent} is not writable")
    return resolved


# ------------------------------------------------------------------------------------------ the cache
CACHE_ENV = "MOEVERIFY_CACHE_DIR"


def _cache_refusal(path: Path, why: str, environ) -> UsageError:
    raw = environ.get(CACHE_ENV)
    named = f"{CACHE_ENV}={raw!r}" if raw else f"the cache directory {path} (set {CACHE_ENV} to use another)"
    return UsageError(
        f"{named}: {why}; expected a directory moeverify can create files in (seeded checkpoints are written there)"
    )


def cache_root(environ=os.environ) -> Path:
    """moeverify's cache directory: ``MOEVERIFY_CACHE_DIR``, else ``~/.cache/moeverify`` (not created here)."""
    return Path(environ.get(CACHE_ENV) or Path("~/.cache/moeverify").expanduser())


def check_cache_root(environ=os.environ) -> Path:
    """The cache directory, refused (``UsageError`` naming ``MOEVERIFY_CACHE_DIR``) when it could not be used: a file,
    under a file, or missing under a directory that cannot be written. Creates nothing (``moeverify run`` calls
    this before any rank starts; a cache that exists is accepted as it is: it may be a read-only, filled one)."""
    root = cache_root(environ)
    try:
        probe = root.absolute()
        while not probe.exists() and probe != probe.parent:
            probe = probe.parent
        if not probe.is_dir():
            raise _cache_refusal(root, f"{probe} is not a directory", environ)
        if probe != root.absolute() and not os.access(probe, os.W_OK | os.X_OK):
            raise _cache_refusal(root, f"{root} does not exist and {probe} is not writable", environ)
    except (OSError, ValueError) as exc:
        raise _cache_refusal(
            root, f"cannot look at {root} ({getattr(exc, 'strerror', None) or exc})", environ
        ) from None
    return root


def cache_dir(name: str, environ=os.environ) -> Path:
    """The cache's subdirectory ``name``, created if absent (``UsageError`` naming ``MOEVERIFY_CACHE_DIR`` if it
    cannot be)."""
    path = cache_root(environ) / name
    try:
        path.mkdir(parents=True, exist_ok=True)
    except (OSError, ValueError) as exc:
        raise _cache_refusal(path, f"cannot create {path} ({getattr(exc, 'strerror', None) or exc})", environ) from None
    return path


def cache_tempdir(parent: Path, *, prefix: str) -> Path:
    """A new temporary directory in the cache directory ``parent`` (``UsageError`` naming ``MOEVERIFY_CACHE_DIR``
    when it cannot be written)."""
    try:
        return Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    except OSError as exc:
        raise _cache_refusal(parent, f"cannot write in {parent} ({exc.strerror or exc})", os.environ) from None
