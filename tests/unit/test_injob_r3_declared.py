"""In-job R3 with the routes handed over with the batch (1 CPU rank): what the trainer declares about its tokens.

- BSHD padding told by an attention mask rather than ``padding_mask`` (verl's BSHD engine path with more than one
  sequence a micro-batch): read under ``injob.padding_from_attention_mask``, refused without it naming the ways out;
- tokens the engine never routed (a multi-turn trajectory ending in a tool's output: verl's zero rows after the last
  generation) declared with ``add_routes(native=)``: trained, routed as the actor's own routing routes them
  (``torch.topk`` of the router's logits decides), counted apart by the agreement guard; undeclared, a capture gap.

The engine is a second model of other weights run one request at a time; a spy on the actor's routers reads what
Megatron used, checked token by token against what the engine routed.
"""

from __future__ import annotations

import gc
import os

import pytest
import torch
from test_injob_r3 import engine_routes
from test_injob_replay import Spy, installed_world, random_sequences

from moeverify.errors import RouteError, UsageError
from moeverify.patches import agreement, injob

SEED = 83
LAYERS = (0, 1, 2, 3)


@pytest.fixture(scope="module")
def world():
    # the engine has other weights: its ids are no better than random ids, and its experts are other experts
    off = (agreement.FLOOR_ENV, agreement.NUMBERING_ENV)
    saved = {name: os.environ.get(name) for name in off}
    os.environ.update({name: agreement.OFF for name in off})
    try:
        yield from installed_world("r3")
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        gc.collect()


def right_padded(sequences, width):
    """verl's ``preprocess_bshd_engine``: each sequence from column 0, zeros after; attention mask True on tokens."""
    ids = torch.zeros(len(sequences), width, dtype=torch.long)
    tokens = torch.zeros(len(sequences), width, dtype=torch.bool)
    for i, seq in enumerate(sequences):
        ids[i, : len(seq)], tokens[i, : len(seq)] = seq, True
    return ids, tokens


def forward_bshd(actor, ids, attention_mask, *, grad=False):
    """The GPTModel called as verl's BSHD branch calls it: ``attention_mask`` given, no ``padding_mask``."""
    pos = torch.arange(ids.shape[1])[None].expand_as(ids)
    with torch.set_grad_enabled(grad):
        out = actor(ids, pos, attention_mask)
    if grad:
        out.float().square().masked_fill(~attention_mask[..., None], 0).sum().backward()


def checked(calls, sequences, routes) -> int:
    """Every real token but each sequence's last (no engine row) on its engine route, in router order ``s * B + b``."""
    n, b = 0, len(sequences)
    for layer, ids_TK in calls:
        for i, seq in enumerate(sequences):
            for s in range(len(seq) - 1):
                assert torch.equal(ids_TK[s * b + i], routes[i][s, layer]), (layer, i, s)
                n += 1
    return n


def test_injob_bshd_padding_from_attention_mask_read_when_named_refused_with_the_ways_out_otherwise(world):
    actor, engine, vocab = world
    sequences = random_sequences(vocab, [7, 4, 6], SEED)
    routes = engine_routes(engine, sequences)
    injob.drop_routes()
    injob.add_routes(version=0, sequences=sequences, routes=[r[:-1] for r in routes])
    ids, tokens = right_padded(sequences, 8)
    with pytest.raises(
        RouteError,
        match=r"training token 13 \(sequence 1 of this forward, position 4\) has no route.*this BSHD forward got "
        r"attention_mask \(3, 8\) and no padding_mask.*pass padding_mask= \(True = padding\) to the GPTModel, "
        r"remove the padding \(THD.*injob.padding_from_attention_mask\(marks='tokens'\)",
    ):
        forward_bshd(actor, ids, tokens)
    spy = Spy(actor)
    try:
        with injob.padding_from_attention_mask(marks="tokens"):  # True = token, as verl's mask reads
            forward_bshd(actor, ids, tokens)
            logp = spy.take()
            forward_bshd(actor, ids, tokens, grad=True)
            train = spy.take()
        with injob.padding_from_attention_mask(marks="padding"):  # True = padding, Megatron's padding_mask reading
            forward_bshd(actor, ids, ~tokens)
            told = spy.take()
    finally:
        spy.close()
        actor.zero_grad(set_to_none=True)
    want = len(LAYERS) * sum(len(s) - 1 for s in sequences)
    assert checked(logp, sequences, routes) == checked(train, sequences, routes) == checked(told, sequences, routes)
    assert checked(logp, sequences, routes) == want
    with pytest.raises(RouteError, match=r"attention_mask is \(3, 1, 8, 8\), not \[B, S\] = \(3, 8\).*padding_mask="):
        with injob.padding_from_attention_mask(marks="tokens"):
            forward_bshd(actor, ids, tokens[:, None, None, :].expand(3, 1, 8, 8))
    with pytest.raises(UsageError, match=r"marks='real'\): expected one of \('tokens', 'padding'\)"):
        with injob.padding_from_attention_mask(marks="real"):
            pass
    injob.drop_routes()


