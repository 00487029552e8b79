"""The real runner under torchrun: passing groups, a raising rank, a hanging rank, exit codes.

The checks are the tiny ones of ``test_runner_checks.py`` (no model is built), so each test costs
little more than torchrun start-up and the megatron import on every rank.
"""

from __future__ import annotations

import json
import os
import signal
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest


def test_runner_passing_group_on_1_rank(run_moeverify):
    run = run_moeverify("""
        scenarios:
          - {family: qwen2, world_size: 1, checks: [passing]}
    """)
    assert run.code == 0, run.output
    (record,) = run.records
    assert (record["scenario"], record["check"], record["passed"]) == ("qwen2/tp1", "passing", True)
    assert len(record["peak_rss_mb"]) == 1 and record["peak_rss_mb"][0] > 50


def test_runner_passing_group_on_2_ranks_passes_scenario_options(run_moeverify):
    run = run_moeverify("""
        defaults: {world_size: 2, checks: [passing]}
        scenarios:
          - {family: qwen3_moe, layout: {ep: 2}}
          - {family: qwen3_moe, layout: {pp: 2}, options: {subject: sharded, replay_impl: native},
             checks: [passing, echo]}
    """)
    assert run.code == 0, run.output
    assert [(r["scenario"], r["check"], r["passed"]) for r in run.records] == [
        ("qwen3_moe/ep2-dp2", "passing", True),
        ("qwen3_moe/pp2", "passing", True),
        ("qwen3_moe/pp2", "echo", True),
    ]
    assert [len(r["peak_rss_mb"]) for r in run.records] == [2, 2, 2]
    assert "world size 2 on cpu: 2 scenario(s)" in run.output


@pytest.mark.release  # the 1- and 2-rank groups prove the same path; the matrix runs 4-rank groups
def test_runner_passing_group_on_4_ranks(run_moeverify):
    run = run_moeverify("""
        scenarios:
          - {family: qwen3_moe, world_size: 4, layout: {pp: 2, ep: 2}, checks: [passing]}
          - {family: qwen2, world_size: 4, layout: {tp: 2, pp: 2}, checks: [passing]}
    """)
    assert run.code == 0, run.output
    assert [r["scenario"] for r in run.records] == ["qwen3_moe/pp2-ep2-dp2", "qwen2/tp2-pp2"]
    assert [r["subchecks"]["collective"]["checked"] for r in run.records] == [2, 2]


def test_runner_raise_on_rank_1_is_reported_and_rest_runs(run_moeverify):
    run = run_moeverify("""
        defaults: {world_size: 2}
        scenarios:
          - {family: qwen3_moe, layout: {ep: 2}, checks: [passing]}
          - {family: qwen3_moe, layout: {pp: 2}, checks: [raise1, passing2]}
          - {family: qwen2, layout: {tp: 2}, checks: [passing, failing]}
    """)
    assert run.code == 1, run.output
    crashed = run.record("qwen3_moe/pp2", "raise1")
    first = crashed["error"].splitlines()[0]
    assert first.startswith(
        "rank 1 raised ValueError: planted error on rank 1 in check raise1 at test_runner_checks.py:"
    ), crashed["error"]
    assert "Traceback (most recent call last)" in crashed["error"] and crashed["passed"] is False
    assert run.record("qwen3_moe/pp2", "passing2")["error"] == "not run: the scenario crashed in check raise1"
    assert run.record("qwen2/tp2", "passing")["passed"] is True  # the group restarted after the crash
    failed = run.record("qwen2/tp2", "failing")
    assert failed["subchecks"]["planted"]["failures"] == ["planted failure seen by rank 0"]
    cases = {(c.get("classname"), c.get("name")): c for c in ET.parse(run.junit).iter("testcase")}
    assert cases["qwen3_moe/pp2", "raise1"].find("error") is not None
    assert cases["qwen2/tp2", "failing"].find("failure") is not None


def test_runner_hang_is_killed_past_timeout_and_rest_runs(run_moeverify):
    run = run_moeverify(
        """
        defaults: {world_size: 2}
        scenarios:
          - {family: qwen3_moe, layout: {ep: 2}, checks: [hang1]}
          - {family: qwen2, layout: {tp: 2}, checks: [passing]}
    """,
        "--timeout",
        "10",
    )
    assert run.code == 1, run.output
    hung = run.record("qwen3_moe/ep2-dp2", "hang1")
    assert " timed out in check hang1 at test_runner_checks.py:" in hung["error"].splitlines()[0], hung["error"]
    assert "still running after --timeout 10 s" in hung["error"]
    assert "hang_on_rank1" in hung["error"]  # the stack of the hung check is in the record
    assert 9 <= hung["seconds"] <= 60
    assert run.record("qwen2/tp2", "passing")["passed"] is True


