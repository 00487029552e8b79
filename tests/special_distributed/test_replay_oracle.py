"""The replay check under the runner (``moeverify run``, torchrun, gloo CPU ranks): each implementation passes
on 1 and 2 ranks for both MoE families, and every mutant makes its subcheck fail with the reason.

Each case writes a one-scenario file to ``tmp_path`` and runs ``python -m moeverify run FILE --json OUT``
(the runner's per-scenario deadline, per-rank stacks and blame included) in a subprocess with a timeout;
a failing case prints the record and the tail of the runner's output.
"""

import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from moeverify.oracles.replay.faulty import CAUGHT_BY

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = int(os.environ.get("MOEVERIFY_TEST_TIMEOUT_S", "900"))
_RUNS = itertools.count()


def run_replay(
    tmp_path: Path,
    family: str,
    *,
    world_size: int,
    impl: str,
    layout: dict | None = None,
    options: dict | None = None,
    env: dict | None = None,
) -> dict:
    """Run the replay check on one scenario through the runner; return its record (asserting there is one)."""
    tag = f"{family}-{impl.rsplit(':', 1)[-1]}-{next(_RUNS)}"
    scenario = {
        "family": family,
        "world_size": world_size,
        "layout": layout or {},
        "checks": ["replay"],
        "options": {"replay_impl": impl, **(options or {})},
    }
    scenario_file, out = tmp_path / f"{tag}.yaml", tmp_path / f"{tag}.json"
    scenario_file.write_text(json.dumps({"version": 1, "scenarios": [scenario]}))  # JSON is YAML
    cmd = [
        sys.executable,
        "-m",
        "moeverify",
        "run",
        str(scenario_file),
        "--json",
        str(out),
        "--run-dir",
        str(tmp_path / f"{tag}.run"),
        "--timeout",
        str(TIMEOUT_S),
    ]
    proc = subprocess.run(
        cmd, cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S + 180, env={**os.environ, **(env or {})}
    )
    output = (proc.stdout + proc.stderr)[-4000:]
    assert out.exists(), f"no records from {' '.join(cmd)} (exit {proc.returncode}):\n{output}"
    records = json.loads(out.read_text())
    assert len(records) == 1 and records[0]["check"] == "replay", f"{records}\n{output}"
    (record,) = records
    assert proc.returncode == (0 if record["passed"] else 1), f"exit {proc.returncode} for {record}\n{output}"
    return record


def _summary(record: dict) -> str:
    lines = [f"{record['scenario']}: passed={record['passed']} error={record.get('error')}"]
    for name, sub in record["subchecks"].items():
        lines.append(f"  {name}: passed={sub['passed']} checked={sub['checked']} {sub['failures'][:3]}")
    return "\n".join(lines)


SUBCHECKS = {
    "equivalence",
    "drift",
    "recompute",
    "cross_layout",
    "native_parity",
    "backward_order",
    "validation",
    "token_counts",
    "weights",
}
# Findings in the peers: both serve recomputes in queue order (Megatron-Core's replay_backward_list.pop(0)), so
# a reverse-order or summed-loss backward recomputes with another micro-batch's routes; and both accept some
# bad routes (routes for a layer the model lacks; verl also a table one row short) without a refusal.
PEER_FINDINGS = {
    "backward_order": "it replayed another micro-batch's routes",
    "validation": "accepted routes with another model's layer count",
}
# token_counts: verl drops the padding mask (aux losses and counts include padding tokens); native runs
# megatron-core 0.19.2's expert-bias count, which lines the padding mask up with experts (deepseek_v3 has
# expert bias: T == E counts wrong, T != E raises).
COUNT_FINDINGS = {("verl", "qwen3_moe"), ("verl", "deepseek_v3"), ("native", "deepseek_v3")}


IMPL_CASES = {
    "qwen3_moe/tp1": ("qwen3_moe", 1, {}),
    "qwen3_moe/ep2": ("qwen3_moe", 2, {"ep": 2}),
    "deepseek_v3/tp1": ("deepseek_v3", 1, {}),
    "deepseek_v3/ep2": ("deepseek_v3", 2, {"ep": 2}),
}
# make test runs each peer on one family per world size; moeverify itself runs every subcheck of both families
# on 1 and 2 ranks in the release matrix (scenarios/release.yaml), so its cases here, and the rest, are release-only
QUICK_IMPL_CASES = {
    ("native", "qwen3_moe/tp1"),
    ("verl", "qwen3_moe/tp1"),
    ("native", "deepseek_v3/ep2"),
    ("verl", "deepseek_v3/ep2"),
}


