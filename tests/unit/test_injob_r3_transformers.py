"""In-job R3 with Hugging Face transformers as the rollout engine, on the actor's own weights (1 CPU rank).

The engine is ``transformers``' Qwen3-MoE loaded from the very checkpoint the Megatron actor was built from, run the
way ``generate`` runs a batch: padded on the left, positions from the first real token, router logits returned
(``output_router_logits=True``) and decoded per request with ``moeverify.routing.engine_routes.from_transformers``. The
trainer hands them over with its batch (``injob.add_routes``), padded on the other side, and runs its log-prob and
training passes with the agreement guard as in-job R3 installs it (the chance floor on). Every real token must use
exactly the engine's route, and the guard must pass and report what it counted.
"""

from __future__ import annotations

import gc
import os

import pytest
import torch
from test_injob_replay import Spy, installed_world, random_sequences

from moeverify.patches import agreement, injob
from moeverify.routing import engine_routes as er

SEED = 71
TOPK = 2


@pytest.fixture(scope="module")
def world():
    saved = os.environ.pop(agreement.FLOOR_ENV, None)  # the guard's default: the chance floor on
    try:
        yield from installed_world("r3")
    finally:
        if saved is not None:
            os.environ[agreement.FLOOR_ENV] = saved
        gc.collect()


def hf_engine():
    transformers = pytest.importorskip("transformers")
    from moeverify.models import families

    path = families.hf_checkpoint("qwen3_moe", seed=0)  # the checkpoint the actor (seed 0) was built from
    return transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()


def test_r3_transformers_engine_left_padded_routes_replayed_with_an_honest_guard(world):
    actor, _, vocab = world
    engine = hf_engine()
    sequences = random_sequences(vocab, [7, 4, 9, 6], SEED)
    width = max(len(s) for s in sequences)
    ids = torch.zeros(len(sequences), width, dtype=torch.long)
    mask = torch.zeros(len(sequences), width, dtype=torch.long)
    for b, seq in enumerate(sequences):  # generate() pads on the left
        ids[b, width - len(seq) :], mask[b, width - len(seq) :] = seq, 1
    with torch.no_grad():
        out = engine(
            input_ids=ids,
            attention_mask=mask,
            position_ids=(mask.cumsum(1) - 1).clamp(min=0),
            output_router_logits=True,
        )
    logits = [x.float().numpy() for x in out.router_logits]
    routes = [
        er.from_transformers(
            logits, top_k=TOPK, batch=len(sequences), index=b, attention_mask=mask, num_tokens=len(seq), request=b
        )
        for b, seq in enumerate(sequences)
    ]
    assert all(r.routes.shape[0] == len(s) for r, s in zip(routes, sequences, strict=True))  # a row for every fed token
    injob.add_routes(version=0, sequences=sequences, routes=routes)

    device = next(actor.parameters()).device
    right = torch.zeros(len(sequences), width + 2, dtype=torch.long)  # the trainer pads on the right, wider
    pad = torch.ones(len(sequences), width + 2, dtype=torch.bool)
    for b, seq in enumerate(sequences):
        right[b, : len(seq)], pad[b, : len(seq)] = seq, False
    guard = agreement.ACTIVE
    assert guard is not None and guard.floor == agreement.CHANCE
    guard.end_step()
    spy = Spy(actor)
    try:
        pos = torch.arange(width + 2).expand_as(right)
        with torch.no_grad():
            actor(right.to(device), pos.to(device), None, padding_mask=pad.to(device))
        logp = spy.take()
        out = actor(right.to(device), pos.to(device), None, padding_mask=pad.to(device))
        out.float().square().masked_fill(pad.to(device)[..., None], 0).sum().backward()
        train = spy.take()
    finally:
        spy.close()
        actor.zero_grad(set_to_none=True)
        injob.drop_routes()
    checked = 0
    for calls in (logp, train):
        for layer, ids_TK in calls:
            for b, seq in enumerate(sequences):
                for s in range(len(seq)):  # router order s * B + b; the engine routed every fed token
                    want = torch.from_numpy(routes[b].routes[s, layer].astype("int64")).sort().values
                    assert torch.equal(ids_TK[s * len(sequences) + b], want), (layer, b, s)
                    checked += 1
    real = sum(len(s) for s in sequences)
    assert checked == 2 * 4 * real
    shares = guard.end_step()  # the chance floor judges both passes: the engine is the actor's own weights
    rows = [r for r in guard.history if r["step"] == guard.step]
    assert {r["pass"] for r in rows} == {"log_prob", "training"} and shares
    for row in rows:
        assert (row["tokens"], row["padding"], row["routed_natively"]) == (real, pad.numel() - real, 0), row
        assert row["overlap"] >= row["floor"] and row["agreement"] >= 0.5, row
