"""In-job R3 (``MOEVERIFY_ROUTER_REPLAY=r3:DIR``): a rollout engine's routes, written by ``RolloutWriter``, replayed
in an RL step's log-prob and training passes by token identity (1 CPU rank).

The "engine" is a second model (other weights, so its routes differ from the actor's native ones) run one request at
a time without the patch; what it routed is written as vLLM returns it (``[S - 1, L, K]``: no row for the last,
sampled token). The actor runs verl's loop unmodified under the patch; a spy on its routers reads what Megatron
actually used, and gradients are compared bitwise with the session API given the rollout's routes by hand.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from test_injob_replay import (
    Spy,
    assert_grads_as_session_api,
    batch_of,
    forward,
    installed_world,
    ppo_update,
    random_sequences,
    verl_plan,
)

from moeverify.errors import RouteError, UsageError
from moeverify.patches import agreement, autopatch, injob
from moeverify.routing.rollout_writer import RolloutWriter, complete_steps, mark_complete, read_marker

SEED = 23


def r3_world(tmp_path_factory, family: str, overrides: dict | None = None, *, floor: str | None = agreement.OFF):
    """An actor bound to r3 on a fresh directory, and an engine model of other weights routing natively.

    The engine's routes are no better than random ids for the actor (other weights): the agreement guard's chance
    floor, which exists to refuse exactly that, is turned off (``floor``; ``test_injob_r3_guard.py`` tests it)."""
    directory = tmp_path_factory.mktemp("rollout")
    saved = os.environ.get(agreement.FLOOR_ENV)
    if floor is None:
        os.environ.pop(agreement.FLOOR_ENV, None)
    else:
        os.environ[agreement.FLOOR_ENV] = floor
    try:
        for actor, engine, vocab in installed_world(f"r3:{directory}", family, overrides):
            yield actor, engine, vocab, directory
    finally:
        if saved is None:
            os.environ.pop(agreement.FLOOR_ENV, None)
        else:
            os.environ[agreement.FLOOR_ENV] = saved


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    yield from r3_world(tmp_path_factory, "qwen3_moe")


def engine_routes(engine, sequences) -> list[torch.Tensor]:
    """What the engine routed for each request, ``[S, L, K]`` (sorted ids), one request at a time."""
    spy = Spy(engine)
    out = []
    try:
        with torch.no_grad():
            for seq in sequences:
                forward(engine, seq[None], torch.zeros(1, len(seq), dtype=torch.bool))
                calls = spy.take()
                out.append(torch.stack([ids_TK for _, ids_TK in sorted(calls, key=lambda c: c[0])], dim=1))
    finally:
        spy.close()
    return out


def write_step(directory, step, sequences, routes, *, last_row=False, **kwargs):
    with RolloutWriter(directory, step=step, **kwargs) as w:
        for seq, r in zip(sequences, routes, strict=True):
            w.add(seq, r if last_row else r[:-1])  # vLLM: no row for the last, sampled token


def check_used(used, sequences, routes, micro_batches, *, layers=(0, 1, 2, 3)) -> tuple[int, list[dict]]:
    """Every token but each sequence's last used its rollout route; returns (tokens checked, per micro-batch the
    routes to replay by hand: the rollout's, and padding and last tokens as they were routed natively)."""
    checked, aligned = 0, []
    for occurrence, (where, calls) in enumerate(used):
        assert sorted(c[0] for c in calls) == list(layers), f"routing calls of layers {[c[0] for c in calls]}"
        table = {}
        for column, (layer, ids_TK) in enumerate(sorted(calls, key=lambda c: c[0])):
            for t, w in enumerate(where):
                if w is None or w[1] == len(sequences[w[0]]) - 1:  # padding, the last token: as it was routed
                    table[(layer, *(w or ("pad", occurrence, t)))] = ids_TK[t]
                    continue
                want = routes[w[0]][w[1], column]
                assert torch.equal(ids_TK[t], want), f"layer {layer} token {w}: not its rollout route"
                table[(layer, *w)] = want
                checked += 1
        aligned.append(table)
    return checked, aligned


def test_r3_verl_loop_replays_the_rollouts_routes(world):
    actor, engine, vocab, directory = world
    run_r3_step(actor, engine, directory, random_sequences(vocab, [6, 3, 8, 5, 7, 2, 8, 4], SEED), step=0)


