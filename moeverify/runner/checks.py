"""Check names a run knows: the registry's, plus extra ``name=target`` entries from the environment.

``MOEVERIFY_EXTRA_CHECKS="name=module:function,other=path/to/file.py:function"`` adds checks without
editing the registry: the runner's own tests register tiny checks this way (a passing one, one that
raises on one rank, one that hangs). torchrun passes the environment on, so every rank sees them.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping

from moeverify import plugins
from moeverify.errors import UsageError
from moeverify.oracles import registry

ENV_VAR = "MOEVERIFY_EXTRA_CHECKS"


def extra_checks(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """Parse ``MOEVERIFY_EXTRA_CHECKS`` into name -> "module:function" (or "file.py:function")."""
    raw = (os.environ if environ is None else environ).get(ENV_VAR, "")
    out: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in raw.split(","))):
        name, sep, target = item.partition("=")
        module, colon, attr = target.rpartition(":")
        if not sep or not name or not colon or not module or not attr:
            raise UsageError(f"{ENV_VAR}: entry {item!r} is not name=module:function or name=file.py:function")
        if name in registry.CHECKS:
            raise UsageError(f"{ENV_VAR}: {name!r} is a built-in check; pick another name")
        out[name] = target
    return out


def check_names(environ: Mapping[str, str] | None = None) -> tuple[str, ...]:
    return registry.check_names() + tuple(extra_checks(environ))


def resolve(name: str) -> Callable:
    """The check function for ``name``: an extra one if registered so, else the registry's."""
    extras = extra_checks()
    if name in extras:
        return plugins.load(extras[name], what=f"{ENV_VAR} check {name!r}")
    return registry.resolve(name)
