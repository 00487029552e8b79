"""The receiver subcheck with real Megatron-Bridge, 2 ranks (qwen3_moe, EP 2): each built-in receiver passes
``receiver`` and ``receiver_reload`` with items checked; each receiver mutant fails the subcheck it names."""

from __future__ import annotations

from test_export_matrix import _failures, run_driver

from moeverify.oracles.export.receiver_mutants import CONTROLS, MUTANTS


def test_receiver_controls_pass_and_mutants_are_caught(tmp_path):
    records = run_driver(tmp_path, nproc=2, scenarios=["qwen3_moe:ep2"], extra=["--receivers"], timeout=300)
    by = {r["subject"]: r for r in records}
    assert set(by) == {f"receiver:{n}" for n in CONTROLS} | {f"receiver-mutant:{n}" for n in MUTANTS}
    for name in CONTROLS:
        control = by[f"receiver:{name}"]
        assert control["passed"], _failures([control])
        assert set(control["subchecks"]) == {"receiver", "receiver_reload"}
        assert [k for k, v in control["subchecks"].items() if v["checked"] == 0] == [], control
    for name, (_, subcheck) in MUTANTS.items():
        r = by[f"receiver-mutant:{name}"]
        assert r["error"] is None and not r["subchecks"][subcheck]["passed"], (name, r)
