"""The receiver subcheck with real Megatron-Bridge, 2 ranks (qwen3_moe, EP 2): the receiver loads what the subject
streamed. Each built-in receiver on the ``sharded`` subject passes every subcheck, ``receiver`` and
``receiver_reload`` with items checked; each receiver mutant fails the subcheck it names; and each subject mutant of
``SUBJECT_MUTANTS`` is seen through the ``fused`` receiver too (the engine would hold the subject's error)."""

from __future__ import annotations

from test_export_matrix import _failures, run_driver

from moeverify.oracles.export.receiver_mutants import CONTROLS, MUTANTS, SUBJECT_MUTANTS


def test_receiver_controls_pass_and_mutants_are_caught(tmp_path):
    records = run_driver(tmp_path, nproc=2, scenarios=["qwen3_moe:ep2"], extra=["--receivers"], timeout=300)
    by = {r["subject"]: r for r in records}
    assert set(by) == ({f"receiver:{n}" for n in CONTROLS} | {f"receiver-mutant:{n}" for n in MUTANTS}
                       | {f"subject-mutant:{n}" for n in SUBJECT_MUTANTS})
    for name in CONTROLS:
        control = by[f"receiver:{name}"]
        assert control["passed"], _failures([control])
        assert {"receiver", "receiver_reload", "refresh"} <= set(control["subchecks"])
        assert [k for k, v in control["subchecks"].items() if v["checked"] == 0] == [], control
    for name, (_, subcheck) in MUTANTS.items():
        r = by[f"receiver-mutant:{name}"]
        assert r["error"] is None and not r["subchecks"][subcheck]["passed"], (name, r)
    for name, subcheck in SUBJECT_MUTANTS.items():
        r = by[f"subject-mutant:{name}"]
        failures = r["subchecks"][subcheck]["failures"]
        assert r["error"] is None and failures, (name, r["subchecks"][subcheck])
        if subcheck == "receiver_reload":  # stale after the update only: the first load was the subject's fresh bits
            assert r["subchecks"]["receiver"]["passed"], (name, r["subchecks"]["receiver"])
            assert any(f.startswith("after the weight sync: ") for f in failures), failures
    # the subject's swapped fc1 halves reach the engine's fused w13: the receiver names the engine tensor and part
    swapped = by["subject-mutant:gate_up_swapped"]["subchecks"]["receiver"]["failures"]
    assert any("w13_weight[" in f and "_proj.weight: " in f and "differ" in f for f in swapped), swapped
