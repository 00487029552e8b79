"""Check options as one flat table, derived from the checks' declarations (``moeverify.spec.checks``).

Scenario files (``options:``), the ``moeverify run`` flags, ``--list``-time checks (an option no selected
check reads is refused) and the docs' option table all read ``OPTIONS``; each entry is a field of a check's
options dataclass. Pure Python: no torch, so bad options are refused in a fraction of a second, before
torchrun starts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from moeverify.errors import UsageError
from moeverify.spec import checks
from moeverify.spec.checks import OptionMeta


@dataclasses.dataclass(frozen=True, kw_only=True)
class Option:
    """One option: its key (``name``), the check that reads it, and the field's declaration."""

    name: str
    check: str  # the check that reads it
    default: str  # in words
    meta: OptionMeta

    @property
    def flag(self) -> str | None:
        return self.meta.flag

    @property
    def flags(self) -> tuple[str, ...]:
        """Every flag that sets it: a switch (``OptionMeta.switch``) has ``--NAME`` and ``--no-NAME``."""
        if self.flag is None:
            return ()
        return (self.flag, "--no-" + self.flag.removeprefix("--")) if self.meta.switch else (self.flag,)

    def flag_for(self, value: object) -> str:
        """The flag that gave ``value`` (``--no-NAME`` for a switch set false), else the option's key."""
        if not self.flags:
            return self.name
        return self.flags[-1] if self.meta.switch and value is False else self.flags[0]

    @property
    def metavar(self) -> str:
        return self.meta.metavar

    @property
    def help(self) -> str:
        """The help line: what it means, and its default."""
        return f"{self.meta.help} (default {self.default})"

    @property
    def plugin(self) -> tuple[str, Mapping[str, str]] | None:
        """``(what, builtins)`` for an option that names a plugin, None otherwise."""
        if self.meta.plugin is None:
            return None
        return self.meta.plugin, self.meta.builtins or {}


def _table(specs: Mapping[str, checks.CheckSpec]) -> dict[str, Option]:
    table: dict[str, Option] = {}
    for spec in specs.values():
        for field, meta in spec.options.declared():
            if meta.key in table:
                raise AssertionError(f"option {meta.key} is declared by {table[meta.key].check} and {spec.name}")
            table[meta.key] = Option(
                name=meta.key, check=spec.name, meta=meta, default=spec.options.default_text(field, meta)
            )
    return table


OPTIONS: dict[str, Option] = _table(checks.CHECKS)


def validate(where: object, key: object, value: object) -> object:
    """The normalised value of option ``key``, or ``UsageError`` naming ``where``, the option and the reason."""
    option = OPTIONS.get(key) if isinstance(key, str) else None
    if option is None:
        raise UsageError(f"{where}: unknown option {key!r}; known options: {', '.join(OPTIONS)}")
    return checks.validate_option(where, option.meta, value)


def markdown_table() -> str:
    """The options as a Markdown table (docs/scenarios.md is checked against it)."""
    rows = ["| option | check | flag | default | meaning |", "|---|---|---|---|---|"]
    rows += [
        f"| `{o.name}` | {o.check} | {', '.join(f'`{f}`' for f in o.flags)} | {o.default} | {o.meta.help} |"
        for o in OPTIONS.values()
    ]
    return "\n".join(rows)
