"""The drop-in router-replay patch used as an RL team would, from docs/router_replay.md alone (1 CPU rank).

Each loop is checked independently of the patch: a forward hook on every ``TopKRouter`` reads the routing map
Megatron returned (which experts each token went to), so recorded routes are compared with native routing on
the same inputs and replayed routes with the routes given; gradients under replay are compared bitwise with
the same loop routed natively. Misuse must raise; a loop that replays other tokens' routes without an error is
the failure these tests exist for (micro-batch order changed, the previous step's routes, another model's
routes, a forgotten ``check_consumed()``).
"""

from __future__ import annotations

import re

import pytest
import torch

from moeverify.errors import RouteError, UsageError
from moeverify.patches import router_replay as rr
from moeverify.routing.routes import Routes
from moeverify.spec.layout import Layout

pytestmark = pytest.mark.usefixtures("patched_megatron_world")
B, S, MB = 2, 8, 3


class RouterSpy:
    """Per global layer, the sorted expert ids ``[T, K]`` of every forward routing call (recomputes apart)."""

    def __init__(self, chunks):
        self.forward: dict[int, list[torch.Tensor]] = {}
        self.handles = [
            m.register_forward_hook(self._hook) for c in chunks for m in c.modules() if type(m).__name__ == "TopKRouter"
        ]

    def _hook(self, router, _inputs, outputs):
        if torch._C._current_graph_task_id() != -1:
            return
        routing_map_TE = outputs[1]
        ids_TK = routing_map_TE.nonzero()[:, 1].view(routing_map_TE.shape[0], router.topk)
        self.forward.setdefault(router.layer_number - 1, []).append(ids_TK)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()


def srt(ids_TK) -> torch.Tensor:
    return torch.sort(torch.as_tensor(ids_TK).long(), dim=-1).values


def data(vocab: int, n: int = MB, *, seed: int = 40, batch: int = B) -> list[torch.Tensor]:
    return [torch.randint(0, vocab, (batch, S), generator=torch.Generator().manual_seed(seed + i)) for i in range(n)]


def pos(batch: int = B) -> torch.Tensor:
    return torch.arange(S).expand(batch, S)


def summed_step(chunk, micro_batches) -> dict[str, torch.Tensor]:
    """Gradient accumulation as one backward over the summed micro-batch losses; returns the grads."""
    for p in chunk.parameters():
        p.grad = None
    sum(chunk(t, pos(t.shape[0]), None).float().square().mean() for t in micro_batches).backward()
    return {n: p.grad.clone() for n, p in chunk.named_parameters() if p.grad is not None}


def log_prob_pass(session, chunk, micro_batches) -> Routes:
    with torch.no_grad(), session.record():  # train mode, dropout off: what RL engines run
        for t in micro_batches:
            chunk(t, pos(t.shape[0]), None)
    return session.routes()


