"""The real runner under torchrun: passing groups, a raising rank, a hanging rank, exit codes.

The checks are the tiny ones of ``test_runner_checks.py`` (no model is built), so each test costs
little more than torchrun start-up and the megatron import on every rank.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET


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
          - {family: qwen3_moe, layout: {pp: 2}, options: {subject: sharded, replay_impl: native}, checks: [passing, echo]}
    """)
    assert run.code == 0, run.output
    assert [(r["scenario"], r["check"], r["passed"]) for r in run.records] == [
        ("qwen3_moe/ep2-dp2", "passing", True), ("qwen3_moe/pp2", "passing", True), ("qwen3_moe/pp2", "echo", True)]
    assert [len(r["peak_rss_mb"]) for r in run.records] == [2, 2, 2]
    assert "world size 2 on cpu: 2 scenario(s)" in run.output


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
    assert first.startswith("rank 1 raised ValueError: planted error on rank 1 in check raise1 at "
                            "test_runner_checks.py:"), crashed["error"]
    assert "Traceback (most recent call last)" in crashed["error"] and crashed["passed"] is False
    assert run.record("qwen3_moe/pp2", "passing2")["error"] == "not run: the scenario crashed in check raise1"
    assert run.record("qwen2/tp2", "passing")["passed"] is True  # the group restarted after the crash
    failed = run.record("qwen2/tp2", "failing")
    assert failed["subchecks"]["planted"]["failures"] == ["planted failure seen by rank 0"]
    cases = {(c.get("classname"), c.get("name")): c for c in ET.parse(run.junit).iter("testcase")}
    assert cases["qwen3_moe/pp2", "raise1"].find("error") is not None
    assert cases["qwen2/tp2", "failing"].find("failure") is not None


def test_runner_hang_is_killed_past_timeout_and_rest_runs(run_moeverify):
    run = run_moeverify("""
        defaults: {world_size: 2}
        scenarios:
          - {family: qwen3_moe, layout: {ep: 2}, checks: [hang1]}
          - {family: qwen2, layout: {tp: 2}, checks: [passing]}
    """, "--timeout", "10")
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