def run_r3_step(actor, engine, directory, sequences, *, step, layers=(0, 1, 2, 3)):
    """One verl step under r3 (log-prob pass, shuffled mini-batches, 2 epochs, dynamic batching), checked token by
    token and against the session API given the rollout's routes by hand."""
    routes = engine_routes(engine, sequences)
    write_step(directory, step, sequences, routes)
    uids = list(range(len(sequences)))
    spy = Spy(actor)
    saved = {k: v.clone() for k, v in actor.state_dict().items() if isinstance(v, torch.Tensor)}
    plan = verl_plan(uids, max_tokens=24, sequences=sequences)
    try:
        with torch.no_grad():  # the log-prob pass replays the rollout's routes too
            logp_used = []
            for i in range(0, len(uids), 4):
                ids, pad, where = batch_of(sequences, uids[i : i + 4])
                forward(actor, ids, pad)
                logp_used.append((where, spy.take()))
        got, used = ppo_update(actor, sequences, plan, spy=spy)
    finally:
        spy.close()
    logp_checked, _ = check_used(
        logp_used, sequences, routes, [uids[i : i + 4] for i in range(0, len(uids), 4)], layers=layers
    )
    micro_batches = [m for mb in plan for m in mb]
    checked, aligned = check_used(used, sequences, routes, micro_batches, layers=layers)
    real = sum(len(s) - 1 for s in sequences)
    assert logp_checked == len(layers) * real and checked == 2 * len(layers) * real
    assert_grads_as_session_api(actor, saved, sequences, plan, aligned, got, what="the rollout's routes")


def test_r3_routes_differ_from_native_routing(world):
    # the rollout engine's weights differ from the actor's: replay must have changed routes (else the test is moot)
    actor, engine, vocab, directory = world
    sequences = random_sequences(vocab, [8, 8], SEED + 1)
    routes = engine_routes(engine, sequences)
    with torch.no_grad():
        state = {k: v.clone() for k, v in engine.state_dict().items() if isinstance(v, torch.Tensor)}
        engine.load_state_dict(
            {k: v for k, v in actor.state_dict().items() if isinstance(v, torch.Tensor)}, strict=False
        )
        native = engine_routes(engine, sequences)
        engine.load_state_dict(state, strict=False)
    differ = sum(not torch.equal(a[:-1], b[:-1]) for a, b in zip(routes, native, strict=True))
    assert differ == 2


def test_r3_token_not_in_the_rollout_refused(world):
    actor, engine, vocab, directory = world
    sequences = random_sequences(vocab, [5, 5], SEED + 2)
    write_step(directory, 10, sequences[:1], engine_routes(engine, sequences[:1]))
    with pytest.raises(
        RouteError,
        match=r"layer 0 rank 0: training token 1 \(sequence 1 of this forward, position 0"
        r"\) has no route recorded by the rollout routes of step\(s\) 10(, \d+)? in .*"
        r"\(5 of 10 tokens of this forward\).*write every sequence the step trains "
        r"on with RolloutWriter",
    ):
        forward(actor, torch.stack(sequences), torch.zeros(2, 5, dtype=torch.bool)).sum().backward()


