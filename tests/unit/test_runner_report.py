"""Runner outputs: result statuses, exit code, table, JSON and JUnit files."""

from __future__ import annotations

import io
import json
import math
import xml.etree.ElementTree as ET

from rich.console import Console

from moeverify.oracles.results import CheckRecord, Tally
from moeverify.runner import junit, report
from moeverify.runner.report import Result
from moeverify.spec import bug_classes


def _passed(scenario="qwen2/tp2", check="roundtrip") -> Result:
    t = Tally()
    t.ok(3)
    return Result(
        record=CheckRecord.from_tallies(scenario=scenario, check=check, seconds=1.25, tallies={"bitwise": t}),
        peak_rss_mb=(100.0, 101.5),
    )


def _failed() -> Result:
    good, bad = Tally(), Tally()
    good.ok()
    bad.fail("tensor w: 3 elements differ")
    bad.fail("tensor v: dtype bf16 != fp32")
    record = CheckRecord.from_tallies(
        scenario="qwen3_moe/ep2-dp2", check="export", seconds=2.0, tallies={"key_set": good, "bitwise": bad}
    )
    return Result(record=record)


def _crashed() -> Result:
    return Result(
        record=CheckRecord.crashed(
            scenario="qwen3_moe/pp2",
            check="replay",
            seconds=0.5,
            error="rank 1 raised ValueError: boom in check replay\nTraceback ...",
        ),
        peak_rss_mb=(100.0, math.nan),
    )


def _skipped() -> Result:
    return Result.skip(scenario="deepseek_v3/cp2", check="export", reason="gpu only: TE attention")


def test_result_status_of_each_kind():
    assert [r.status for r in (_passed(), _failed(), _crashed(), _skipped())] == [
        "passed",
        "failed",
        "crashed",
        "skipped",
    ]


def test_result_as_dict_is_design_record_plus_rss_and_skip():
    d = _passed().as_dict()
    assert d == {
        "scenario": "qwen2/tp2",
        "check": "roundtrip",
        "passed": True,
        "seconds": 1.25,
        "subchecks": {
            "bitwise": {
                "passed": True,
                "checked": 3,
                "failures": [],
                "guards": bug_classes.guards("roundtrip", "bitwise"),
            }
        },
        "not_run": {"key_set": bug_classes.guards("roundtrip", "key_set")},
        "peak_rss_mb": [100.0, 101.5],
    }
    assert _crashed().as_dict()["peak_rss_mb"] == [100.0, None]
    assert "peak_gpu_mb" not in d  # CPU ranks: no GPU figure at all


def test_gpu_peaks_come_from_the_ranks_end_events(tmp_path):
    """Each rank's ``end`` event carries its GPU peak (None on a CPU rank); the record lists them per rank."""
    from moeverify.runner.launch import _Collector
    from moeverify.runner.plan import append_line, events_path, results_path

    record = _passed(scenario="m/tp1", check="replay").record
    append_line(results_path(tmp_path), {"index": 0, "record": record.as_dict()})
    for rank, gpu in ((0, 2048.0), (1, None)):
        append_line(
            events_path(tmp_path, rank),
            {"event": "end", "index": 0, "check": "replay", "t": 0.0, "peak_rss_mb": 100.0 + rank, "peak_gpu_mb": gpu},
        )
    collector = _Collector(tmp_path, 2, on_result=lambda r: None)
    collector.poll()
    (result,) = collector.results()
    assert result.as_dict()["peak_gpu_mb"] == [2048.0, None]
    assert result.as_dict()["peak_rss_mb"] == [100.0, 101.0]
    skipped = _skipped().as_dict()
    assert (skipped["passed"], skipped["skipped"]) == (False, "gpu only: TE attention")


def test_exit_code_zero_only_when_every_run_check_passed():
    assert report.exit_code([_passed(), _skipped()]) == 0
    assert report.exit_code([_passed(), _failed()]) == 1
    assert report.exit_code([_passed(), _crashed()]) == 1


def test_exit_code_nothing_ran_is_failure():
    assert report.exit_code([_skipped()]) == 1
    assert report.exit_code([]) == 1


def test_table_shows_failing_subchecks_and_crash_line():
    out = io.StringIO()
    report.print_report(
        [_passed(), _failed(), _crashed(), _skipped()], console=Console(file=out, width=200, color_system=None)
    )
    text = out.getvalue()
    assert "bitwise: tensor w: 3 elements differ" in text
    assert "rank 1 raised ValueError: boom in check replay" in text
    assert "gpu only: TE attention" in text
    assert "1 passed, 1 failed, 1 crashed, 1 skipped" in text
    # the class of bug each failing subcheck guards against, once per (check, subcheck)
    assert f"export bitwise: {bug_classes.guards('export', 'bitwise')}" in " ".join(text.split())
    assert "export key_set" not in text


