"""The ``weights`` subcheck on the moved router (``moeverify.oracles.replay.moved_weights``) on plain tensors.

Megatron-Core's own routing function decides what a right implementation gives: its probabilities at the replayed
ids (``precomputed_indices``), in the routes' slot order and in another one, pass in fp32 and bf16 for every score
function; its native post-top-k probabilities read at the replayed ids (ISEEKYAN/Megatron-LM #79) fail, naming the
zero weights, their tokens and an example, with counts decided by ``torch.topk`` here.

Legend: T = tokens, E = experts, K = top-k.
"""

from __future__ import annotations

import types

import pytest
import torch

from moeverify.oracles.replay import moved_weights
from moeverify.oracles.results import Tally
from moeverify.patches.semantics import RoutingMode
from moeverify.routing.routes import Routes

T, E, K = 64, 16, 4
LAYER = 3
MODES = {
    "softmax": RoutingMode(num_experts=E, topk=K),
    "softmax_pre": RoutingMode(num_experts=E, topk=K, pre_softmax=True),
    "softmax_scaled": RoutingMode(num_experts=E, topk=K, scaling_factor=2.5),
    "sigmoid": RoutingMode(num_experts=E, topk=K, score_function="sigmoid"),
    "sigmoid_top1": RoutingMode(num_experts=E, topk=1, score_function="sigmoid"),
    "sqrtsoftplus_scaled": RoutingMode(num_experts=E, topk=K, score_function="sqrtsoftplus", scaling_factor=2.5),
}


def _logits(seed: int, dtype=torch.float32, *, spread: float = 8.0) -> torch.Tensor:
    # by default a wide spread: weights from near 1 down to 1e-12, where fp32 rounds exp's argument to its own ulp
    return (torch.randn(T, E, generator=torch.Generator().manual_seed(seed)) * spread).to(dtype)


def _replayed(seed: int, topk: int) -> torch.Tensor:
    """Routes recorded on other weights: ``[T, K]`` ids, unrelated to the logits' own top-k."""
    return torch.rand(T, E, generator=torch.Generator().manual_seed(100 + seed)).argsort(dim=1)[:, :topk]


def _megatron(logits_TE, mode: RoutingMode, ids_TK=None):
    """Megatron-Core's routing of ``logits_TE``: at ``ids_TK`` (replay), or its own top-k."""
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

    return topk_routing_with_score_function(
        logits_TE,
        mode.topk,
        use_pre_softmax=mode.pre_softmax,
        scaling_factor=mode.scaling_factor,
        score_function=mode.score_function,
        precomputed_indices=ids_TK,
    )


def _check(ids_TK, probs_TE, map_TE, logits_TE, mode: RoutingMode) -> Tally:
    routes = Routes({LAYER: [ids_TK]}, num_experts=E, topk=mode.topk)
    observed = types.SimpleNamespace(routing={(LAYER, 0): (map_TE, probs_TE)}, router_logits={(LAYER, 0): logits_TE})
    t = Tally()
    moved_weights.check(t, routes, observed, modes={LAYER: mode}, prefix="router moved: ")
    return t


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", sorted(MODES))
def test_moved_weights_megatrons_replay_passes_in_any_slot_order(name, dtype):
    mode = MODES[name]
    logits_TE, ids_TK = _logits(1, dtype), _replayed(1, mode.topk)
    for order_TK in (ids_TK, ids_TK.flip(1), ids_TK.roll(1, dims=1)):  # the routes' order, and others
        probs_TE, map_TE = _megatron(logits_TE, mode, order_TK)
        t = _check(ids_TK, probs_TE, map_TE, logits_TE, mode)
        assert t.passed and t.checked == 1, t.failures