def test_r3_newest_steps_serve_and_a_sequence_rolled_out_in_both_names_its_version(world):
    actor, engine, vocab, directory = world
    old, new = random_sequences(vocab, [6, 6], SEED + 3)
    routes_old = engine_routes(engine, [old, new])
    write_step(directory, 20, [old, new], routes_old)
    flipped = [(r + 1) % 8 for r in routes_old]  # another engine version: other (valid, distinct) experts
    write_step(directory, 21, [new], flipped[1:])
    spy = Spy(actor)
    try:
        with torch.no_grad():
            forward(actor, old[None], torch.zeros(1, 6, dtype=torch.bool))
            assert autopatch.session().state.source.steps == (21, 20)
            for layer, ids_TK in spy.take():  # only in step 20
                assert all(torch.equal(ids_TK[s], routes_old[0][s, layer]) for s in range(5))
            # `new` was rolled out whole in both steps, routed differently: refused unless the batch names its version
            with pytest.raises(
                RouteError,
                match=r"training token 0 \(sequence 0 of this forward, position 0\): its "
                r"whole sequence was rolled out under several versions \(21, 20\), "
                r"routed differently in them \(5 of 6 tokens of this forward\).*"
                r"injob.rollout_version\(N\)",
            ):
                forward(actor, new[None], torch.zeros(1, 6, dtype=torch.bool))
            spy.take()
            for version, want in ((20, routes_old[1]), (21, flipped[1])):
                with injob.rollout_version(version):
                    forward(
                        actor,
                        torch.stack([old, new]) if version == 20 else new[None],
                        torch.zeros(2 if version == 20 else 1, 6, dtype=torch.bool),
                    )
                b = 2 if version == 20 else 1
                for layer, ids_TK in spy.take():  # router order s * B + b
                    assert all(torch.equal(ids_TK[s * b + b - 1], want[s, layer].sort().values) for s in range(5))
            with (
                injob.rollout_version(21),
                pytest.raises(
                    RouteError,
                    match=r"training token 0 \(sequence 0 of this "
                    r"forward, position 0\) has no route "
                    r"recorded by the rollout routes of step\(s\)"
                    r" 21, 20.*version 21, which the forward "
                    r"names .*did not roll out",
                ),
            ):
                forward(actor, old[None], torch.zeros(1, 6, dtype=torch.bool))  # not rolled out under 21
            with (
                injob.rollout_version(7),
                pytest.raises(
                    RouteError,
                    match=r"names rollout version 7, but the rollout "
                    r"routes of step\(s\) 21, 20 .*hold versions "
                    r"21, 20",
                ),
            ):
                forward(actor, old[None], torch.zeros(1, 6, dtype=torch.bool))
        write_step(directory, 22, [new], routes_old[1:])
        with pytest.raises(RouteError, match=r"has no route recorded by the rollout routes of step\(s\) 22, 21"):
            with torch.no_grad():
                forward(actor, old[None], torch.zeros(1, 6, dtype=torch.bool))
    finally:
        spy.close()


def test_r3_off_policy_samples_keep_their_own_steps_routes_on_shared_prompts(world):
    # GRPO one step off-policy: steps 23 and 24 share their prompts (a system prompt, the same questions), each with
    # its own responses and another engine version's routes; training on step 30's samples while step 31 is served
    # too must replay step 23's routes on the shared prompt tokens, never step 24's
    actor, engine, vocab, directory = world
    prompts = random_sequences(vocab, [5, 4], SEED + 9)
    answers = random_sequences(vocab, [3, 4, 2, 5], SEED + 10)
    samples = {
        23: [torch.cat([prompts[0], answers[0]]), torch.cat([prompts[1], answers[1]])],
        24: [torch.cat([prompts[0], answers[2]]), torch.cat([prompts[1], answers[3]])],
    }
    routes = {23: engine_routes(engine, samples[23])}
    routes[24] = [(r + 3) % 8 for r in engine_routes(engine, samples[24])]  # the next engine version's routes
    for step in (23, 24):
        write_step(directory, step, samples[step], routes[step])
    spy = Spy(actor)
    try:
        for step in (23, 24):
            with torch.no_grad():
                for seq, want in zip(samples[step], routes[step], strict=True):
                    forward(actor, seq[None], torch.zeros(1, len(seq), dtype=torch.bool))
                    for layer, ids_TK in spy.take():
                        for pos in range(len(seq) - 1):
                            assert torch.equal(ids_TK[pos], want[pos, layer].sort().values), (step, layer, pos)
    finally:
        spy.close()


