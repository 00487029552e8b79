"""verl 0.9.1's own Megatron actor path, unmodified, on a CPU rank under in-job R3 with the routes handed over with
the batch (``MOEVERIFY_ROUTER_REPLAY=r3``, ``injob.add_routes(input_ids=, attention_mask=, routes=)``).

verl 0.9.1 has no ``verl/workers/actor/megatron_actor.py`` (no ``MegatronPPOActor``): the actor's
``compute_log_prob`` and ``update_actor`` (``verl/workers/engine_workers.py``) go to the Megatron engine,
``MegatronEngineWithLMHead.infer_batch`` / ``train_batch`` -> ``forward_backward_batch`` -> ``forward_step`` ->
``verl.models.mcore.model_forward.gptmodel_forward_model_engine`` under Megatron's schedule. That path runs here,
in its own process, through ``tests/unit/verl_actor_peer.py`` (shims listed there; none in verl's code).

Set ``MOEVERIFY_VERL_SITE`` to a directory holding verl 0.9.1 (``pip install --no-deps --target DIR verl==0.9.1``
or the wheel unpacked) and ``MOEVERIFY_VERL_DEPS`` to one holding tensordict<=0.10 (with cloudpickle,
importlib_metadata, orjson, pyvers) and ray (with msgpack, protobuf, jsonschema, requests and their deps), e.g.
``pip install --no-deps --target DIR ...``; without them the tests skip. About 20 s each on CPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from waiting import CHILD_S

HERE = Path(__file__).resolve().parent
SITE = os.environ.get("MOEVERIFY_VERL_SITE", "")
DEPS = os.environ.get("MOEVERIFY_VERL_DEPS", "")


def _verl_reason() -> str | None:
    if not SITE:
        return "MOEVERIFY_VERL_SITE not set (a directory holding verl 0.9.1, installed with --no-deps)"
    engine = Path(SITE, "verl", "workers", "engine", "megatron", "transformer_impl.py")
    if not engine.is_file():
        return f"no verl Megatron engine under MOEVERIFY_VERL_SITE={SITE}"
    for package in ("tensordict", "ray"):
        if not any(Path(d, package).is_dir() for d in (SITE, DEPS) if d):
            return f"{package} not found under MOEVERIFY_VERL_SITE or MOEVERIFY_VERL_DEPS (verl's imports need it)"
    return None


pytestmark = [pytest.mark.skipif(_verl_reason() is not None, reason=_verl_reason() or ""), pytest.mark.timing]


def run_peer(micro_batch_size: int) -> dict:
    env = dict(os.environ, MOEVERIFY_VERL_MBS=str(micro_batch_size), MOEVERIFY_TEST_BACKEND="cpu")
    done = subprocess.run(
        [sys.executable, str(HERE / "verl_actor_peer.py")],
        env=env,
        cwd=HERE.parent.parent,
        capture_output=True,
        text=True,
        timeout=CHILD_S,
    )
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("VERL_ACTOR_RESULT ")]
    assert done.returncode == 0 and lines, f"rc {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    return json.loads(lines[-1].split(" ", 1)[1])


def test_verl_engine_log_prob_and_update_replay_the_batch_routes():
    # micro-batch size 1: verl's BSHD path then pads nothing, and every real token but each request's last
    # (the engine's unfilled row: native) takes its handed-over route in both passes
    result = run_peer(1)
    assert "route_error" not in result, result["route_error"]
    assert result["held"] == result["log_probs_tokens"] == 26
    assert result["log_prob_checked"] == result["train_checked"] == result["want"] == 4 * 22
    assert result["params_moved"] and result["grad_norm"] > 0


def test_verl_bshd_micro_batch_padding_is_not_told_to_the_model():
    # micro-batch size 2: verl's preprocess_bshd_engine (verl/models/mcore/util.py) right-pads the micro-batch
    # and gptmodel_forward_model_engine calls GPTModel without padding_mask in BSHD (model_forward.py, the
    # bshd branch; it passes one only for dynamic CP), so its padding tokens are training tokens to the
    # route check and have no route: refused, never replayed wrong
    result = run_peer(2)
    assert "has no route" in result.get("route_error", ""), result
    assert "mark padding: padding_mask" in result["route_error"]
