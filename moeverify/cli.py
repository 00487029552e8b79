"""``moeverify run | dump | doctor | bench`` (and ``--version``): the entry point and its dispatch.

Each command is a module of ``moeverify.commands`` with ``register(subparsers)``; ``dump``'s module is imported only
when ``dump`` runs (its format needs torch), so ``--help``, ``run --list`` and scenario validation import no torch.
User errors print one message and exit 2, never a traceback. A command line error names the (sub)command and shows
its usage line; options are never abbreviated (``--fail`` is not ``--fail-on-diff``). A closed stdout (``| head``)
never changes the exit code: what is printed after it closed is dropped, the command runs to its verdict.
"""

from __future__ import annotations

import argparse
import os
import sys

from moeverify import __version__
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


class ParseError(UsageError):
    """A command line argparse refused: the message, and the usage line of the (sub)command that refused it."""

    def __init__(self, prog: str, message: str, usage: str):
        super().__init__(message)
        self.prog, self.usage = prog, usage


class _Parser(argparse.ArgumentParser):
    """argparse that raises ``ParseError`` instead of exiting (``main`` returns 2 itself), never abbreviates an
    option, and refuses an unknown argument in the (sub)parser that got it, so the message names that subcommand."""

    def __init__(self, *args, **kwargs):
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args=None, namespace=None):
        namespace, extras = super().parse_known_args(args, namespace)
        if extras:  # a subparser's parse_known_args returns first: the innermost subcommand reports it
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return namespace, extras

    def error(self, message: str):
        raise ParseError(self.prog, message, self.format_usage())


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
    parser.add_argument("--version", action="version", version=f"moeverify {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    subparsers.required = True
    run.register(subparsers)
    _add_dump(subparsers, load=command == "dump")
    doctor.register(subparsers)
    bench.register(subparsers)
    return parser


class _PipeSafeStdout:
    """``sys.stdout`` while a command runs: once the reader has gone (``BrokenPipeError``: ``| head``), the rest of
    the output goes to /dev/null (the file descriptor too, so the interpreter's flush at exit cannot fail) and the
    command goes on to its verdict; the exit code is the command's, never the pipe's."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            self._to_devnull()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._to_devnull()

    def _to_devnull(self) -> None:
        try:
            fd = self._stream.fileno()
        except (AttributeError, OSError, ValueError):  # not a file (a test's capture): drop the rest
            fd = None
        if fd is not None:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, fd)  # the stream's buffer now drains into /dev/null, at exit too
            os.close(devnull)
        else:
            self._stream = open(os.devnull, "w")  # noqa: SIM115 - lives as long as the process

    def __getattr__(self, name):
        return getattr(self._stream, name)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``moeverify`` command; returns the exit code."""
    stdout = sys.stdout
    guarded = sys.stdout = _PipeSafeStdout(stdout) if stdout is not None else stdout
    try:
        argv = sys.argv[1:] if argv is None else list(argv)
        args = build_parser(argv[0] if argv else None).parse_args(argv)
        return int(args.func(args) or 0)
    except ParseError as exc:
        print(f"{exc.usage.rstrip()}\n{exc.prog}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except UsageError as exc:
        print(f"moeverify: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except SystemExit as exc:  # --help, or a subcommand that exits itself
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else EXIT_USAGE)
    except KeyboardInterrupt:
        print("moeverify: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    finally:
        if guarded is not None:
            guarded.flush()  # what is still buffered, while a closed pipe is still caught
        sys.stdout = stdout
