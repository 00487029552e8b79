"""The project's exception hierarchy (user errors are ``MoEVerifyError`` subclasses, never bare asserts), and how
much a message quotes of what it found (``SHOW``, ``SHOW_NAMES``, ``few``, ``more``), declared once for every layer.
"""

from __future__ import annotations

from collections.abc import Sequence

# How much a message quotes, declared once: every message that lists what it found reads these.
SHOW = 5  # items quoted per failure message: differing elements, flat indices
SHOW_NAMES = 8  # names quoted per message (lists of names read better a little longer)


def more(total: int, shown: int, *, what: str = "") -> str:
    """What a message that quotes ``shown`` of ``total`` items adds: `` (+N more)``, or `` (+N more WHAT)`` with
    ``what``; nothing when it quotes them all."""
    if total <= shown:
        return ""
    return f" (+{total - shown} more{f' {what}' if what else ''})"


def few(items: Sequence[object], limit: int = SHOW_NAMES) -> str:
    """The first ``limit`` of ``items`` as a list, then how many more: ``['a', 'b'] (+3 more)``."""
    return f"{list(items[:limit])}{more(len(items), limit)}"


class MoEVerifyError(Exception):
    """Base of every error moeverify raises for bad input or a failed precondition."""


class UsageError(MoEVerifyError):
    """Bad command line, scenario file, name or option (the CLI exits 2)."""


class LayoutError(UsageError):
    """An invalid parallel layout; the message names the rule that broke."""


class RouteError(MoEVerifyError):
    """A route tensor that cannot be recorded or replayed (names layer, rank, micro-batch, expected, got)."""


class DumpError(MoEVerifyError):
    """A routing dump that is corrupt, truncated, missing or inconsistent (names the file)."""


class SubjectError(MoEVerifyError):
    """An export subject that cannot be loaded or yields malformed rows (names rank, row, slot)."""


class EnvironmentProblem(MoEVerifyError):
    """The installed stack does not match what moeverify was written against (names what was expected)."""


class RankDisagreement(MoEVerifyError):
    """Ranks that ran one step in lockstep ended it differently: some raised, others did not (names the ranks)."""
