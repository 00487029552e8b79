"""Replay at top-k >= 4 over many experts is bitwise native grad-mode routing, whatever order the ids come in.

Megatron-Core 0.19.2 takes the plain top-k unsorted under ``no_grad`` (sorted with grad) and sums the K gathered
probabilities in slot order, so a log-prob pass records each row's ids in another order than a grad-mode pass
routes them; replay must give the probabilities of the grad-mode order (one canonical slot order).

Legend: T = tokens, E = experts, K = top-k, H = hidden.
"""

from __future__ import annotations

import pytest
import torch

from moeverify.patches import router_replay as rr
from moeverify.routing.routes import Routes

H, E, K, S, B = 32, 64, 8, 16, 4  # T = S * B = 64 tokens
T = S * B

pytestmark = pytest.mark.usefixtures("patched_megatron_world")

ROUTERS = {
    "softmax": dict(moe_router_score_function="softmax"),
    "softmax_pre": dict(moe_router_score_function="softmax", moe_router_pre_softmax=True),
    "sigmoid": dict(moe_router_score_function="sigmoid"),
    "sigmoid_bias_groups": dict(
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_router_num_groups=8,
        moe_router_group_topk=4,
    ),
    "sqrtsoftplus_bias": dict(moe_router_score_function="sqrtsoftplus", moe_router_enable_expert_bias=True),
}


def make_router(seed: int, **overrides):
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=2,
        hidden_size=H,
        num_attention_heads=2,
        num_moe_experts=E,
        moe_router_topk=K,
        use_cpu_initialization=True,
        moe_aux_loss_coeff=0.0,
        add_bias_linear=False,
        **overrides,
    )
    router = TopKRouter(config, pg_collection=get_default_pg_collection())
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        router.weight.normal_(0.0, 1.0, generator=gen)
        if router.expert_bias is not None:
            router.expert_bias.copy_(0.1 * torch.randn(E, generator=gen))
    router.set_layer_number(1)
    return router


def _pass(router, x_TBH, *, session=None, routes=None):
    """Grad-mode forward + backward: (probs, map, weight grad, input grad); replayed when ``routes`` is given."""
    x = x_TBH.clone().requires_grad_(True)
    router.weight.grad = None
    with session.replay(routes) if routes is not None else torch.enable_grad():
        probs_TE, map_TE = router(x)
        (probs_TE * torch.linspace(-1.0, 1.0, E)).square().sum().backward()
    if session is not None and routes is not None:
        session.check_consumed()
    return probs_TE.detach(), map_TE, router.weight.grad.clone(), x.grad.clone()


def _assert_bitwise(got, want, what):
    for name, a, b in zip(("probs", "routing map", "weight grad", "input grad"), got, want, strict=True):
        diff = int((a != b).sum())
        assert diff == 0, f"{what}: {name} differs in {diff} of {a.numel()} elements"


@pytest.mark.parametrize("name", list(ROUTERS))
def test_replay_recorded_without_grad_bitwise_native_grad_mode(name):
    native, subject = make_router(11, **ROUTERS[name]), make_router(11, **ROUTERS[name])
    x_TBH = torch.randn(S, B, H, generator=torch.Generator().manual_seed(5))
    want = _pass(native, x_TBH)
    session = rr.ReplaySession(subject)
    with torch.no_grad(), session.record():
        logprob_TE, _ = subject(x_TBH)
    assert torch.equal(logprob_TE, want[0]), "the recording (log-prob) pass's probs differ from grad-mode routing"
    _assert_bitwise(_pass(subject, x_TBH, session=session, routes=session.routes()), want, "replay of no-grad record")


@pytest.mark.parametrize("order", ["reversed", "shuffled", "ascending"])
def test_replay_of_ids_in_any_slot_order_bitwise_native_grad_mode(order):
    overrides = ROUTERS["sigmoid_bias_groups"]
    native, subject = make_router(12, **overrides), make_router(12, **overrides)
    x_TBH = torch.randn(S, B, H, generator=torch.Generator().manual_seed(6))
    want = _pass(native, x_TBH)
    ids_TK = want[1].nonzero()[:, 1].view(T, K)  # ascending expert ids
    if order == "reversed":
        ids_TK = ids_TK.flip(1)
    elif order == "shuffled":
        ids_TK = ids_TK.gather(1, torch.rand(T, K, generator=torch.Generator().manual_seed(1)).argsort(dim=1))
    session = rr.ReplaySession(subject)
    routes = Routes({0: [ids_TK]}, num_experts=E, topk=K)
    _assert_bitwise(_pass(subject, x_TBH, session=session, routes=routes), want, f"replay of {order} ids")


def test_native_no_grad_pass_differs_from_grad_mode_at_top8_of_64():
    """The upstream behaviour the canonical order removes (a test that it is still there: else drop the sort)."""
    router = make_router(13, **ROUTERS["softmax"])
    x_TBH = torch.randn(S, B, H, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        nograd_TE, map_nograd = router(x_TBH)
    grad_TE, map_grad = router(x_TBH)
    assert torch.equal(map_nograd, map_grad)
    assert not torch.equal(nograd_TE, grad_TE)


@pytest.mark.parametrize("name", ["softmax", "softmax_pre", "sigmoid_bias_groups"])
@pytest.mark.parametrize("dtype", ["bf16", "fp32_integer_logits"])
def test_replay_of_tied_scores_has_native_gradients(name, dtype):
    """Tied scores sum alike in the forward, but their gradients are summed in slot order, so a replay must break
    ties as Megatron's own grad-mode top-k does (an order "descending score, ties by id" gave every forward bitwise
    and input gradients off by bf16 ulps on an H200 at Qwen3-30B-A3B's width, where bf16 logits tie often). Integer
    weights and inputs give fp32 logits that tie in most rows, with no bf16 rounding to hide a difference."""
    overrides = dict(ROUTERS[name], **(dict(params_dtype=torch.bfloat16, bf16=True) if dtype == "bf16" else {}))
    native, subject = make_router(14, **overrides), make_router(14, **overrides)
    gen = torch.Generator().manual_seed(8)
    x_TBH = torch.randn(1024, B, H, generator=gen)  # 4,096 tokens
    if dtype == "bf16":
        x_TBH = x_TBH.to(torch.bfloat16)
    else:
        x_TBH = x_TBH.mul(1.5).round()
        for router in (native, subject):
            with torch.no_grad():
                router.weight.copy_(
                    torch.randint(-2, 3, router.weight.shape, generator=torch.Generator().manual_seed(9))
                )
    want = _pass(native, x_TBH)
    with torch.no_grad():
        logits_TE = native.gating(x_TBH.view(-1, H))
    top_TK = logits_TE.float().topk(K, dim=1).values  # the case is the one it claims: top-k rows holding ties
    assert int((top_TK[:, 1:] == top_TK[:, :-1]).any(dim=1).sum()) >= logits_TE.shape[0] // 8
    session = rr.ReplaySession(subject)
    with torch.no_grad(), session.record():
        subject(x_TBH)
    _assert_bitwise(_pass(subject, x_TBH, session=session, routes=session.routes()), want, f"replay of {dtype} record")
