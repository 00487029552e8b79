"""The export check's receiver subchecks against a real vLLM (the ``vllm`` and ``vllm_repack`` receivers).

``moeverify run --check export --receiver ...`` on one rank, on the checkpoint vLLM serves here: the subject's export
(Megatron-Bridge's, unless named) is loaded into a running vLLM process (first load from files, each later load a
weight sync through ``reload_weights``), and every weight, read back as the engine's kernels read it, is compared
bit for bit with a fresh reference export after each load.

- ``vllm_repack`` (finding V2's workaround): every receiver subcheck passes; 135 reference tensors covered.
- ``vllm`` (the plain reload vLLM offers): ``receiver`` passes (the engine's own first load) and ``receiver_reload``
  fails naming the experts: finding V2, seen bit for bit through the real engine.
- a subject that keeps sending its first export (``stale_conversion_cache``): the stale weights reach the engine and
  ``receiver_reload`` fails, the same engine and receiver as the control.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STALE = ROOT / "tests" / "special_distributed" / "stale_subject.py"


def _run(tmp_path, engine_python, receiver, subject=None):
    from moeverify.models import families

    ckpt = families.written_checkpoint("qwen3_moe", 0, head_dim=32, dtype="float32")
    out = tmp_path / f"{receiver}.json"
    cmd = [sys.executable, "-m", "moeverify", "run", "scenarios/one_rank.yaml", "--model", str(ckpt)]
    cmd += ["--check", "export", "--receiver", receiver, "--json", str(out)]
    cmd += ["--subject", subject] if subject else []
    env = {**os.environ, "MOEVERIFY_VLLM_PYTHON": engine_python}
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    (record,) = json.loads(out.read_text())
    return run, {k: v for k, v in record["subchecks"].items() if k.startswith("receiver")}


def test_vllm_repack_receiver_holds_the_export_after_every_load(tmp_path, engine_python):
    run, subs = _run(tmp_path, engine_python, "vllm_repack")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert all(s["passed"] for s in subs.values()), subs
    assert subs["receiver"]["checked"] == subs["receiver_reload"]["checked"] == 135
    assert subs["receiver_repeat"]["checked"] > 0


def test_vllm_plain_reload_fails_receiver_reload_on_the_experts(tmp_path, engine_python):
    run, subs = _run(tmp_path, engine_python, "vllm")
    assert run.returncode == 1, run.stdout[-3000:]
    assert subs["receiver"]["passed"] and subs["receiver"]["checked"] == 135, subs["receiver"]
    failures = subs["receiver_reload"]["failures"]
    assert not subs["receiver_reload"]["passed"] and failures
    named = [f for f in failures if "more" not in f.split(":")[0]]  # the last line may count the rest
    assert all(".mlp.experts." in f and ("w13_weight" in f or "w2_weight" in f) for f in named), failures


@pytest.mark.parametrize("subject", [f"{STALE}:stale"])
def test_stale_subject_reaches_the_real_engine_and_is_caught(tmp_path, engine_python, subject):
    run, subs = _run(tmp_path, engine_python, "vllm_repack", subject=subject)
    assert run.returncode == 1, run.stdout[-3000:]
    assert subs["receiver"]["passed"], subs["receiver"]
    assert not subs["receiver_reload"]["passed"], subs["receiver_reload"]
    assert any("after the weight sync" in f for f in subs["receiver_reload"]["failures"])
