"""In-job R3 on 2 ranks: a rollout engine's routes, written by ``RolloutWriter`` (``MOEVERIFY_ROUTER_REPLAY=r3:DIR``)
or handed over with the batch (``r3``, ``injob.add_routes``), replayed in an unmodified verl-like step under TP2 + SP
(each router sees half of every sequence) and under EP2 (``jobs/injob_r3_job.py``). Every training token but each
sequence's last uses exactly the engine's route for its (sequence, position), in every micro-batching of the step; the
last token (no rollout row) routes natively; native routing with the actor's perturbed weights would have picked other
experts for many tokens.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
JOB = Path(__file__).resolve().parent / "jobs" / "injob_r3_job.py"
TIMEOUT_S = int(os.environ.get("MOEVERIFY_TEST_TIMEOUT_S", "600"))
EPOCHS = 2


# EP2 runs in make release: TP2 + SP covers both sources in make test (each rank sees half of every sequence)
@pytest.mark.parametrize(
    ("layout", "source"),
    [
        ("tp2sp", "files"),
        pytest.param("ep2", "files", marks=pytest.mark.release),
        ("tp2sp", "batch"),
        pytest.param("ep2", "batch", marks=pytest.mark.release),
    ],
)
def test_injob_r3_verl_step_replays_the_rollouts_routes(tmp_path, layout, source):
    rollout = tmp_path / "rollout"
    # the engine has other weights than the actor: its routes are no better than random ids for the actor, which the
    # agreement guard's default floor refuses; here replay itself is under test
    env = {
        **os.environ,
        "MOEVERIFY_ROUTER_REPLAY": "r3" if source == "batch" else f"r3:{rollout}",
        "MOEVERIFY_ROUTER_REPLAY_MODEL": "0",
        "MOEVERIFY_AGREEMENT_FLOOR": "off",
    }
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "moeverify.patches.autopatch",
        str(JOB),
        layout,
        "batch" if source == "batch" else str(rollout),
        str(tmp_path / "out"),
    ]
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert run.returncode == 0, run.stderr[-4000:]
    if source == "files":
        assert sorted(p.name for p in (rollout / "step-0").iterdir()) == ["COMPLETE", "part-0.npz"]
    ranks = [json.loads((tmp_path / f"out.rank{r}").read_text()) for r in range(2)]
    for r, got in enumerate(ranks):
        assert got["wrong"] == [], f"rank {r}: training tokens not on their rollout route: {got['wrong']}"
        assert got["last_wrong"] == [], f"rank {r}: last tokens not routed natively: {got['last_wrong']}"
        assert len(got["losses"]) == 8  # 2 epochs x 2 mini-batches x 2 micro-batches
    layers, real, seqs = ranks[0]["layers"], ranks[0]["real_tokens"], ranks[0]["sequences"]
    per_rank = 2 if layout == "ep2" else 1  # EP2: both ranks route every token; TP2 + SP: each rank half
    assert sum(got["checked"] for got in ranks) == per_rank * EPOCHS * layers * (real - seqs)
    assert sum(got["last"] for got in ranks) == per_rank * EPOCHS * layers * seqs
    assert (
        len(ranks) == 2 and [r for r, got in enumerate(ranks) if got["native_differs"] == 0] == []
    )  # replay did the work


FAIL_CLOSED = Path(__file__).resolve().parent / "jobs" / "injob_r3_fail_closed_job.py"


@pytest.mark.parametrize("case", ["healthy", "renumbered"])
def test_a_renumbering_on_one_rank_stops_every_rank_before_the_update(tmp_path, case):
    # 2 data-parallel ranks; in "renumbered" rank 1's engine ids are renumbered with 4 of 8 experts keeping their
    # number. The guard decides in the optimizer's pre-hook, across ranks: both ranks raise and no parameter moves.
    env = {**os.environ, "MOEVERIFY_ROUTER_REPLAY": "r3", "MOEVERIFY_ROUTER_REPLAY_MODEL": "0"}
    for name in ("MOEVERIFY_AGREEMENT", "MOEVERIFY_AGREEMENT_FLOOR", "MOEVERIFY_AGREEMENT_NUMBERING"):
        env.pop(name, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd += ["-m", "moeverify.patches.autopatch", str(FAIL_CLOSED), case, str(tmp_path / "out")]
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert run.returncode == 0, run.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"out.rank{r}").read_text()) for r in range(2)]
    lines = [line for line in run.stderr.splitlines() if "moeverify agreement guard: step 1:" in line]
    assert len(lines) == 1, run.stderr[-4000:]  # rank 0's line, over both ranks
    assert "training pass" in lines[0] and "log_prob pass" in lines[0]
    if case == "healthy":
        assert [got["error"] for got in ranks] == [None, None]
        assert [got["unchanged"] for got in ranks] == [False, False]  # the step ran
        assert lines[0].endswith("ok (MOEVERIFY_AGREEMENT_LOG=off quiets this)")
        return
    assert [got["unchanged"] for got in ranks] == [True, True], ranks
    assert "rank 1: engine expert" in ranks[1]["error"] and "routes like trainer expert" in ranks[1]["error"]
    assert "rank 0: rank(s) 1 of 2 failed the guard" in ranks[0]["error"]
    assert "FAILED on 1 rank(s)" in lines[0]
