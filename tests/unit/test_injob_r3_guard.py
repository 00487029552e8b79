"""In-job R3 with padding on either side and the agreement guard as it is on by default (1 CPU rank).

The engine is the second model given the actor's own weights, so its routes are the ones native routing picks
(agreement 1 on every real token): a replay that counts padding or natively routed tokens, a left-padded batch that
loses its real tokens' routes, or an engine in another expert numbering, each shows. Every expectation is counted
here from the engine's own routes and the batch layout, independently of the patch.
"""

from __future__ import annotations

import contextlib
import re

import pytest
import torch
from test_injob_r3 import engine_routes, r3_world, write_step
from test_injob_replay import Spy, random_sequences

from moeverify.errors import RouteError
from moeverify.patches import agreement, injob

SEED = 41
LAYERS = (0, 1, 2, 3)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    yield from r3_world(tmp_path_factory, "qwen3_moe", floor=None)  # the guard as in-job R3 installs it


@contextlib.contextmanager
def actor_weights(engine, actor):
    """The engine model holding the actor's weights (restored after)."""
    saved = {k: v.clone() for k, v in engine.state_dict().items() if isinstance(v, torch.Tensor)}
    with torch.no_grad():
        engine.load_state_dict(
            {k: v for k, v in actor.state_dict().items() if isinstance(v, torch.Tensor)}, strict=False
        )
    try:
        yield engine
    finally:
        engine.load_state_dict(saved, strict=False)


def padded(sequences, *, side: str, width: int):
    """``[B, S]`` ids padded on ``side`` with token 0, the padding mask, and (sequence, position) per router token."""
    ids = torch.zeros(len(sequences), width, dtype=torch.long)
    pad = torch.ones(len(sequences), width, dtype=torch.bool)
    where = {}
    for b, seq in enumerate(sequences):
        first = width - len(seq) if side == "left" else 0
        ids[b, first : first + len(seq)], pad[b, first : first + len(seq)] = seq, False
        for s in range(len(seq)):
            where[(first + s) * len(sequences) + b] = (b, s)
    return ids, pad, where


def run_forward(actor, ids, pad, *, grad: bool):
    """A forward as verl's BSHD batches give it: positions from each row's first real token, padding keys masked
    in attention (RoPE sees relative positions: a shifted row attends as the unpadded sequence)."""
    device = next(actor.parameters()).device
    ids, pad = ids.to(device), pad.to(device)
    pos = (torch.cumsum(~pad, dim=1) - 1).clamp(min=0)
    causal = torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool, device=device).triu(1)
    mask = causal[None, None] | pad[:, None, None, :]
    with torch.set_grad_enabled(grad):
        out = actor(ids, pos, mask, padding_mask=pad)
    if grad:
        out.float().square().masked_fill(pad[..., None], 0).sum().backward()


@pytest.mark.parametrize("side", ["left", "right"])
def test_r3_padded_batch_replays_every_real_token_and_the_guard_counts_only_them(world, side):
    actor, engine, vocab, directory = world
    sequences = random_sequences(vocab, [7, 3, 9, 5], SEED)
    with actor_weights(engine, actor):
        routes = engine_routes(engine, sequences)
    write_step(directory, 100 + (side == "right"), sequences, routes)
    ids, pad, where = padded(sequences, side=side, width=12)
    guard = agreement.ACTIVE
    assert guard is not None and guard.floor == agreement.CHANCE  # on by default in r3, with the chance floor
    guard.end_step()
    spy = Spy(actor)
    try:
        run_forward(actor, ids, pad, grad=False)  # the log-prob pass
        logp = spy.take()
        run_forward(actor, ids, pad, grad=True)  # the training pass
        train = spy.take()
    finally:
        spy.close()
    checked = 0
    for calls in (logp, train):
        for layer, ids_TK in calls:
            for t, (b, s) in where.items():
                if s < len(sequences[b]) - 1:  # the last token has no engine row: native
                    assert torch.equal(ids_TK[t], routes[b][s, layer]), f"{side}: layer {layer} seq {b} pos {s}"
                    checked += 1
    real = sum(len(s) for s in sequences)
    assert checked == 2 * len(LAYERS) * (real - len(sequences))
    guard.end_step()
    rows = [r for r in guard.history if r["step"] == guard.step]
    assert sorted((r["pass"], r["layer"]) for r in rows) == sorted(
        (p, layer) for p in ("log_prob", "training") for layer in LAYERS
    )
    for row in rows:  # padding and last tokens counted apart; the engine is native routing of unpadded requests
        assert (row["tokens"], row["padding"], row["routed_natively"], row["routed"]) == (
            real - len(sequences),
            ids.numel() - real,
            len(sequences),
            ids.numel(),
        ), row
        assert 0.9 <= row["agreement"] <= row["overlap"], row  # a batch's numerics may flip a near-tie


