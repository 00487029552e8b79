"""The top-k slot-order finding: a plain no-grad pass and a plain grad-mode pass route with other probabilities.

Megatron-Core 0.19.2 takes the plain top-k with ``sorted=torch.is_grad_enabled()`` and sums a row's K gathered
probabilities in slot order, so at top-k >= 3 a no-grad (log-prob) pass and a grad-mode (training) pass of the
same weights can differ by an ulp. That is upstream behaviour, reported as finding ``FINDING`` with its evidence,
not a failure of the implementation under test. What the implementation owes is a training pass equal to its
recorded pass: an implementation that replays in the recorded no-grad order is compared, for its gradients, with
native grad-mode routing *in that order* (``reference_pass``), built here from Megatron's own top-k.

Legend of shape suffixes: T = tokens (router order), E = experts, K = top-k.
"""

from __future__ import annotations

import torch

from moeverify.oracles.bits import bitwise_equal
from moeverify.patches.routers import find_routers

FINDING = "F12"
TITLE = "megatron-core 0.19.2 top-k slot order: a no-grad pass and a grad-mode pass route with other probabilities"


class NoGradOrder:
    """Megatron's ``router_replay`` protocol: the native top-k ids in the order a no-grad pass takes them, the
    scores gathered with grad (what a grad-mode pass gives when it routes in a no-grad pass's slot order)."""

    __slots__ = ()

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        with torch.no_grad():
            _, ids_TK = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        return scores.gather(1, ids_TK), ids_TK


def evidence(grad_pass, nograd_pass) -> list[str]:
    """Per (layer, mb) where the plain grad-mode and no-grad passes route the same experts with other probs."""
    found = []
    for key, (map_TE, probs_TE) in sorted(grad_pass.routing.items()):
        other = nograd_pass.routing.get(key)
        if other is None or other[0].shape != map_TE.shape:
            continue
        if torch.equal(other[0], map_TE) and not bitwise_equal(other[1], probs_TE):
            diff_TE = (other[1].double() - probs_TE.double()).abs()
            found.append(
                f"layer {key[0]} mb {key[1]}: same experts, router probs differ in "
                f"{int((diff_TE > 0).sum())} of {diff_TE.numel()} elements (max {float(diff_TE.max()):.3g})"
            )
    return found


def same_probs(a, b) -> bool:
    """Two passes routed every (layer, mb) with bitwise the same map and probs."""
    return a.routing.keys() == b.routing.keys() and all(
        torch.equal(a.routing[k][0], b.routing[k][0]) and bitwise_equal(a.routing[k][1], b.routing[k][1])
        for k in a.routing
    )


def reference_pass(chunks: list, run) -> object:
    """``run()`` (a grad-mode pass of ``chunks``) with every router routing natively in the no-grad slot order."""

    routers = [router for _, router in find_routers(chunks).values()]
    saved = [router.__dict__.get("router_replay") for router in routers]
    try:
        for router in routers:
            router.__dict__["router_replay"] = NoGradOrder()
        return run()
    finally:
        for router, value in zip(routers, saved, strict=True):
            router.__dict__["router_replay"] = value