@pytest.mark.parametrize("name", sorted(MODES))
def test_moved_weights_post_topk_probabilities_fail_naming_the_zero_weights(name):
    mode = MODES[name]
    logits_TE, ids_TK = _logits(2, spread=1.0), _replayed(2, mode.topk)
    native_TE, _ = _megatron(logits_TE, mode)
    right_TE, map_TE = _megatron(logits_TE, mode, ids_TK)
    assert float(right_TE.gather(1, ids_TK).min()) > 1e-4  # every right weight far from 0: each zero is seen
    t = _check(ids_TK, native_TE * map_TE, map_TE, logits_TE, mode)  # #79: the router's own top-k read at the ids
    # independently: the replayed experts the router's own top-k leaves out (every score function is monotonic in
    # the logits, so their top-k is the logits')
    picked_TE = torch.zeros(T, E, dtype=torch.bool).scatter(1, logits_TE.topk(mode.topk, dim=1).indices, True)
    unpicked_TK = ~picked_TE.gather(1, ids_TK)
    tok, slot = (int(i) for i in unpicked_TK.nonzero()[0])
    assert not t.passed
    assert t.failures[0].startswith(
        f"router moved: layer {LAYER} mb 0: {int(unpicked_TK.sum())} replayed expert weight(s) are 0 in "
        f"{int(unpicked_TK.any(dim=1).sum())} of {T} token(s) where the moved router's "
        f"{moved_weights.describe(mode)} gives them weight (first: token {tok} expert {int(ids_TK[tok, slot])}: 0 vs "
    ), t.failures


def test_moved_weights_one_zero_weight_one_weight_off_and_nan_are_each_named():
    mode = MODES["softmax"]
    logits_TE, ids_TK = _logits(3), _replayed(3, K)
    probs_TE, map_TE = _megatron(logits_TE, mode, ids_TK)
    t, e = 5, int(ids_TK[5, 2])
    zeroed = probs_TE.clone()
    zeroed[t, e] = 0
    assert _check(ids_TK, zeroed, map_TE, logits_TE, mode).failures == [
        f"router moved: layer {LAYER} mb 0: 1 replayed expert weight(s) are 0 in 1 of {T} token(s) where the moved "
        f"router's softmax over the replayed experts' logits gives them weight (first: token {t} expert {e}: 0 vs "
        f"{float(probs_TE[t, e]):.6g}): a replayed expert's weight comes from the router's scores at the replayed ids, "
        "not from its post-top-k (masked) probabilities"
    ]
    rtol, atol = moved_weights.tolerance(mode, torch.float32)
    nudged = probs_TE.clone()
    nudged[t, e] = probs_TE[t, e] * (1 + 4 * rtol) + 4 * atol  # past the tolerance, by a few ulps
    failures = _check(ids_TK, nudged, map_TE, logits_TE, mode).failures
    assert len(failures) == 1 and failures[0].startswith(
        f"router moved: layer {LAYER} mb 0: 1 of {T * K} replayed weight(s) differ from the moved router's softmax "
        f"over the replayed experts' logits at the replayed ids by more than {rtol:.1e} x |weight| + {atol:.1e} "
        f"(first: token {t} slot 2 expert {e}: "
    ), failures
    nan = probs_TE.clone()
    nan[t, e] = float("nan")
    assert " 1 of " in _check(ids_TK, nan, map_TE, logits_TE, mode).failures[0]


def test_moved_weights_judge_only_what_can_be_judged():
    """A replayed expert the pass did not route to is drift's finding, not a weight; logits not kept fail by name; a
    router call without a route (drift's too) is left alone."""
    mode = MODES["softmax"]
    logits_TE, ids_TK = _logits(4), _replayed(4, K)
    probs_TE, map_TE = _megatron(logits_TE, mode, ids_TK)
    unrouted_TE, zero_TE = map_TE.clone(), probs_TE.clone()
    unrouted_TE[0, ids_TK[0, 0]] = False
    zero_TE[0, ids_TK[0, 0]] = 0
    assert _check(ids_TK, zero_TE, unrouted_TE, logits_TE, mode).passed
    routes = Routes({LAYER: [ids_TK]}, num_experts=E, topk=K)
    t = Tally()
    observed = types.SimpleNamespace(routing={(LAYER, 0): (map_TE, probs_TE), (LAYER + 1, 0): (map_TE, probs_TE)})
    moved_weights.check(t, routes, types.SimpleNamespace(**vars(observed), router_logits={}), modes={}, prefix="")
    assert t.failures == [f"layer {LAYER} mb 0: the router's logits were not kept: its weights cannot be judged"]