def test_write_json_is_a_list_of_records(tmp_path):
    path = tmp_path / "r.json"
    path.write_bytes(report.to_json([_passed(), _failed()]))
    data = json.loads(path.read_text())
    assert [d["passed"] for d in data] == [True, False]
    assert data[1]["subchecks"]["bitwise"]["failures"] == [
        "tensor w: 3 elements differ",
        "tensor v: dtype bf16 != fp32",
    ]


def test_junit_has_one_testcase_per_check_with_outcome(tmp_path):
    path = tmp_path / "j.xml"
    path.write_bytes(junit.to_bytes([_passed(), _failed(), _crashed(), _skipped()]))
    root = ET.parse(path).getroot()
    suite = root.find("testsuite")
    assert (suite.get("tests"), suite.get("failures"), suite.get("errors"), suite.get("skipped")) == (
        "4",
        "1",
        "1",
        "1",
    )
    cases = {(c.get("classname"), c.get("name")): c for c in suite.iter("testcase")}
    assert list(cases["qwen2/tp2", "roundtrip"]) == []
    failure = cases["qwen3_moe/ep2-dp2", "export"].find("failure")
    assert failure.get("message") == "failed subchecks: bitwise"
    assert "bitwise: tensor v: dtype bf16 != fp32" in failure.text
    assert failure.text.endswith(f"guards against: export bitwise: {bug_classes.guards('export', 'bitwise')}")
    error = cases["qwen3_moe/pp2", "replay"].find("error")
    assert error.get("message") == "rank 1 raised ValueError: boom in check replay" and "Traceback" in error.text
    assert cases["deepseek_v3/cp2", "export"].find("skipped").get("message") == "gpu only: TE attention"


def test_table_prints_failure_text_that_looks_like_markup():
    error = "rank 1 raised RuntimeError: [/__w/pytorch/gloo/pair.cc:561] Connection closed by peer [bold]"
    crashed = Result(record=CheckRecord.crashed(scenario="qwen3_moe/pp2", check="replay", seconds=1.0, error=error))
    out = io.StringIO()
    report.print_report([crashed], console=Console(file=out, width=300, color_system=None))
    assert out.getvalue().count("[/__w/pytorch/gloo/pair.cc:561] Connection closed by peer [bold]") == 2


def test_table_says_which_declared_subchecks_did_not_run_and_why_without_changing_the_exit_code():
    t = Tally()
    t.ok(3)
    ran = dict.fromkeys(
        (
            "lockstep",
            "slot_tables",
            "coverage",
            "conflicts",
            "replicas",
            "shape_dtype",
            "bitwise",
            "key_set",
            "reference_keys",
            "model_intact",
        ),
        t,
    )
    off = {
        "refresh": {
            "on": False,
            "why": "default for the built-in subject sharded without a receiver; --refresh "
            "or refresh: true turns it on",
        }
    }
    once = Result(
        record=CheckRecord.from_tallies(
            scenario="qwen3_moe/tp1", check="export", seconds=1.0, tallies=ran, decisions=off
        )
    )
    twice = Result(
        record=CheckRecord.from_tallies(
            scenario="qwen2/tp2",
            check="export",
            seconds=1.0,
            tallies=ran
            | dict.fromkeys(
                (
                    "refresh",
                    "refresh_delta",
                    "receiver",
                    "receiver_reload",
                    "receiver_repeat",
                    "receiver_wake",
                    "receiver_copies",
                    "receiver_ranks",
                ),
                t,
            ),
            decisions={"refresh": {"on": True, "why": "default with a receiver (fused); ..."}},
        )
    )
    assert report.not_run_line(once) == (
        "not run: refresh, receiver, receiver_reload, refresh_delta, receiver_ranks, "
        "receiver_repeat, receiver_wake, receiver_copies (refresh off: "
        f"{off['refresh']['why']})"
    )
    assert report.not_run_line(twice) is None and report.not_run_line(_skipped()) is None
    assert once.as_dict()["decisions"] == off and CheckRecord.from_dict(once.as_dict()).decisions == off
    assert report.exit_code([once, twice]) == 0  # not-run subchecks do not change the exit code
    out = io.StringIO()
    report.print_report([once, twice], console=Console(file=out, width=300, color_system=None))
    assert "receiver_wake, receiver_copies (refresh off: default for the built-in" in out.getvalue()
