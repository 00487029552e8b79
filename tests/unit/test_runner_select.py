"""Runner decisions made before any work: selection, option use, backends and skips."""

from __future__ import annotations

import pytest

from moeverify.errors import UsageError
from moeverify.runner.select import check_option_use, plan_backends, select
from moeverify.spec.layout import Layout
from moeverify.spec.scenario import Scenario


def _scenario(family="qwen3_moe", world_size=2, checks=("roundtrip", "export"), gpu_only=None, **layout):
    return Scenario(
        family=family, layout=Layout(**layout), world_size=world_size, checks=tuple(checks), gpu_only=gpu_only
    )


SCENARIOS = [
    _scenario(ep=2),
    _scenario(pp=2, checks=("roundtrip", "replay")),
    _scenario("qwen2", 1),
    _scenario("qwen2", 4, tp=2),
]


def test_select_filter_globs_any_match():
    got = select(SCENARIOS, filters=["qwen3_moe/*", "qwen2/tp1"])
    assert [s.name for s in got] == ["qwen3_moe/ep2-dp2", "qwen3_moe/pp2", "qwen2/tp1"]


def test_select_filter_matching_nothing_is_usage_error():
    with pytest.raises(UsageError, match=r"--filter nope\* matches none of the 4 scenarios; `moeverify run --list`"):
        select(SCENARIOS, filters=["nope*"])


def test_select_check_narrows_to_scenarios_that_run_it():
    got = select(SCENARIOS, check="replay")
    assert [(s.name, s.checks) for s in got] == [("qwen3_moe/pp2", ("replay",))]


def test_select_check_no_scenario_runs_it_is_usage_error():
    with pytest.raises(UsageError, match=r"--check export: none of the 1 selected scenarios runs 'export'"):
        select(SCENARIOS, filters=["qwen3_moe/pp2"], check="export")


def test_check_option_use_subject_without_export_is_rejected_with_fix():
    with pytest.raises(UsageError, match=r"--subject applies to the export check.*drop --subject or select export"):
        check_option_use([SCENARIOS[1]], {"subject": "sharded", "replay_impl": None})


def test_check_option_use_replay_impl_without_replay_is_rejected():
    with pytest.raises(UsageError, match=r"--replay-impl applies to the replay check"):
        check_option_use([SCENARIOS[0]], {"subject": None, "replay_impl": "native"})


def test_check_option_use_accepts_used_options():
    check_option_use(SCENARIOS, {"subject": "bridge", "replay_impl": "verl"})


def test_plan_backends_cpu_skips_gpu_only_with_reason():
    gpu = _scenario(cp=2, gpu_only="needs TE attention")
    groups, skipped, notices = plan_backends([*SCENARIOS, gpu], backend="cpu", gpu_count=0)
    assert [(g.world_size, g.backend, len(g.scenarios)) for g in groups] == [
        (1, "cpu", 1),
        (2, "cpu", 2),
        (4, "cpu", 1),
    ]
    assert [(r.record.scenario, r.record.check, r.skipped) for r in skipped] == [
        ("qwen3_moe/cp2", "roundtrip", "gpu only: needs TE attention"),
        ("qwen3_moe/cp2", "export", "gpu only: needs TE attention"),
    ]
    assert notices == []


def test_plan_backends_auto_uses_gpus_where_each_rank_has_one():
    groups, _, notices = plan_backends(SCENARIOS, backend="auto", gpu_count=2)
    assert [(g.world_size, g.backend) for g in groups] == [(1, "cuda"), (2, "cuda"), (4, "cpu")]
    assert notices == ["world size 4: 2 GPU(s) visible, fewer than 4 ranks: running on CPU ranks (gloo)"]


def test_plan_backends_cuda_without_gpu_is_usage_error():
    with pytest.raises(UsageError, match=r"--backend cuda: torch sees no GPU here; use --backend cpu"):
        plan_backends(SCENARIOS, backend="cuda", gpu_count=0)


def test_plan_backends_cuda_with_too_few_gpus_says_so():
    with pytest.raises(UsageError, match=r"world size 2 need 2 GPUs, this machine has 1; use --backend auto"):
        plan_backends(SCENARIOS, backend="cuda", gpu_count=1)


def test_plan_backends_more_than_8_cpu_ranks_is_refused():
    big = Scenario(family="qwen2", layout=Layout(), world_size=16, checks=("export",))
    with pytest.raises(UsageError, match=r"world size 16 exceeds the 8 CPU ranks"):
        plan_backends([big], backend="cpu", gpu_count=0)
