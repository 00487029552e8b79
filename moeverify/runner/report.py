"""What a run hands back: one ``Result`` per scenario and check, the table, the JSON file, the exit code.

A JSON entry is the check's record (``oracles.results``; docs/design.md, "Public contract") plus, where known,
``"peak_rss_mb": [per rank]`` (the rank's peak RSS at the end of that check; peaks only grow within a group), on GPU
ranks ``"peak_gpu_mb": [per rank]`` (the most GPU memory their tensors held, likewise) and, for a scenario that did
not run, ``"skipped": reason`` with ``"passed": false``. Skipped entries do not change the exit code.
A check its scenario marks ``expect_fail`` carries ``"expected_failure": {finding, check, subchecks, reason,
outcome, status, message}``: failing as the finding says (``"status": "expected failure (F3)"``) does not change
the exit code; passing again (``"expected failure now passes: F3"``) does, like a failure.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence

from rich.console import Console
from rich.table import Table
from rich.text import Text

from moeverify.oracles.results import CheckRecord
from moeverify.spec import expectations
from moeverify.spec.expectations import ExpectedFailure, Verdict

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
_MAX_SHOWN = 3  # failure lines per row in the table; the JSON file holds them all


@dataclasses.dataclass(frozen=True, kw_only=True)
class Result:
    """One scenario x check outcome as the runner reports it."""

    record: CheckRecord
    skipped: str | None = None
    peak_rss_mb: tuple[float, ...] = ()
    peak_gpu_mb: tuple[float, ...] = ()  # GPU ranks only: the most their tensors held
    interrupted: bool = False  # the run was stopped (Ctrl-C, SIGTERM) before this check finished
    verdict: Verdict | None = None  # set when the scenario marks this check expect_fail (``expect``)

    @property
    def status(self) -> str:
        if self.interrupted:
            return "interrupted"
        if self.skipped is not None:
            return "skipped"
        if self.verdict is not None and self.verdict.outcome == expectations.EXPECTED:
            return "xfailed"
        if self.verdict is not None and self.verdict.outcome == expectations.NOW_PASSES:
            return "xpassed"
        if self.record.passed:
            return "passed"
        return "crashed" if self.record.error is not None else "failed"

    @property
    def label(self) -> str:
        """The status as the table shows it: ``expected failure (F3)`` names the finding."""
        if self.verdict is not None and self.status in ("xfailed", "xpassed"):
            return self.verdict.label
        return self.status

    def as_dict(self) -> dict:
        out = self.record.as_dict()
        if self.skipped is not None:
            out["passed"] = False
            out["skipped"] = self.skipped
        if self.interrupted:
            out["interrupted"] = True
        if self.verdict is not None and self.skipped is None and not self.interrupted:
            out["expected_failure"] = self.verdict.as_dict()
        if self.peak_rss_mb:
            out["peak_rss_mb"] = [None if math.isnan(v) else v for v in self.peak_rss_mb]
        if self.peak_gpu_mb:
            out["peak_gpu_mb"] = [None if math.isnan(v) else v for v in self.peak_gpu_mb]
        return out

    @classmethod
    def skip(cls, *, scenario: str, check: str, reason: str) -> Result:
        return cls(record=CheckRecord(scenario=scenario, check=check, seconds=0.0, subchecks={}), skipped=reason)


def interrupted(planned: Sequence[tuple[str, str]], *, done: set[tuple[str, str]]) -> list[Result]:
    """Entries for the planned (scenario, check) pairs an interrupted run did not finish."""
    return [
        Result(
            record=CheckRecord(
                scenario=scenario,
                check=check,
                seconds=0.0,
                subchecks={},
                error="interrupted (Ctrl-C or SIGTERM) before this check finished",
            ),
            interrupted=True,
        )
        for scenario, check in planned
        if (scenario, check) not in done
    ]


def expect(result: Result, marks: dict[tuple[str, str], ExpectedFailure]) -> Result:
    """``result`` judged against its scenario's ``expect_fail`` mark for its check, if there is one."""
    mark = marks.get((result.record.scenario, result.record.check))
    if mark is None or result.skipped is not None or result.interrupted:
        return result
    record = result.record
    failing = [name for name, sub in record.subchecks.items() if not sub["passed"]]
    verdict = expectations.judge(mark, passed=record.passed, crashed=record.error is not None, failing=failing)
    return dataclasses.replace(result, verdict=verdict)


def expect_marks(scenarios) -> dict[tuple[str, str], ExpectedFailure]:
    """(scenario name, check) -> the scenario's ``expect_fail`` entry for that check."""
    return {(s.name, e.check): e for s in scenarios for e in s.expect_fail}


