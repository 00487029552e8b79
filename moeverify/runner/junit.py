"""JUnit XML for CI dashboards: one testcase per scenario x check.

A failed check is a ``<failure>`` (its failing subchecks in the message, every failure line in the
text, then the class of bug each failing subcheck guards against); a crashed one (a rank raised, hung or died) an
``<error>`` with the rank's traceback, an interrupted one (Ctrl-C, SIGTERM) an ``<error>`` as well; a skipped scenario a
``<skipped>`` with the reason. A check failing as its ``expect_fail`` mark says is a ``<skipped>`` naming the finding;
one that now passes is a ``<failure>`` saying so.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from collections.abc import Sequence

from moeverify.runner.report import Result, failing_lines, guard_lines


def _testcase(result: Result) -> ET.Element:
    record = result.record
    case = ET.Element("testcase", classname=record.scenario, name=record.check, time=f"{record.seconds:.3f}")
    status = result.status
    if status == "skipped":
        ET.SubElement(case, "skipped", message=result.skipped or "")
    elif status == "xfailed" and result.verdict is not None:  # x-statuses come from the verdict
        skipped = ET.SubElement(case, "skipped", type="ExpectedFailure", message=result.verdict.message)
        skipped.text = "\n".join(record.failure_lines())
    elif status == "xpassed" and result.verdict is not None:
        failure = ET.SubElement(case, "failure", type="ExpectedFailureNowPasses", message=result.verdict.message)
        failure.text = "\n".join(failing_lines(result))
    elif status in ("crashed", "interrupted") and record.error is not None:  # both carry the error text
        error = ET.SubElement(case, "error", type=status.capitalize(), message=record.error.splitlines()[0])
        error.text = record.error
    elif status == "failed":
        failed = [name for name, sub in record.subchecks.items() if not sub["passed"]]
        message = f"failed subchecks: {', '.join(failed)}" if failed else "no subcheck ran"
        failure = ET.SubElement(case, "failure", type="CheckFailed", message=message)
        guards = [f"guards against: {line}" for line in guard_lines([result])]
        failure.text = "\n".join((record.failure_lines() or failing_lines(result)) + guards)
    return case


def to_xml(results: Sequence[Result], *, suite: str = "moeverify") -> ET.ElementTree[ET.Element]:
    counts = {
        s: sum(r.status == s for r in results)
        for s in ("failed", "crashed", "skipped", "interrupted", "xfailed", "xpassed")
    }
    counts["skipped"] += counts.pop("xfailed")  # JUnit has no expected failure: a skip that names the finding
    counts["failed"] += counts.pop("xpassed")
    counts["crashed"] += counts.pop("interrupted")  # JUnit knows errors, failures and skips
    total_s = sum(r.record.seconds for r in results)
    root = ET.Element(
        "testsuites",
        name=suite,
        tests=str(len(results)),
        failures=str(counts["failed"]),
        errors=str(counts["crashed"]),
        skipped=str(counts["skipped"]),
        time=f"{total_s:.3f}",
    )
    node = ET.SubElement(
        root,
        "testsuite",
        name=suite,
        tests=str(len(results)),
        failures=str(counts["failed"]),
        errors=str(counts["crashed"]),
        skipped=str(counts["skipped"]),
        time=f"{total_s:.3f}",
    )
    for result in results:
        node.append(_testcase(result))
    tree: ET.ElementTree[ET.Element] = ET.ElementTree(root)
    ET.indent(tree)
    return tree


def to_bytes(results: Sequence[Result]) -> bytes:
    """The ``--junit`` file's content."""
    return ET.tostring(to_xml(results).getroot(), encoding="utf-8", xml_declaration=True) + b"\n"
