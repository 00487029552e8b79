"""``moeverify run | dump | doctor | bench``: the entry point and its dispatch.

Each command is a module of ``moeverify.commands`` with ``register(subparsers)``; ``dump``'s module is imported only
when ``dump`` runs (its format needs torch), so ``--help``, ``run --list`` and scenario validation import no torch.
User errors print one message and exit 2, never a traceback.
"""

from __future__ import annotations

import argparse
import sys

from moeverify.commands import bench, doctor, run
from moeverify.commands.common import EXIT_INTERRUPTED, EXIT_USAGE
from moeverify.commands.run import DEFAULT_SCENARIOS, DEFAULT_TIMEOUT_S, RELEASE_SCENARIOS
from moeverify.errors import UsageError

__all__ = [
    "DEFAULT_SCENARIOS",
    "DEFAULT_TIMEOUT_S",
    "EXIT_INTERRUPTED",
    "EXIT_USAGE",
    "RELEASE_SCENARIOS",
    "build_parser",
    "main",
]


class _Parser(argparse.ArgumentParser):
    """argparse that raises ``UsageError`` instead of exiting, so ``main`` returns 2 itself."""

    def error(self, message: str):
        raise UsageError(f"{self.prog}: {message}")


def _add_dump(subparsers, *, load: bool) -> None:
    """``dump`` and its verbs when ``load``; else a stub that lists it, so that ``--help``, ``run`` and
    ``doctor`` never import the dump format (torch)."""
    if load:
        from moeverify.commands import dump  # lazy: torch, safetensors (the dump format)

        dump.register(subparsers)
        return
    p = subparsers.add_parser("dump", help="routing dumps: inspect, diff, convert", add_help=False)
    p.add_argument("rest", nargs=argparse.REMAINDER)
    p.set_defaults(func=lambda args: main(["dump", *args.rest]))


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The ``moeverify`` parser; ``command`` is the one about to run (its module is loaded, the others' not)."""
    parser = _Parser(prog="moeverify", description="Prove MoE RL training on Megatron-Core correct.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    subparsers.required = True
    run.register(subparsers)
    _add_dump(subparsers, load=command == "dump")
    doctor.register(subparsers)
    bench.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``moeverify`` command; returns the exit code."""
    try:
        argv = sys.argv[1:] if argv is None else list(argv)
        args = build_parser(argv[0] if argv else None).parse_args(argv)
        return int(args.func(args) or 0)
    except UsageError as exc:
        print(f"moeverify: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except SystemExit as exc:  # --help, or a subcommand that exits itself
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else EXIT_USAGE)
    except KeyboardInterrupt:
        print("moeverify: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