@pytest.mark.parametrize(
    "family,world_size,layout,impl",
    [
        pytest.param(
            *case, impl, id=f"{name}-{impl}", marks=() if (impl, name) in QUICK_IMPL_CASES else pytest.mark.release
        )
        for name, case in IMPL_CASES.items()
        for impl in ("moeverify", "native", "verl")
    ],
)
def test_replay_check_passes_for_impl(tmp_path, family, world_size, layout, impl):
    record = run_replay(tmp_path, family, world_size=world_size, layout=layout, impl=impl)
    assert set(record["subchecks"]) == SUBCHECKS
    assert [name for name, sub in record["subchecks"].items() if sub["checked"] == 0] == [], _summary(record)
    findings = dict(PEER_FINDINGS) if impl != "moeverify" else {}
    if (impl, family) in COUNT_FINDINGS:
        findings["token_counts"] = "token_counts T"
    for name, sub in record["subchecks"].items():
        if name in findings:
            assert not sub["passed"] and any(findings[name] in f for f in sub["failures"]), _summary(record)
        else:
            assert sub["passed"], _summary(record)
    if impl != "moeverify":  # validation's smallest bad inputs, one token without a route or with an expert twice
        for case in ("short table", "expert twice in a row"):  # (bug_classes' minimal): both peers route them
            assert any(f"accepted routes with {case}" in f for f in record["subchecks"]["validation"]["failures"]), (
                _summary(record)
            )


@pytest.mark.release  # make test runs the same cases in process (tests/unit/test_replay_minimal_mutants.py)
@pytest.mark.parametrize("mutant,subcheck,reason", [(m, sub, reason) for (m, sub), reason in CAUGHT_BY.items()])
def test_replay_subcheck_fails_for_mutant(tmp_path, mutant, subcheck, reason):
    if mutant == "fifo_recompute":  # moeverify's queue-order twin passes recompute (backward in forward order)
        passing = run_replay(
            tmp_path,
            "qwen3_moe",
            world_size=1,
            impl=f"moeverify.oracles.replay.faulty:{mutant}",
            options={"replay_subchecks": ["recompute"], "replay_recompute": ["full"]},
        )
        assert passing["passed"], _summary(passing)
    record = run_replay(
        tmp_path,
        "qwen3_moe",
        world_size=1,
        impl=f"moeverify.oracles.replay.faulty:{mutant}",
        options={"replay_subchecks": [subcheck]},
    )
    sub = record["subchecks"][subcheck]
    assert not record["passed"] and not sub["passed"], _summary(record)
    assert any(reason in f for f in sub["failures"]), _summary(record)


@pytest.mark.release  # make test keeps the mutant catalogue's reversed_slots (caught by weights) at the tiny width
def test_replay_weights_catch_right_ids_in_another_slot_order_at_top8_of_64(tmp_path):
    # deepseek_v3_wide: top-8 of 64 in 8 groups with an expert bias; a sum of 8 probabilities depends on its order.
    # The control (moeverify passes weights on this family, both variants) is scenarios/families_ci.yaml's run.
    options = {"replay_subchecks": ["weights"], "replay_microbatches": 1}  # one micro-batch: ~65 of 2,048 probs differ
    record = run_replay(
        tmp_path,
        "deepseek_v3_wide",
        world_size=1,
        impl="moeverify.oracles.replay.faulty:reversed_slots",
        options=options,
    )
    sub = record["subchecks"]["weights"]
    assert not sub["passed"], _summary(record)
    assert any("replay vs recorded pass: router probs" in f for f in sub["failures"]), _summary(record)


def test_replay_equivalence_catches_tied_scores_summed_in_another_slot_order(tmp_path):
    # tied_scores: router rows equal in pairs, so logits tie in every row; top-8 of 64. A replay that breaks ties by
    # expert id instead of as native top-k does gives every forward bitwise and the gradients below the router not
    # (what an H200 showed in bf16 at Qwen3-30B-A3B's width); moeverify's own order passes the same case.
    options = {"replay_subchecks": ["equivalence"], "router_variants": ["tied_scores"], "replay_microbatches": 1}
    control = run_replay(tmp_path, "deepseek_v3_wide", world_size=1, impl="moeverify", options=options)
    assert control["passed"] and control["subchecks"]["equivalence"]["checked"] > 0, _summary(control)
    record = run_replay(
        tmp_path, "deepseek_v3_wide", world_size=1, impl="moeverify.oracles.replay.faulty:ties_by_id", options=options
    )
    sub = record["subchecks"]["equivalence"]
    assert not sub["passed"], _summary(record)
    assert all("replay vs plain pass: grad" in f or "more failure" in f for f in sub["failures"]), _summary(record)