def test_runner_usage_error_exits_2_before_torchrun(run_moeverify):
    run = run_moeverify("""
        scenarios:
          - {family: qwen3_moe, world_size: 2, layout: {tp: 2}, checks: [passing]}
    """)
    assert run.code == 2
    assert "scenario qwen3_moe/tp2: invalid layout: MoE with tp 2 > 1 needs sp" in run.output
    assert "Traceback" not in run.output and run.records == []


def test_runner_sigkill_of_a_rank_names_that_rank_and_the_signal(run_moeverify):
    run = run_moeverify("""
        defaults: {world_size: 2}
        scenarios:
          - {family: qwen3_moe, layout: {ep: 2}, checks: [kill1]}
          - {family: qwen2, layout: {tp: 2}, checks: [passing]}
    """)
    assert run.code == 1, run.output
    first = run.record("qwen3_moe/ep2-dp2", "kill1")["error"].splitlines()[0]
    assert first.startswith("rank 1 was killed in check kill1"), first
    assert "signal 9 (SIGKILL)" in first and "out-of-memory" in first, first
    assert run.record("qwen2/tp2", "passing")["passed"] is True


def _processes_mentioning(text: str) -> list[str]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline:
            found.append(f"{pid}: {cmdline[:200]}")
    return found


def _wait_for(predicate, *, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def _started(run_dir: Path, check: str) -> bool:
    for events in run_dir.glob("world*/attempt*/rank*.events.jsonl"):
        if f'"check": "{check}"' in events.read_text(errors="replace"):
            return True
    return False


_SLEEPY = """
    defaults: {world_size: 2}
    scenarios:
      - {family: qwen2, layout: {tp: 2}, checks: [passing]}
      - {family: qwen3_moe, layout: {ep: 2}, checks: [sleep, passing]}
      - {family: qwen2, layout: {pp: 2}, checks: [passing]}
"""


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_runner_interrupt_keeps_results_marks_the_rest_and_ends_its_ranks(run_moeverify, sig):
    proc = run_moeverify(_SLEEPY, background=True)
    run_dir = run_moeverify.tmp_path / "run"
    out_json = run_moeverify.tmp_path / "out.json"
    # The JSON file is kept current: the first result is in it while the run goes on.
    _wait_for(lambda: out_json.exists() and json.loads(out_json.read_text()), timeout_s=150, what="a first result")
    _wait_for(lambda: _started(run_dir, "sleep"), timeout_s=60, what="the sleep check")
    proc.send_signal(sig)
    run = run_moeverify.finish(proc, timeout_s=90)
    assert run.code == 130, run.output
    assert run.record("qwen2/tp2", "passing")["passed"] is True
    for scenario, check in (("qwen3_moe/ep2-dp2", "sleep"), ("qwen3_moe/ep2-dp2", "passing"), ("qwen2/pp2", "passing")):
        record = run.record(scenario, check)
        assert record["interrupted"] is True and record["passed"] is False, record
    cases = {(c.get("classname"), c.get("name")): c for c in ET.parse(run.junit).iter("testcase")}
    assert cases["qwen3_moe/ep2-dp2", "sleep"].find("error").get("type") == "Interrupted"
    assert "interrupted" in run.output
    assert _processes_mentioning(str(run_dir)) == []


def test_runner_killed_parent_takes_torchrun_and_its_ranks_with_it(run_moeverify):
    proc = run_moeverify(_SLEEPY, background=True)
    run_dir = run_moeverify.tmp_path / "run"
    _wait_for(lambda: _started(run_dir, "sleep"), timeout_s=150, what="the sleep check")
    assert len(_processes_mentioning(str(run_dir))) >= 3  # torchrun and two ranks
    proc.kill()
    proc.communicate(timeout=30)
    leftover = _wait_for(
        lambda: not _processes_mentioning(str(run_dir)) or None,
        timeout_s=60,
        what=f"the ranks to end: {_processes_mentioning(str(run_dir))}",
    )
    assert leftover
