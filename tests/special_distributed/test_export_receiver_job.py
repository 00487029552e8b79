"""The receiver subchecks with real Megatron-Bridge, 2 ranks: the receiver (one per rank) loads what the subject
streamed. On qwen3_moe EP 2, each built-in receiver on the ``sharded`` subject passes every subcheck (``receiver``,
``receiver_reload``, ``receiver_repeat``, ``receiver_ranks``, ``receiver_wake`` where it sleeps) with items
checked; each receiver mutant fails the subcheck it names; and each subject mutant of ``SUBJECT_MUTANTS`` is seen
through the ``fused`` receiver too (the engine would hold the subject's error). On a tied model (qwen2_tied) and an
MTP model (deepseek_v3_mtp EP 2), the ``fused`` control passes ``receiver_copies`` and the tied-head and MTP-draft
mutants fail it (the same torchrun: imports paid once)."""

from __future__ import annotations

from test_export_matrix import _failures, run_driver

from moeverify.oracles.export.receiver_mutants import APPLIES, CONTROLS, MUTANTS, SUBJECT_MUTANTS

FIRST, TIED, MTP = "qwen3_moe:ep2", "qwen2_tied:dp2", "deepseek_v3_mtp:ep2"


def _ran(sub: dict) -> list[str]:
    """Subchecks that checked nothing although they applied."""
    return [k for k, v in sub.items() if v["checked"] == 0 and not v.get("not_applicable")]


def test_receiver_controls_pass_and_mutants_are_caught(tmp_path):
    records = run_driver(tmp_path, nproc=2, scenarios=[FIRST, TIED, MTP], extra=["--receivers"], timeout=400)
    by = {(r["scenario"].split("/")[0], r["subject"]): r for r in records}
    first = {s for (f, s) in by if f == "qwen3_moe"}
    assert first == (
        {f"receiver:{n}" for n in CONTROLS}
        | {f"receiver-mutant:{n}" for n in MUTANTS if n not in APPLIES}
        | {f"subject-mutant:{n}" for n in SUBJECT_MUTANTS}
    )
    for name in CONTROLS:
        control = by["qwen3_moe", f"receiver:{name}"]
        assert control["passed"], _failures([control])
        assert {
            "receiver",
            "receiver_reload",
            "refresh",
            "refresh_delta",
            "receiver_repeat",
            "receiver_ranks",
            "receiver_wake",
            "receiver_copies",
        } <= set(control["subchecks"]), control["subchecks"].keys()
        assert _ran(control["subchecks"]) == [], control
        assert control["subchecks"]["receiver_ranks"]["checked"] > 0  # rank 1's receiver, every load of it
    assert by["qwen3_moe", "receiver:fused"]["subchecks"]["receiver_wake"]["checked"] > 0
    for family in ("qwen2_tied", "deepseek_v3_mtp"):  # the tied head, the MTP draft: held and compared
        control = by[family, "receiver:fused"]
        assert control["passed"], _failures([control])
        assert control["subchecks"]["receiver_copies"]["checked"] > 0 and _ran(control["subchecks"]) == [], control
    where = {
        "tied_head_stale": "qwen2_tied",
        "tied_head_one_element_stale": "qwen2_tied",
        "mtp_not_synced": "deepseek_v3_mtp",
    }
    for name, (_, subcheck) in MUTANTS.items():
        r = by[where.get(name, "qwen3_moe"), f"receiver-mutant:{name}"]
        assert r["error"] is None and not r["subchecks"][subcheck]["passed"], (name, r)
        if subcheck not in ("receiver", "receiver_reload"):  # the first load is right: the fault is the life cycle's
            assert r["subchecks"]["receiver"]["passed"], (name, r["subchecks"]["receiver"])
        if subcheck == "receiver_wake":  # the repeated load that puts the right bits back is not blamed for the cycle
            assert r["subchecks"]["receiver_repeat"]["passed"], (name, r["subchecks"]["receiver_repeat"])
    # a cycle's failure names the HF tensor of the part it changed, as receiver does (not the engine's w2_weight alone)
    woke = by["qwen3_moe", "receiver-mutant:wake_restores_one_element"]["subchecks"]["receiver_wake"]["failures"]
    assert any(
        f.startswith("after sleep/wake following the weight sync: ")
        and ".mlp.experts.w2_weight[0] = " in f
        and ".mlp.experts.0.down_proj.weight: 1 of " in f
        for f in woke
    ), woke
    ranks = by["qwen3_moe", "receiver-mutant:sync_rank0_only"]["subchecks"]
    assert ranks["receiver_reload"]["passed"], ranks["receiver_reload"]  # rank 0's engine worker got the sync
    shown = [f for f in ranks["receiver_ranks"]["failures"] if not f.startswith("... and ")]
    assert shown and {tuple(f.split(": ")[:3]) for f in shown} == {
        ("rank 1", "receiver_reload", "after the weight sync")
    }, ranks["receiver_ranks"]
    for name, subcheck in SUBJECT_MUTANTS.items():
        r = by["qwen3_moe", f"subject-mutant:{name}"]
        failures = r["subchecks"][subcheck]["failures"]
        assert r["error"] is None and failures, (name, r["subchecks"][subcheck])
        if subcheck == "receiver_reload":  # stale after the update only: the first load was the subject's fresh bits
            assert r["subchecks"]["receiver"]["passed"], (name, r["subchecks"]["receiver"])
            assert any(f.startswith("after the weight sync: ") for f in failures), failures
    # the subject's swapped fc1 halves reach the engine's fused w13: the receiver names the engine tensor and part
    swapped = by["qwen3_moe", "subject-mutant:gate_up_swapped"]["subchecks"]["receiver"]["failures"]
    assert any("w13_weight[" in f and "_proj.weight: " in f and "differ" in f for f in swapped), swapped