def test_replay_equivalence_under_the_slot_order_finding_still_checks_gradients(tmp_path):
    # plain top-8 of 64 (sigmoid, no groups): the no-grad pass routes with other probs (F12); the native-based
    # mutant replays that order, so equivalence takes native grad-mode routing in that order as its reference,
    # and its detached probabilities still fail there, on the gradients
    options = {
        "replay_subchecks": ["equivalence"],
        "router_variants": ["sigmoid"],
        "replay_microbatches": 1,
        "replay_notes_path": str(tmp_path / "notes.json"),
    }
    record = run_replay(
        tmp_path,
        "deepseek_v3_wide",
        world_size=1,
        impl="moeverify.oracles.replay.faulty:detached_probs",
        options=options,
    )
    sub = record["subchecks"]["equivalence"]
    assert not sub["passed"] and any("replay vs plain pass: grad" in f for f in sub["failures"]), _summary(record)
    notes = json.loads((tmp_path / "notes.json").read_text())["variants"]["sigmoid"]["notes"]
    assert "F12" in notes["findings"] and "no-grad slot order" in notes["equivalence"], notes


def test_replay_mutant_no_recompute_replay_reports_unconsumed_routes(tmp_path):
    record = run_replay(
        tmp_path,
        "qwen3_moe",
        world_size=1,
        impl="moeverify.oracles.replay.faulty:no_recompute_replay",
        options={"replay_subchecks": ["recompute"], "replay_recompute": ["full"]},
    )
    failures = record["subchecks"]["recompute"]["failures"]
    assert any("recompute route(s) never consumed" in f for f in failures), _summary(record)


def test_replay_mutant_on_two_ranks_names_the_rank(tmp_path):
    # drift: few failures per rank (one per layer and micro-batch), so rank 1's fit in the kept 50
    record = run_replay(
        tmp_path,
        "deepseek_v3",
        world_size=2,
        layout={"ep": 2},
        impl="moeverify.oracles.replay.faulty:wrong_microbatch",
        options={"replay_subchecks": ["drift"]},
    )
    failures = record["subchecks"]["drift"]["failures"]
    assert not record["passed"]
    assert any(f.startswith("rank 1 ") for f in failures), _summary(record)


def test_replay_one_rank_crash_ends_quickly_naming_the_rank(tmp_path):
    # Rank 1 raises inside a replayed forward; rank 0 goes on into the expert all-to-all it left. The check ends
    # after the agreement timeout (20 s here), not the collective timeout (900 s here), and names rank 1.
    t0 = time.monotonic()
    record = run_replay(
        tmp_path,
        "qwen3_moe",
        world_size=2,
        layout={"ep": 2},
        impl="moeverify.oracles.replay.faulty:one_rank_crash",
        options={"replay_subchecks": ["drift"]},
        env={"MOEVERIFY_AGREE_TIMEOUT_S": "20", "MOEVERIFY_COLLECTIVE_TIMEOUT_S": "900"},
    )
    seconds = time.monotonic() - t0
    assert not record["passed"]
    error = record.get("error") or ""
    assert "RankDisagreement" in error and "rank 1 raised RuntimeError: one_rank_crash" in error, _summary(record)
    assert "rank(s) [0] did not end this step within 20 s" in error, _summary(record)
    assert seconds < 600, f"{seconds:.0f} s: the check waited for the collective timeout"


def test_replay_in_bf16_on_two_ranks_passes_every_subcheck_and_notes_f13(tmp_path):
    """``replay_dtype: bf16`` under EP2 (expert bias, padding): every subcheck passes bitwise on Megatron's bf16
    builds, and token_counts notes finding F13 (the count buffer held in bf16) with its evidence."""
    options = {"replay_dtype": "bf16", "replay_notes_path": str(tmp_path / "notes.json")}
    record = run_replay(tmp_path, "deepseek_v3", world_size=2, layout={"ep": 2}, impl="moeverify", options=options)
    assert record["passed"] and set(record["subchecks"]) == SUBCHECKS, _summary(record)
    assert all(sub["checked"] > 0 for sub in record["subchecks"].values()), _summary(record)
    notes = json.loads((tmp_path / "notes.json").read_text())["variants"]["default"]["notes"]
    evidence = notes["findings"]["F13"]["evidence"]
    assert evidence and {e["dtype"] for e in evidence} == {"torch.bfloat16"}, notes["findings"]
