"""The top-k slot-order finding (``oracles.replay.slot_order``): its evidence, and the no-grad-order reference
built from Megatron-Core's own routing function (no model, no process group).

Legend: T = tokens, E = experts, K = top-k.
"""

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function  # noqa: E402

from moeverify.oracles.replay import slot_order  # noqa: E402
from moeverify.oracles.replay.drive import PassResult  # noqa: E402

T, E, K = 256, 64, 8


def _logits():
    return torch.randn(T, E, generator=torch.Generator().manual_seed(3))


def _pass(probs_TE, map_TE):
    return PassResult(routing={(1, 0): (map_TE, probs_TE)}, recompute={}, logits={}, seq_loss={}, grads={})


def test_megatron_no_grad_and_grad_routing_differ_at_top8_of_64():
    with torch.no_grad():
        nograd = topk_routing_with_score_function(_logits(), K)
    grad = topk_routing_with_score_function(_logits().requires_grad_(), K)
    found = slot_order.evidence(_pass(grad[0].detach(), grad[1]), _pass(*nograd))
    assert len(found) == 1 and found[0].startswith("layer 1 mb 0: same experts, router probs differ in ")


def test_no_grad_order_reference_reproduces_the_no_grad_pass_with_grad():
    with torch.no_grad():
        nograd_TE, _ = topk_routing_with_score_function(_logits(), K)
    logits_TE = _logits().requires_grad_()
    probs_TE, _ = topk_routing_with_score_function(logits_TE, K, router_replay=slot_order.NoGradOrder())
    assert torch.equal(probs_TE, nograd_TE) and probs_TE.requires_grad
    probs_TE.sum().backward()
    assert logits_TE.grad is not None


def test_evidence_empty_for_equal_passes_and_for_other_experts():
    with torch.no_grad():
        probs_TE, map_TE = topk_routing_with_score_function(_logits(), K)
    assert slot_order.evidence(_pass(probs_TE, map_TE), _pass(probs_TE.clone(), map_TE.clone())) == []
    assert slot_order.same_probs(_pass(probs_TE, map_TE), _pass(probs_TE.clone(), map_TE.clone()))
    other_TE = map_TE.roll(1, dims=1)  # other experts: not this finding (the routing map comparison reports it)
    assert slot_order.evidence(_pass(probs_TE, map_TE), _pass(probs_TE + 1, other_TE)) == []
    assert not slot_order.same_probs(_pass(probs_TE, map_TE), _pass(probs_TE + 1, map_TE))
