"""Result records shared by every check (docs/design.md, "The checks" and "Public contract").

A record is ``{"scenario", "check", "passed", "seconds", "subchecks": {NAME: {"passed", "checked",
"failures"}}}``. A subcheck that checked zero items fails: an oracle that looked at nothing proves nothing,
unless the oracle found it not applicable to the model: then its entry also carries ``"not_applicable": REASON``
(``checked`` 0, no failures), and the record passes only if some other subcheck checked items.

Every subcheck of a built-in check also carries ``"guards": CLASS``, the class of bug it exists for, and a record
whose subchecks ran lists the declared subchecks that did not (an option off, ``replay_subchecks``) under
``"not_run": {NAME: CLASS}``, so a reader sees what was and was not checked (``moeverify.spec.bug_classes``). Options
whose value a default rule decided (export's ``refresh``: on for a user's subject) are listed under
``"decisions": {KEY: {"on": bool, "why": str}}`` (``CheckOptions.decisions``).
"""

from __future__ import annotations

import dataclasses

from moeverify.spec import bug_classes

MAX_FAILURES_KEPT = 50  # per subcheck; the count of the rest is reported in one line


@dataclasses.dataclass(kw_only=True, slots=True)
class Tally:
    """Accumulates one subcheck: items checked and failure messages."""

    checked: int = 0
    failures: list[str] = dataclasses.field(default_factory=list)
    dropped: int = 0
    not_applicable: str | None = None  # why the subcheck does not apply to this model (it then checks nothing)

    def skip(self, reason: str) -> None:
        """Mark the subcheck not applicable; one that already counted items cannot be."""
        if self.checked:
            raise RuntimeError(f"a subcheck that checked {self.checked} item(s) cannot be not applicable: {reason}")
        self.not_applicable = reason

    def ok(self, n: int = 1) -> None:
        self.checked += n

    def fail(self, message: str, *, n: int = 1) -> None:
        self.checked += n
        if len(self.failures) < MAX_FAILURES_KEPT:
            self.failures.append(message)
        else:
            self.dropped += 1

    def check(self, condition: bool, message: str) -> bool:
        """Count one item; record ``message`` when ``condition`` is false. Returns ``condition``."""
        if condition:
            self.ok()
        else:
            self.fail(message)
        return condition

    @property
    def passed(self) -> bool:
        if self.not_applicable is not None:
            return self.checked == 0
        return self.checked > 0 and not self.failures

    def as_dict(self) -> dict:
        if self.not_applicable is not None and self.checked == 0:
            return {"passed": True, "checked": 0, "failures": [], "not_applicable": self.not_applicable}
        failures = list(self.failures)
        if self.checked == 0:
            failures.append("checked 0 items: an oracle that checked nothing fails")
        if self.dropped:
            failures.append(f"... and {self.dropped} more failure(s) not shown")
        return {"passed": self.passed, "checked": self.checked, "failures": failures}


@dataclasses.dataclass(kw_only=True, slots=True)
class CheckRecord:
    """One check's result on one scenario."""

    scenario: str
    check: str
    seconds: float
    subchecks: dict[str, dict]
    error: str | None = None  # set when the check raised or a rank died instead of finishing
    not_run: dict[str, str] = dataclasses.field(default_factory=dict)  # declared subchecks that did not run
    decisions: dict[str, dict] = dataclasses.field(default_factory=dict)  # options a rule decided, and why

    @property
    def passed(self) -> bool:
        ran = [s for s in self.subchecks.values() if "not_applicable" not in s]
        return self.error is None and bool(ran) and all(s["passed"] for s in self.subchecks.values())

    @classmethod
    def from_tallies(
        cls,
        *,
        scenario: str,
        check: str,
        seconds: float,
        tallies: dict[str, Tally],
        decisions: dict[str, dict] | None = None,
    ) -> CheckRecord:
        subchecks = {}
        for name, t in tallies.items():
            subchecks[name] = t.as_dict()
            if (what := bug_classes.guards(check, name)) is not None:
                subchecks[name]["guards"] = what
        not_run = (
            {  # a declared subcheck always names its guard: the filter only narrows the type
                name: what
                for name in bug_classes.subchecks(check)
                if name not in tallies and (what := bug_classes.guards(check, name)) is not None
            }
            if tallies
            else {}
        )
        return cls(
            scenario=scenario,
            check=check,
            seconds=seconds,
            subchecks=subchecks,
            not_run=not_run,
            decisions=dict(decisions or {}),
        )

    @classmethod
    def crashed(cls, *, scenario: str, check: str, seconds: float, error: str) -> CheckRecord:
        return cls(scenario=scenario, check=check, seconds=seconds, subchecks={}, error=error)

    def as_dict(self) -> dict:
        out = {
            "scenario": self.scenario,
            "check": self.check,
            "passed": self.passed,
            "seconds": round(self.seconds, 3),
            "subchecks": self.subchecks,
        }
        if self.error is not None:
            out["error"] = self.error
        if self.not_run:
            out["not_run"] = dict(self.not_run)
        if self.decisions:
            out["decisions"] = {k: dict(v) for k, v in self.decisions.items()}
        return out

    @classmethod
    def from_dict(cls, data: dict) -> CheckRecord:
        return cls(
            scenario=data["scenario"],
            check=data["check"],
            seconds=float(data["seconds"]),
            subchecks=dict(data["subchecks"]),
            error=data.get("error"),
            not_run=dict(data.get("not_run", {})),
            decisions=dict(data.get("decisions", {})),
        )

    def failure_lines(self) -> list[str]:
        lines = [] if self.error is None else [self.error]
        for name, sub in self.subchecks.items():
            lines += [f"{name}: {msg}" for msg in sub["failures"]]
        return lines
