"""In-job R3 with the engine's routes handed over with the batch (``MOEVERIFY_ROUTER_REPLAY=r3``, no directory; 1 CPU
rank): a verl-style padded batch carrying ``routed_experts`` aligned with ``input_ids``, and per-request engine
payloads (SGLang's base64 int32, vLLM 0.21's split prompt/completion arrays) decoded by
``moeverify.routing.engine_routes``.

The engine is a second model of other weights run one request at a time; a spy on the actor's routers reads what
Megatron used, checked token by token against what the engine routed (found by the test from the sequence and
position it fed).
"""

from __future__ import annotations

import base64
import gc
import os

import numpy as np
import pytest
import torch
from test_injob_r3 import engine_routes
from test_injob_replay import Spy, installed_world, random_sequences

from moeverify.errors import UsageError
from moeverify.patches import agreement, autopatch, injob
from moeverify.routing import engine_routes as er

SEED = 61
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


def verl_batch(sequences, routes, *, width):
    """verl's layout: each sequence left-padded to ``width``, ``routed_experts`` aligned with ``input_ids`` (the
    last real token's row never filled: zeros), mask 1 on real tokens."""
    b = len(sequences)
    ids = torch.zeros(b, width, dtype=torch.long)
    mask = torch.zeros(b, width, dtype=torch.long)
    routed = torch.zeros(b, width, len(LAYERS), routes[0].shape[-1], dtype=torch.int64)
    for i, (seq, r) in enumerate(zip(sequences, routes, strict=True)):
        first = width - len(seq)
        ids[i, first:], mask[i, first:] = seq, 1
        routed[i, first : first + len(seq) - 1] = r[:-1]
    return ids, mask, routed


def run(actor, seq):
    """A one-sequence forward on the actor's device."""
    device = next(actor.parameters()).device
    return actor(seq[None].to(device), torch.arange(len(seq), device=device)[None], None)


def forward_padded(actor, ids, mask, *, grad):
    device = next(actor.parameters()).device
    ids, mask = ids.to(device), mask.to(device)
    pad = mask == 0
    pos = (torch.cumsum(mask, dim=1) - 1).clamp(min=0)
    causal = torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool, device=device).triu(1)
    with torch.set_grad_enabled(grad):
        out = actor(ids, pos, causal[None, None] | pad[:, None, None, :], padding_mask=pad)
    if grad:
        out.float().square().masked_fill(pad[..., None], 0).sum().backward()


def assert_each_on_its_route(actor, sequences, routes) -> None:
    """A no-grad forward per sequence: every token but the last (no engine row) on its engine route."""
    spy = Spy(actor)
    try:
        with torch.no_grad():
            for seq, want in zip(sequences, routes, strict=True):
                run(actor, seq)
                for layer, ids_TK in spy.take():
                    assert all(torch.equal(ids_TK[s], want[s, layer]) for s in range(len(seq) - 1)), layer
    finally:
        spy.close()


def check_replayed(calls, sequences, routes, *, width) -> int:
    checked = 0
    b = len(sequences)
    for layer, ids_TK in calls:
        for i, seq in enumerate(sequences):
            first = width - len(seq)
            for s in range(len(seq) - 1):  # the last token has no engine row: native
                assert torch.equal(ids_TK[(first + s) * b + i], routes[i][s, layer]), (layer, i, s)
                checked += 1
    return checked


def test_r3_batch_padded_routed_experts_replayed_in_both_passes(world):
    actor, engine, vocab = world
    sequences = random_sequences(vocab, [7, 4, 9, 6], SEED)
    routes = engine_routes(engine, sequences)
    ids, mask, routed = verl_batch(sequences, routes, width=11)
    held = injob.add_routes(version=3, input_ids=ids, attention_mask=mask, routes=routed)
    assert held == sum(len(s) for s in sequences)  # this rank holds its own tokens only
    spy = Spy(actor)
    try:
        forward_padded(actor, ids, mask, grad=False)
        logp = spy.take()
        forward_padded(actor, ids, mask, grad=True)
        train = spy.take()
    finally:
        spy.close()
        actor.zero_grad(set_to_none=True)
    want = len(LAYERS) * sum(len(s) - 1 for s in sequences)
    assert check_replayed(logp, sequences, routes, width=11) == want
    assert check_replayed(train, sequences, routes, width=11) == want
    source = autopatch.session().state.source
    assert source is autopatch.session().batch and source.steps == (3,) and source.builds >= 1
    injob.drop_routes()