def test_r3_physical_slots_mapped_through_the_steps_expert_map(world):
    actor, engine, vocab, directory = world
    seq = random_sequences(vocab, [7], SEED + 4)
    routes = engine_routes(engine, seq)
    # an expert placement with 2 redundant slots (8 holds expert 3, 9 expert 0); the engine records slots
    emap = np.array([3, 0, 7, 1, 6, 2, 5, 4, 3, 0])
    slot_of = {int(e): p for p, e in enumerate(emap[:8])}
    physical = routes[0].clone().apply_(lambda e: slot_of[e])
    replica = {slot_of[3]: 8, slot_of[0]: 9}
    physical[::2] = physical[::2].clone().apply_(lambda p: replica.get(p, p))  # even positions use the replicas
    assert bool((physical >= 8).any()) and not torch.equal(physical, routes[0])
    write_step(directory, 30, seq, [physical])  # the map forgotten
    with pytest.raises(
        RouteError,
        match=r"step-30/part-0.npz: request 0 position \d layer \d: expert ids .* outside "
        r"\[0, 8\).*RolloutWriter\(expert_map=\), add_routes\(expert_map=\) or MOEVERIFY_ROUTER_REPLAY_EXPERT_MAP",
    ):
        with torch.no_grad():
            forward(actor, seq[0][None], torch.zeros(1, 7, dtype=torch.bool))
    for step in (31, 32):  # the forgotten map's step no longer among the newest two
        write_step(directory, step, seq, [physical], expert_map=emap)
    spy = Spy(actor)
    try:
        with torch.no_grad():
            forward(actor, seq[0][None], torch.zeros(1, 7, dtype=torch.bool))
        calls = spy.take()
    finally:
        spy.close()
    assert len(calls) == 4
    for layer, ids_TK in calls:
        assert torch.equal(ids_TK[:6], routes[0][:6, layer])


def test_r3_capture_gap_on_a_real_token_refused(world):
    actor, engine, vocab, directory = world
    seq = random_sequences(vocab, [6], SEED + 5)
    routes = engine_routes(engine, seq)[0].clone()
    routes[2, 1] = -1  # position 2, layer 1 not captured
    write_step(directory, 40, seq, [routes])
    with pytest.raises(
        RouteError,
        match=r"step-40/part-0.npz: request 0 position 2 layer 1: capture gap \(a row of "
        r"-1 or of zeros: \[-1, -1\]\)",
    ):
        with torch.no_grad():
            forward(actor, seq[0][None], torch.zeros(1, 6, dtype=torch.bool))
    for step in (41, 42):  # later tests start from complete, well-formed steps
        write_step(directory, step, seq, engine_routes(engine, seq))


def test_r3_incomplete_step_is_not_read(world, tmp_path):
    actor, engine, vocab, directory = world
    seq = random_sequences(vocab, [5], SEED + 6)
    routes = engine_routes(engine, seq)
    other = random_sequences(vocab, [4], SEED + 7)
    write_step(directory, 49, other, engine_routes(engine, other))
    before = complete_steps(directory)[::-1][:2]
    w = RolloutWriter(directory, step=50, part="worker1")
    w.add(seq[0], routes[0][:-1])
    w.close(complete=False)
    with pytest.raises(
        RouteError,
        match=r"has no route recorded by the rollout routes of step\(s\) " + ", ".join(str(s) for s in before),
    ):
        with torch.no_grad():
            forward(actor, seq[0][None], torch.zeros(1, 5, dtype=torch.bool))
    mark_complete(directory, step=50)
    with torch.no_grad():
        forward(actor, seq[0][None], torch.zeros(1, 5, dtype=torch.bool))
    assert autopatch.session().state.source.steps[0] == 50