_OK = ("passed", "xfailed")  # an expected failure failing as expected is no change


def exit_code(results: Sequence[Result]) -> int:
    """0 when every check that ran passed or failed exactly as its expect_fail mark says (and at least one
    ran), else 1: an expected failure that now passes is a change too."""
    ran = [r for r in results if r.status != "skipped"]
    return EXIT_OK if ran and all(r.status in _OK for r in ran) else EXIT_FAILED


def failing_lines(result: Result) -> list[str]:
    if result.skipped is not None:
        return [result.skipped]
    if result.verdict is not None and result.status != "xfailed":
        return [result.verdict.message] + _record_lines(result)
    return _record_lines(result)


def not_run_line(result: Result) -> str | None:
    """``not run: NAME, ...`` for a check whose declared subchecks did not all run (an option off, a narrowed
    subcheck list), with why where a default rule decided it (``refresh off: default for the built-in subject
    ...``); None when every declared subcheck ran. Not-run subchecks do not change the exit code."""
    record = result.record
    if result.skipped is not None or result.interrupted or record.error is not None or not record.not_run:
        return None
    why = [f"{key} off: {d['why']}" for key, d in record.decisions.items() if not d.get("on") and d.get("why")]
    return f"not run: {', '.join(record.not_run)}" + "".join(f" ({w})" for w in why)


def _record_lines(result: Result) -> list[str]:
    record = result.record
    if record.error is not None:
        return [record.error.splitlines()[0]]
    return [
        f"{name}: {sub['failures'][0] if sub['failures'] else 'failed'}"
        for name, sub in record.subchecks.items()
        if not sub["passed"]
    ]


_STYLE = {
    "passed": "green",
    "xfailed": "cyan",
    "failed": "red",
    "xpassed": "bold red",
    "crashed": "bold red",
    "skipped": "yellow",
    "interrupted": "magenta",
}
_SUMMARY_NAME = {"xfailed": "expected failure(s)", "xpassed": "expected failure(s) now passing"}


def table(results: Sequence[Result]) -> Table:
    """The result table: scenario, check, status, seconds, failing subchecks (and the subchecks not run)."""
    out = Table(title="moeverify run", show_lines=False)
    for column in ("scenario", "check", "result", "seconds", "failing subchecks"):
        out.add_column(column, justify="right" if column == "seconds" else "left", overflow="fold")
    for result in results:
        lines = failing_lines(result)
        if len(lines) > _MAX_SHOWN:
            lines = lines[:_MAX_SHOWN] + [f"... {len(lines) - _MAX_SHOWN} more (see --json)"]
        if (line := not_run_line(result)) is not None:
            lines.append(line)
        # Failure text is data (gloo errors look like markup: "[/__w/pytorch/...]"), never markup.
        out.add_row(
            Text(result.record.scenario),
            Text(result.record.check),
            Text(result.label, style=_STYLE[result.status]),
            f"{result.record.seconds:.1f}",
            Text("\n".join(lines)),
        )
    return out


def summary(results: Sequence[Result]) -> str:
    counts = {s: sum(r.status == s for r in results) for s in _STYLE}
    return ", ".join(f"{n} {_SUMMARY_NAME.get(s, s)}" for s, n in counts.items() if n) or "nothing ran"


def guard_lines(results: Sequence[Result]) -> list[str]:
    """One line per (check, subcheck) that failed in a failing result: the class of bug it exists for (the
    record's ``guards``), so the reader of a red table sees what kind of bug each failure points at."""
    seen: dict[tuple[str, str], str] = {}
    for result in results:
        if result.status not in ("failed", "xpassed"):
            continue
        for name, sub in result.record.subchecks.items():
            if not sub["passed"] and sub.get("guards"):
                seen.setdefault((result.record.check, name), sub["guards"])
    return [f"{check} {name}: {what}" for (check, name), what in seen.items()]


def print_report(results: Sequence[Result], *, console: Console | None = None) -> None:
    console = console or Console()
    console.print(table(results))
    console.print(Text(summary(results)))
    if lines := guard_lines(results):
        console.print(Text("What the failing subchecks guard against:\n" + "\n".join(f"  {line}" for line in lines)))
    for result in results:
        if result.status == "crashed" and result.record.error is not None:  # crashed: the record holds an error
            console.print(Text(f"\n{result.record.scenario} {result.record.check} crashed", style="bold red"))
            console.print(Text(result.record.error), highlight=False)  # the rank's text: no markup, no emoji


def to_json(results: Sequence[Result]) -> bytes:
    """The ``--json`` file's content: a list of records."""
    return (json.dumps([r.as_dict() for r in results], indent=2) + "\n").encode()
