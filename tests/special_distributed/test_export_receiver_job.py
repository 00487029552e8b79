"""The receiver subcheck with real Megatron-Bridge, 2 ranks (qwen3_moe, EP 2): the fused receiver passes
``receiver`` and ``receiver_reload`` with items checked; each receiver mutant fails the subcheck it names."""

from __future__ import annotations

from test_export_matrix import _failures, run_driver

from moeverify.oracles.export.receiver_mutants import MUTANTS


def test_receiver_controls_pass_and_mutants_are_caught(tmp_path):
    records = run_driver(tmp_path, nproc=2, scenarios=["qwen3_moe:ep2"], extra=["--receivers"], timeout=300)
    by = {r["subject"]: r for r in records}
    assert set(by) == {"receiver:fused"} | {f"receiver-mutant:{n}" for n in MUTANTS}
    control = by["receiver:fused"]
    assert control["passed"], _failures([control])
    assert all(v["checked"] > 0 for v in control["subchecks"].values()), control
    for name, (_, subcheck) in MUTANTS.items():
        r = by[f"receiver-mutant:{name}"]
        assert r["error"] is None and not r["subchecks"][subcheck]["passed"], (name, r)