def test_rollout_writer_refusals(tmp_path):
    ok_tokens, ok_routes = np.arange(5), np.zeros((4, 2, 2), dtype=np.int64) + [0, 1]
    w = RolloutWriter(tmp_path, step=0)
    cases = [
        (
            (np.arange(5.0), ok_routes),
            r"request 0 of part-0.npz: token_ids: expected a 1-d integer array, got 1-d "
            r"float64",
        ),
        (
            (ok_tokens, ok_routes[:2]),
            r"routes hold 2 rows for 5 tokens; expected 4 \(the engine's missing last row\) "
            r"or 5",
        ),
        ((ok_tokens, ok_routes[0]), r"routes: expected a 3-d integer array, got 2-d int64"),
        ((ok_tokens, ok_routes - 3), r"routes hold -3; expert ids are >= 0 \(-1: not captured\)"),
        ((-ok_tokens - 1, ok_routes), r"token_ids hold a negative id -5"),
        ((np.arange(0), np.zeros((0, 2, 2), dtype=np.int64)), r"token_ids is empty"),
    ]
    for args, message in cases:
        with pytest.raises(UsageError, match=message):
            w.add(*args)
    w.add(ok_tokens, ok_routes)
    with pytest.raises(
        UsageError,
        match=r"request 1 of part-0.npz: routes \[\*, W, K\] = \(3, 2\) != request 0's "
        r"\(2, 2\)",
    ):
        w.add(ok_tokens, np.zeros((5, 3, 2), dtype=np.int64))
    with pytest.raises(UsageError, match=r"already exists: each writer of a step needs its own part= name"):
        w.close(complete=False)
        RolloutWriter(tmp_path, step=0)
    mark_complete(tmp_path, step=0)
    with pytest.raises(UsageError, match=r"step 0 is already complete"):
        RolloutWriter(tmp_path, step=0, part="late")
    for kwargs, message in [
        ({"step": -1}, r"step=-1: expected an integer >= 0"),
        ({"step": 1, "part": "../x"}, r"part='../x': expected 1-64 letters"),
        ({"step": 1, "numbering": "layers"}, r"numbering='layers': expected 'routers'"),
    ]:
        with pytest.raises(UsageError, match=message):
            RolloutWriter(tmp_path, **kwargs)
    with pytest.raises(UsageError, match=r"step-2: no part-\*.npz written; nothing to mark complete"):
        mark_complete(tmp_path, step=2)
    assert sorted(p.name for p in (tmp_path / "step-0").iterdir()) == ["COMPLETE", "part-0.npz"]  # no temp left
    marker = tmp_path / "step-0" / "COMPLETE"
    marker.write_text(marker.read_text().replace('"version": 1', '"version": 7'))
    with pytest.raises(UsageError, match=r"COMPLETE: not a .* version 1 marker: \(format, version\) = \('.*', 7\)"):
        read_marker(tmp_path, 0)


def test_rollout_files_malformed_refused(tmp_path):
    from moeverify.patches.rollout_source import Step

    good = {
        "tokens": np.arange(5),
        "lengths": np.array([5]),
        "rows": np.array([4]),
        "routes": np.zeros((4, 2, 2), dtype=np.int16),
        "numbering": np.array([0], dtype=np.int8),
    }
    cases = [
        ({"tokens": np.arange(6)}, r"6 tokens and 4 route rows, the requests' lengths and rows sum to 5 and 4"),
        ({"rows": np.array([2])}, r"5 tokens and 4 route rows, the requests' lengths and rows sum to 5 and 2"),
        (
            {"rows": np.array([3]), "routes": np.zeros((3, 2, 2), dtype=np.int16)},
            r"request 0 holds 3 route rows for 5 tokens; expected 4 or 5",
        ),
        ({"routes": np.zeros((4, 2), dtype=np.int16)}, r"'routes' must be a 3-d integer array, got 2-d int16"),
        ({"lengths": np.array([5.0])}, r"'lengths' must be a 1-d integer array, got 1-d float64"),
        ({"numbering": np.array([7], dtype=np.int8)}, r"numbering code 7 is none of \[0, 1, 2\]"),
        ({"tokens": np.array(["a"] * 5)}, r"dtype <U1 is not a numeric dtype"),
    ]
    for step, (change, message) in enumerate(cases):
        where = tmp_path / f"step-{step}"
        where.mkdir()
        np.savez(where / "part-0.npz", **{**good, **change})
        mark_complete(tmp_path, step=step)
        with pytest.raises(RouteError, match=message):
            Step.read(tmp_path, step)
    where = tmp_path / "step-99"
    where.mkdir()
    np.savez(where / "part-0.npz", **good, extra=np.array([object()], dtype=object))
    mark_complete(tmp_path, step=99)
    with pytest.raises(RouteError, match=r"npz member 'extra.npy'.*object arrays are never unpickled"):
        Step.read(tmp_path, 99)


