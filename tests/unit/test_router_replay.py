"""Router replay on real Megatron-Core TopKRouters built on CPU (1-rank gloo world).

Legend: T = tokens, E = experts, K = top-k, H = hidden.
"""

from __future__ import annotations

import gc

import pytest
import torch

from moeverify.errors import RouteError, UsageError
from moeverify.patches import router_replay as rr
from moeverify.routing.routes import Routes

H, E, K, S, B = 16, 8, 2, 6, 2  # hidden, experts, top-k, sequence, batch: T = S * B = 12
T = S * B


pytestmark = pytest.mark.usefixtures("patched_megatron_world")


def make_router(layer: int, *, seed: int = 0, mtp: bool = False, **overrides):
    """A TopKRouter with its 1-based layer number set, weights from ``seed``."""
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.transformer_config import TransformerConfig

    settings = dict(
        num_layers=4,
        hidden_size=H,
        num_attention_heads=2,
        num_moe_experts=E,
        moe_router_topk=K,
        use_cpu_initialization=True,
        moe_aux_loss_coeff=0.0,
        add_bias_linear=False,
    )
    settings.update(overrides)
    config = TransformerConfig(**settings)
    torch.manual_seed(seed)
    router = TopKRouter(config, pg_collection=get_default_pg_collection(), is_mtp_layer=mtp)
    with torch.no_grad():
        router.weight.normal_(0.0, 1.0, generator=torch.Generator().manual_seed(seed))
    router.set_layer_number(layer)
    return router


def hidden(seed: int, *, tokens: int = S) -> torch.Tensor:
    return torch.randn(tokens, B, H, generator=torch.Generator().manual_seed(100 + seed))


def ids_of(routing_map_TE: torch.Tensor) -> torch.Tensor:
    """Sorted expert ids per token from a dense routing map."""
    return routing_map_TE.nonzero()[:, 1].view(routing_map_TE.shape[0], -1)


def random_routes(layers, *, microbatches: int = 1, tokens: int = T, seed: int = 7) -> Routes:
    g = torch.Generator().manual_seed(seed)
    per_layer = {
        layer: [torch.rand(tokens, E, generator=g).argsort(dim=1)[:, :K] for _ in range(microbatches)]
        for layer in layers
    }
    return Routes(per_layer, num_experts=E, topk=K)


def test_apply_idempotent_and_revert_restores_original():
    from megatron.core.transformer.moe.router import TopKRouter

    patched = TopKRouter.__dict__["routing"]
    rr.apply()
    assert TopKRouter.__dict__["routing"] is patched
    rr.revert()
    assert TopKRouter.__dict__["routing"] is not patched
    assert TopKRouter.__dict__["routing"].__module__ == "megatron.core.transformer.moe.router"
    rr.apply()
    assert TopKRouter.__dict__["routing"] is patched


def test_apply_foreign_patch_refused():
    from megatron.core.transformer.moe.router import TopKRouter

    from moeverify.errors import EnvironmentProblem

    rr.revert()
    original = TopKRouter.routing

    def foreign(self, logits, padding_mask=None):
        return original(self, logits, padding_mask)

    TopKRouter.routing = foreign
    try:
        with pytest.raises(EnvironmentProblem, match="TopKRouter.routing was replaced by .*foreign"):
            rr.apply()
    finally:
        TopKRouter.routing = original
        rr.apply()


def test_session_without_apply_refused():
    session = rr.ReplaySession(make_router(1))
    rr.revert()
    try:
        with pytest.raises(UsageError, match="not applied; call router_replay.apply"):
            with session.record():
                pass
    finally:
        rr.apply()


def test_record_matches_torch_topk_reference():
    router = make_router(2)
    session = rr.ReplaySession(router)
    x = hidden(0)
    with torch.no_grad(), session.record():
        router(x)
        router(hidden(1))
    routes = session.routes()
    assert routes.layers == (1,) and routes.microbatches == 2
    logits_TE = (x.view(T, H) @ router.weight.t()).double()
    expected = torch.topk(logits_TE, K, dim=1).indices.sort(dim=1).values
    assert torch.equal(routes.get(1, 0).sort(dim=1).values, expected)


