"""The ``weights`` subcheck on the moved router: a replayed expert's combine weight is the router's scoring function
of its current logits at the replayed ids, not what its own top-k left there.

On the weights the routes were recorded with, the router's own top-k picks the replayed experts, so a replay that
reads the weights from anywhere a top-k has touched is right there: Megatron's post-top-k probabilities (zero off the
router's own picks, normalised over them) give every replayed expert its weight. Once the router moves (``drift``'s
perturbation) a replayed expert the router no longer picks reads 0 there, and one it still picks reads a weight
normalised over another set (ISEEKYAN/Megatron-LM #79). ``drift`` compares expert ids only; this compares, for every
replayed (token, expert) the drifted pass routed, the weight it gave with the reference.

The reference is ``moeverify.patches.semantics.reference_routing`` in float64, from the maths and the router's own
settings (``RoutingMode.from_router``: the score function, softmax before or after the top-k, the sigmoid /
sqrtsoftplus normalisation over K at top-k > 1, the scaling factor), at the replayed ids in the order the routes give
them; never Megatron's code. Compared within ``tolerance``, not bit for bit: a weight normalises over K scores (over
all E before a pre-softmax top-k), and implementations sum them in the slot order they choose (Megatron's native
replay in the routes' order, moeverify's patch in descending score), which moves an fp32 result by up to a few ulps
at top-k >= 3; fp32 rounds the argument of ``exp``, which moves a tiny weight by a few parts in a million of itself;
the cast to the pass's dtype may round once more. The weights on the unmoved router are compared bit
for bit with the recorded pass (``pass_checks.compare_passes``).

Legend of shape suffixes: T = tokens (router order), E = experts, K = top-k.
"""

from __future__ import annotations

import torch

from moeverify.oracles.results import Tally
from moeverify.patches.semantics import RoutingMode, reference_routing
from moeverify.routing.routes import Routes

_EPS32 = torch.finfo(torch.float32).eps


def tolerance(mode: RoutingMode, dtype: torch.dtype) -> tuple[float, float]:
    """``(rtol, atol)``: a weight may differ from the float64 reference by ``rtol * |reference| + atol``.

    ``rtol``: two fp32 ulps per score the weight is normalised over (K; E for softmax before top-k), plus one
    rounding to ``dtype``. ``atol``: one fp32 epsilon per such score, times the scaling factor: fp32 rounds the
    argument of ``exp`` (a logit minus the row's largest) to its own ulp, which moves a weight ``w = exp(d) / Z`` by
    up to ``w * |d| * eps / 2 <= eps / (2e)`` absolute however small ``w`` is (a weight of 5e-10 is then a few
    parts in 1e6 off)."""
    terms = mode.num_experts if mode.score_function == "softmax" and mode.pre_softmax else mode.topk
    return 2 * terms * _EPS32 + torch.finfo(dtype).eps, terms * _EPS32 * max(1.0, float(mode.scaling_factor or 1.0))


def describe(mode: RoutingMode) -> str:
    """The scoring rule of ``mode`` in words (failure messages)."""
    if mode.score_function == "softmax":
        rule = "softmax over every expert" if mode.pre_softmax else "softmax over the replayed experts' logits"
    else:
        rule = f"{mode.score_function} scores" + (" normalised over the replayed experts" if mode.topk > 1 else "")
    return rule + (f", scaled by {mode.scaling_factor}" if mode.scaling_factor else "")


def check(t: Tally, routes: Routes, observed, *, modes: dict[int, RoutingMode], prefix: str) -> None:
    """Every (layer, mb) of ``observed`` (a replayed ``drive.PassResult`` with ``router_logits``) gave each replayed
    expert it routed to the weight ``modes[layer]`` gives it from the router's logits; one item per router call."""
    if not observed.routing:
        return  # a stage without MoE layers routes nothing (drift asks whether one should have)
    for (layer, mb), (map_TE, probs_TE) in sorted(observed.routing.items()):
        if layer not in routes.layers or mb >= routes.microbatches:
            continue  # routed without a route: drift names it
        logits_TE = observed.router_logits.get((layer, mb))
        if logits_TE is None:
            t.fail(f"{prefix}layer {layer} mb {mb}: the router's logits were not kept: its weights cannot be judged")
            continue
        _check_call(
            t,
            routes.get(layer, mb),
            map_TE,
            probs_TE,
            logits_TE,
            mode=modes[layer],
            where=f"{prefix}layer {layer} mb {mb}",
        )


def _check_call(t: Tally, ids_TK, map_TE, probs_TE, logits_TE, *, mode: RoutingMode, where: str) -> None:
    T = probs_TE.shape[0]
    if ids_TK.dim() != 2 or ids_TK.shape[0] != T or tuple(logits_TE.shape) != tuple(probs_TE.shape):
        t.fail(
            f"{where}: replayed routes {tuple(ids_TK.shape)}, router probs {tuple(probs_TE.shape)} and logits "
            f"{tuple(logits_TE.shape)} do not describe one call of T tokens"
        )
        return
    ids_TK = ids_TK.to(torch.int64)
    want_TK, _ = reference_routing(logits_TE, mode, topk_ids_TK=ids_TK)
    got_TK = probs_TE.gather(1, ids_TK)
    routed_TK = map_TE.gather(1, ids_TK)  # replayed experts the pass routed to (one it did not: drift's finding)
    rtol, atol = tolerance(mode, probs_TE.dtype)
    off_TK = routed_TK & ~((got_TK.double() - want_TK).abs() <= rtol * want_TK.abs() + atol)  # NaN is off
    zero_TK = off_TK & (got_TK == 0)
    if not bool(off_TK.any()):
        t.ok()
        return
    if bool(zero_TK.any()):
        tok, slot = (int(i) for i in zero_TK.nonzero()[0])
        t.fail(
            f"{where}: {int(zero_TK.sum())} replayed expert weight(s) are 0 in {int(zero_TK.any(dim=1).sum())} of {T} "
            f"token(s) where the moved router's {describe(mode)} gives them weight (first: token {tok} expert "
            f"{int(ids_TK[tok, slot])}: 0 vs {float(want_TK[tok, slot]):.6g}): a replayed expert's weight comes from "
            "the router's scores at the replayed ids, not from its post-top-k (masked) probabilities"
        )
    rest_TK = off_TK & ~zero_TK
    if bool(rest_TK.any()):
        tok, slot = (int(i) for i in rest_TK.nonzero()[0])
        got, want = float(got_TK[tok, slot]), float(want_TK[tok, slot])
        t.fail(
            f"{where}: {int(rest_TK.sum())} of {int(routed_TK.sum())} replayed weight(s) differ from the moved "
            f"router's {describe(mode)} at the replayed ids by more than {rtol:.1e} x |weight| + {atol:.1e} "
            f"(first: token {tok} slot {slot} expert {int(ids_TK[tok, slot])}: {got!r} vs {want:.9g})"
        )
