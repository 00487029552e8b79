"""In-job R3 with the routes handed over with the batch (1 CPU rank): what the trainer declares about its tokens.

- BSHD padding told by an attention mask rather than ``padding_mask`` (verl's BSHD engine path with more than one
  sequence a micro-batch): read under ``injob.padding_from_attention_mask``, refused without it naming the ways out;
- tokens the engine never routed (a multi-turn trajectory ending in a tool's output: verl's zero rows after the last
  generation) declared with ``add_routes(native=)``: trained, routed as the actor's own routing routes them
  (``torch.topk`` of the router's logits decides), counted apart by the agreement guard; undeclared, a capture gap;
- THD slots given as ``cu_seqlens_q`` (verl's ``preprocess_thd_engine`` passes the padded lengths as both): the real
  lengths named with ``injob.packed_lengths``, so slot padding routes natively instead of reading as content;
- the recipes of docs/use-rl-job.md for slime's and NeMo-RL's batches, on batches laid out as their code lays them
  out: slime's per-sample ``tokens`` and ``rollout_routed_experts`` ``[len(tokens) - 1, num_layers, topk]`` (every
  decoder layer: ``slime/utils/types.py``, ``Sample`` and its routed-experts decode; ``slime/ray/rollout.py``,
  ``train_data``), NeMo-RL's flat right-padded ``input_ids`` / ``input_lengths`` / ``routed_experts`` with its all -1
  missing-route sentinel on tokens no generation routed (``nemo_rl/experience/rollouts.py``,
  ``backfill_missing_routed_experts``).

The engine is a second model of other weights run one request at a time; a spy on the actor's routers reads what
Megatron used, checked token by token against what the engine routed.
"""

from __future__ import annotations

import contextlib
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


def slime_requests(rollout_data):
    """docs/use-rl-job.md's slime recipe: per sample its tokens and routes, the rows past the engine's last routed
    token (a tool's output appended after the last generation) declared native."""
    sequences, routes, native = [], [], []
    for tokens, routed in zip(rollout_data["tokens"], rollout_data["rollout_routed_experts"], strict=True):
        tokens = torch.as_tensor(tokens)
        routed = torch.as_tensor(routed)
        unrouted = torch.zeros(len(tokens), dtype=torch.bool)
        unrouted[routed.shape[0] :] = True
        missing = len(tokens) - 1 - routed.shape[0]
        sequences.append(tokens)
        routes.append(torch.cat([routed, routed.new_full((missing, *routed.shape[1:]), -1)]))
        native.append(unrouted)
    return sequences, routes, native


def nemo_rl_batch(flat):
    """docs/use-rl-job.md's NeMo-RL recipe: the flat batch's mask from ``input_lengths``, the all -1 rows NeMo-RL puts
    where no generation routed a token declared native."""
    width = flat["input_ids"].shape[1]
    mask = torch.arange(width)[None, :] < flat["input_lengths"][:, None]
    unrouted = (flat["routed_experts"] == -1).flatten(2).all(dim=2) & mask
    return dict(input_ids=flat["input_ids"], attention_mask=mask, routes=flat["routed_experts"], native=unrouted)


def test_injob_r3_slime_and_nemo_rl_layouts_through_their_recipes(world):
    actor, engine, vocab = world
    tool, last = trajectory(vocab, SEED + 4)
    single = random_sequences(vocab, [7], SEED + 5)[0]
    r_tool, r_single = engine_routes(engine, [tool, single])
    k = r_tool.shape[-1]
    # slime: rows for every token but the last; the tool-output sample's rows stop at its last generation
    rollout_data = {
        "tokens": [single.tolist(), tool.tolist()],
        "rollout_routed_experts": [r_single[:-1].int(), r_tool[:last].int()],
    }
    sequences, routes, native = slime_requests(rollout_data)
    layouts = {
        # version: the rollout_id slime's actor trains on; numbering: every decoder layer (args.num_layers)
        "slime": lambda: injob.add_routes(
            version=7, numbering="decoder", sequences=sequences, routes=routes, native=native
        ),
        # NeMo-RL: flat, right-padded; the tool output after the last generation and the sampled last token of each
        # generation carry the all -1 sentinel
        "nemo_rl": lambda: injob.add_routes(version=7, **nemo_rl_batch(flat)),
    }
    width = len(tool) + 2
    flat = {
        "input_ids": torch.zeros(2, width, dtype=torch.long),
        "input_lengths": torch.tensor([len(single), len(tool)]),
        "routed_experts": torch.zeros(2, width, len(LAYERS), k, dtype=torch.int16),
    }
    flat["input_ids"][0, : len(single)], flat["input_ids"][1, : len(tool)] = single, tool
    flat["routed_experts"][0, : len(single) - 1] = r_single[:-1]
    flat["routed_experts"][0, len(single) - 1] = -1
    flat["routed_experts"][1, :last] = r_tool[:last]
    flat["routed_experts"][1, last : len(tool)] = -1
    for name, hand_over in layouts.items():
        injob.drop_routes()
        hand_over()
        spy = Natives(actor)
        try:
            with torch.no_grad():
                for seq in (single, tool):
                    actor(seq[None], torch.arange(len(seq))[None], None)
        finally:
            spy.close()
        ends = [len(single) - 1] * len(LAYERS) + [last] * len(LAYERS)
        wants = [r_single] * len(LAYERS) + [r_tool] * len(LAYERS)
        for (layer, used_TK, native_TK), end, want in zip(spy.calls, ends, wants, strict=True):
            assert torch.equal(used_TK[:end], want[:end, layer]), (name, layer)
            assert torch.equal(used_TK[end:], native_TK[end:]), (name, layer)
    injob.drop_routes()