def test_r3_grpo_shared_prompt_routed_differently_takes_the_first_route(world):
    # GRPO: 3 responses of one prompt; the engine prefilled the prompt in different batches and routed its tokens
    # differently for request 1 (batch-dependent numerics). Each copy of the prompt replays request 0's route (the
    # first written); with MOEVERIFY_ROUTER_REPLAY_DUPLICATES=refuse the step is refused.
    actor, engine, vocab, directory = world
    prompt = random_sequences(vocab, [5], SEED + 8)[0]
    responses = random_sequences(vocab, [3, 3, 3], SEED + 9)
    sequences = [torch.cat([prompt, r]) for r in responses]
    routes = engine_routes(engine, sequences)
    routes[1][:5] = (routes[1][:5] + 1) % 8  # request 1's prompt rows: other (valid, distinct) experts
    for step in (60, 61):  # the two serving steps hold the same requests
        write_step(directory, step, sequences, routes)
    spy = Spy(actor)
    try:
        ids, pad, where = batch_of(sequences, [2, 1, 0])
        with torch.no_grad():
            forward(actor, ids, pad)
        calls = spy.take()
    finally:
        spy.close()
    assert len(calls) == 4
    for layer, ids_TK in calls:
        for t, (u, p) in enumerate(where):
            want = routes[0][p, layer] if p < 5 else routes[u][p, layer]  # the prompt: request 0's route
            if p < len(sequences[u]) - 1:
                assert torch.equal(ids_TK[t], want.sort().values), f"layer {layer} token {(u, p)}"
    source = autopatch.session().state.source
    source.duplicates, source._tables = "refuse", type(source._tables)()
    try:
        with pytest.raises(
            RouteError,
            match=r"position 0\) was recorded more than once with different expert sets "
            r".*routed differently by the rollout routes of step\(s\) 61, 60",
        ):
            with torch.no_grad():
                forward(actor, ids, pad)
    finally:
        source.duplicates, source._tables = "first", type(source._tables)()


def test_r3_other_top_k_refused(world):
    actor, engine, vocab, directory = world
    seq = random_sequences(vocab, [5], SEED + 10)
    routes = engine_routes(engine, seq)[0]
    for step in (70, 71):
        write_step(directory, step, seq, [torch.cat([routes, (routes[..., :1] + 2) % 8], dim=2)])  # top-3 ids
    with pytest.raises(
        RouteError,
        match=r"step-71: the rollout routes hold top-3 ids, the model routes top-2 "
        r"\(moe_router_topk\): another model's routes\?",
    ):
        with torch.no_grad():
            forward(actor, seq[0][None], torch.zeros(1, 5, dtype=torch.bool))
    for step in (72, 73):  # later tests start from well-formed steps
        write_step(directory, step, seq, [routes])


def test_r3_writer_takes_engine_payloads_as_returned(world, tmp_path):
    # last in this file: its steps are the newest of the world's directory from here on
    import base64

    from moeverify.routing import engine_routes as er

    actor, engine, vocab, directory = world
    seq = random_sequences(vocab, [7], SEED + 12)[0]
    routes = engine_routes(engine, [seq])[0]
    payload = {
        "meta_info": {"routed_experts": base64.b64encode(routes[:-1].numpy().astype("<i4").tobytes()).decode()}
    }  # SGLang: base64 int32 [S - 1, num_hidden_layers, K]
    decoded = er.from_sglang(payload, num_layers=4, top_k=2, num_tokens=len(seq), physical=False, request="r0")
    with RolloutWriter(directory, step=200) as w:
        w.add(seq, decoded)
        assert w.numbering == "decoder"  # taken from the payload
    spy = Spy(actor)
    try:
        with torch.no_grad():
            forward(actor, seq[None], torch.zeros(1, len(seq), dtype=torch.bool))
        for layer, ids_TK in spy.take():
            assert all(torch.equal(ids_TK[s], routes[s, layer]) for s in range(len(seq) - 1))
    finally:
        spy.close()
    physical = er.from_sglang(payload, num_layers=4, top_k=2, num_tokens=len(seq), physical=True)
    with pytest.raises(UsageError, match=r"request 0 of part-0.npz: the engine recorded physical expert slots"):
        RolloutWriter(tmp_path, step=0).add(seq, physical)
    later = er.EngineRoutes(
        routes=routes[3:-1].numpy().astype(np.int16),
        numbering="decoder",
        physical=False,
        engine="sglang",
        request=1,
        start=3,
    )
    with pytest.raises(UsageError, match=r"rows start at position 3, not 0.*splice"):
        RolloutWriter(tmp_path, step=1).add(seq, later)
    with pytest.raises(UsageError, match=r"the payload numbers layers 'decoder', this part 'routers'"):
        RolloutWriter(tmp_path, step=2, numbering="routers").add(seq, decoded)
