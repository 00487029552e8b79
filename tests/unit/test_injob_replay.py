"""In-job R2 (``MOEVERIFY_ROUTER_REPLAY=r2``) in RL loops written the way trainers write them (1 CPU rank).

The patch is installed from the environment as the entry point does, before the models are built; the loops
never mention it. A spy (a forward hook on every ``TopKRouter``) reads the experts Megatron actually used, so
every training token is checked against the route its own log-prob forward chose (found by the test from the
sequence and position it fed, independently of the patch's keys), and gradients are compared bitwise with
the session API given those routes aligned by hand.
"""

from __future__ import annotations

import gc
import os

import pytest
import torch

from moeverify.errors import RouteError
from moeverify.patches import autopatch, injob
from moeverify.patches import router_replay as rr
from moeverify.spec.layout import Layout

VOCAB_SEED = 11


def backend_of_tests() -> str:
    """cpu (gloo); ``MOEVERIFY_TEST_BACKEND=cuda``: one GPU with deterministic kernels (docs/gpu/)."""
    backend = os.environ.get("MOEVERIFY_TEST_BACKEND", "cpu")
    if backend == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    return backend


def installed_world(setting: str, family: str = "qwen3_moe", overrides: dict | None = None):
    """Autopatch installed from the environment (``MOEVERIFY_ROUTER_REPLAY=setting``) as the entry point does,
    then two models built: the actor (bound) and a second one of other weights (the reference or the engine,
    routing natively). Yields (actor chunk, second chunk, vocab size)."""
    from moeverify import models, runtime

    runtime.init(backend_of_tests())
    with runtime.parallel(Layout(), seed=0):
        gc.collect()  # models are numbered over live routers: earlier modules' models must be gone
        saved = {k: os.environ.get(k) for k in (autopatch.ENV, autopatch.MODEL_ENV)}
        os.environ[autopatch.ENV] = setting
        os.environ[autopatch.MODEL_ENV] = str(len(autopatch._ORDER.models()))  # the actor: built next
        from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

        scale = MoEAuxLossAutoScaler.main_loss_backward_scale
        try:
            autopatch.install_from_env()
            actor = models.build(family, Layout(), seed=0, overrides=overrides)
            second = models.build(family, Layout(), seed=1, overrides=overrides)
            for chunk in actor.model_chunks + second.model_chunks:
                chunk.train()
            yield actor.model_chunks[0], second.model_chunks[0], actor.config.vocab_size
        finally:
            MoEAuxLossAutoScaler.main_loss_backward_scale = scale
            autopatch.uninstall()
            rr.revert()
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value


@pytest.fixture(scope="module")
def world():
    yield from installed_world("r2")


class Spy:
    """Per forward routing call of the bound model (recomputes apart): ``(layer, sorted ids [T, K])``."""

    def __init__(self, chunk):
        self.calls: list[tuple[int, torch.Tensor]] = []
        self.handles = [
            m.register_forward_hook(self._hook) for m in chunk.modules() if type(m).__name__ == "TopKRouter"
        ]

    def _hook(self, router, _inputs, outputs):
        if torch._C._current_graph_task_id() == -1:
            ids_TK = torch.topk(outputs[1].int(), router.topk).indices.sort().values.cpu()
            self.calls.append((router.layer_number - 1, ids_TK))

    def take(self) -> list:
        calls, self.calls = self.calls, []
        return calls

    def close(self):
        for h in self.handles:
            h.remove()


def batch_of(sequences, uids):
    """Right-padded ``[B, S]`` ids, Megatron's padding mask, and the (uid, position) of each token in router order."""
    width = max(len(sequences[u]) for u in uids)
    ids = torch.zeros(len(uids), width, dtype=torch.long)
    pad = torch.ones(len(uids), width, dtype=torch.bool)
    for b, u in enumerate(uids):
        ids[b, : len(sequences[u])], pad[b, : len(sequences[u])] = sequences[u], False
    where = [(uids[b], s) if not pad[b, s] else None for s in range(width) for b in range(len(uids))]
    return ids, pad, where


