"""In-job R2 (``MOEVERIFY_ROUTER_REPLAY=r2``) on 2 ranks: an unmodified verl-like PPO step under TP2 + SP.

The job (``jobs/injob_verl_job.py``) runs through the autopatch entry point as torchrun's script. Its log-prob
pass and its training micro-batches are batched differently (4 sequences; then shuffled mini-batches of
2-sequence micro-batches, then micro-batches grouped by token count, padded with ``padding_mask``), and each TP
rank's routers see only their half of every sequence. Every real training token must use exactly the experts
its own log-prob forward chose (observed by the job's forward hooks, keyed by sequence and position), while
native routing with the perturbed weights would have picked others for many of them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
JOB = Path(__file__).resolve().parent / "jobs" / "injob_verl_job.py"
TIMEOUT_S = int(os.environ.get("MOEVERIFY_TEST_TIMEOUT_S", "600"))
LAYERS, EPOCHS = 4, 2


def test_injob_r2_verl_step_tp2_sp_replays_each_tokens_log_prob_route(tmp_path):
    env = {**os.environ, "MOEVERIFY_ROUTER_REPLAY": "r2"}
    env.pop("MOEVERIFY_ROUTER_REPLAY_MODEL", None)
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
        str(tmp_path / "out"),
    ]
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert run.returncode == 0, run.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"out.rank{r}").read_text()) for r in range(2)]
    for r, got in enumerate(ranks):
        assert got["wrong"] == [], f"rank {r}: training tokens not on their log-prob route: {got['wrong']}"
        assert got["sizes"] == [1, 2, 3], f"rank {r}: micro-batch sizes {got['sizes']}"
    # each TP rank checks its half of every sequence: together, every real token of both epochs, every layer
    assert sum(got["checked"] for got in ranks) == EPOCHS * LAYERS * ranks[0]["real_tokens"]
    assert [r for r, got in enumerate(ranks) if got["native_differs"] == 0] == []  # replay did the work
    assert [len(got["losses"]) for got in ranks] == [8, 8]  # 2 epochs x 2 mini-batches x 2 micro-batches
