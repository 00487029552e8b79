"""Every timeout moeverify waits with, declared once: its meaning, how to override it, its default.

Users read the values from here (``timeouts.COLLECTIVE_S``, ...); the modules that always exposed one keep
their public name as an alias of this table's value (``runtime.DEFAULT_TIMEOUT_S``, ``cli.DEFAULT_TIMEOUT_S``,
``runtime.outcome.AGREE_TIMEOUT_S``, ``runner.launch.STARTUP_SLACK_S``). An environment override is read when
the value is: importing never raises, so ``moeverify --help`` works whatever the environment holds, and a value
that is not a positive number of seconds is refused where it is used (``UsageError`` naming the variable, what it
holds and what was expected). ``check()`` reads every override at once: ``moeverify run`` calls it before any
rank starts (exit 2). ``markdown_table()`` renders the table in docs/design.md (a test checks the two agree).
Pure Python: no torch.
"""

from __future__ import annotations

import dataclasses
import os

from moeverify.errors import UsageError

# The longest wait any entry (and ``--timeout``) accepts: about 115 days. Longer ones overflow what they are
# handed to (``datetime.timedelta`` of a process group, ``faulthandler``'s watchdog, a store's deadline).
MAX_S = 1e7


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Timeout:
    """One timeout: ``name`` (the attribute of this module), its ``default_s``, its ``env`` override (or the
    command-line flag that sets it, ``flag``), what waits on it (``meaning``)."""

    name: str
    default_s: float
    meaning: str
    env: str | None = None
    flag: str | None = None
    derived: str | None = None  # how it follows from another entry (not overridable itself)
    # none of env, flag or derived: fixed (a heartbeat, a grace period: part of a protocol, not a user's wait)

    def seconds(self, environ=os.environ) -> float:
        """The value: the environment override when set, else the default."""
        raw = environ.get(self.env) if self.env else None
        if raw is None or raw == "":
            return self.default_s
        try:
            value = float(raw)
        except ValueError:
            value = float("nan")
        if not 0 < value <= MAX_S:
            raise UsageError(
                f"{self.env}={raw!r}: expected a positive number of seconds, at most {MAX_S:.0f} ({self.meaning})"
            )
        return value


TABLE: tuple[Timeout, ...] = (
    Timeout(
        name="SCENARIO_S",
        default_s=600.0,
        flag="--timeout",
        meaning="per-scenario deadline on every rank: a rank past it writes every thread's stack and ends hard",
    ),
    Timeout(
        name="STARTUP_S",
        default_s=300.0,
        env="MOEVERIFY_STARTUP_TIMEOUT_S",
        meaning="a rank's imports and rendezvous, before its first scenario (whatever --timeout says)",
    ),
    Timeout(
        name="STARTUP_SLACK_S",
        default_s=360.0,
        derived="STARTUP_S + 60",
        meaning="the launcher's wait for ranks to start: past the ranks' own start-up watchdog, so theirs fires first",
    ),
    Timeout(
        name="COLLECTIVE_S",
        default_s=300.0,
        env="MOEVERIFY_COLLECTIVE_TIMEOUT_S",
        meaning="process-group timeout of every collective a check runs (also export's lockstep_timeout default)",
    ),
    Timeout(
        name="AGREE_S",
        default_s=60.0,
        env="MOEVERIFY_AGREE_TIMEOUT_S",
        meaning="a rank that raised waits this long for the others to report before ending the group",
    ),
    Timeout(
        name="NODE_JOIN_S",
        default_s=300.0,
        env="MOEVERIFY_NODE_JOIN_TIMEOUT_S",
        meaning="multi-node run: node 0 waits this long for every node to join",
    ),
    Timeout(
        name="NODE_REPORT_S",
        default_s=60.0,
        env="MOEVERIFY_NODE_REPORT_TIMEOUT_S",
        meaning="multi-node run: node 0 waits this long for a node's report once its launch ended",
    ),
    Timeout(
        name="DUMP_COLLECTIVE_S",
        default_s=600.0,
        env="MOEVERIFY_DUMP_COLLECTIVE_TIMEOUT_S",
        meaning="autopatch recording: the dump's own gloo group (ranks settle each dump step on it)",
    ),
    Timeout(
        name="ENGINE_S",
        default_s=900.0,
        env="MOEVERIFY_ENGINE_TIMEOUT_S",
        meaning="a real engine's process (moeverify.engines): a whole job, or one step of a serving engine; past it "
        "the engine's process group is killed",
    ),
    Timeout(
        name="LAUNCH_GRACE_S",
        default_s=60.0,
        meaning="after --timeout, before the launcher kills a group whose ranks' own watchdogs did not fire",
    ),
    Timeout(name="NODE_BEAT_S", default_s=1.0, meaning="multi-node run: how often each node writes its heartbeat"),
    Timeout(
        name="NODE_DEAD_AFTER_S",
        default_s=15.0,
        meaning="multi-node run: a node whose heartbeat is older than this is named dead",
    ),
)
_BY_NAME = {t.name: t for t in TABLE}

_DERIVED = {"STARTUP_SLACK_S": lambda environ: value("STARTUP_S", environ) + 60.0}


def value(name: str, environ=os.environ) -> float:
    """The seconds of the entry ``name`` now (its override read now); ``UsageError`` naming a bad override."""
    if name in _DERIVED:
        return _DERIVED[name](environ)
    return _BY_NAME[name].seconds(environ)


def check(environ=os.environ) -> None:
    """Refuse a bad override of any entry (``UsageError`` naming the first bad variable); nothing else."""
    for t in TABLE:
        value(t.name, environ)


def __getattr__(name: str) -> float:
    """``timeouts.COLLECTIVE_S`` and the other entries: read when used, never at import."""
    if name in _BY_NAME:
        return value(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def markdown_table() -> str:
    """The table as docs/design.md shows it (between its ``timeouts`` markers)."""
    lines = ["| timeout | default (s) | override | meaning |", "|---|---|---|---|"]
    for t in TABLE:
        override = f"`{t.env}`" if t.env else f"`{t.flag}`" if t.flag else f"= {t.derived}" if t.derived else "fixed"
        lines.append(f"| `timeouts.{t.name}` | {t.default_s:g} | {override} | {t.meaning} |")
    return "\n".join(lines) + "\n"