def forward(chunk, ids, pad):
    device = next(chunk.parameters()).device
    ids, pad = ids.to(device), pad.to(device)
    pos = torch.arange(ids.shape[1], device=device).expand_as(ids)
    return chunk(ids, pos, None, padding_mask=pad if bool(pad.any()) else None)


def loss_of(output, pad):
    pad = pad.to(output.device)
    return output.float().square().mean(dim=-1).masked_fill(pad, 0.0).sum() / (~pad).sum()


def log_prob_pass(chunk, sequences, uids, spy, *, micro=4) -> dict:
    """verl's compute_log_prob: no grad, its own micro-batch size; returns (layer, uid, pos) -> sorted ids."""
    routes = {}
    with torch.no_grad():
        for i in range(0, len(uids), micro):
            ids, pad, where = batch_of(sequences, uids[i : i + micro])
            forward(chunk, ids, pad)
            for layer, ids_TK in spy.take():
                routes.update({(layer, *w): ids_TK[t] for t, w in enumerate(where) if w is not None})
    return routes


def dynamic_micro_batches(sequences, uids, max_tokens):
    """Group a mini-batch's sequences by token count (padded width x rows <= max_tokens), in the given order."""
    groups, current = [], []
    for u in uids:
        trial = current + [u]
        if current and max(len(sequences[v]) for v in trial) * len(trial) > max_tokens:
            groups.append(current)
            trial = [u]
        current = trial
    return groups + [current]


def ppo_update(chunk, sequences, plan, *, spy=None, aligned=None, session=None):
    """PPO epochs of shuffled mini-batches (one optimizer step each); returns the grads of every mini-batch.

    ``aligned``: (layer, uid, pos) -> ids to replay through ``session`` by hand (the reference run), or a list of
    such dicts, one per micro-batch in order; else the loop runs as a trainer writes it and ``spy`` collects what
    each token used."""
    opt = torch.optim.SGD(chunk.parameters(), lr=0.5)
    grads, used, count = [], [], 0
    for minibatch in plan:
        opt.zero_grad(set_to_none=True)
        for micro in minibatch:
            ids, pad, where = batch_of(sequences, micro)
            if aligned is None:
                loss_of(forward(chunk, ids, pad), pad).backward()
                used.append((where, spy.take()))
                continue
            table = aligned[count] if isinstance(aligned, list) else aligned
            count += 1  # padding is keyed by micro-batch occurrence: one micro-batch may recur in another epoch
            routes = rr.Routes(
                {
                    layer: [torch.stack([table[(layer, *(w or ("pad", count - 1, t)))] for t, w in enumerate(where)])]
                    for layer in session.layers
                },
                num_experts=session.num_experts,
                topk=session.topk,
            )
            with session.replay(routes):
                loss_of(forward(chunk, ids, pad), pad).backward()
            session.check_consumed()
        grads.append({n: p.grad.clone() for n, p in chunk.named_parameters() if p.grad is not None})
        opt.step()
    return grads, used


def verl_plan(uids, *, epochs=2, minibatches=2, ppo_micro=2, max_tokens=None, sequences=None, seed=3):
    """verl's update_policy: per epoch, shuffled mini-batches split into micro-batches of ``ppo_micro``
    sequences; with ``max_tokens``, the last epoch regroups them by token count (use_dynamic_bsz) instead."""
    g = torch.Generator().manual_seed(seed)
    plan = []
    for epoch in range(epochs):
        order = [uids[i] for i in torch.randperm(len(uids), generator=g).tolist()]
        size = len(order) // minibatches
        for m in range(minibatches):
            part = order[m * size : (m + 1) * size]
            if max_tokens is None or epoch < epochs - 1:
                plan.append([part[i : i + ppo_micro] for i in range(0, len(part), ppo_micro)])
            else:
                plan.append(dynamic_micro_batches(sequences, part, max_tokens))
    return plan


