"""In-job R2 (``MOEVERIFY_ROUTER_REPLAY=r2``) under context parallel 2, pipeline parallel 2 and PP2 x VPP2 (interleaved
1F1B), 2 ranks each, and TP2 + SP x CP2 on 4 ranks.

The job (``jobs/injob_layouts_job.py``) runs unmodified through the autopatch entry point as torchrun's script, and
drives Megatron's own schedule: a no-grad log-prob pass in micro-batches of 4 sequences at width 8, then training
micro-batches of 2 sequences in a shuffled order at width 12 (under CP2 the zigzag chunks change size, so tokens
change CP rank). Checked per rank: every real training token used its own log-prob route (a spy on the routers,
tokens known by sequence and position from the job's batching); with the weights unchanged the replayed actor and
its natively routed twin route alike and their gradients are bitwise equal; with the actor's routers perturbed
the table still serves and native routing would have differed. Under PP a stage past the first fed no input_ids
is refused naming its pipeline stage and the remedy.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
JOB = Path(__file__).resolve().parent / "jobs" / "injob_layouts_job.py"
TIMEOUT_S = int(os.environ.get("MOEVERIFY_TEST_TIMEOUT_S", "600"))
LAYERS = 4  # qwen3_moe: every decoder layer is MoE


def run_job(tmp_path, layout: str, *, ranks: int = 2) -> list[dict]:
    env = {**os.environ, "MOEVERIFY_ROUTER_REPLAY": "r2", "MOEVERIFY_ROUTER_REPLAY_MODEL": "0"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(ranks),
        "-m",
        "moeverify.patches.autopatch",
        str(JOB),
        layout,
        str(tmp_path / "out"),
    ]
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert run.returncode == 0, run.stderr[-4000:]
    return [json.loads((tmp_path / f"out.rank{r}").read_text()) for r in range(ranks)]


def check_replayed(ranks: list[dict]) -> None:
    for r, got in enumerate(ranks):
        assert got["wrong"] == [], f"rank {r}: training tokens not on their log-prob route: {got['wrong']}"
        # (a rank whose slice is all padding, as TP rank 1 of CP rank 0 under TP2 + SP x CP2 at width 12, checks none)
        assert got["native_differs"] > 0 or got["checked"] == 0, f"rank {r}: perturbed routers, native agrees"
        assert len(got["minibatches"]) == 2
        for i, mb in enumerate(got["minibatches"]):
            assert mb["same_routes"], f"rank {r} mini-batch {i}: replay and native twin routed differently"
            assert mb["grads"] > 0 and mb["grads_equal"], f"rank {r} mini-batch {i}: grads not bitwise equal"


@pytest.mark.parametrize("layout", ["cp2", "pp2", "pp2-vpp2"])
def test_injob_r2_layout_replays_each_tokens_log_prob_route(tmp_path, layout):
    ranks = run_job(tmp_path, layout)
    check_replayed(ranks)
    if layout == "cp2":
        # each CP rank checks its zigzag halves: together every real token, both training passes, every layer
        assert [got["layers"] for got in ranks] == [list(range(LAYERS))] * 2
        assert sum(got["checked"] for got in ranks) == 2 * LAYERS * ranks[0]["real_tokens"]
    else:
        # each stage checks its own layers (VPP: one per model chunk) on every real token
        vpp = layout == "pp2-vpp2"
        assert [got["layers"] for got in ranks] == ([[0, 2], [1, 3]] if vpp else [[0, 1], [2, 3]])
        assert [got["checked"] for got in ranks] == [2 * 2 * got["real_tokens"] for got in ranks]  # both ranks, above
        stage = "(pipeline stage 1 of 2, virtual chunk 0)" if vpp else "(pipeline stage 1 of 2)"
        assert ranks[1]["no_input_ids"].startswith(
            f"layer {1 if vpp else 2} rank 1: this model chunk's forward got no input_ids {stage}"
        )
        assert "pass input_ids to every stage's GPTModel forward, as verl does" in ranks[1]["no_input_ids"]


@pytest.mark.release  # 4 ranks; make test runs CP2 and TP2 + SP on 2 ranks each
def test_injob_r2_tp2_sp_cp2_pools_over_tp_and_cp(tmp_path):
    # 4 ranks (about 47 s on a loaded 2-core host): a TP rank routes a slice of its CP rank's halves; the 4 ranks of
    # the TP x CP group pool their recordings
    ranks = run_job(tmp_path, "tp2-sp-cp2", ranks=4)
    check_replayed(ranks)
    assert sum(got["checked"] > 0 for got in ranks) == 3
    assert sum(got["checked"] for got in ranks) == 2 * LAYERS * ranks[0]["real_tokens"]


def test_injob_r2_cp2_packed_thd_at_the_router_replays_across_cp_ranks(tmp_path):
    # packed sequences under CP2 (per-slot zigzag halves), at the router: CPU attention cannot run THD
    job = JOB.parent / "injob_cp_thd_job.py"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(job),
        str(tmp_path / "out"),
    ]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert run.returncode == 0, run.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"out.rank{r}").read_text()) for r in range(2)]
    for r, got in enumerate(ranks):
        assert got["wrong"] == [], f"rank {r}: tokens not on their log-prob route: {got['wrong']}"
        assert got["padding"] > 0 and got["padding_not_native"] == 0, f"rank {r}: {got}"
    assert sum(got["checked"] for got in ranks) == 8  # A (5) and B (3): each real token on one CP rank
    assert sum(got["native_differs"] for got in ranks) > 0
    refused = [got["refused"] for got in ranks if got["refused"]]
    assert refused and all(
        "(sequence 1 of this forward, position" in e and "has no route recorded" in e for e in refused
    ), refused
    for r, got in enumerate(ranks):
        assert got["tail_refused"].startswith(
            f"layer 0 rank {r}: context parallel with packed sequences: 2 CP ranks "
            "hold 6 tokens each but the slots (cu_seqlens_padded, else cu_seqlens) "
            "end at 8"
        ), got["tail_refused"]