def assert_same_grads(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys() and a, what
    diff = [n for n in a if not torch.equal(a[n], b[n])]
    assert not diff, f"{what}: gradients differ: {diff[:4]}"


def set_full_recompute(chunk, on: bool) -> None:
    for m in chunk.modules():
        config = getattr(m, "config", None)
        if config is not None:
            config.recompute_granularity = "full" if on else None
            config.recompute_method = "uniform" if on else None
            config.recompute_num_layers = 1 if on else None


@pytest.fixture(scope="module", autouse=True)
def restore_aux_loss_scale():
    # A backward outside Megatron's schedule sets MoEAuxLossAutoScaler's process-wide scale to a 0-d tensor;
    # the schedule later copies its [1] scale into it and fails. Leave it as this module found it.
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    saved = MoEAuxLossAutoScaler.main_loss_backward_scale
    yield
    MoEAuxLossAutoScaler.main_loss_backward_scale = saved


@pytest.fixture(scope="module")
def qwen(qwen3_moe_train):
    return qwen3_moe_train.model_chunks[0], qwen3_moe_train.config.vocab_size


@pytest.fixture(scope="module")
def deepseek(patched_megatron_world):
    from moeverify import models

    built = models.build("deepseek_v3", Layout(), seed=0)
    built.model_chunks[0].train()
    return built.model_chunks[0], built.config


def test_loop_grad_accumulation_records_native_and_replays_it(qwen):
    chunk, vocab = qwen
    mbs = data(vocab)
    native = summed_step(chunk, mbs)
    session = rr.ReplaySession(chunk)
    with RouterSpy([chunk]) as spy:
        routes = log_prob_pass(session, chunk, mbs)
        with session.replay(routes):
            replayed = summed_step(chunk, mbs)
        session.check_consumed()
    assert session.layers == (0, 1, 2, 3)
    for layer in session.layers:
        for mb in range(MB):
            assert torch.equal(srt(routes.get(layer, mb)), spy.forward[layer][mb]), (layer, mb)
            assert torch.equal(spy.forward[layer][MB + mb], spy.forward[layer][mb]), (layer, mb)
    assert_same_grads(native, replayed, "summed-loss gradient accumulation")


def test_loop_actor_and_reference_sessions_keep_their_own_routes(qwen):
    from moeverify import models

    actor, vocab = qwen
    reference = models.build("qwen3_moe", Layout(), seed=1).model_chunks[0].train()  # same shape, other weights
    mbs = data(vocab)
    on_actor, on_ref = rr.ReplaySession(actor), rr.ReplaySession(reference)
    with RouterSpy([actor]) as spy_a, RouterSpy([reference]) as spy_r:
        with torch.no_grad(), on_ref.record(), on_actor.record():  # both models' log-probs, interleaved
            for t in mbs:
                reference(t, pos(), None)
                actor(t, pos(), None)
    actor_routes, ref_routes = on_actor.routes(), on_ref.routes()
    assert any(
        not torch.equal(actor_routes.get(layer, mb), ref_routes.get(layer, mb))
        for layer in on_actor.layers
        for mb in range(MB)
    )
    for layer in on_actor.layers:
        for mb in range(MB):
            assert torch.equal(srt(actor_routes.get(layer, mb)), spy_a.forward[layer][mb])
            assert torch.equal(srt(ref_routes.get(layer, mb)), spy_r.forward[layer][mb])
    with pytest.raises(RouteError, match=r"layer 0 rank 0: these routes were recorded by the session of another model"):
        with on_ref.replay(actor_routes):
            pass
    with on_ref.replay(ref_routes), torch.no_grad():
        for t in mbs:
            reference(t, pos(), None)
    on_ref.check_consumed()


def test_loop_full_recompute_reverse_backward_after_exit_equals_native(qwen):
    chunk, vocab = qwen
    mbs = data(vocab, seed=50)
    set_full_recompute(chunk, True)
    try:
        for p in chunk.parameters():
            p.grad = None
        losses = [chunk(t, pos(), None).float().square().mean() for t in mbs]
        for loss in reversed(losses):
            loss.backward()
        native = {n: p.grad.clone() for n, p in chunk.named_parameters() if p.grad is not None}
        session = rr.ReplaySession(chunk)
        routes = log_prob_pass(session, chunk, mbs)
        for p in chunk.parameters():
            p.grad = None
        with session.replay(routes, recompute=True):
            losses = [chunk(t, pos(), None).float().square().mean() for t in mbs]
        for loss in reversed(losses):  # backward (and recompute) after the replay block
            loss.backward()
        session.check_consumed()
    finally:
        set_full_recompute(chunk, False)
    replayed = {n: p.grad.clone() for n, p in chunk.named_parameters() if p.grad is not None}
    assert_same_grads(native, replayed, "full recompute, reverse backward after exit")


def engine_arrays(chunk, tokens_BS, lengths, layers):
    """What an engine running this model returns: per request ``[len - 1, L, K]`` of its native routes."""
    with RouterSpy([chunk]) as spy, torch.no_grad():
        chunk(tokens_BS, pos(len(lengths)), None)
    stacked_SBLK = torch.stack([spy.forward[layer][0].view(S, len(lengths), -1) for layer in layers], dim=2)
    return [stacked_SBLK[: n - 1, b].numpy().copy() for b, n in enumerate(lengths)], stacked_SBLK


def replay_rollout(chunk, tokens_BS, arrays, *, lengths, num_layers, columns_all_layers=False):
    from moeverify.routing.views import job_layout

    session = rr.ReplaySession(chunk)
    routes = Routes.from_rollout(
        arrays,
        layers=list(session.layers),
        num_experts=session.num_experts,
        lengths=lengths,
        seq_len=S,
        num_layers=num_layers,
        numbering="decoder" if columns_all_layers else "routers",
    )
    layout, coords, _ = job_layout(sp=False)
    local = routes.to_local(layout, coords=coords, seq_len=S, batch=len(lengths), num_layers=num_layers)
    with RouterSpy([chunk]) as spy, session.replay(local):
        chunk(tokens_BS, pos(len(lengths)), None).float().square().mean().backward()
    session.check_consumed()
    return session, routes, spy


def assert_engine_routes_followed(spy, stacked_SBLK, layers, lengths):
    for j, layer in enumerate(layers):
        got_SBK = spy.forward[layer][0].view(S, len(lengths), -1)
        for b, n in enumerate(lengths):
            assert torch.equal(got_SBK[: n - 1, b], srt(stacked_SBLK[: n - 1, b, j])), (layer, b)


def test_loop_rollout_arrays_one_row_short_replay_the_engine_routes(qwen):
    chunk, vocab = qwen
    lengths = [8, 6, 7]
    tokens_BS = data(vocab, 1, seed=5, batch=3)[0]
    layers = rr.ReplaySession(chunk).layers
    arrays, stacked_SBLK = engine_arrays(chunk, tokens_BS, lengths, layers)
    session, routes, spy = replay_rollout(chunk, tokens_BS, arrays, lengths=lengths, num_layers=len(layers))
    assert_engine_routes_followed(spy, stacked_SBLK, layers, lengths)
    with pytest.raises(RouteError, match=r"rank 0: these routes are in sequence order"):  # to_local forgotten
        with session.replay(routes):
            pass


def test_loop_dense_prefix_keys_routes_by_global_layer(deepseek):
    chunk, config = deepseek
    lengths = [8, 7]
    tokens_BS = data(config.vocab_size, 1, seed=6)[0]
    layers = rr.ReplaySession(chunk).layers
    assert layers == (1, 2, 3)  # layer 0 is dense
    arrays, stacked_SBLK = engine_arrays(chunk, tokens_BS, lengths, layers)
    all_layer = []
    for a in arrays:  # the engine's all-layer numbering: a zero column for the dense layer
        full = torch.zeros(a.shape[0], config.num_layers, a.shape[2], dtype=torch.long)
        full[:, list(layers)] = torch.as_tensor(a)
        all_layer.append(full.numpy())
    for given, columns_all_layers in ((arrays, False), (all_layer, True)):
        _, _, spy = replay_rollout(
            chunk,
            tokens_BS,
            given,
            lengths=lengths,
            num_layers=config.num_layers,
            columns_all_layers=columns_all_layers,
        )
        assert_engine_routes_followed(spy, stacked_SBLK, layers, lengths)
    moe_index = Routes.from_rollout(arrays, layers=[0, 1, 2], num_experts=8, lengths=lengths, seq_len=S)
    with pytest.raises(RouteError, match=r"routes layers \[0, 1, 2\] != expected \[1, 2, 3\] .*global layer"):
        with rr.ReplaySession(chunk).replay(moe_index):
            pass
    mbs = data(config.vocab_size, 2, seed=60)
    native = summed_step(chunk, mbs)
    session = rr.ReplaySession(chunk)
    with session.replay(log_prob_pass(session, chunk, mbs)):
        replayed = summed_step(chunk, mbs)
    session.check_consumed()
    assert_same_grads(native, replayed, "deepseek_v3 dense prefix")


def test_loop_second_step_replays_its_own_recording_and_refuses_stale_routes(qwen):
    chunk, vocab = qwen
    session = rr.ReplaySession(chunk)
    first, second = data(vocab, seed=70), data(vocab, seed=80)
    step1 = log_prob_pass(session, chunk, first)
    with session.replay(step1):
        summed_step(chunk, first)
    session.check_consumed()
    step2 = log_prob_pass(session, chunk, second)  # the second step records again: its own routes
    with RouterSpy([chunk]) as spy, session.replay(step2):
        summed_step(chunk, second)
    session.check_consumed()
    assert session.layers
    assert [
        (layer, mb)
        for layer in session.layers
        for mb in range(MB)
        if not torch.equal(spy.forward[layer][mb], srt(step2.get(layer, mb)))
    ] == []
    for stale in (step1, session.routes()):  # a third step that forgot record(): last step's routes, new data
        with pytest.raises(
            RouteError,
            match=r"chunk 0 rank 0 mb 0: the token ids of replayed forward 0 are not "
            r"those micro-batch 0's routes were recorded on \(they match no",
        ):
            with session.replay(stale):
                summed_step(chunk, data(vocab, seed=90))
        session.check_consumed()
    with session.replay(step2):  # the same routes again on the same data (another PPO epoch): fine
        summed_step(chunk, second)
    session.check_consumed()


def test_loop_microbatch_order_changed_is_refused(qwen):
    chunk, vocab = qwen
    mbs = data(vocab, seed=100)
    session = rr.ReplaySession(chunk)
    routes = log_prob_pass(session, chunk, mbs)
    with pytest.raises(RouteError, match=r"mb 0: the token ids .* \(it equals recorded micro-batch 2's\)"):
        with session.replay(routes):
            summed_step(chunk, list(reversed(mbs)))
    session.check_consumed()
    # Deliberately other inputs: rebuild the routes (no recorded inputs travel with them).
    rebuilt = Routes(
        {layer: [routes.get(layer, mb) for mb in (2, 1, 0)] for layer in routes.layers},
        num_experts=routes.num_experts,
        topk=routes.topk,
    )
    native = summed_step(chunk, list(reversed(mbs)))
    with session.replay(rebuilt):
        replayed = summed_step(chunk, list(reversed(mbs)))
    session.check_consumed()
    assert_same_grads(native, replayed, "routes reordered with the micro-batches")
    # Shuffled micro-batches the checked way: take() keeps the recorded inputs in its order. Fed in that order it
    # replays them; fed in any other (the same token count each: only the token ids tell), it is refused.
    shuffled = routes.take([2, 0, 1])
    with RouterSpy([chunk]) as spy, session.replay(shuffled):
        summed_step(chunk, [mbs[2], mbs[0], mbs[1]])
    session.check_consumed()
    assert [
        (layer, i)
        for layer in session.layers
        for i, mb in enumerate((2, 0, 1))
        if not torch.equal(spy.forward[layer][i], srt(routes.get(layer, mb)))
    ] == []
    with pytest.raises(
        RouteError,
        match=r"mb 0: .* not those recorded micro-batch 2's .* \(it equals recorded micro-batch 0's\); routes.take",
    ):
        with session.replay(routes.take([0, 1, 2]).take([2, 0, 1])):  # taken twice: the order composes
            summed_step(chunk, mbs)
    session.check_consumed()
    with pytest.raises(RouteError, match=r"take: micro-batch 3 is not an index of the 3 micro-batch"):
        routes.take([0, 3])
    assert routes.take(torch.tensor([2, 0, 1])).taken_from[1] == (2, 0, 1)  # a permutation as a tensor
    for bad in ([], "012", [1.0], [True]):
        with pytest.raises(RouteError, match=r"take: "):
            routes.take(bad)


def test_loop_misuse_is_refused(qwen):
    chunk, vocab = qwen
    mbs = data(vocab, seed=110)
    session = rr.ReplaySession(chunk)
    with pytest.raises(UsageError, match=r"nothing recorded yet"):
        session.routes()
    with torch.no_grad(), session.record():
        chunk(mbs[0], pos(), None)
        with pytest.raises(UsageError, match=r"routes\(\) inside record\(\)"):
            session.routes()
        with pytest.raises(UsageError, match=r"this session is already recording"):
            with session.replay(
                Routes({layer: [torch.tensor([[0, 1]] * B * S)] for layer in session.layers}, num_experts=8, topk=2)
            ):
                pass
    routes = log_prob_pass(session, chunk, mbs)
    with session.replay(routes):  # one of three micro-batches trained; check_consumed() forgotten
        summed_step(chunk, mbs[:1])
    with pytest.raises(
        RouteError,
        match=r"previous replay on these routers was never checked .* layer 0 rank 0 mb 1: "
        r"2 of 3 replayed micro-batch\(es\) never used",
    ):
        log_prob_pass(rr.ReplaySession(chunk), chunk, mbs)  # the next step, even through a new session
    set_full_recompute(chunk, True)
    try:
        routes = log_prob_pass(session, chunk, mbs)
        with session.replay(routes):
            losses = [chunk(t, pos(), None).float().square().mean() for t in mbs]
        with pytest.raises(RouteError, match=r"layer 0 rank 0 mb 0: its checkpointed forward's graph is alive"):
            session.check_consumed()  # before the backward that recomputes
        sum(losses).backward()
        session.check_consumed()
    finally:
        set_full_recompute(chunk, False)


def test_loop_one_sequence_rollout_split_in_microbatches_goes_through_to_local(qwen):
    from moeverify.routing.views import job_layout

    chunk, vocab = qwen
    mbs = data(vocab, 2, seed=120, batch=1)
    session = rr.ReplaySession(chunk)
    recorded = log_prob_pass(session, chunk, mbs)
    engine_TLK = torch.cat(
        [torch.stack([recorded.get(layer, mb) for layer in session.layers], dim=1) for mb in range(2)]
    )[:-1]  # one sequence per micro-batch, the last row missing
    routes = Routes.from_rollout(
        engine_TLK.numpy(), layers=list(session.layers), num_experts=session.num_experts, tokens=2 * S, split=[S, S]
    )
    assert routes.order == "sequence"  # also for one sequence (docs/router_replay.md said None before)
    with pytest.raises(RouteError, match=r"rank 0: these routes are in sequence order"):
        with session.replay(routes):
            pass
    layout, coords, _ = job_layout(sp=False)
    local = routes.to_local(layout, coords=coords, seq_len=S, batch=1, num_layers=len(session.layers))
    with RouterSpy([chunk]) as spy, session.replay(local):
        for t in mbs:
            chunk(t, pos(1), None).float().square().mean().backward()
    session.check_consumed()
    for layer in session.layers:
        for mb in range(2):
            rows = S - mb  # the engine's missing last row was filled with a safe route
            assert torch.equal(spy.forward[layer][mb][:rows], srt(recorded.get(layer, mb))[:rows]), (layer, mb)


def test_loop_optimizer_step_inside_the_replay_block_on_other_data_is_refused_before_the_weights_change(qwen):
    # PPO mini-batches: forward, backward and optimizer.step() per micro-batch inside one replay block. The token
    # ids are compared before every optimizer step, so routes replayed on other data never reach the weights.
    chunk, vocab = qwen
    session = rr.ReplaySession(chunk)
    routes = log_prob_pass(session, chunk, data(vocab, seed=110))
    optimizer = torch.optim.SGD(chunk.parameters(), lr=0.1)
    before = {n: p.detach().clone() for n, p in chunk.named_parameters()}
    with pytest.raises(RouteError, match=r"chunk 0 rank 0 mb 0: the token ids of replayed forward 0 are not"):
        with session.replay(routes):
            for t in data(vocab, seed=120):
                optimizer.zero_grad()
                chunk(t, pos(t.shape[0]), None).float().square().mean().backward()
                optimizer.step()
    assert [n for n, p in chunk.named_parameters() if not torch.equal(p, before[n])] == []
    # the same loop on the recorded data steps every micro-batch
    mbs = data(vocab, seed=130)
    routes = log_prob_pass(session, chunk, mbs)
    with session.replay(routes):
        for t in mbs:
            optimizer.zero_grad()
            chunk(t, pos(t.shape[0]), None).float().square().mean().backward()
            optimizer.step()
    session.check_consumed()
    assert [n for n, p in chunk.named_parameters() if not torch.equal(p, before[n])]


def renumbered(arrays, experts: int):
    """The engine's ids under another numbering that keeps half the experts' numbers (the chance floor lets it
    through): expert ``f`` becomes ``perm[f]``, the odd experts rotated."""
    perm = torch.arange(experts)
    odd = perm[1::2].clone()
    perm[1::2] = odd.roll(1)
    return [perm[torch.as_tensor(a).long()].numpy() for a in arrays], perm


def test_loop_rollout_in_another_expert_numbering_is_refused_before_the_update(qwen):
    # Routes.from_rollout through session.replay with no guard set up by the user: the numbering check runs by
    # default on an engine's routes, at the optimizer step inside the block (no parameter moves) and at its exit
    from moeverify.routing.views import job_layout

    chunk, vocab = qwen
    lengths = [8] * 8
    tokens_BS = data(vocab, 1, seed=21, batch=len(lengths))[0]
    session = rr.ReplaySession(chunk)
    layers = session.layers
    arrays, _ = engine_arrays(chunk, tokens_BS, lengths, layers)
    bad, perm = renumbered(arrays, session.num_experts)
    layout, coords, _ = job_layout(sp=False)

    def local(engine_arrays_):
        routes = Routes.from_rollout(
            engine_arrays_, layers=list(layers), num_experts=session.num_experts, lengths=lengths, seq_len=S
        )
        assert routes.provenance == "rollout"
        return routes.to_local(layout, coords=coords, seq_len=S, batch=len(lengths), num_layers=len(layers))

    optimizer = torch.optim.SGD(chunk.parameters(), lr=0.1)
    before = {n: p.detach().clone() for n, p in chunk.named_parameters()}
    with pytest.raises(RouteError, match=r"replay pass layer \d+ rank 0: engine expert \d+ routes like trainer") as err:
        with session.replay(local(bad)):
            chunk(tokens_BS, pos(len(lengths)), None).float().square().mean().backward()
            optimizer.step()
    e, f = map(int, re.search(r"engine expert (\d+) routes like trainer expert (\d+)", str(err.value)).groups())
    assert int(perm[f]) == e and e != f
    assert all(torch.equal(before[n], p.detach()) for n, p in chunk.named_parameters())
    optimizer.zero_grad()
    with pytest.raises(RouteError, match=r"engine expert \d+ routes like trainer expert"):  # at the block's exit
        with session.replay(local(bad)):
            chunk(tokens_BS, pos(len(lengths)), None)
    with session.replay(local(arrays)):  # the engine's own numbering passes
        chunk(tokens_BS, pos(len(lengths)), None)
    with session.replay(local(bad), guard=False):  # turned off: replayed as given
        chunk(tokens_BS, pos(len(lengths)), None)
    with pytest.raises(UsageError, match=r"replay\(guard='yes'\)"):
        session.replay(local(arrays), guard="yes")