def run_step(world, sequences, plan, *, reference=False):
    """One RL step as a trainer runs it, then the same updates by hand through the session API; compares."""
    actor, ref_model, _ = world
    saved = {k: v.clone() for k, v in actor.state_dict().items() if isinstance(v, torch.Tensor)}
    uids = list(range(len(sequences)))
    spy = Spy(actor)
    try:
        logp = log_prob_pass(actor, sequences, uids, spy)
        if reference:
            with torch.no_grad():
                for i in range(0, len(uids), 4):
                    ids, pad, _ = batch_of(sequences, uids[i : i + 4])
                    forward(ref_model, ids, pad)
        got, used = ppo_update(actor, sequences, plan, spy=spy)
    finally:
        spy.close()
    checked, aligned = 0, dict(logp)
    for occurrence, (where, calls) in enumerate(used):
        assert len(calls) == 4, f"{len(calls)} forward routing calls, expected one per MoE layer"
        for layer, ids_TK in calls:
            for t, w in enumerate(where):
                if w is None:
                    aligned[(layer, "pad", occurrence, t)] = ids_TK[t]  # padding: as it was routed
                    continue
                assert torch.equal(ids_TK[t], logp[(layer, *w)]), f"layer {layer} token {w}: not its log-prob route"
                checked += 1
    assert checked == 4 * sum(len(sequences[u]) for mb in plan for m in mb for u in m)
    assert_grads_as_session_api(actor, saved, sequences, plan, aligned, got, what="hand-aligned routes")
    return checked


def assert_grads_as_session_api(actor, saved, sequences, plan, aligned, got, *, what: str) -> None:
    """The same updates through the session API given ``aligned`` routes from the ``saved`` weights: every
    mini-batch's gradients bitwise equal to ``got``; the weights are restored after."""
    actor.load_state_dict(saved, strict=False)
    session = rr.ReplaySession(actor)
    want, _ = ppo_update(actor, sequences, plan, aligned=aligned, session=session)
    actor.load_state_dict(saved, strict=False)
    assert len(got) == len(want) == len(plan)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert a.keys() == b.keys() and a
        diff = [n for n in a if not torch.equal(a[n], b[n])]
        assert not diff, f"mini-batch {i}: gradients differ from the session API with {what}: {diff[:3]}"


def random_sequences(vocab, lengths, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g) for n in lengths]


def test_injob_verl_loop_replays_each_tokens_log_prob_route(world):
    # log-prob micro-batch 4; PPO micro-batch 2, then dynamic batching by token count; 2 shuffled mini-batches,
    # 2 epochs; sequences of several lengths, right-padded with Megatron's padding_mask
    sequences = random_sequences(world[2], [6, 3, 8, 5, 7, 2, 8, 4], VOCAB_SEED)
    plan = verl_plan(list(range(8)), max_tokens=24, sequences=sequences)
    assert {len(m) for mb in plan for m in mb} == {1, 2, 3}
    assert run_step(world, sequences, plan) == 2 * sum(len(s) for s in sequences) * 4


