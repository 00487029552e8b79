"""In-job R3 on vLLM's own routes under torchrun on 2 ranks: EP2 (each rank a data-parallel rank with its own
requests, experts split) and TP2 + SP (each router sees half of every sequence). The engine (fp32, the trainer's
checkpoint) generates in its own process; the job (tests/engines/jobs/vllm_r3_job.py) hands each rank's payloads over
with its batch. Every routed token takes the engine's experts in both passes, each last token routes natively, and
the step is the native step bit for bit (loss and every gradient on every rank)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from moeverify.engines import vllm_process
from moeverify.files import atomic_write_json

ROOT = Path(__file__).resolve().parents[2]
JOB = Path(__file__).resolve().parent / "jobs" / "vllm_r3_job.py"
LENGTHS = [22, 35, 28, 41, 19, 30]


@pytest.fixture(scope="module")
def rollout(engine_python, tmp_path_factory):
    from moeverify.models import families

    ckpt = families.written_checkpoint("qwen3_moe", 0, head_dim=32, dtype="float32")
    g = np.random.default_rng(17)
    requests = [
        {"id": f"q{i}", "prompt": g.integers(3, 256, n).tolist(), "max_tokens": 12} for i, n in enumerate(LENGTHS)
    ]
    llm = {"dtype": "float32", "max_model_len": 128, "enforce_eager": True, "block_size": 32}
    out = tmp_path_factory.mktemp("rollout")
    run = vllm_process.run(
        {"model": str(ckpt), "llm": llm, "steps": [{"op": "generate", "requests": requests}]},
        workdir=out / "engine",
        python=engine_python,
    )
    samples = run.samples(0)
    atomic_write_json(
        out / "rollout.json",
        {
            "checkpoint": str(ckpt),
            "requests": [{"id": s.request, "tokens": s.tokens, "routes": f"engine/{s.file}"} for s in samples],
        },
    )
    return out


@pytest.mark.parametrize("layout", ["ep2", "tp2sp"])
def test_r3_on_vllm_routes_on_two_ranks(rollout, layout, tmp_path):
    env = {**os.environ, "MOEVERIFY_ROUTER_REPLAY": "r3", "MOEVERIFY_ROUTER_REPLAY_MODEL": "0"}
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
        str(rollout),
        str(tmp_path / "out"),
        layout,
    ]
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"out.rank{r}").read_text()) for r in range(2)]
    for r, got in enumerate(ranks):
        assert got["wrong"] == [] and got["last_wrong"] == [], (r, got)
        assert got["loss_equal"] and got["grads_differ"] == [] and got["grads"] > 0, (r, got)
        assert got["calls"] == {str(layer): 2 for layer in range(4)}, got  # log-prob and training passes
    if layout == "ep2":  # every rank routes all of its own requests' tokens
        for got in ranks:
            assert got["checked"] == 2 * 4 * got["rows"] and got["last"] == 2 * 4 * got["sequences"]
        assert sum(got["sequences"] for got in ranks) == len(LENGTHS)
    else:  # each rank routes its half of every sequence
        rows = ranks[0]["rows"]
        assert ranks[0]["rows"] == ranks[1]["rows"] == sum(n + 12 - 1 for n in LENGTHS)
        assert sum(got["checked"] for got in ranks) == 2 * 4 * rows
        assert sum(got["last"] for got in ranks) == 2 * 4 * len(LENGTHS)