def test_replay_bitwise_equal_to_native_forward_backward():
    native, subject = make_router(1, seed=3), make_router(1, seed=3)
    x = hidden(2)
    probs_native, map_native = native(x)
    probs_native.square().sum().backward()
    session = rr.ReplaySession(subject)
    with torch.no_grad(), session.record():
        subject(x)
    with session.replay(session.routes()):
        probs, routing_map = subject(x)
        probs.square().sum().backward()
    session.check_consumed()
    assert torch.equal(probs, probs_native) and torch.equal(routing_map, map_native)
    assert torch.equal(subject.weight.grad, native.weight.grad)


def test_replay_perturbed_weights_follows_recorded_routes():
    router = make_router(1, seed=4)
    session = rr.ReplaySession(router)
    x = hidden(3)
    with torch.no_grad(), session.record():
        router(x)
    routes = session.routes()
    with torch.no_grad():
        router.weight.add_(torch.randn(E, H, generator=torch.Generator().manual_seed(9)))
        natively = ids_of(router(x)[1])
    assert not torch.equal(natively, routes.get(0, 0).sort(dim=1).values)  # the perturbation changes routes
    with session.replay(routes):
        probs_TE, map_TE = router(x)
    agree = (ids_of(map_TE) == routes.get(0, 0).sort(dim=1).values).all(dim=1).float().mean()
    assert agree.item() == 1.0
    logits_TE = (x.view(T, H) @ router.weight.t()).detach().double()
    ref_TK = torch.softmax(logits_TE.gather(1, routes.get(0, 0)), dim=-1)
    got_TK = probs_TE.detach().double().gather(1, routes.get(0, 0))
    torch.testing.assert_close(got_TK, ref_TK, rtol=1e-6, atol=1e-7)


def test_replay_matches_megatron_native_router_replay_bitwise():
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    RouterReplay.global_router_replay_instances.clear()
    native = make_router(
        1,
        seed=5,
        moe_enable_routing_replay=True,
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_router_num_groups=4,
        moe_router_group_topk=2,
    )
    ours = make_router(
        1,
        seed=5,
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_router_num_groups=4,
        moe_router_group_topk=2,
    )
    routes = random_routes([0])
    try:
        native.router_replay.set_target_indices(routes.get(0, 0))
        native.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        probs_native, _ = native(hidden(4))
        probs_native.sum().backward()
    finally:
        native.router_replay.clear_router_replay_action()
        RouterReplay.global_router_replay_instances.clear()
    session = rr.ReplaySession(ours)
    with session.replay(routes):
        probs, _ = ours(hidden(4))
        probs.sum().backward()
    assert torch.equal(probs, probs_native) and torch.equal(ours.weight.grad, native.weight.grad)


def checkpointed(router, x):
    from megatron.core import tensor_parallel

    return tensor_parallel.checkpoint(lambda inp: router(inp)[0], False, x)


