"""Check names -> the function that runs them. Imported lazily so that a check's heavy imports are
paid only by the scenarios that use it.

A check function has the signature ``run(ctx: CheckContext) -> dict[str, Tally]``. It runs on every rank
of the group; the tallies of rank 0 become the scenario's record, so a check gathers what it needs to
rank 0 itself.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from moeverify.errors import UsageError

CHECKS: dict[str, str] = {
    "roundtrip": "moeverify.oracles.roundtrip:run",
    "export": "moeverify.oracles.export:run",
    "replay": "moeverify.oracles.replay.oracle:run",
    "hf_parity": "moeverify.oracles.hf_parity:run",
}


def check_names() -> tuple[str, ...]:
    return tuple(CHECKS)


def resolve(name: str) -> Callable:
    """The check function for ``name``; ``UsageError`` naming the known checks otherwise."""
    if name not in CHECKS:
        raise UsageError(f"unknown check {name!r}; known checks: {', '.join(CHECKS)}")
    module, _, attr = CHECKS[name].partition(":")
    return getattr(importlib.import_module(module), attr)