def test_r3_batch_engine_payloads_as_the_engines_return_them(world):
    actor, engine, vocab = world
    sequences = random_sequences(vocab, [6, 8], SEED + 1)
    routes = engine_routes(engine, sequences)
    k = routes[0].shape[-1]
    # SGLang: base64 of flat int32 [S - 1, num_hidden_layers, K] in meta_info
    sglang = er.from_sglang(
        {"meta_info": {"routed_experts": base64.b64encode(routes[0][:-1].numpy().astype("<i4").tobytes()).decode()}},
        num_layers=len(LAYERS),
        top_k=k,
        num_tokens=len(sequences[0]),
        physical=False,
        request="req-0",
    )
    # vLLM 0.21: the prompt's rows apart from the completion's, int16, the last token's row never filled
    prompt = 3
    full = np.concatenate([routes[1].numpy(), np.zeros((1, len(LAYERS), k))]).astype(np.int16)[: len(sequences[1])]
    full[-1] = 0
    vllm = er.from_vllm(
        full[prompt:],
        prompt_routed_experts=full[:prompt],
        num_tokens=len(sequences[1]),
        physical=False,
        numbering="routers",
        request="req-1",
    )
    injob.add_routes(version=4, sequences=sequences[:1], routes=[sglang])  # one engine's layer numbering a version
    injob.add_routes(version=5, sequences=sequences[1:], routes=[vllm])
    assert_each_on_its_route(actor, sequences, routes)
    injob.drop_routes()


def test_r3_batch_off_policy_versions_and_refusals(world):
    actor, engine, vocab = world
    prompt = random_sequences(vocab, [5], SEED + 2)[0]
    answers = random_sequences(vocab, [3, 4], SEED + 3)
    old, new = torch.cat([prompt, answers[0]]), torch.cat([prompt, answers[1]])
    routes_old = engine_routes(engine, [old])[0]
    routes_new = (engine_routes(engine, [new])[0] + 5) % 8  # the next policy version's routes
    injob.add_routes(version=10, sequences=[old], routes=[routes_old[:-1]])
    injob.add_routes(version=11, sequences=[new], routes=[routes_new[:-1]])
    assert_each_on_its_route(actor, [old], [routes_old])  # one step off-policy: version 10's prompt routes
    injob.drop_routes()
    bad = [
        (dict(version=-1, sequences=[old], routes=[routes_old]), r"expected the step or policy version"),
        (dict(version=1, routes=[routes_old]), r"give either sequences="),
        (dict(version=1, sequences=[old], routes=[routes_old[:-2]]), r"request 0: 6 route rows for 8 tokens"),
        (dict(version=1, input_ids=old[None], routes=routes_old[None]), r"attention_mask is needed"),
        (
            dict(
                version=1,
                input_ids=old[None],
                attention_mask=torch.tensor([[1, 1, 0, 1, 1, 1, 1, 1]]),
                routes=routes_old[None],
            ),
            r"batch row 0: its real tokens are not contiguous .*position 2",
        ),
        (
            dict(
                version=1,
                sequences=[old],
                routes=[
                    er.EngineRoutes(
                        routes=routes_old[:-1].numpy().astype(np.int16),
                        numbering="routers",
                        physical=True,
                        engine="sglang",
                        request=0,
                    )
                ],
            ),
            r"physical expert slots \(EPLB\); give expert_map=",
        ),
        (
            dict(
                version=1,
                sequences=[old],
                routes=[
                    er.EngineRoutes(
                        routes=routes_old[2:-1].numpy().astype(np.int16),
                        numbering="routers",
                        physical=False,
                        engine="sglang",
                        request=0,
                        start=2,
                    )
                ],
            ),
            r"rows start at position 2, not 0.*splice",
        ),
        (dict(version=1, sequences=[old], routes=[routes_old.float()]), r"expected a 3-d integer array"),
        (dict(version=1, sequences=[old], routes=[routes_old], numbering="layers"), r"numbering='layers'"),
    ]
    for kwargs, message in bad:
        with pytest.raises(UsageError, match=message):
            injob.add_routes(**kwargs)


def test_r3_batch_nothing_handed_over_and_not_installed_refused(world, monkeypatch):
    actor, _, vocab = world
    seq = random_sequences(vocab, [5], SEED + 4)[0]
    with pytest.raises(Exception, match=r"no routes handed over yet; call injob.add_routes"):
        with torch.no_grad():
            run(actor, seq)
    source = autopatch.session().batch
    monkeypatch.setattr(injob.batch_routes, "_SOURCE", [])
    with pytest.raises(UsageError, match=r"not installed; run the job with MOEVERIFY_ROUTER_REPLAY=r3"):
        injob.add_routes(version=0, sequences=[seq], routes=[np.zeros((4, 4, 2), dtype=np.int64)])
    monkeypatch.setattr(source, "max_tokens", 4)
    monkeypatch.setattr(injob.batch_routes, "_SOURCE", [source])
    with pytest.raises(UsageError, match=r"this rank now holds 5 tokens of routes .*over the cap of 4"):
        injob.add_routes(version=0, sequences=[seq], routes=[np.tile(np.arange(2), (4, 4, 1))])


