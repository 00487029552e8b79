"""Expert-bias token counts with padding (T == E and T != E), and routers whose copied settings disagree
with their config, on real megatron-core TopKRouters (1-rank gloo world, CPU).

The right counts are decided by an independent reference: ``torch.bincount`` of the routed expert ids of
the non-padding tokens. Legend: S = positions, B = sequences, T = tokens, E = experts, K = top-k, H = hidden.
"""

from __future__ import annotations

import pytest
import torch
from seeded_router import seeded_router

from moeverify.errors import UsageError
from moeverify.patches import router_replay as rr
from moeverify.routing.routes import Routes

H, E, K = 16, 8, 2

pytestmark = pytest.mark.usefixtures("patched_megatron_world")


def make_router(seed: int = 0, **overrides):
    return seeded_router(
        hidden=H,
        experts=E,
        topk=K,
        seed=seed,
        **{"moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True, **overrides},
    )


def hidden(seq: int, batch: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(seq, batch, H, generator=torch.Generator().manual_seed(50 + seed))


def padding(seq: int, batch: int) -> torch.Tensor:
    """Megatron's ``[S, B]`` mask, True on padding: the last quarter of the last sequence, and position 1 of all."""
    pad_SB = torch.zeros(seq, batch, dtype=torch.bool)
    pad_SB[seq - max(1, seq // 4) :, -1] = True
    pad_SB[1, :] = True
    return pad_SB


def random_ids(tokens: int, seed: int) -> torch.Tensor:
    return torch.rand(tokens, E, generator=torch.Generator().manual_seed(seed)).argsort(dim=1)[:, :K]


def expected_counts(ids_TK: torch.Tensor, pad_SB: torch.Tensor) -> torch.Tensor:
    valid_T = ~pad_SB.reshape(-1)
    return torch.bincount(ids_TK[valid_T].flatten(), minlength=E).float()


def test_native_counts_t_equals_e_with_padding_silently_wrong():
    # The upstream finding the patch corrects: megatron-core 0.19.2 broadcasts the [T] mask over experts.
    seq, batch = 4, 2  # T = 8 = E
    router, pad_SB = make_router(1), padding(seq, batch)
    router.local_tokens_per_expert.zero_()
    _, map_TE = router(hidden(seq, batch, 1), padding_mask=pad_SB)  # no session: megatron-core's own code
    ids_TK = map_TE.nonzero()[:, 1].view(-1, K)
    assert not torch.equal(router.local_tokens_per_expert, expected_counts(ids_TK, pad_SB))


@pytest.mark.parametrize("seq,batch", [(4, 2), (6, 2)], ids=["T==E", "T!=E"])
def test_replay_counts_padding_per_token(seq, batch):
    router, pad_SB, ids_TK = make_router(2), padding(seq, batch), random_ids(seq * batch, 3)
    router.local_tokens_per_expert.zero_()
    session = rr.ReplaySession(router)
    with session.replay(Routes({0: [ids_TK]}, num_experts=E, topk=K)):
        router(hidden(seq, batch, 2), padding_mask=pad_SB)
    session.check_consumed()
    assert torch.equal(router.local_tokens_per_expert, expected_counts(ids_TK, pad_SB))


@pytest.mark.parametrize("seq,batch", [(4, 2), (6, 2)], ids=["T==E", "T!=E"])
def test_record_with_grad_counts_padding_per_token(seq, batch):
    router, pad_SB = make_router(3), padding(seq, batch)
    router.local_tokens_per_expert.zero_()
    session = rr.ReplaySession(router)
    with session.record():
        router(hidden(seq, batch, 3), padding_mask=pad_SB)
    assert torch.equal(router.local_tokens_per_expert, expected_counts(session.routes().get(0, 0), pad_SB))


def test_record_without_grad_counts_nothing():
    router = make_router(4)
    router.local_tokens_per_expert.zero_()
    with torch.no_grad(), rr.ReplaySession(router).record():
        router(hidden(4, 2, 4), padding_mask=padding(4, 2))
    assert torch.equal(router.local_tokens_per_expert, torch.zeros(E))


def test_replay_counts_equal_native_when_no_token_is_padding():
    # Where megatron-core's count is right (T == E, a mask with no padding), the patch's count equals it bitwise,
    # and the router returns the same routing map and probs: the map counted is the map Megatron routes by.
    seq, batch = 4, 2
    x, pad_SB = hidden(seq, batch, 5), torch.zeros(seq, batch, dtype=torch.bool)
    native = make_router(5)
    native.local_tokens_per_expert.zero_()
    native_probs, native_map = native(x, padding_mask=pad_SB)
    router = make_router(5)
    session = rr.ReplaySession(router)
    with torch.no_grad(), session.record():
        router(x, padding_mask=pad_SB)
    router.local_tokens_per_expert.zero_()
    with session.replay(session.routes()):
        probs, routing_map = router(x, padding_mask=pad_SB)
    assert torch.equal(routing_map, native_map) and torch.equal(probs, native_probs)
    assert torch.equal(router.local_tokens_per_expert, native.local_tokens_per_expert)
    assert router.enable_expert_bias is True  # the gate is handed back after each call


# -- settings Megatron copies at build time: the guard reads the copies -------------------------------------


def test_replay_refuses_routing_type_changed_to_sinkhorn_after_build():
    router = make_router(6, moe_router_enable_expert_bias=False, moe_router_score_function="softmax")
    router.routing_type = "sinkhorn"  # config still says aux_loss; megatron routes by the attribute
    assert router.config.moe_router_load_balancing_type == "aux_loss"
    session = rr.ReplaySession(router)
    with pytest.raises(
        UsageError,
        match=r"layer 0: load-balancing type\(s\) \['sinkhorn'\] select experts outside "
        r"the replay hook",
    ):
        with session.replay(Routes({0: [random_ids(8, 6)]}, num_experts=E, topk=K)):
            router(hidden(4, 2, 6))


def test_replay_refuses_routing_type_changed_inside_the_block():
    router = make_router(7, moe_router_enable_expert_bias=False, moe_router_score_function="softmax")
    session = rr.ReplaySession(router)
    with pytest.raises(
        UsageError,
        match=r"layer 0 rank 0: load-balancing type\(s\) \['quantile_balancing'\] .*"
        r"read from the router's own attributes",
    ):
        with session.replay(Routes({0: [random_ids(8, 7)]}, num_experts=E, topk=K)):
            router.routing_type = "quantile_balancing"
            router(hidden(4, 2, 7))


def test_replay_follows_attribute_when_config_says_sinkhorn():
    # The reverse disagreement: megatron routes by the attribute (top-k, through the hook), so replay serves it.
    router = make_router(8, moe_router_enable_expert_bias=False, moe_router_score_function="softmax")
    router.config.moe_router_load_balancing_type = "sinkhorn"
    ids_TK = random_ids(8, 8)
    session = rr.ReplaySession(router)
    with session.replay(Routes({0: [ids_TK]}, num_experts=E, topk=K)):
        _, map_TE = router(hidden(4, 2, 8))
    session.check_consumed()
    assert torch.equal(map_TE.nonzero()[:, 1].view(-1, K), ids_TK.sort(dim=1).values)


def test_replay_refuses_score_function_attribute_unknown():
    router = make_router(9)
    router.score_function = "tanh"
    with pytest.raises(UsageError, match="layer 0: score function 'tanh' is unknown to router replay"):
        with rr.ReplaySession(router).replay(Routes({0: [random_ids(8, 9)]}, num_experts=E, topk=K)):
            router(hidden(4, 2, 9))


def test_replay_refuses_topk_attribute_disagreeing_with_config():
    router = make_router(10)
    session = rr.ReplaySession(router)
    with pytest.raises(
        UsageError,
        match=r"layer 0 rank 0: the router's topk = 3 disagrees with its "
        r"config.moe_router_topk = 2 .*rebuild the model",
    ):
        with session.replay(Routes({0: [random_ids(8, 10)]}, num_experts=E, topk=K)):
            router.topk = 3
            router(hidden(4, 2, 10))