def test_r3_engine_in_another_expert_numbering_fails_the_default_floor(world):
    # EPLB physical slots that happen to be a permutation within range, written without their map: every id is in
    # [0, E), so only the agreement with native routing can tell; the guard's default floor refuses the step
    actor, engine, vocab, directory = world
    sequences = random_sequences(vocab, [9, 8, 9, 7, 8, 9], SEED + 1)
    with actor_weights(engine, actor):
        routes = engine_routes(engine, sequences)
    slot_of = torch.tensor([3, 7, 0, 5, 1, 6, 2, 4])  # logical expert -> physical slot, no fixed point
    write_step(directory, 110, sequences, [slot_of[r] for r in routes])
    guard = agreement.ACTIVE
    guard.end_step()
    ids, pad, _ = padded(sequences, side="left", width=10)
    run_forward(actor, ids, pad, grad=False)
    # the numbering check (on by default for engine routes) names an engine expert and the trainer expert it is;
    # the expected pair is read off the permutation here: engine slot slot_of[f] holds trainer expert f
    with pytest.raises(
        RouteError, match=r"log_prob pass layer \d rank 0: engine expert \d routes like trainer expert"
    ) as err:
        guard.end_step()
    e, f = (int(n) for n in re.search(r"engine expert (\d) routes like trainer expert (\d)", str(err.value)).groups())
    assert int(slot_of[f]) == e, str(err.value)
    assert "MOEVERIFY_AGREEMENT_NUMBERING=off turns this check off" in str(err.value)
    guard.numbering = False  # the chance floor stays as the backstop
    run_forward(actor, ids, pad, grad=False)
    with pytest.raises(
        RouteError,
        match=r"agreement guard: step \d+ log_prob pass layer \d rank 0: overlap .*no "
        r"better than random ids: another expert numbering \(EPLB physical slots "
        r"without their map\).* over 44 replayed tokens \(padding 10 and tokens "
        r"routed natively 6 not counted\).*MOEVERIFY_AGREEMENT_FLOOR=chance, the "
        r"default of in-job replay",
    ):
        guard.end_step()
    write_step(directory, 111, sequences, routes)  # the engine's logical ids: the same batch passes
    with injob.rollout_version(111):  # rolled out whole in steps 110 and 111: the batch names its version
        run_forward(actor, ids, pad, grad=False)
    assert guard.end_step() == {} and all(r["overlap"] >= 0.9 for r in guard.history[-len(LAYERS) :])
    guard.numbering = True


def test_guard_counts_only_replayed_tokens_where_the_old_share_passed():
    # 10 real tokens of which 5 replay native routing's experts, 30 padding tokens and 10 natively routed tokens
    # (which agree by construction): counting every token gives 45 / 50 = 0.9 and passes a 0.9 minimum; the
    # replayed tokens agree at 0.5 and the step fails
    g = torch.Generator().manual_seed(3)
    native_TK = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(50)])
    replayed_TK = native_TK.clone()
    replayed_TK[5:10] = (native_TK[5:10] + 1) % 8  # 5 real tokens on other experts
    pad_T = torch.zeros(50, dtype=torch.bool)
    pad_T[10:40] = True
    native_T = torch.zeros(50, dtype=torch.bool)
    native_T[40:] = True
    every_token = (replayed_TK.sort(1).values == native_TK.sort(1).values).all(1).double().mean().item()
    assert every_token == 0.9
    guard = agreement.Guard(minimum=0.9)
    try:
        guard.count(3, replayed_TK, native_TK, kind="training", num_experts=8, pad_T=pad_T, routed_natively_T=native_T)
        with pytest.raises(
            RouteError,
            match=r"step 1 training pass layer 3 rank 0: agreement \(top-k set equal to "
            r"native routing's\) 50.0000% over 10 replayed tokens \(padding 30 and "
            r"tokens routed natively 10 not counted\), expected at least 90.0000%",
        ):
            guard.end_step()
        row = guard.history[-1]
        hits = sum(
            len(set(a.tolist()) & set(b.tolist())) for a, b in zip(replayed_TK[:10], native_TK[:10], strict=True)
        )
        assert (row["agreement"], row["overlap"], row["tokens"]) == (0.5, hits / 20, 10)
    finally:
        guard.close()


@pytest.mark.parametrize(("k", "e", "slots", "want"), [(2, 8, 10**6, 0.25), (8, 128, 4000, 0.0625)])
def test_chance_floor_sits_between_random_ids_and_a_real_engine(k, e, slots, want):
    chance, floor = agreement.chance_floor(topk=k, num_experts=e, slots=slots)
    assert chance == want and chance < floor <= chance + (1 - chance) / 4
    small_chance, small_floor = agreement.chance_floor(topk=k, num_experts=e, slots=4)
    assert small_floor == pytest.approx(chance + (1 - chance) / 4)  # few slots: the margin, not the noise, binds