def test_injob_grpo_step_shared_prompts_and_reference_model(world):
    vocab = world[2]
    prompts = random_sequences(vocab, [4, 5], VOCAB_SEED + 2)
    responses = random_sequences(vocab, [3] * 6, VOCAB_SEED + 3)
    sequences = [torch.cat([prompts[i // 3], responses[i]]) for i in range(6)]  # 3 responses per prompt
    plan = verl_plan(list(range(6)), epochs=1, minibatches=2, ppo_micro=3, seed=5)
    run_step(world, sequences, plan, reference=True)
    session = autopatch.session()
    assert len(session.state.tables) == 1  # the actor's chunk only: the reference model routed natively


def test_injob_token_without_route_refused(world):
    actor, _, vocab = world
    sequences = random_sequences(vocab, [5, 5], VOCAB_SEED + 4)
    with torch.no_grad():
        forward(actor, sequences[0][None], torch.zeros(1, 5, dtype=torch.bool))
    ids = torch.stack(sequences)
    with pytest.raises(
        RouteError,
        match=r"layer 0 rank 0: training token 1 \(sequence 1 of this forward, position 0"
        r"\) has no route recorded by this step's log-prob pass \(5 of 10 tokens",
    ):
        forward(actor, ids, torch.zeros(2, 5, dtype=torch.bool))
    with torch.no_grad():  # a new step: the previous step's routes are dropped
        forward(actor, ids[1:], torch.zeros(1, 5, dtype=torch.bool))
    with pytest.raises(RouteError, match=r"training token 0 \(sequence 0 of this forward, position 0\) has no route"):
        forward(actor, ids[:1], torch.zeros(1, 5, dtype=torch.bool))
    with injob.pass_kind("log_prob"):  # the override: a forward with grad enabled that records
        forward(actor, ids, torch.zeros(2, 5, dtype=torch.bool))
    forward(actor, ids, torch.zeros(2, 5, dtype=torch.bool)).sum().backward()


def test_injob_spy_catches_routes_replayed_on_other_tokens(world, monkeypatch):
    # mutant: the table replays each forward's rows shifted by one token (a layout bug); run_step's spy must fail
    import dataclasses

    from moeverify.patches.route_table import RouteTable

    real = RouteTable.lookup

    def shifted(self, keys, **kwargs):
        found = real(self, keys, **kwargs)
        return dataclasses.replace(found, index_T=found.index_T.roll(1))

    monkeypatch.setattr(RouteTable, "lookup", shifted)
    sequences = random_sequences(world[2], [5, 5], VOCAB_SEED + 5)
    with pytest.raises(AssertionError, match=r"not its log-prob route"):
        run_step(world, sequences, [[[1, 0]]])


def test_injob_stage_without_input_ids_refused(world):
    # a pipeline stage fed hidden states only (no input_ids): its tokens cannot be identified, never routed natively
    actor, _, vocab = world
    ids = random_sequences(vocab, [4], VOCAB_SEED + 6)[0][None]
    with torch.no_grad():
        forward(actor, ids, torch.zeros(1, 4, dtype=torch.bool))
    weight = next(actor.parameters())
    hidden_SBH = torch.randn(4, 1, actor.config.hidden_size, dtype=weight.dtype).to(weight.device)
    with pytest.raises(RouteError, match=r"layer 0 rank 0: this model chunk's forward got no input_ids"):
        actor(None, None, None, decoder_input=hidden_SBH)


def test_injob_setting_parsed_from_the_environment_value():
    assert (autopatch.parse("r2").mode, autopatch.parse("r2").directory) == ("r2", None)
    assert (autopatch.parse("r3:/tmp/x").mode, str(autopatch.parse("r3:/tmp/x").directory)) == ("r3", "/tmp/x")
    assert (autopatch.parse("r3").mode, autopatch.parse("r3").directory) == ("r3", None)  # routes with the batch
    for bad in ("r2:/tmp/x", "r3:", "r4:/tmp/x"):
        with pytest.raises(
            Exception,
            match=r"expected record:DIR or replay:DIR, r2 \(in-job replay of the log-prob "
            r"pass\), r3:DIR \(in-job replay of a rollout's routes written to DIR\) "
            r"or r3 \(the rollout's routes handed over with the batch",
        ):
            autopatch.parse(bad)


def test_injob_packed_thd_step_other_packing_replays_and_padding_routes_natively(world):
    # THD: the log-prob pass packs A|B, training packs B|C|A in padded slots (the router itself, driven as the
    # GPTModel pre-hook drives it: CPU attention cannot run packed sequences). Each token's hidden state depends on
    # its (sequence, position) only; the router weights move between the passes, so native routing differs.
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=2,
        hidden_size=16,
        num_attention_heads=2,
        num_moe_experts=8,
        moe_router_topk=2,
        use_cpu_initialization=True,
        moe_aux_loss_coeff=0.0,
    )
    device = "cuda" if os.environ.get("MOEVERIFY_TEST_BACKEND", "cpu") == "cuda" else "cpu"
    router = TopKRouter(config, pg_collection=get_default_pg_collection()).to(device)
    router.set_layer_number(1)
    chunk = torch.nn.ModuleList([router])
    g = torch.Generator().manual_seed(7)
    seqs = {u: torch.randint(0, 100, (n,), generator=g) for u, n in (("A", 5), ("B", 3), ("C", 4))}
    hidden = {u: torch.randn(len(s), 16, generator=g) for u, s in seqs.items()}

    def packed_pass(order, slot):
        cu = torch.tensor([0] + [len(seqs[u]) for u in order]).cumsum(0).int()
        cu_pad = torch.tensor([0] + [slot or len(seqs[u]) for u in order]).cumsum(0).int()
        n = int(cu_pad[-1])
        ids, h = torch.zeros(1, n, dtype=torch.long), torch.randn(n, 1, 16, generator=g)  # padding: any state
        h = h.to(device)
        where = [None] * n
        for i, u in enumerate(order):
            at = int(cu_pad[i])
            ids[0, at : at + len(seqs[u])], h[at : at + len(seqs[u]), 0] = seqs[u], hidden[u].to(device)
            where[at : at + len(seqs[u])] = [(u, p) for p in range(len(seqs[u]))]
        packed = PackedSeqParams(
            qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu_pad, cu_seqlens_kv_padded=cu_pad
        )
        fwd = injob.ChunkForward(chunk, (ids.to(device), None, None), {"packed_seq_params": packed})
        injob._CURRENT.append(fwd)
        try:
            ids_TK = torch.topk(router(h)[1].int(), 2).indices.sort().values.cpu()
        finally:
            injob._CURRENT.pop()
        if fwd.check is not None:
            fwd.check()
        return ids_TK, where, h

    state = injob.InJobState(original=rr.original_routing(), num_experts=8)
    rr._ACTIVE[id(router)] = (state, 0)
    try:
        with torch.no_grad():
            recorded, where, _ = packed_pass(["A", "B"], None)
        logp = {w: recorded[t] for t, w in enumerate(where)}
        with torch.no_grad():
            router.weight.add_(torch.randn(router.weight.shape, generator=g).to(device) * 3)
        replayed, where, h = packed_pass(["B", "A"], 6)  # other order, padded slots, trailing padding none
        with pytest.raises(
            RouteError,
            match=r"layer 0 rank 0: training token 6 \(sequence 1 of this forward, "
            r"position 0\) has no route",
        ):
            packed_pass(["B", "C"], 6)
    finally:
        del rr._ACTIVE[id(router)]
    native_TK = torch.topk(h.view(-1, 16) @ router.weight.t(), 2).indices.sort().values.cpu()
    real = [t for t, w in enumerate(where) if w is not None]
    assert len(real) == 8 and len(where) == 12
    assert [t for t in real if not torch.equal(replayed[t], logp[where[t]])] == []
    assert sum(not torch.equal(native_TK[t], logp[where[t]]) for t in real) > 0  # replay did the work
    pads = [t for t, w in enumerate(where) if w is None]
    assert len(pads) == 4
    assert [t for t in pads if not torch.equal(replayed[t], native_TK[t])] == []  # padding slots routed natively


def test_injob_multi_turn_samples_share_their_earlier_turns(world):
    # multi-turn RL: each turn of a conversation is a sample (turn 1, turns 1-2, turns 1-3: every earlier turn a
    # prefix of the later samples) plus a second conversation; shuffled PPO mini-batches of 2
    vocab = world[2]
    turns = random_sequences(vocab, [4, 3, 5], VOCAB_SEED + 7)
    other = random_sequences(vocab, [6], VOCAB_SEED + 8)[0]
    sequences = [turns[0], torch.cat(turns[:2]), torch.cat(turns), other]
    plan = verl_plan(list(range(4)), epochs=2, minibatches=2, ppo_micro=2, seed=9)
    assert run_step(world, sequences, plan) == 2 * sum(len(s) for s in sequences) * 4


def test_injob_training_pass_padded_on_the_left_replays_its_right_padded_log_prob_routes(world):
    # the log-prob pass pads on the right, the training pass on the left (verl's prompt padding) at another width:
    # with the padding mask every real token finds its log-prob route; padding routes natively
    actor = world[0]
    sequences = random_sequences(world[2], [6, 3, 8, 5], VOCAB_SEED + 9)
    spy = Spy(actor)
    try:
        logp = log_prob_pass(actor, sequences, [0, 1, 2, 3], spy)
        width = 11
        ids = torch.zeros(4, width, dtype=torch.long)
        pad = torch.ones(4, width, dtype=torch.bool)
        where = {}
        for b, seq in enumerate(sequences):
            first = width - len(seq)
            ids[b, first:], pad[b, first:] = seq, False
            where.update({(first + s) * 4 + b: (b, s) for s in range(len(seq))})
        loss_of(forward(actor, ids, pad), pad).backward()
        calls = spy.take()
    finally:
        spy.close()
        actor.zero_grad(set_to_none=True)
    checked = 0
    for layer, ids_TK in calls:
        for t, (b, s) in where.items():
            assert torch.equal(ids_TK[t], logp[(layer, b, s)]), f"layer {layer} sequence {b} position {s}"
            checked += 1
    assert checked == 4 * sum(len(s) for s in sequences)


def test_injob_inference_engine_forward_routes_natively_and_records_nothing(world):
    # Megatron-LM's RL loop runs Megatron-Core's inference engine on the training model itself, gradients off: its
    # forwards carry an inference context. They are the rollout, not a log-prob pass: routed natively (what the
    # model's own routing picks), never recorded into the step's table nor replayed
    from megatron.core.inference.contexts.static_context import StaticInferenceContext

    from moeverify.errors import RouteError
    from moeverify.patches import injob

    actor, _, vocab = world
    device = next(actor.parameters()).device
    ids = torch.randint(0, vocab, (2, 6), generator=torch.Generator().manual_seed(7)).to(device)
    pos = torch.arange(6, device=device).expand(2, 6)
    state = autopatch.session().state
    steps = state.steps if state is not None else 0
    spy = Spy(actor)
    try:
        with torch.no_grad():
            context = StaticInferenceContext(max_batch_size=2, max_sequence_length=6)
            actor(ids, pos, None, inference_context=context)
        calls = spy.take()
    finally:
        spy.close()
    assert calls and all(ids_TK.shape[0] == ids.numel() for _, ids_TK in calls)
    state = autopatch.session().state
    assert (state.steps if state is not None else 0) == steps  # no log-prob pass began: nothing recorded
    with pytest.raises(RouteError, match=r"no routes recorded|has no route recorded"):
        with injob.pass_kind("training"):  # the engine's tokens were never recorded: a training pass has no route
            actor(ids.flip(1), pos, None).float().sum().backward()


def test_injob_reference_pass_on_the_training_model_under_native_pass_kind_is_not_recorded(world):
    # Megatron-LM's RL loop loads the reference weights into the training model for the reference log-probs: under
    # pass_kind("native") that pass routes natively and records nothing, so training replays the old log-prob pass
    from moeverify.patches import injob

    actor, _, vocab = world
    device = next(actor.parameters()).device
    ids = torch.randint(0, vocab, (2, 6), generator=torch.Generator().manual_seed(17)).to(device)
    pos = torch.arange(6, device=device).expand(2, 6)
    routers = [m for m in actor.modules() if type(m).__name__ == "TopKRouter"]
    spy = Spy(actor)
    try:
        with torch.no_grad():
            actor(ids, pos, None)  # the old log-prob pass: recorded
        old = spy.take()
        saved = [r.weight.detach().clone() for r in routers]
        with torch.no_grad():
            for r in routers:  # the reference weights
                r.weight.add_(torch.randn(r.weight.shape, generator=torch.Generator().manual_seed(3)).to(device))
            with injob.pass_kind("native"):
                actor(ids, pos, None)
            ref = spy.take()
            for r, w in zip(routers, saved, strict=True):
                r.weight.copy_(w)
        actor(ids, pos, None).float().sum().backward()  # training replays the old pass
        train = spy.take()
    finally:
        spy.close()
        actor.zero_grad(set_to_none=True)
    assert any(not torch.equal(a, b) for (_, a), (_, b) in zip(old, ref, strict=True))  # the reference routed otherwise
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(old, train, strict=True))
