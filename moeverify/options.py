"""Check options, declared once: name, the check that reads it, its command-line flag, help and validation.

Scenario files (``options:``), the ``moeverify run`` flags, ``--list``-time checks (an option no selected
check reads is refused) and the docs' option table all come from ``OPTIONS``. Pure Python: no torch, so
bad options are refused in a fraction of a second, before torchrun starts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from moeverify import plugins
from moeverify.errors import UsageError

# The replay oracle's subchecks and recompute modes, named here so they can be validated without torch;
# moeverify.oracles.replay.oracle runs them under these names.
REPLAY_SUBCHECKS = ("equivalence", "drift", "recompute", "cross_layout", "native_parity", "backward_order",
                    "validation", "token_counts", "weights")
RECOMPUTE_MODES = ("full", "moe")
SUBJECTS = {
    "bridge": "moeverify.subjects:bridge",
    "sharded": "moeverify.subjects:sharded",
    "gather": "moeverify.subjects:gather",
    "verl": "moeverify.subjects.verl:verl",
}
REPLAY_IMPLS = ("moeverify", "native", "verl")
RECEIVERS = {"fused": "moeverify.oracles.export.receiver:fused",
             "transformers": "moeverify.oracles.export.receiver_transformers:transformers_receiver"}  # the export check's receiver subcheck


@dataclasses.dataclass(frozen=True, kw_only=True)
class Option:
    name: str
    check: str  # the check that reads it
    help: str
    validate: Callable[[object], object]  # value -> normalised value, or raises ValueError with the reason
    flag: str | None = None  # command-line flag, where there is one
    metavar: str = "VALUE"


def _names(allowed: tuple[str, ...], what: str) -> Callable[[object], tuple[str, ...]]:
    def check(value: object) -> tuple[str, ...]:
        items = value.split(",") if isinstance(value, str) else value
        if not isinstance(items, list | tuple) or not items:
            raise ValueError(f"expected a non-empty list of {what} (or one comma-separated string), got {value!r}")
        names = tuple(str(i).strip() for i in items if isinstance(i, str))
        if len(names) != len(items) or not all(names):
            raise ValueError(f"expected {what} as strings, got {value!r}")
        unknown = [n for n in names if n not in allowed]
        if unknown:
            raise ValueError(f"unknown {what} {unknown}; known: {', '.join(allowed)}")
        return names
    return check


def _plugin(builtins: tuple[str, ...] | dict, what: str) -> Callable[[object], str]:
    def check(value: object) -> str:
        if not isinstance(value, str) or not value:
            raise ValueError(f"expected a non-empty string, got {value!r}")
        if value in builtins:
            return value
        plugins.parse(value, what=what, builtins=tuple(builtins))  # grammar only; loaded before launch
        return value
    return check


def _positive_int(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"expected a whole number >= 1, got {value!r}")
    return value


def _positive_seconds(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < float("inf"):
        raise ValueError(f"expected a finite number of seconds > 0, got {value!r}")
    return float(value)


def _bool(value: object) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"expected true or false, got {value!r}")
    return value


def _router_variants(value: object) -> object:
    from moeverify.oracles.replay.variants import select

    try:
        select(value)
    except UsageError as exc:
        raise ValueError(str(exc)) from None
    return value


def _path(value: object) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"expected a file path, got {value!r}")
    return value


OPTIONS: dict[str, Option] = {o.name: o for o in (
    Option(name="subject", check="export", flag="--subject", metavar="S", validate=_plugin(SUBJECTS, "subject"),
           help=f"export subject: {', '.join(SUBJECTS)}, package.module:factory or path/file.py:factory "
                "(default sharded)"),
    Option(name="lockstep_timeout", check="export", validate=_positive_seconds,
           help="seconds a rank waits for the others at each exported row (default: the collective timeout)"),
    Option(name="replay_impl", check="replay", flag="--replay-impl", metavar="IMPL",
           validate=_plugin(REPLAY_IMPLS, "replay implementation"),
           help=f"replay implementation under test: {', '.join(REPLAY_IMPLS)}, package.module:factory or "
                "path/file.py:factory (default moeverify)"),
    Option(name="router_variants", check="replay", validate=_router_variants,
           help="router configurations to replay: a name, a list of names, or 'full' (default: default)"),
    Option(name="replay_subchecks", check="replay", validate=_names(REPLAY_SUBCHECKS, "replay subchecks"),
           help=f"replay subchecks to run (default all: {', '.join(REPLAY_SUBCHECKS)})"),
    Option(name="replay_recompute", check="replay", validate=_names(RECOMPUTE_MODES, "recompute modes"),
           help=f"recompute modes the recompute subcheck drives (default all: {', '.join(RECOMPUTE_MODES)})"),
    Option(name="replay_seq_len", check="replay", validate=_positive_int, help="tokens per sequence (default 16)"),
    Option(name="replay_batch", check="replay", validate=_positive_int, help="sequences per micro-batch (default 2)"),
    Option(name="replay_microbatches", check="replay", validate=_positive_int,
           help="micro-batches per step (default 3, or 2 x pp under interleaving)"),
    Option(name="replay_notes_path", check="replay", validate=_path,
           help="rank 0 writes per-variant notes (drift agreement) to this JSON file"),
    Option(name="refresh", check="export", validate=_bool,
           help="export again after an optimizer-like update of every weight; subcheck refresh (default false)"),
    Option(name="receiver", check="export", flag="--receiver", metavar="R", validate=_plugin(RECEIVERS, "receiver"),
           help=f"load the export into a receiver ({', '.join(RECEIVERS)}, package.module:factory or "
                "path/file.py:factory) and compare what it holds; subcheck receiver, and receiver_reload "
                "with refresh (default: none)"),
)}


def validate(where: object, key: object, value: object) -> object:
    """The normalised value of option ``key``, or ``UsageError`` naming ``where``, the option and the reason."""
    option = OPTIONS.get(key) if isinstance(key, str) else None
    if option is None:
        raise UsageError(f"{where}: unknown option {key!r}; known options: {', '.join(OPTIONS)}")
    try:
        return option.validate(value)
    except ValueError as exc:
        raise UsageError(f"{where}: option {key}: {exc}") from None


def markdown_table() -> str:
    """The options as a Markdown table (docs/scenarios.md is checked against it)."""
    rows = ["| option | check | flag | meaning |", "|---|---|---|---|"]
    rows += [f"| `{o.name}` | {o.check} | {f'`{o.flag}`' if o.flag else ''} | {o.help} |" for o in OPTIONS.values()]
    return "\n".join(rows)