class Natives:
    """Per forward routing call of the bound model (recomputes apart): ``(layer, ids used [T, K], the top-k of the
    router's own logits [T, K])``, each row sorted."""

    def __init__(self, chunk):
        self.calls: list[tuple[int, torch.Tensor, torch.Tensor]] = []
        self.handles = [
            m.register_forward_hook(self._hook) for m in chunk.modules() if type(m).__name__ == "TopKRouter"
        ]

    def _hook(self, router, inputs, outputs):
        if torch._C._current_graph_task_id() == -1:
            with torch.no_grad():
                logits_TE = router.gating(inputs[0].reshape(-1, inputs[0].shape[-1]))
            native_TK = torch.topk(logits_TE.float(), router.topk).indices.sort().values
            used_TK = torch.topk(outputs[1].int(), router.topk).indices.sort().values
            self.calls.append((router.layer_number - 1, used_TK, native_TK))

    def close(self):
        for h in self.handles:
            h.remove()


def trajectory(vocab, seed):
    """prompt, generation, tool output, generation, tool output: the tokens, the engine's routes as verl aligns them
    (rows of the last generation's request, the sampled last token's and the trailing tool output's rows zero), and
    where the last generation ends."""
    parts = random_sequences(vocab, [4, 3, 2, 3, 3], seed)
    tokens = torch.cat(parts)
    last = sum(len(p) for p in parts[:4]) - 1  # the last generated token: the engine never fed it back
    return tokens, last


def test_injob_r3_tool_output_declared_native_trains_routed_natively_and_counted_apart(world):
    actor, engine, vocab = world
    tokens, last = trajectory(vocab, SEED + 1)
    routes = engine_routes(engine, [tokens])[0]
    routed = torch.zeros_like(routes)
    routed[:last] = routes[:last]  # verl: the engine's rows up to its last generation, zeros after
    injob.drop_routes()
    # undeclared, the tool output's zero rows are what a failed capture leaves: refused
    injob.add_routes(version=0, sequences=[tokens], routes=[routed])
    gap = rf"request 0 position {last} layer 0: capture gap .*declared with add_routes\(native=\)"
    with pytest.raises(RouteError, match=gap):
        with torch.no_grad():
            actor(tokens[None], torch.arange(len(tokens))[None], None)
    injob.drop_routes()
    native = torch.zeros(len(tokens), dtype=torch.bool)
    native[last:] = True
    with pytest.raises(UsageError, match=r"request 0: native= holds 14 entries for 15 tokens; one per token"):
        injob.add_routes(version=0, sequences=[tokens], routes=[routed], native=[native[1:]])
    injob.add_routes(version=0, sequences=[tokens], routes=[routed], native=[native])
    guard = agreement.ACTIVE
    guard.end_step()
    spy = Natives(actor)
    try:
        with torch.no_grad():
            actor(tokens[None], torch.arange(len(tokens))[None], None)
        out = actor(tokens[None], torch.arange(len(tokens))[None], None)
        out.float().square().sum().backward()
        guard.end_step()
        rows = [r for r in guard.history if r["step"] == guard.step]
    finally:
        spy.close()
        actor.zero_grad(set_to_none=True)
    assert sorted(layer for layer, _, _ in spy.calls) == sorted(2 * LAYERS)  # both passes, every layer
    for layer, used_TK, native_TK in spy.calls:
        assert torch.equal(used_TK[:last], routes[:last, layer]), layer  # the engine's routes
        assert torch.equal(used_TK[last:], native_TK[last:]), layer  # the tool output: the actor's own routing
    declared = len(tokens) - last
    assert {(r["pass"], r["routed_natively"], r["tokens"]) for r in rows} == {
        ("log_prob", declared, last),
        ("training", declared, last),
    }
    injob.drop_routes()


def test_injob_r3_native_declared_on_a_padded_batch(world):
    # the padded form: native= [B, S] aligned with input_ids (padding on either side), as verl's batch lays it out
    actor, engine, vocab = world
    tokens, last = trajectory(vocab, SEED + 2)
    other = random_sequences(vocab, [6], SEED + 3)[0]
    ra, rb = engine_routes(engine, [tokens, other])
    width = len(tokens) + 1
    ids = torch.zeros(2, width, dtype=torch.long)
    mask = torch.zeros(2, width, dtype=torch.long)
    routed = torch.zeros(2, width, len(LAYERS), ra.shape[-1], dtype=torch.int64)
    native = torch.zeros(2, width, dtype=torch.bool)
    ids[0, 1:], mask[0, 1:], routed[0, 1 : 1 + last], native[0, 1 + last :] = tokens, 1, ra[:last], True
    ids[1, : len(other)], mask[1, : len(other)], routed[1, : len(other) - 1] = other, 1, rb[:-1]
    injob.drop_routes()
    with pytest.raises(UsageError, match=r"native= \(2, 15\) must be \[B, S\] like input_ids \(2, 16\)"):
        injob.add_routes(version=0, input_ids=ids, attention_mask=mask, routes=routed, native=native[:, 1:])
    injob.add_routes(version=0, input_ids=ids, attention_mask=mask, routes=routed, native=native)
    spy = Spy(actor)
    try:
        with torch.no_grad():
            actor(tokens[None], torch.arange(len(tokens))[None], None)
            actor(other[None], torch.arange(len(other))[None], None)
        calls = spy.take()
    finally:
        spy.close()
    for layer, ids_TK in calls[: len(LAYERS)]:
        assert all(torch.equal(ids_TK[s], ra[s, layer]) for s in range(last)), layer
    for layer, ids_TK in calls[len(LAYERS) :]:
        assert all(torch.equal(ids_TK[s], rb[s, layer]) for s in range(len(other) - 1)), layer
    injob.drop_routes()
