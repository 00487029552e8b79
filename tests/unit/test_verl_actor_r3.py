"""verl 0.9.1's own Megatron actor path, unmodified, on a CPU rank under in-job R3, turned on as a verl user turns it
on: ``external_lib="moeverify.integrations.verl"`` in verl's own model config, nothing else (the integration hands
each batch's ``routed_experts`` to in-job R3; the test never calls ``injob``).

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


def check(result: dict, *, padding: int) -> None:
    assert "route_error" not in result, result["route_error"]
    assert result["installed"], "importing the integration through verl's external_lib started in-job R3"
    assert result["log_probs_tokens"] == 47
    # every token before its sample's last generated token on the engine's route, bitwise; from it on (the engine's
    # missing last row, the tool's output ending trajectory 4) on the actor's own top-k; in both passes
    assert result["log_prob"] == result["train"] == result["want"] == [4 * 38, 4 * 9]
    assert result["params_moved"] and result["grad_norm"] > 0
    # the guard counts the routed-natively tokens apart (padding told through verl's attention mask among them:
    # the router itself is not told), and replays 38 tokens a layer in each pass
    assert result["guard"] == [["log_prob", 9 + padding, 38, 0], ["training", 9 + padding, 38, 0]]
    assert result["held_after"] == 0  # a batch's routes are dropped once its forwards ran
    bare, own = result["refusals"]
    assert "verl's batch carries no routed_experts" in bare and "enable_rollout_routing_replay=True" in bare
    assert "verl's own router replay is on" in own and "router_replay.mode=disabled" in own


def test_verl_engine_through_the_integration_micro_batch_1():
    # verl's BSHD path pads nothing at micro-batch size 1
    check(run_peer(1), padding=0)


def test_verl_engine_through_the_integration_bshd_micro_batch_2():
    # micro-batch size 2: verl's preprocess_bshd_engine right-pads each micro-batch and calls GPTModel with its
    # attention mask (True = token) and no padding_mask; the integration reads that mask as the padding
    # (3 padding tokens in each of the 3 micro-batches), and each micro-batch mixes the two policy versions
    check(run_peer(2), padding=9)