def test_recompute_replays_same_microbatch_not_next():
    plain, ckpt = (
        make_router(1, seed=6),
        make_router(1, seed=6, recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    )
    routes = random_routes([0], microbatches=2)
    xs = [hidden(10).requires_grad_(), hidden(11).requires_grad_()]
    s_plain, s_ckpt = rr.ReplaySession(plain), rr.ReplaySession(ckpt)
    with s_plain.replay(routes):
        outs = [plain(x)[0] for x in xs]
        for out in outs:
            out.square().sum().backward()
    with s_ckpt.replay(routes):
        outs = [checkpointed(ckpt, x) for x in xs]
        for out in outs:  # backward in forward order, as Megatron's schedules do
            out.square().sum().backward()
    s_ckpt.check_consumed()
    assert torch.equal(ckpt.weight.grad, plain.weight.grad)


def test_check_consumed_missing_recompute_raises():
    router = make_router(1, seed=6, recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    session = rr.ReplaySession(router)
    with session.replay(random_routes([0], microbatches=2)):
        out0 = checkpointed(router, hidden(0).requires_grad_())
        out1 = checkpointed(router, hidden(1).requires_grad_())  # graph kept alive, backward never run
        out0.sum().backward()
    with pytest.raises(
        RouteError,
        match=r"layer 0 rank 0 mb 1: its checkpointed forward's graph is alive but was "
        r"never recomputed",
    ):
        session.check_consumed()
    del out1


def test_check_consumed_discarded_checkpointed_forward_accepted():
    # A checkpointed forward whose graph is dropped is never recomputed: nothing can route wrongly.
    router = make_router(1, seed=6, recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    session = rr.ReplaySession(router)
    with session.replay(random_routes([0], microbatches=2)):
        checkpointed(router, hidden(0).requires_grad_())
        checkpointed(router, hidden(1).requires_grad_()).sum().backward()
    session.check_consumed()


def test_recompute_with_recompute_false_raises():
    router = make_router(1, seed=6)
    session = rr.ReplaySession(router)
    x = hidden(0).requires_grad_()
    with session.replay(random_routes([0]), recompute=False):
        out = checkpointed(router, x)
        with pytest.raises(
            RouteError,
            match="layer 0 rank 0 mb 0: recompute of a replayed forward, but the replay "
            "was started with recompute=False",
        ):
            out.sum().backward()


def test_replay_too_few_microbatches_raises():
    router = make_router(1)
    session = rr.ReplaySession(router)
    with session.replay(random_routes([0], microbatches=1)):
        router(hidden(0))
        with pytest.raises(RouteError, match=r"layer 0 rank 0: forward 2 of this replay, but 1 micro-batch"):
            router(hidden(1))


def test_check_consumed_too_many_microbatches_raises():
    router = make_router(1)
    session = rr.ReplaySession(router)
    with session.replay(random_routes([0], microbatches=3)):
        router(hidden(0))
    with pytest.raises(RouteError, match=r"layer 0 rank 0 mb 1: 2 of 3 replayed micro-batch\(es\) never used"):
        session.check_consumed()


def test_replay_token_count_mismatch_raises():
    router = make_router(1)
    session = rr.ReplaySession(router)
    with session.replay(random_routes([0], tokens=T + 2)):
        with pytest.raises(RouteError, match=r"layer 0 rank 0 mb 0: replay ids shape \(14, 2\) != expected \(T=12"):
            router(hidden(0))


def test_replay_layer_set_mismatch_raises():
    session = rr.ReplaySession([make_router(1), make_router(3)])
    with pytest.raises(RouteError, match=r"routes layers \[0, 1\] != expected \[0, 2\] \(missing \[2\], extra \[1\]"):
        with session.replay(random_routes([0, 1])):
            pass


def test_replay_of_global_routes_on_a_stage_of_some_layers_names_to_local():
    # A pipeline stage (layers 0 and 2) given every layer of a rollout or a merged recording (sequence order):
    # select would keep the layers but not make the rows this rank's, in router order; to_local does both.
    session = rr.ReplaySession([make_router(1), make_router(3)])
    with pytest.raises(RouteError, match=r"extra \[1, 3\]\); these are global routes .*routes\.to_local\(layout"):
        with session.replay(random_routes([0, 1, 2, 3]).in_order("sequence")):
            pass


def test_replay_routes_of_other_model_raises():
    session = rr.ReplaySession(make_router(1))
    other = Routes({0: [torch.zeros(T, 1, dtype=torch.int64)]}, num_experts=4, topk=1)
    with pytest.raises(
        RouteError, match=r"routes of another model: \(num_experts, topk\) = \(4, 1\) != expected \(8, 2\)"
    ):
        with session.replay(other):
            pass


def test_two_models_one_process_only_bound_model_replays():
    actor, reference = make_router(1, seed=8), make_router(1, seed=8)
    expected_map = reference(hidden(5))[1]
    session = rr.ReplaySession(actor)
    routes = random_routes([0])
    with session.replay(routes):
        actor_map = actor(hidden(5))[1]
        reference_map = reference(hidden(5))[1]
    assert torch.equal(ids_of(actor_map), routes.get(0, 0).sort(dim=1).values)
    assert torch.equal(reference_map, expected_map)


def test_two_sessions_same_router_refused():
    router = make_router(1)
    first, second = rr.ReplaySession(router), rr.ReplaySession(router)
    with first.record():
        with pytest.raises(UsageError, match="layer 0: its router is held by another active session"):
            with second.record():
                pass


def test_vpp_chunks_keyed_by_global_layer():
    # chunk 0 holds global layers 1 and 3 (0-based 0, 2), chunk 1 holds 2 and 4: construction order differs.
    chunk1 = torch.nn.ModuleList([make_router(2, seed=1), make_router(4, seed=2)])
    chunk0 = torch.nn.ModuleList([make_router(1, seed=3), make_router(3, seed=4)])
    session = rr.ReplaySession([chunk0, chunk1])
    assert session.layers == (0, 1, 2, 3)
    routes = random_routes(session.layers)
    with session.replay(routes):
        maps = {layer - 1: r(hidden(6))[1] for chunk in (chunk1, chunk0) for r in chunk for layer in [r.layer_number]}
    session.check_consumed()
    for layer, routing_map in maps.items():
        assert torch.equal(ids_of(routing_map), routes.get(layer, 0).sort(dim=1).values), layer


def test_mtp_router_keyed_after_decoder_layers():
    session = rr.ReplaySession([make_router(4), make_router(1, mtp=True)])
    assert session.layers == (3, 4)


def test_duplicate_global_layer_refused():
    with pytest.raises(UsageError, match="two routers claim global layer 0"):
        rr.ReplaySession([make_router(1), make_router(1)])


def test_rebuilt_model_refused():
    router = make_router(1)
    session = rr.ReplaySession(router)
    del router
    gc.collect()
    with pytest.raises(UsageError, match="router of layer 0 no longer exists"):
        with session.record():
            pass


def test_fused_router_refused():
    router = make_router(1)
    router.config.moe_router_fusion = True
    with pytest.raises(UsageError, match="layer 0: moe_router_fusion=True takes a fused top-k path"):
        with rr.ReplaySession(router).record():
            pass


def test_fused_router_disabled_while_active_and_restored():
    router = make_router(1)
    router.config.moe_router_fusion = True
    session = rr.ReplaySession(router, disable_fusion=True)
    with torch.no_grad(), session.record():
        assert router.config.moe_router_fusion is False
        router(hidden(0))
    assert router.config.moe_router_fusion is True
    assert session.routes().microbatches == 1


def test_a_refused_block_leaves_every_routers_fusion_as_it_was():
    """Two fused routers, the second refused at enter: the first one's fusion, switched off before the refusal, is
    switched on again."""
    first, second = make_router(1), make_router(2, moe_router_load_balancing_type="sinkhorn")
    for router in (first, second):
        router.config.moe_router_fusion = True
    session = rr.ReplaySession(torch.nn.ModuleList([first, second]), disable_fusion=True)
    with pytest.raises(UsageError, match="sinkhorn"):
        with session.record():
            pass
    assert first.config.moe_router_fusion is True and second.config.moe_router_fusion is True


def test_sinkhorn_refused():
    router = make_router(1, moe_router_load_balancing_type="sinkhorn")
    with pytest.raises(UsageError, match=r"load-balancing type\(s\) \['sinkhorn'\] select experts outside"):
        with rr.ReplaySession(router).replay(random_routes([0])):
            pass


def test_native_replay_action_conflict_refused():
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    router = make_router(1, moe_enable_routing_replay=True)
    router.router_replay.set_router_replay_action(RouterReplayAction.RECORD)
    try:
        with pytest.raises(UsageError, match="native RouterReplay action .* is set on a router held"):
            with rr.ReplaySession(router).record():
                pass
    finally:
        RouterReplay.global_router_replay_instances.clear()


@pytest.mark.parametrize(
    "routes", [{1: [torch.zeros(T, 2, dtype=torch.int64)]}, torch.zeros(T, 1, 2, dtype=torch.int64), None, [[0, 1]]]
)
def test_replay_of_something_else_than_routes_refused_naming_the_argument(routes):
    session = rr.ReplaySession(make_router(1))
    with pytest.raises(
        UsageError, match=rf"replay\(routes\): routes is a {type(routes).__name__}; replay takes a Routes"
    ):
        session.replay(routes)


def test_check_consumed_before_replay_refused():
    with pytest.raises(UsageError, match="check_consumed\\(\\) needs a replay first"):
        rr.ReplaySession(make_router(1)).check_consumed()


def test_routes_before_record_refused():
    with pytest.raises(UsageError, match="nothing recorded yet"):
        rr.ReplaySession(make_router(1)).routes()


def test_session_without_routers_refused():
    with pytest.raises(UsageError, match="found no TopKRouter"):
        rr.ReplaySession(torch.nn.Linear(2, 2))


def test_recompute_true_pairs_non_reentrant_checkpoint():
    from torch.utils.checkpoint import checkpoint

    plain, ckpt = make_router(1, seed=12), make_router(1, seed=12)
    routes = random_routes([0], microbatches=2, seed=3)
    xs = [hidden(20).requires_grad_(), hidden(21).requires_grad_()]
    with rr.ReplaySession(plain).replay(routes):
        for out in [plain(x)[0] for x in xs]:
            out.square().sum().backward()
    session = rr.ReplaySession(ckpt)
    with session.replay(routes, recompute=True):
        outs = [checkpoint(lambda inp: ckpt(inp)[0], x, use_reentrant=False) for x in xs]
        for out in outs:
            out.square().sum().backward()
    session.check_consumed()
    assert torch.equal(ckpt.weight.grad, plain.weight.grad)


@pytest.mark.parametrize("checkpointed", [False, True])
def test_recompute_true_names_why_a_forward_was_never_recomputed(checkpointed):
    # recompute=True with no checkpoint: the backward ran, nothing could recompute; with one whose backward has
    # not run yet: the backward is what is missing. The message says which.
    from torch.utils.checkpoint import checkpoint

    router = make_router(1, seed=12)
    routes = random_routes([0], microbatches=1, seed=3)
    session = rr.ReplaySession(router)
    x = hidden(20).requires_grad_()
    with session.replay(routes, recompute=True):
        out = checkpoint(lambda inp: router(inp)[0], x, use_reentrant=False) if checkpointed else router(x)[0]
        if not checkpointed:
            out.square().sum().backward()
    why = "its backward pass did not run" if checkpointed else "this forward ran in no checkpointed region"
    with pytest.raises(RouteError, match=rf"layer 0 rank 0 mb 0: recomputed 0 time\(s\), .*\(recompute=True; {why}"):
        session.check_consumed()
    del out


def test_replay_bad_recompute_option_refused():
    with pytest.raises(UsageError, match="recompute must be 'auto', True or False, got 'yes'"):
        with rr.ReplaySession(make_router(1)).replay(random_routes([0]), recompute="yes"):
            pass


def test_apply_topk_function_without_replay_hook_refused(monkeypatch):
    from megatron.core.transformer.moe import moe_utils

    from moeverify.errors import EnvironmentProblem

    def old_topk(
        logits,
        topk,
        use_pre_softmax=False,
        num_groups=None,
        group_topk=None,
        scaling_factor=None,
        score_function="softmax",
        expert_bias=None,
        fused=False,
    ):
        raise AssertionError("never called")

    rr.revert()
    monkeypatch.setattr(moe_utils, "topk_routing_with_score_function", old_topk)
    try:
        with pytest.raises(
            EnvironmentProblem, match=r"lacks parameter\(s\) \['router_replay'\].*megatron-core >= 0.16"
        ):
            rr.apply()
    finally:
        monkeypatch.undo()
        rr.apply()


def test_replay_checks_routes_built_unchecked():
    router = make_router(1)
    session = rr.ReplaySession(router)
    bad = Routes.unchecked({0: [torch.tensor([[3, 3]] * T)]}, num_experts=E, topk=K)
    with pytest.raises(RouteError, match=r"layer 0 rank 0 mb 0: token 0 routes to expert\(s\) twice: \[3, 3\]"):
        with session.replay(bad):
            pass


def test_replay_keeps_its_own_copy_of_the_routes():
    router = make_router(1, seed=2)
    routes = random_routes([0])
    expected = routes.get(0, 0).clone()
    session = rr.ReplaySession(router)
    with session.replay(routes):
        routes.get(0, 0).fill_(0)  # writing through get() after replay started changes nothing replayed
        got = ids_of(router(hidden(0))[1])
    assert torch.equal(got, expected.sort(dim=1).values)


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        dict(
            moe_router_score_function="sigmoid",
            moe_router_enable_expert_bias=True,
            moe_router_num_groups=2,
            moe_router_group_topk=1,
        ),
    ],
)
def test_fidelity_is_the_share_of_tokens_native_routing_would_route_alike(overrides):
    routers = [make_router(1, seed=4, **overrides), make_router(2, seed=5, **overrides)]
    session = rr.ReplaySession(routers)
    xs = [hidden(3), hidden(4)]
    with torch.no_grad(), session.record():
        for x in xs:
            for r in routers:
                r(x)
    routes = session.routes()
    with session.replay(routes, fidelity=True), torch.no_grad():
        for x in xs:
            for r in routers:
                r(x)
    assert session.fidelity() == {0: 1.0, 1: 1.0}  # same weights: replay changes nothing
    with torch.no_grad():
        routers[1].weight.add_(torch.randn(E, H, generator=torch.Generator().manual_seed(9)))
        native = [ids_of(routers[1](x)[1]) for x in xs]  # what native routing now picks, layer 1
    expected = sum(int((n == routes.get(1, mb).sort(dim=1).values).all(dim=1).sum()) for mb, n in enumerate(native))
    with session.replay(routes, fidelity=True), torch.no_grad():
        for x in xs:
            for r in routers:
                r(x)
    report = session.fidelity()
    assert report[0] == 1.0 and report[1] == expected / (2 * T) < 1.0


def test_fidelity_off_by_default_says_how_to_ask():
    router = make_router(1, seed=4)
    session = rr.ReplaySession(router)
    with torch.no_grad(), session.record():
        router(hidden(0))
    with session.replay(session.routes()), torch.no_grad():
        router(hidden(0))
    with pytest.raises(UsageError, match=r"replay\(routes, fidelity=True\)"):
        session.fidelity()


def _stage_without_routers(**overrides) -> torch.nn.Module:
    """A module carrying a megatron-core config but no router: a pipeline stage of dense layers only."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    settings = dict(
        num_layers=4,
        hidden_size=H,
        num_attention_heads=2,
        num_moe_experts=E,
        moe_router_topk=K,
        pipeline_model_parallel_size=2,
        pipeline_dtype=torch.float32,
        use_cpu_initialization=True,
    )
    settings.update(overrides)
    stage = torch.nn.Linear(H, H)
    stage.config = TransformerConfig(**settings)
    return stage


def test_a_dense_stage_of_an_moe_pipeline_binds_no_layer_and_a_dense_model_is_refused():
    session = rr.ReplaySession(_stage_without_routers())
    assert session.layers == () and (session.num_experts, session.topk) == (E, K)
    with session.record():
        pass
    routes = session.routes()
    assert routes.layers == () and (routes.num_experts, routes.topk) == (E, K)
    with session.replay(routes.select(())):
        pass
    with pytest.raises(RouteError, match=r"routes layers \[1\] != expected \[\]"):
        with session.replay(random_routes([1])):
            pass
    for dense in (
        _stage_without_routers(num_moe_experts=None, moe_router_topk=2),  # no experts at all
        _stage_without_routers(pipeline_model_parallel_size=1),
    ):  # the whole model, no router
        with pytest.raises(UsageError, match="found no TopKRouter .*dense model has nothing to replay"):
            rr.ReplaySession(dense)


def test_replay_of_sequence_order_routes_is_refused_and_their_local_view_replays_right():
    from moeverify.routing import views
    from moeverify.spec.layout import Layout

    router = make_router(1, seed=3)
    x = hidden(2)
    session = rr.ReplaySession(router)
    with torch.no_grad(), session.record():
        router(x)
    local = session.routes()  # router order: row s * B + b
    assert local.order == "router"
    # what a rollout engine returns for the same tokens: one [S, L, K] array per request (sequence-major rows)
    requests = [local.get(0, 0).view(S, B, K)[:, b, :].unsqueeze(1).numpy() for b in range(B)]
    rollout = Routes.from_rollout(requests, layers=[0], num_experts=E, lengths=[S] * B)
    assert rollout.order == "sequence"
    with pytest.raises(RouteError, match=r"rank 0: these routes are in sequence order .* routes.to_local"):
        with session.replay(rollout):
            pass
    mine = rollout.to_local(
        Layout(), coords=views.rank_coords(Layout(), rank=0, world_size=1), seq_len=S, batch=B, num_layers=4
    )
    assert mine.order == "router" and mine == local
    with torch.no_grad(), session.replay(mine):
        _, routing_map = router(x)
    assert torch.equal(ids_of(routing_map), local.get(0, 0).sort(dim=1).values)


@pytest.mark.parametrize("write", ["torch", "numpy"])
def test_replay_of_a_route_written_into_after_validation_is_refused(write):
    router = make_router(1)
    routes = random_routes([0])
    ids = routes.get(0, 0)
    if write == "torch":
        ids[-4:] = 0  # "masking the padding": rows [0, 0], a duplicate expert
    else:
        ids.numpy()[-4:] = 0  # a write torch's in-place counter does not see
    session = rr.ReplaySession(router)
    with pytest.raises(
        RouteError,
        match=r"layer 0 mb 0: (the route was written into after it was validated|token 8 "
        r"routes to expert\(s\) twice)",
    ):
        with session.replay(routes):
            router(hidden(0))


@pytest.mark.parametrize("write", ["torch", "numpy"])
def test_a_route_written_into_after_its_first_replay_is_refused_at_every_later_replay(write):
    # Replay routes with private copies made at the first replay: a later write into the tensor get() returned
    # would show in get() and not in what is replayed. Valid ids (the rows' experts reversed), so no validation
    # of the ids could see it: the write itself is refused, by this session and by a new one.
    router = make_router(1)
    routes = random_routes([0])
    session = rr.ReplaySession(router)
    with session.replay(routes):
        router(hidden(0))
    session.check_consumed()
    ids = routes.get(0, 0)
    if write == "torch":
        ids[:2] = ids[:2].flip(1).clone()
    else:
        ids.numpy()[:2] = ids.numpy()[:2, ::-1].copy()  # a write torch's in-place counter does not see
    what = "validated" if write == "torch" else r"replayed \(through a NumPy view"
    for replaying in (session, rr.ReplaySession(router)):
        with pytest.raises(RouteError, match=rf"layer 0 mb 0: the route was written into after it was {what}"):
            with replaying.replay(routes):
                router(hidden(0))


def _rollout_of(router, x):
    """The routes native routing picks for ``x``, as a rollout engine returns them (sequence-order, global view)."""
    with torch.no_grad():
        _, routing_map = router(x)
    ids_SBK = ids_of(routing_map).view(S, B, K)
    return Routes.from_rollout(
        [ids_SBK[:, b].unsqueeze(1).numpy() for b in range(B)], layers=[0], num_experts=E, lengths=[S] * B
    )


@pytest.mark.parametrize(
    ("coords", "batch", "refusal"),
    [
        (
            dict(rank=1),
            B,
            r"rank 0: these routes are rank 1 \(tp0 pp0 cp0 dp0 ep0\)'s view \(to_local\(coords=\) of another",
        ),
        (
            dict(rank=0, dp=1),
            1,
            r"rank 0: to_local was given rank 0 \(tp0 pp0 cp0 dp1 ep0\), but Megatron places this "
            r"rank at tp0 pp0 cp0 dp0: the layout",
        ),
        (dict(rank=0), 1, r"rank 0: to_local read the global routes as 2 data-parallel batch\(es\) .* this job has 1 "),
    ],
)
def test_a_local_view_made_for_another_rank_or_batch_is_refused(coords, batch, refusal):
    # to_local given another rank's coordinates, a place Megatron does not give this rank, or a batch that reads the
    # global rows as more data-parallel ranks than the job has: each replays other tokens' routes. Refused.
    from moeverify.routing import views
    from moeverify.spec.layout import Layout

    router = make_router(1, seed=3)
    rollout = _rollout_of(router, hidden(2))
    local = rollout.to_local(Layout(), coords=views.RankCoords(**coords), seq_len=S, batch=batch, num_layers=4)
    with pytest.raises(RouteError, match=refusal):
        with rr.ReplaySession(router).replay(local):
            router(hidden(2))


def _recorded(*, router_seed: int, hidden_seed: int):
    """A router, its input, a session that recorded native routing of it, that routing map, and the routes."""
    router = make_router(1, seed=router_seed)
    x = hidden(hidden_seed)
    session = rr.ReplaySession(router)
    with torch.no_grad(), session.record():
        _, routing_map = router(x)
    return router, x, session, routing_map, session.routes()


@pytest.mark.parametrize("how", ["pickle", "torch.save", "deepcopy"])
def test_a_copied_routes_replays_like_its_original(how, tmp_path):
    # A copy is validated anew (its tensors have their own write counters): replayed right, not refused as written.
    import copy
    import pickle

    router, x, session, native, routes = _recorded(router_seed=3, hidden_seed=2)
    if how == "pickle":
        again = pickle.loads(pickle.dumps(routes))
    elif how == "torch.save":
        torch.save(routes, tmp_path / "routes.pt")
        again = torch.load(tmp_path / "routes.pt", weights_only=False)
    else:
        again = copy.deepcopy(routes)
    assert again == routes and again.order == "router" and again is not routes
    with torch.no_grad(), session.replay(again):
        _, replayed = router(x)
    session.check_consumed()
    assert torch.equal(replayed, native)


def test_rollout_in_physical_expert_slots_replays_the_logical_experts_through_its_map():
    # An EPLB engine records physical slots (12 slots for 8 experts, 4 replicated); with expert_map= the replayed
    # experts are the logical ones native routing picked. Without the map the slot ids are refused, not replayed.
    from moeverify.routing import views
    from moeverify.spec.layout import Layout

    slot_to_logical = [5, 0, 7, 3, 1, 6, 2, 4, 3, 0, 6, 5]
    last_slot = {e: max(s for s, x in enumerate(slot_to_logical) if x == e) for e in range(E)}
    router, x, session, native_map, local = _recorded(router_seed=4, hidden_seed=3)
    logical = [local.get(0, 0).view(S, B, K)[:, b, :].unsqueeze(1) for b in range(B)]
    physical = [a.clone().apply_(lambda e: last_slot[e]).numpy() for a in logical]
    assert max(int(a.max()) for a in physical) >= E
    with pytest.raises(RouteError, match=r"expert id \d+ out of range \[0, 8\) .*pass expert_map="):
        Routes.from_rollout(physical, layers=[0], num_experts=E, lengths=[S] * B)
    rollout = Routes.from_rollout(physical, layers=[0], num_experts=E, lengths=[S] * B, expert_map=slot_to_logical)
    mine = rollout.to_local(
        Layout(), coords=views.rank_coords(Layout(), rank=0, world_size=1), seq_len=S, batch=B, num_layers=4
    )
    with torch.no_grad(), session.replay(mine):
        _, routing_map = router(x)
    session.check_consumed()
    assert torch.equal(routing_map, native_map)


def test_a_routes_replayed_every_step_is_checked_once_and_changes_still_refused(monkeypatch):
    router = make_router(1, seed=4)
    session = rr.ReplaySession(router)
    routes = random_routes([0])
    checks = []
    real = session._check_routes
    monkeypatch.setattr(session, "_check_routes", lambda r, rank: checks.append(1) or real(r, rank))
    for _ in range(3):  # a trainer's steps: one Routes, replayed again each step
        with session.replay(routes):
            router(hidden(0))
        session.check_consumed()
    assert len(checks) == 1
    routes.in_order("sequence")  # what the routes say about themselves changed: checked again, and refused
    with pytest.raises(RouteError, match="these routes are in sequence order"):
        with session.replay(routes):
            pass
    assert len(checks) == 2
    with pytest.raises(RouteError, match=r"routes layers \[1\] != expected \[0\]"):  # another Routes: checked
        with session.replay(random_routes([1])):
            pass


def test_routes_built_unchecked_are_checked_at_every_replay():
    router = make_router(1)
    session = rr.ReplaySession(router)
    ids = random_routes([0]).get(0, 0).clone()
    routes = Routes.unchecked({0: [ids]}, num_experts=E, topk=K)
    with session.replay(routes):
        router(hidden(0))
    session.check_consumed()
    ids[0] = torch.tensor([3, 3])  # written after a first replay: an unchecked Routes is read again
    routes = Routes.unchecked({0: [ids]}, num_experts=E, topk=K)
    with pytest.raises(RouteError, match=r"token 0 routes to expert\(s\) twice: \[3, 3\]"):
        with session.replay(routes):
            pass


def test_a_recording_of_float_inputs_hooks_nothing_at_replay_and_token_ids_are_still_compared():
    router = make_router(1, seed=5)  # the chunk is the router: its forward takes hidden states, no token ids
    session = rr.ReplaySession(router)
    with session.record():
        router(hidden(0))
    routes = session.routes()
    with session.replay(routes):
        assert not router._forward_pre_hooks  # nothing recorded to compare with: torch's fast call path kept
        router(hidden(0))
    session.check_consumed()


def test_a_routes_replayed_again_after_the_model_moved_takes_a_table_on_the_new_device(monkeypatch):
    from moeverify.patches import router_replay as module

    router = make_router(1, seed=6)
    session = rr.ReplaySession(router)
    routes = random_routes([0])
    with session.replay(routes):
        router(hidden(0))
    session.check_consumed()
    tables = []
    real = Routes.replay_table
    monkeypatch.setattr(Routes, "replay_table", lambda self, device: tables.append(device) or real(self, device))
    with session.replay(routes):  # the same device: the table made at the first replay serves
        router(hidden(0))
    session.check_consumed()
    assert tables == []
    moved = torch.device("cpu", 0)  # another device as torch compares them (it computes on the same CPU)
    monkeypatch.setattr(module, "_device_of", lambda routers: moved)
    with session.replay(routes):
        router(hidden(0))
    session.check_consumed()
    assert tables == [moved]
