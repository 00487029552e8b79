"""The files a ``moeverify dump`` verb writes (``inspect --json``, ``diff --json/--plot``, ``convert``'s DST), checked
before any input is read: a non-empty, writable path; never one of the command's own inputs nor inside an input
directory (symlinks resolved, other names of the same file compared with ``os.path.samefile``); two outputs never
the same file; a plot path that names an image format matplotlib writes (exactly that path, no suffix added)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from moeverify.errors import UsageError
from moeverify.files import check_output_file

PLOT_SUFFIXES = (".png", ".pdf", ".svg")

Named = tuple[str, str | None]  # (what: "--json", "A", ..., its path or None when not given)


def check_outputs(outputs: Sequence[Named], inputs: Sequence[Named]) -> None:
    """Refuse (``UsageError``, exit 2) every given output that cannot be written, is an input, lies in an input
    directory, or is the same file as another output; ``--plot`` must end in one of ``PLOT_SUFFIXES``."""
    seen: list[tuple[str, str, Path]] = []
    for flag, value in outputs:
        if value is None:
            continue
        if not value.strip():
            raise UsageError(f"{flag}: expected a path to write, got {value!r}")
        if flag == "--plot":
            check_plot_suffix(flag, value)
        path = check_output_file(flag, value)
        for other_flag, other_value, other in seen:
            if _same(path, other):
                raise UsageError(
                    f"{other_flag} {other_value} and {flag} {value} name the same file; give them different paths"
                )
        refuse_inputs(flag, value, inputs)
        seen.append((flag, value, path))


def check_plot_suffix(flag: str, value: str) -> None:
    """A plot is written to exactly the path named, in the format its suffix names."""
    suffix = Path(value).suffix
    formats = ", ".join(PLOT_SUFFIXES)
    if not suffix:
        raise UsageError(
            f"{flag} {value}: no suffix, so no image format (matplotlib would write {value}.png instead); "
            f"give a path ending in {formats}, e.g. {value}.png"
        )
    if suffix.lower() not in PLOT_SUFFIXES:
        raise UsageError(
            f"{flag} {value}: {suffix} is not an image format {flag} writes; give a path ending in {formats}"
        )


def refuse_inputs(flag: str, value: str, inputs: Sequence[Named]) -> None:
    """Refuse an output ``value`` that is one of ``inputs`` or lies inside an input directory (writing it would
    overwrite, or add to, what the command reads)."""
    out = Path(value).resolve()
    for what, src_text in inputs:
        if not src_text:
            continue
        src = Path(src_text)
        if src.is_dir():
            inside = out == src.resolve() or src.resolve() in out.parents
            inside = inside or any(_same(ancestor, src) for ancestor in (out, *out.parents) if ancestor.exists())
            if inside:
                raise UsageError(
                    f"{flag} {value}: lies inside the directory of input {what} ({src_text}); writing there would "
                    f"change the input: give a path outside it"
                )
        elif _same(out, src):
            raise UsageError(
                f"{flag} {value}: is input {what} ({src_text}); writing it would destroy the input: give another path"
            )


def _same(a: Path, b: Path) -> bool:
    """The same file: one resolved path, or (both existing) one inode, a hard link or bind mount included."""
    if a.resolve() == b.resolve():
        return True
    try:
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except OSError:
        return False
