"""Expected failures: a known finding marked in a scenario file, so that exit codes mean "something changed".

A scenario (or matrix block) may say that one of its checks fails because of a known finding::

    expect_fail:
      - {finding: F3, check: hf_parity, subchecks: [layers, logits], reason: "bridge routes with sigmoid"}

The check's outcome is then judged against that statement (``judge``):

- exactly the named subchecks fail: ``expected failure (F3)``; not counted as a regression (exit 0);
- the check passes, or only some of the named subchecks still fail: ``expected failure now passes: F3 ...``,
  counted (exit 1): the finding changed, so the file must change too;
- any other subcheck fails, or the check crashes: a plain failure or crash, as without the mark.

Entries are validated when the file is loaded: the finding id, a check the scenario runs, and subchecks that
check declares (``CheckSpec.subchecks`` in ``moeverify.spec.checks``).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Collection, Mapping, Sequence

from moeverify.spec.checks import CHECKS
from moeverify.spec.yaml_file import Where, error

_KEYS = frozenset({"finding", "check", "subchecks", "reason"})
_FINDING = re.compile(r"[A-Z]+[0-9]+")  # the README's findings table ids: F3, M1

EXPECTED, NOW_PASSES = "expected failure", "expected failure now passes"


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ExpectedFailure:
    """One known finding: which check of the scenario fails, in which subchecks, and why."""

    finding: str
    check: str
    subchecks: tuple[str, ...]
    reason: str = ""

    def as_dict(self) -> dict:
        return {"finding": self.finding, "check": self.check, "subchecks": list(self.subchecks), "reason": self.reason}

    @classmethod
    def from_dict(cls, data: Mapping) -> ExpectedFailure:
        return cls(
            finding=data["finding"],
            check=data["check"],
            subchecks=tuple(data["subchecks"]),
            reason=data.get("reason", ""),
        )


def subcheck_names(check: str) -> tuple[str, ...] | None:
    """The subcheck names ``check`` declares; None for a check that declares none (an extra check)."""
    spec = CHECKS.get(check)
    return spec.declared_subchecks if spec is not None and spec.declared_subchecks else None


def parse(
    where: Where, value: object, *, checks: Sequence[str], options: Mapping[str, object] | None = None
) -> tuple[ExpectedFailure, ...]:
    """``expect_fail:`` of one scenario, whose checks are ``checks``; ``UsageError`` naming the rule otherwise.

    ``options`` (the scenario's validated check options) may narrow which subchecks run, and so can fail
    (``replay_subchecks``: ``CheckSpec.selected_subchecks``).
    """
    if value is None:
        return ()
    if not isinstance(value, list) or not value:
        raise error(
            where,
            f"expect_fail must be a non-empty list of {{finding, check, subchecks, reason}} mappings, got {value!r}",
        )
    out: list[ExpectedFailure] = []
    for entry in value:
        out.append(_entry(where.at(entry), entry, checks=checks, options=options or {}))
    dups = sorted({e.check for e in out if sum(o.check == e.check for o in out) > 1})
    if dups:
        raise error(
            where, f"expect_fail names check(s) {dups} twice; give one entry per check, its subchecks listed together"
        )
    return tuple(out)


def _entry(where: Where, entry: object, *, checks: Sequence[str], options: Mapping[str, object]) -> ExpectedFailure:
    if not isinstance(entry, Mapping):
        raise error(where, f"expect_fail entry must be a mapping {{finding, check, subchecks, reason}}, got {entry!r}")
    unknown = sorted(str(k) for k in entry if k not in _KEYS)
    missing = sorted(k for k in ("finding", "check", "subchecks") if k not in entry)
    if unknown or missing:
        raise error(
            where,
            f"expect_fail entry: {'unknown key(s) ' + str(unknown) if unknown else ''}"
            f"{'; ' if unknown and missing else ''}{'missing ' + str(missing) if missing else ''}; "
            f"allowed: {sorted(_KEYS)}",
        )
    finding, check, subs, reason = entry["finding"], entry["check"], entry["subchecks"], entry.get("reason", "")
    if not isinstance(finding, str) or not _FINDING.fullmatch(finding):
        raise error(
            where,
            f"expect_fail: finding must be a findings-table id such as F3 (see the README's findings), got {finding!r}",
        )
    if check not in checks:
        raise error(
            where,
            f"expect_fail ({finding}): check {check!r} is not run by this scenario (its checks: {', '.join(checks)})",
        )
    if subcheck_names(check) is None:
        raise error(
            where, f"expect_fail ({finding}): check {check!r} declares no subchecks, so none can be expected to fail"
        )
    known, narrowed_by = CHECKS[check].selected_subchecks(options)
    if not isinstance(subs, list) or not subs or not all(isinstance(s, str) for s in subs):
        raise error(
            where,
            f"expect_fail ({finding}): subchecks must be a non-empty list of {check}'s subcheck "
            f"names ({', '.join(known)}), got {subs!r}",
        )
    bad = [s for s in subs if s not in known]
    if bad:
        raise error(
            where,
            f"expect_fail ({finding}): unknown {check} subcheck(s) {bad}"
            f"{f' (or not run: {narrowed_by})' if narrowed_by else ''}; "
            f"known: {', '.join(known)}",
        )
    if len(set(subs)) != len(subs):
        raise error(where, f"expect_fail ({finding}): a subcheck is listed twice in {subs}")
    if not isinstance(reason, str):
        raise error(where, f"expect_fail ({finding}): reason must be a string, got {reason!r}")
    return ExpectedFailure(finding=finding, check=check, subchecks=tuple(subs), reason=reason.strip())


# ------------------------------------------------------------------------------------------------ judging
@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Verdict:
    """How a check's outcome relates to its expected failure."""

    expected: ExpectedFailure
    outcome: str  # EXPECTED, NOW_PASSES, or "failed otherwise" (the mark does not apply: a regression)
    message: str

    @property
    def label(self) -> str:
        if self.outcome == EXPECTED:
            return f"{EXPECTED} ({self.expected.finding})"
        if self.outcome == NOW_PASSES:
            return f"{NOW_PASSES}: {self.expected.finding}"
        return f"failed otherwise (not {self.expected.finding})"

    def as_dict(self) -> dict:
        return {**self.expected.as_dict(), "outcome": self.outcome, "status": self.label, "message": self.message}


def judge(expected: ExpectedFailure, *, passed: bool, crashed: bool, failing: Collection[str]) -> Verdict:
    """The verdict of one check marked ``expected``: its record passed, crashed, or failed in ``failing``."""
    named = f"{expected.finding} {expected.check} {', '.join(expected.subchecks)}"
    if crashed:
        return Verdict(
            expected=expected,
            outcome="failed otherwise",
            message=f"crashed, while {expected.finding} makes {expected.check} fail in "
            f"{', '.join(expected.subchecks)} without crashing",
        )
    failing = set(failing)
    extra = sorted(failing - set(expected.subchecks))
    if extra:
        return Verdict(
            expected=expected,
            outcome="failed otherwise",
            message=f"{', '.join(extra)} failed too: not explained by {expected.finding}",
        )
    if not passed and not failing:
        return Verdict(expected=expected, outcome="failed otherwise", message="failed with no failing subcheck")
    now_passing = [s for s in expected.subchecks if s not in failing]
    if passed or now_passing:
        still = [s for s in expected.subchecks if s in failing]
        return Verdict(
            expected=expected,
            outcome=NOW_PASSES,
            message=f"{NOW_PASSES}: {expected.finding} {expected.check} {', '.join(now_passing)}"
            + (f" ({', '.join(still)} still fails)" if still else "")
            + ": the finding changed; update or drop expect_fail in the scenario file",
        )
    return Verdict(
        expected=expected,
        outcome=EXPECTED,
        message=f"{EXPECTED}: {named}" + (f" ({expected.reason})" if expected.reason else ""),
    )
