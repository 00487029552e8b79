"""What every ``moeverify dump`` verb shares: its exit codes and the guard that turns bad input into one message
on stderr and exit 2 (never a traceback)."""

from __future__ import annotations

import sys

from moeverify.commands.common import EXIT_USAGE
from moeverify.errors import MoEVerifyError, UsageError

EXIT_DIFF = 1


def guarded(fn):
    """Bad input becomes one message on stderr and exit 2."""

    def run(args) -> int:
        try:
            return fn(args)
        except MoEVerifyError as exc:
            print(f"moeverify dump: error: {exc}", file=sys.stderr)
            return EXIT_USAGE
        except OSError as exc:  # a path given by the user that cannot be read or written
            print(f"moeverify dump: error: {exc.filename or ''}: {exc.strerror or exc}", file=sys.stderr)
            return EXIT_USAGE

    run.__name__ = fn.__name__
    run.__doc__ = fn.__doc__
    return run


def refuse_options(args, flags, *, because: str) -> None:
    """Refuse every one of ``flags`` (``"--step-b"``, ...) that was given: an option that would be silently
    ignored is refused, naming it and why it does not apply."""
    given = [flag for flag in flags if _given(args, flag)]
    if given:
        raise UsageError(
            f"{', '.join(given)}: {'does' if len(given) == 1 else 'do'} not apply: {because}; "
            f"drop {'it' if len(given) == 1 else 'them'}"
        )


def _given(args, flag: str) -> bool:
    value = getattr(args, flag.lstrip("-").replace("-", "_"), None)
    return value is not None and value is not False  # `is`: 0 is a value given, and 0 == False
