"""Every mutant of the catalogue makes the export check FAIL with its named subchecks, and no other
subcheck fails beyond its declared collateral. All mutants run in ONE 2-rank torchrun over five
scenarios chosen so that every mutant applies somewhere (EP, fp32 router bias, tied embeddings,
more than one query group per rank, Qwen3-Next's gated delta net). The unmutated control and the stale-state
mutants (``fails=("refresh",)``, and the ``refresh_delta`` ones: not the live post-step model) run with the
``refresh`` subcheck: a second export after a weight update."""

from __future__ import annotations

from test_export_matrix import run_driver

from moeverify.oracles.export.mutants import MUTANTS

SCENARIOS = ["qwen3_moe:ep2", "deepseek_v3:ep2", "qwen2_tied:pp2", "qwen2:pp2", "qwen3_next:tp2-sp"]
# reference_keys' broken implementation is the installed bridge itself (finding F10): GPT-OSS under EP2 with an
# expert FFN width of 1 never exports down_proj; the correct sharded subject sends it
BRIDGE_FINDING = "scenarios/findings/gpt_oss_ffn1/config.json+intermediate_size=1:ep2"


def test_mutant_catalogue_each_fails_with_named_subchecks(tmp_path):
    records = run_driver(
        tmp_path,
        nproc=2,
        scenarios=[*SCENARIOS, BRIDGE_FINDING],
        subjects=("sharded",),
        extra=["--mutants", "--refresh"],
    )
    finding = [r for r in records if r["scenario"].startswith("model:")]
    records = [r for r in records if not r["scenario"].startswith("model:")]
    _assert_bridge_finding_named(finding)
    by_name = {m.name: m for m in MUTANTS}
    seen = set()
    problems = []
    for r in records:
        failed = {k for k, v in r["subchecks"].items() if not v["passed"]}
        if r["subject"] == "sharded":
            if failed or not {"refresh", "refresh_delta"} <= set(r["subchecks"]):
                problems.append(
                    f"{r['scenario']}: unmutated sharded failed {failed} (refresh run: {'refresh' in r['subchecks']})"
                )
            continue
        m = by_name[r["subject"].removeprefix("mutant:")]
        seen.add(m.name)
        if r["error"]:
            problems.append(f"{r['scenario']} {m.name}: crashed {r['error'][:300]}")
        if not set(m.fails) <= failed:
            problems.append(f"{r['scenario']} {m.name}: expected {m.fails} to fail, failed {sorted(failed)}")
        # refresh_delta reads the same second export element by element: whatever fails refresh may fail it too
        allowed = set(m.fails) | set(m.collateral) | ({"refresh_delta"} if "refresh" in m.fails else set())
        if failed - allowed:
            problems.append(f"{r['scenario']} {m.name}: unexpected failures {sorted(failed - allowed)}")
    assert not problems, "\n".join(problems)
    assert seen == set(by_name), f"mutants never applied: {set(by_name) - seen}"
    assert len(MUTANTS) >= 14


def _assert_bridge_finding_named(records):
    assert len(records) == 1 and records[0]["subject"] == "sharded", records
    sub = records[0]["subchecks"]
    assert {k for k, v in sub.items() if not v["passed"]} == {"key_set", "reference_keys"}, sub
    assert sub["refresh"]["passed"], sub["refresh"]  # the subject is right, before and after a weight update
    (msg,) = sub["reference_keys"]["failures"]
    assert msg.startswith(
        "the reference (Megatron-Bridge's export_hf_weights) dropped 4 tensor(s) of the source "
        "checkpoint: ['model.layers.0.mlp.experts.down_proj (8, 1, 64)'"
    ), msg
    assert "the subject exported 4 of them (2048 element(s)), unverified" in msg, msg
