"""Routing semantics under replay, decided by an independent float64 reference (``reference_routing``).

Legend: T = tokens, E = experts, K = top-k, H = hidden.
"""

from __future__ import annotations

import pytest
import torch
from seeded_router import seeded_router

from moeverify.errors import UsageError
from moeverify.patches import router_replay as rr
from moeverify.patches.semantics import RoutingMode, dense, reference_routing, refuse_unreplayable
from moeverify.routing.routes import Routes

H, E, K, S, B = 16, 8, 2, 8, 2
T = S * B

MODES = {
    "softmax_post": {},
    "softmax_pre": dict(moe_router_pre_softmax=True),
    "softmax_scaled": dict(moe_router_topk_scaling_factor=2.5),
    "sigmoid_bias": dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True),
    "sqrtsoftplus": dict(moe_router_score_function="sqrtsoftplus"),
    "group_limited_dsv3": dict(
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_router_num_groups=4,
        moe_router_group_topk=2,
        moe_router_topk_scaling_factor=2.5,
    ),
}


pytestmark = pytest.mark.usefixtures("patched_megatron_world")


def make_router(seed: int = 0, **overrides):
    return seeded_router(hidden=H, experts=E, topk=K, seed=seed, **overrides)


def hidden(seed: int) -> torch.Tensor:
    return torch.randn(S, B, H, generator=torch.Generator().manual_seed(50 + seed))


def random_ids(seed: int) -> torch.Tensor:
    return torch.rand(T, E, generator=torch.Generator().manual_seed(seed)).argsort(dim=1)[:, :K]


def logits_of(router, x) -> torch.Tensor:
    return x.view(T, H).double() @ router.weight.detach().double().t()


@pytest.mark.parametrize("name", sorted(MODES))
def test_record_selection_matches_reference(name):
    router = make_router(1, **MODES[name])
    session = rr.ReplaySession(router)
    x = hidden(1)
    with torch.no_grad(), session.record():
        probs_TE, _ = router(x)
    mode = RoutingMode.from_config(router.config)
    ref_probs_TK, ref_ids_TK = reference_routing(logits_of(router, x), mode, expert_bias_E=router.expert_bias)
    got_TK = session.routes().get(0, 0)
    assert torch.equal(got_TK.sort(dim=1).values, ref_ids_TK.sort(dim=1).values)
    torch.testing.assert_close(probs_TE.double(), dense(ref_probs_TK, ref_ids_TK, E)[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", sorted(MODES))
def test_replay_probs_gathered_from_current_scores(name):
    router = make_router(2, **MODES[name])
    session = rr.ReplaySession(router)
    ids_TK = random_ids(3)
    x = hidden(2)
    with session.replay(Routes({0: [ids_TK]}, num_experts=E, topk=K)):
        probs_TE, map_TE = router(x)
    mode = RoutingMode.from_config(router.config)
    ref_probs_TK, _ = reference_routing(
        logits_of(router, x), mode, expert_bias_E=router.expert_bias, topk_ids_TK=ids_TK
    )
    ref_probs_TE, ref_map_TE = dense(ref_probs_TK, ids_TK, E)
    assert torch.equal(map_TE, ref_map_TE)
    torch.testing.assert_close(probs_TE.detach().double(), ref_probs_TE, rtol=1e-5, atol=1e-6)


def tracked(name: str) -> torch.Tensor:
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    return get_moe_metrics_tracker().metrics[name].values.clone()


def clear_tracker() -> None:
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    get_moe_metrics_tracker().clear()


def test_aux_loss_under_replay_ignores_replayed_ids():
    router = make_router(3, moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001)
    x = hidden(3)
    clear_tracker()
    router(x)
    native_aux, native_z = tracked("load_balancing_loss"), tracked("z_loss")
    for seed in (4, 5):
        clear_tracker()
        with rr.ReplaySession(router).replay(Routes({0: [random_ids(seed)]}, num_experts=E, topk=K)):
            router(x)
        assert torch.equal(tracked("load_balancing_loss"), native_aux)  # native top-k of the logits
        assert torch.equal(tracked("z_loss"), native_z)  # logits only


def test_expert_bias_counts_follow_replayed_ids():
    router = make_router(4, moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True)
    ids_TK = random_ids(6)
    router.local_tokens_per_expert.zero_()
    with rr.ReplaySession(router).replay(Routes({0: [ids_TK]}, num_experts=E, topk=K)):
        router(hidden(4))
    expected_E = torch.bincount(ids_TK.flatten(), minlength=E).float()
    assert torch.equal(router.local_tokens_per_expert, expected_E)


def test_padding_rows_still_replayed_and_excluded_from_aux_loss():
    # megatron-core 0.19.2 cannot combine expert bias with a padding mask even natively
    # (routing_map [T, E] & mask [T] does not broadcast), so padding is shown with aux + z loss.
    router = make_router(7, moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001)
    ids_TK = random_ids(8)
    pad_SB = torch.zeros(S, B, dtype=torch.bool)
    pad_SB[-2:] = True  # megatron's mask: True marks a padding token
    x = hidden(7)
    clear_tracker()
    router(x, padding_mask=pad_SB)
    native_z = tracked("z_loss")
    clear_tracker()
    with rr.ReplaySession(router).replay(Routes({0: [ids_TK]}, num_experts=E, topk=K)):
        _, map_TE = router(x, padding_mask=pad_SB)
    assert torch.equal(map_TE.nonzero()[:, 1].view(T, K), ids_TK.sort(dim=1).values)
    assert torch.equal(tracked("z_loss"), native_z)


def test_capacity_dropping_applies_to_replayed_routes():
    router = make_router(5, moe_expert_capacity_factor=1.0, moe_token_drop_policy="probs")
    ids_TK = torch.tensor([[0, 1]] * T)  # every token on experts 0 and 1: capacity T*K/E = 4 each
    with torch.no_grad(), rr.ReplaySession(router).replay(Routes({0: [ids_TK]}, num_experts=E, topk=K)):
        _, map_TE = router(hidden(5))
    kept_E = map_TE.sum(dim=0)
    assert kept_E.tolist() == [4, 4, 0, 0, 0, 0, 0, 0]


def test_capacity_replay_of_native_routes_bitwise_equal_to_native():
    router = make_router(6, moe_expert_capacity_factor=1.0)
    x = hidden(6)
    native_probs, native_map = router(x)
    session = rr.ReplaySession(router)
    with torch.no_grad(), session.record():
        router(x)
    with session.replay(session.routes()):
        probs, routing_map = router(x)
    assert torch.equal(probs, native_probs) and torch.equal(routing_map, native_map)


def test_refuse_unreplayable_quantile_balancing_raises():
    mode = RoutingMode(num_experts=E, topk=K, load_balancing=("quantile_balancing",))
    with pytest.raises(UsageError, match=r"layer 4: load-balancing type\(s\) \['quantile_balancing'\]"):
        refuse_unreplayable(mode, where="layer 4")


def test_refuse_unreplayable_unknown_score_function_raises():
    mode = RoutingMode(num_experts=E, topk=K, score_function="tanh")
    with pytest.raises(UsageError, match="score function 'tanh' is unknown to router replay"):
        refuse_unreplayable(mode, where="layer 0")


def test_routing_mode_bad_groups_raises():
    with pytest.raises(
        UsageError, match="group-limited routing needs num_groups dividing num_experts 8, got num_groups 3"
    ):
        RoutingMode(num_experts=E, topk=K, num_groups=3, group_topk=1)