def test_r3_batch_route_cut_short_named_as_such_not_as_out_of_range(world):
    # a row with -1 in some of its K slots (a variable top-k engine): neither a capture gap nor an EPLB slot
    actor, engine, vocab = world
    seq = random_sequences(vocab, [6], SEED + 5)[0]
    routes = engine_routes(engine, [seq])[0][:-1].clone()
    routes[2, 1, 1] = -1
    injob.add_routes(version=0, sequences=[seq], routes=[routes])
    try:
        with pytest.raises(
            Exception,
            match=r"the batch routes of version 0: request 0 position 2 layer 1: route "
            r"\[\d+, -1\] has -1 \(not captured\) in 1 of its 2 slots \(1 such "
            r"row\(s\)\): a variable top-k",
        ):
            with torch.no_grad():
                run(actor, seq)
    finally:
        injob.drop_routes()


def test_r3_batch_mixed_versions_in_one_micro_batch_take_each_samples_own_routes(world, monkeypatch):
    # sequence A rolled out under versions 0 and 1 (other routes in each), B under version 1 only: a micro-batch
    # of [A, B] names each row's version; A's routes follow the version its row names, never the other one's
    from moeverify.errors import RouteError
    from moeverify.patches import batch_routes, rollout_source

    actor, engine, vocab = world
    a, b = random_sequences(vocab, [7, 5], SEED + 9)
    ra, rb = engine_routes(engine, [a, b])
    ra_v1 = (
        ((ra + 3) % 8).sort(dim=-1).values
    )  # version 1's engine routed A otherwise (distinct ids per row stay distinct)
    injob.drop_routes()
    injob.add_routes(version=[0, 1], sequences=[a, b], routes=[ra[:-1], rb[:-1]])  # one version per request
    injob.add_routes(version=1, sequences=[a], routes=[ra_v1[:-1]])
    width = 8
    ids, mask, _ = verl_batch([a, b], [ra, rb], width=width)
    for versions, want in (([1, 1], [ra_v1, rb]), ([0, 1], [ra, rb]), (torch.tensor([0, 1]), [ra, rb])):
        spy = Spy(actor)
        try:
            with injob.rollout_version(versions):
                forward_padded(actor, ids, mask, grad=False)
            calls = spy.take()
        finally:
            spy.close()
        assert check_replayed(calls, [a, b], want, width=width) == len(LAYERS) * (len(a) - 1 + len(b) - 1)
    with pytest.raises(
        RouteError, match=r"sequence 1 of this forward, position 0\), its sequence named rollout version 0"
    ):
        with injob.rollout_version([0, 0]):  # B was never rolled out under version 0
            forward_padded(actor, ids, mask, grad=False)
    with pytest.raises(RouteError, match=r"rollout_version: 1 per-sequence versions for a forward of 2 sequences"):
        with injob.rollout_version([1]):
            forward_padded(actor, ids, mask, grad=False)
    for bad, message in (([-1, 0], r"version -1 < 0"), (1.5, r"expected a step or policy version"), ([], "non-empty")):
        with pytest.raises(UsageError, match=message):
            with injob.rollout_version(bad):
                pass
    with pytest.raises(UsageError, match=r"one version for the batch, or one per request \(2\)"):
        injob.add_routes(version=[0], sequences=[a, b], routes=[ra[:-1], rb[:-1]])
    # how many versions serve is a setting: 3 kept, then the default 2
    injob.drop_routes()
    monkeypatch.setenv(rollout_source.KEEP_ENV, "3")
    for v in range(4):
        injob.add_routes(version=v, sequences=[a], routes=[ra[:-1]])
    assert batch_routes._source().steps == (3, 2, 1)
    monkeypatch.setenv(rollout_source.KEEP_ENV, "0")
    with pytest.raises(UsageError, match=r"MOEVERIFY_ROUTER_REPLAY_KEEP='0': expected the number of rollout versions"):
        injob.add_routes(version=4, sequences=[a], routes=[ra[:-1]])
    monkeypatch.delenv(rollout_source.KEEP_ENV)
    injob.drop_routes()


def test_r3_batch_duplicate_expert_named_and_unfilled_last_row_read_alike_on_both_paths(world):
    from moeverify.errors import RouteError

    actor, engine, vocab = world
    a, b = random_sequences(vocab, [6, 5], SEED + 11)
    ra, rb = engine_routes(engine, [a, b])
    injob.drop_routes()
    twice = ra[:-1].clone()
    twice[3, 2] = twice[3, 2].max()  # request 0, position 3, layer 2: one expert in both slots
    injob.add_routes(version=0, sequences=[a, b], routes=[twice, rb[:-1]])
    with pytest.raises(RouteError, match=r"request 0 position 3 layer 2: route \[\d+, \d+\] names one expert twice"):
        assert_each_on_its_route(actor, [a, b], [ra, rb])
    injob.drop_routes()
    # the engine's last row present but never filled (zeros), per request: the padded form drops it, so does this
    unfilled = torch.cat([ra[:-1], torch.zeros_like(ra[:1])])
    injob.add_routes(version=1, sequences=[a], routes=[unfilled])
    assert_each_on_its_route(actor, [a], [ra])
    injob.drop_routes()
    ids, mask, routed = verl_batch([a], [ra], width=8)
    injob.add_routes(version=1, input_ids=ids, attention_mask=mask, routes=routed)
    assert_each_on_its_route(actor, [a], [ra])
    injob.drop_routes()