def test_injob_thd_slots_as_cu_seqlens_read_with_the_packed_lengths_named(world):
    # the router driven as the GPTModel pre-hook drives it (CPU attention cannot run packed sequences), in-job R2:
    # the log-prob pass packs A|B in slots of 6, training B|A in slots of 8, each as verl packs them (the slots as
    # both cu_seqlens_q and cu_seqlens_q_padded); each token's hidden state depends on its (sequence, position) only
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.transformer_config import TransformerConfig

    from moeverify.patches import router_replay as rr

    config = TransformerConfig(
        num_layers=2,
        hidden_size=16,
        num_attention_heads=2,
        num_moe_experts=8,
        moe_router_topk=2,
        use_cpu_initialization=True,
        moe_aux_loss_coeff=0.0,
    )
    router = TopKRouter(config, pg_collection=get_default_pg_collection())
    router.set_layer_number(1)
    chunk = torch.nn.ModuleList([router])
    g = torch.Generator().manual_seed(SEED)
    seqs = {u: torch.randint(0, 100, (n,), generator=g) for u, n in (("A", 5), ("B", 3))}
    hidden = {u: torch.randn(len(s), 16, generator=g) for u, s in seqs.items()}

    def verl_packed(order, slot, lengths):
        slots = torch.tensor([0] + [slot] * len(order)).cumsum(0).int()
        ids, h = torch.zeros(1, int(slots[-1]), dtype=torch.long), torch.randn(int(slots[-1]), 1, 16, generator=g)
        where = [None] * int(slots[-1])
        for i, u in enumerate(order):
            at = int(slots[i])
            ids[0, at : at + len(seqs[u])], h[at : at + len(seqs[u]), 0] = seqs[u], hidden[u]
            where[at : at + len(seqs[u])] = [(u, p) for p in range(len(seqs[u]))]
        packed = PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=slots,
            cu_seqlens_kv=slots,
            cu_seqlens_q_padded=slots,
            cu_seqlens_kv_padded=slots,
        )
        with contextlib.ExitStack() as stack:
            if lengths is not None:
                stack.enter_context(injob.packed_lengths(lengths))
            fwd = injob.ChunkForward(chunk, (ids, None, None), {"packed_seq_params": packed})
        injob._CURRENT.append(fwd)
        try:
            ids_TK = torch.topk(router(h)[1].int(), 2).indices.sort().values
        finally:
            injob._CURRENT.pop()
        if fwd.check is not None:
            fwd.check()
        return ids_TK, where, h

    state = injob.InJobState(original=rr.original_routing(), num_experts=8)
    rr._ACTIVE[id(router)] = (state, 0)
    try:
        with torch.no_grad():
            recorded, where, _ = verl_packed(["A", "B"], 6, [5, 3])
            router.weight.add_(torch.randn(router.weight.shape, generator=g) * 3)  # native routing moves
        logp = {w: recorded[t] for t, w in enumerate(where) if w is not None}
        # unnamed, B's slot padding reads as its tokens 3..7, and 6 and 7 were never in a log-prob slot
        with pytest.raises(RouteError, match=r"sequence 0 of this forward, position 6\) has no route"):
            verl_packed(["B", "A"], 8, None)
        with pytest.raises(RouteError, match=r"packed_lengths names 1 sequences, the forward's packed_seq_params hold"):
            verl_packed(["B", "A"], 8, [3])
        replayed, where, h = verl_packed(["B", "A"], 8, [3, 5])
    finally:
        del rr._ACTIVE[id(router)]
    native_TK = torch.topk(h.view(-1, 16) @ router.weight.t(), 2).indices.sort().values
    real = [t for t, w in enumerate(where) if w is not None]
    assert len(real) == 8 and [t for t in real if not torch.equal(replayed[t], logp[where[t]])] == []
    assert sum(not torch.equal(native_TK[t], logp[where[t]]) for t in real) > 0  # replay did the work
    pads = [t for t, w in enumerate(where) if w is None]
    assert len(pads) == 8 and all(torch.equal(replayed[t], native_TK[t]) for t in pads)  # padding: routed natively
    with pytest.raises(UsageError, match=r"packed_lengths: expected one real length \(an integer >= 1\) per packed"):
        with injob.packed_lengths([3, 0]):
            pass
