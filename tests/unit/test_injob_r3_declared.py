"""In-job R3 with the routes handed over with the batch (1 CPU rank): what the trainer declares about its tokens.

- BSHD padding told by an attention mask rather than ``padding_mask`` (verl's BSHD engine path with more than one
  sequence a micro-batch): read under ``injob.padding_from_attention_mask``, refused without it naming the ways out.

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
    saved = os.environ.get(agreement.FLOOR_ENV)
    os.environ[agreement.FLOOR_ENV] = agreement.OFF  # the engine has other weights: no better than random ids
    try:
        yield from installed_world("r3")
    finally:
        if saved is None:
            os.environ.pop(agreement.FLOOR_ENV, None)
        else:
            os.environ[agreement.FLOOR_ENV] = saved
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
