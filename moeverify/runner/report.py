"""What a run hands back: one ``Result`` per scenario and check, the table, the JSON file, the exit code.

A JSON entry is the DESIGN.md record plus, where known, ``"peak_rss_mb": [per rank]`` (the rank's
peak RSS at the end of that check; peaks only grow within a group) and, for a scenario that did not
run, ``"skipped": reason`` with ``"passed": false``. Skipped entries do not change the exit code.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence

from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from moeverify.oracles.results import CheckRecord

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
_MAX_SHOWN = 3  # failure lines per row in the table; the JSON file holds them all


@dataclasses.dataclass(frozen=True, kw_only=True)
class Result:
    """One scenario x check outcome as the runner reports it."""

    record: CheckRecord
    skipped: str | None = None
    peak_rss_mb: tuple[float, ...] = ()
    interrupted: bool = False  # the run was stopped (Ctrl-C, SIGTERM) before this check finished

    @property
    def status(self) -> str:
        if self.interrupted:
            return "interrupted"
        if self.skipped is not None:
            return "skipped"
        if self.record.passed:
            return "passed"
        return "crashed" if self.record.error is not None else "failed"

    def as_dict(self) -> dict:
        out = self.record.as_dict()
        if self.skipped is not None:
            out["passed"] = False
            out["skipped"] = self.skipped
        if self.interrupted:
            out["interrupted"] = True
        if self.peak_rss_mb:
            out["peak_rss_mb"] = [None if math.isnan(v) else v for v in self.peak_rss_mb]
        return out

    @classmethod
    def skip(cls, *, scenario: str, check: str, reason: str) -> Result:
        return cls(record=CheckRecord(scenario=scenario, check=check, seconds=0.0, subchecks={}), skipped=reason)


def interrupted(planned: Sequence[tuple[str, str]], *, done: set[tuple[str, str]]) -> list[Result]:
    """Entries for the planned (scenario, check) pairs an interrupted run did not finish."""
    return [Result(record=CheckRecord(scenario=scenario, check=check, seconds=0.0, subchecks={},
                                      error="interrupted (Ctrl-C or SIGTERM) before this check finished"),
                   interrupted=True)
            for scenario, check in planned if (scenario, check) not in done]


def exit_code(results: Sequence[Result]) -> int:
    """0 when every check that ran passed (and at least one ran), else 1."""
    ran = [r for r in results if r.status != "skipped"]
    return EXIT_OK if ran and all(r.status == "passed" for r in ran) else EXIT_FAILED


def failing_lines(result: Result) -> list[str]:
    if result.skipped is not None:
        return [result.skipped]
    record = result.record
    if record.error is not None:
        return [record.error.splitlines()[0]]
    return [f"{name}: {sub['failures'][0] if sub['failures'] else 'failed'}"
            for name, sub in record.subchecks.items() if not sub["passed"]]


_STYLE = {"passed": "green", "failed": "red", "crashed": "bold red", "skipped": "yellow",
          "interrupted": "magenta"}


def table(results: Sequence[Result]) -> Table:
    """The result table: scenario, check, status, seconds, failing subchecks."""
    out = Table(title="moeverify run", show_lines=False)
    for column in ("scenario", "check", "result", "seconds", "failing subchecks"):
        out.add_column(column, justify="right" if column == "seconds" else "left", overflow="fold")
    for result in results:
        lines = failing_lines(result)
        if len(lines) > _MAX_SHOWN:
            lines = lines[:_MAX_SHOWN] + [f"... {len(lines) - _MAX_SHOWN} more (see --json)"]
        # Failure text is data (gloo errors look like markup: "[/__w/pytorch/...]"), never markup.
        out.add_row(Text(result.record.scenario), Text(result.record.check),
                    Text(result.status, style=_STYLE[result.status]), f"{result.record.seconds:.1f}",
                    Text("\n".join(lines)))
    return out


def summary(results: Sequence[Result]) -> str:
    counts = {s: sum(r.status == s for r in results) for s in _STYLE}
    return ", ".join(f"{n} {s}" for s, n in counts.items() if n) or "nothing ran"


def print_report(results: Sequence[Result], *, console: Console | None = None) -> None:
    console = console or Console()
    console.print(table(results))
    console.print(summary(results))
    for result in results:
        if result.status == "crashed":
            console.print(Text(f"\n{result.record.scenario} {result.record.check} crashed", style="bold red"))
            console.print(result.record.error, markup=False, highlight=False)


def to_json(results: Sequence[Result]) -> bytes:
    """The ``--json`` file's content: a list of records."""
    return (json.dumps([r.as_dict() for r in results], indent=2) + "\n").encode()
