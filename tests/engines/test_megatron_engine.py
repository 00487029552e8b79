"""Megatron-Core's own inference engine (``DynamicInferenceEngine`` with ``moe_enable_routing_replay``: the engine of
Megatron-LM's RL loop) as a second real engine, run as its own process on CPU ranks
(``moeverify.oracles.engine.megatron_engine``; flash-attn's paged kernels, CUDA-only, replaced by a torch paged
attention there). Each request's ``routing_indices`` is decoded with ``engine_routes.from_megatron`` and compared, per
MoE layer and position, with Megatron's native routing of the same tokens (prompts crossing the engine's 16-token KV
blocks, greedy tokens the engine chose): Qwen3-MoE, and GLM-4.5 with its dense first layer (MoE columns only).
It needs no other venv: `make test` runs it.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest

from moeverify.engines import job as engine_job
from moeverify.oracles.engine import conformance
from moeverify.routing import engine_routes as er

LENGTHS = [7, 20, 33]
GEN = 8


def megatron_rollout(ckpt, workdir, *, lengths=LENGTHS, seed=2):
    g = np.random.default_rng(seed)
    requests = [
        {"id": f"m{i}", "prompt": g.integers(3, 256, n).tolist(), "max_tokens": GEN} for i, n in enumerate(lengths)
    ]
    from conftest import backend

    job = {"model": str(ckpt), "backend": backend(), "steps": [{"op": "generate", "requests": requests}]}
    command = [sys.executable, "-m", "moeverify.oracles.engine.megatron_engine"]
    return engine_job.run_job(command, job, workdir=workdir, name="Megatron-Core")


@pytest.mark.parametrize(("family", "moe_layers"), [("qwen3_moe", [0, 1, 2, 3]), ("glm4_moe", [1, 2, 3])])
def test_megatron_engine_routes_are_the_trainers(megatron, family, moe_layers, tmp_path):
    from moeverify import models
    from moeverify.models import families
    from moeverify.spec.layout import Layout
    from moeverify.spec.models.ref import ModelRef

    ckpt = families.written_checkpoint(family, 0, head_dim=32, dtype="float32")
    run = megatron_rollout(ckpt, tmp_path / "run")
    assert run.engine["moe_layers"] == moe_layers and run.engine["version"] == "0.19.2"
    chunk = models.build(ModelRef.user(ckpt), Layout(), seed=0).model_chunks[0]
    total = conformance.Cell()
    for s in run.samples(0):
        assert s.routes.dtype == np.int16 and s.routes.shape == (len(s.tokens) - 1, len(moe_layers), 2)
        decoded = er.from_megatron(
            s.routes, num_tokens=len(s.tokens), num_moe_layers=len(moe_layers), request=s.request
        )
        native = conformance.native_routes(chunk, s.tokens)
        assert native.layers == moe_layers
        cell = conformance.compare(decoded, native, num_layers=4, what=f"megatron {family} {s.request}")
        assert cell.ok and cell.checked == (len(s.tokens) - 1) * len(moe_layers), cell.summary()
        assert cell.near_tie <= cell.checked // 100, cell.summary()  # kernels round apart only on near ties
        total.add(cell)
    assert total.checked == sum(n + GEN - 1 for n in LENGTHS) * len(moe_layers)
