"""The replay subchecks' comparisons: what one rank observed vs what it should have, into Tallies.

Plain tensors and ``PassResult``s only (no Megatron import); ``subchecks`` runs the passes.
Legend of shape suffixes: T = tokens (router order), E = experts, K = top-k, B = sequences.
"""

from __future__ import annotations

import torch

from moeverify.oracles.bits import bitwise_equal
from moeverify.oracles.replay.compare import (
    agreement,
    close_within,
    compare_maps,
    describe_mismatch,
    map_from_topk_ids,
    same_experts,
    topk_ids_from_map,
)
from moeverify.oracles.results import Tally
from moeverify.routing.routes import Routes

# Cross-layout losses are compared within this fp32 tolerance, not bitwise: TP splits the hidden
# dimension of row-parallel matmuls and all-reduces the partial sums, EP sums expert outputs after an
# all-to-all in a different order, SP/CP change which tokens are summed together in the loss; fp32
# addition is not associative, so the same routes give losses equal only to a few ulps per op.
CROSS_LAYOUT_RTOL = 1e-4
CROSS_LAYOUT_ATOL = 1e-4


def _fill(t: Tally, checked: int, failures: list[str], prefix: str) -> None:
    t.ok(checked - len(failures))
    for msg in failures:
        t.fail(f"{prefix}{msg}")


def compare_passes(t: Tally, expected, got, *, prefix: str, grads: bool = True, logits: bool = True) -> None:
    """Bitwise: routing maps and probs of every (layer, mb), logits, per-sequence losses, gradients."""
    _fill(
        t,
        *compare_maps(
            {k: v[0] for k, v in expected.routing.items()},
            {k: v[0] for k, v in got.routing.items()},
            what="routing map (layer, mb)",
        ),
        prefix,
    )
    _fill(
        t,
        *compare_maps(
            {k: v[1] for k, v in expected.routing.items()},
            {k: v[1] for k, v in got.routing.items()},
            what="router probs (layer, mb)",
        ),
        prefix,
    )
    if logits:
        _fill(t, *compare_maps(expected.logits, got.logits, what="logits mb"), prefix)
        _fill(t, *compare_maps(expected.seq_loss, got.seq_loss, what="loss mb"), prefix)
    if grads:
        _fill(t, *compare_maps(expected.grads, got.grads, what="grad"), prefix)


def check_recorded(t: Tally, routes: Routes, observed, *, prefix: str) -> None:
    """The routes an implementation recorded are the routes its routers took (as observed by hooks)."""
    observed_layers = sorted({layer for layer, _ in observed.routing})
    if list(routes.layers) != observed_layers:
        t.fail(f"{prefix}recorded layers {list(routes.layers)} != layers that routed {observed_layers}")
        return
    for (layer, mb), (map_TE, _) in sorted(observed.routing.items()):
        if mb >= routes.microbatches:
            t.fail(f"{prefix}layer {layer} mb {mb}: not recorded ({routes.microbatches} micro-batch(es) held)")
            continue
        got_TE = map_from_topk_ids(routes.get(layer, mb), num_experts=map_TE.shape[1])
        if got_TE.shape != map_TE.shape:
            t.fail(
                f"{prefix}layer {layer} mb {mb}: recorded route shape {tuple(routes.get(layer, mb).shape)} "
                f"!= router tokens {map_TE.shape[0]}"
            )
            continue
        bad = int((got_TE != map_TE).any(dim=1).sum())
        t.check(
            bad == 0,
            f"{prefix}layer {layer} mb {mb}: recorded routes differ from the routes taken "
            f"for {bad} of {map_TE.shape[0]} token(s)",
        )


def check_follows(t: Tally, routes: Routes, observed, *, prefix: str, what: str, stage_layers: tuple[int, ...]) -> None:
    """Every (layer, mb) the routers ran used exactly ``routes`` (expert sets per token).

    ``stage_layers``: the MoE layers of this rank's pipeline stage; a stage without any (a dense stage of an
    MoE pipeline) must route nothing, and checks nothing here."""
    ran = sorted(observed.routing)
    if not ran and stage_layers:
        t.fail(f"{prefix}no router ran (this stage holds MoE layers {list(stage_layers)})")
    for layer in routes.layers:
        for mb in range(routes.microbatches):
            if (layer, mb) not in observed.routing:
                t.fail(f"{prefix}layer {layer} mb {mb}: {what} route never used (router did not run)")
    for layer, mb in ran:
        got_TK = topk_ids_from_map(observed.routing[(layer, mb)][0])
        if layer not in routes.layers or mb >= routes.microbatches:
            t.fail(f"{prefix}layer {layer} mb {mb}: routed, but no {what} route exists for it")
            continue
        want_TK = routes.get(layer, mb)
        if want_TK.shape != got_TK.shape:
            t.fail(
                f"{prefix}layer {layer} mb {mb}: routed {tuple(got_TK.shape)} tokens x k, {what} routes hold "
                f"{tuple(want_TK.shape)}"
            )
            continue
        same_T = same_experts(want_TK, got_TK)
        bad = int((~same_T).sum())
        t.check(
            bad == 0,
            f"{prefix}layer {layer} mb {mb}: {bad} of {same_T.numel()} token(s) did not follow the "
            f"{what} routes (first token {int((~same_T).nonzero()[0]) if bad else -1})",
        )


def drift_agreement(routes: Routes, native) -> dict[int, tuple[int, int]]:
    """Per layer ``(tokens whose native expert set equals the replayed one, tokens)`` summed over mbs."""
    out: dict[int, tuple[int, int]] = {}
    for (layer, mb), (map_TE, _) in native.routing.items():
        if layer not in routes.layers or mb >= routes.microbatches:
            continue
        same_T = same_experts(routes.get(layer, mb), topk_ids_from_map(map_TE))
        s, n = out.get(layer, (0, 0))
        out[layer] = (s + int(same_T.sum()), n + same_T.numel())
    return out


def check_drift_moved(
    t: Tally, counts: dict[int, tuple[int, int]], *, prefix: str, stage_layers: tuple[int, ...]
) -> None:
    """The perturbation must change native routing somewhere, else the drift check proves nothing (a dense
    stage, without ``stage_layers``, routes nothing and is not asked)."""
    if not counts and not stage_layers:
        return
    same = sum(s for s, _ in counts.values())
    total = sum(n for _, n in counts.values())
    t.check(
        total > 0 and same < total,
        f"{prefix}perturbing the router weights changed no native route ({same} of {total} tokens kept their "
        "experts): a check on the moved router would prove nothing",
    )


def check_recompute_calls(t: Tally, got, *, microbatches: int, prefix: str) -> None:
    """Each layer recomputed each micro-batch once, in forward order, with the forward's routes."""
    for layer, calls in sorted(got.recompute.items()):
        if not t.check(
            len(calls) == microbatches,
            f"{prefix}layer {layer}: {len(calls)} recompute routing call(s), expected {microbatches} "
            "(one per micro-batch)",
        ):
            continue
        for i, (map_TE, probs_TE) in enumerate(calls):
            fwd = got.routing.get((layer, i))
            if fwd is None:
                t.fail(f"{prefix}layer {layer}: recompute call {i} has no forward micro-batch {i}")
                continue
            bad = int((map_TE != fwd[0]).any(dim=1).sum()) if map_TE.shape == fwd[0].shape else map_TE.shape[0]
            t.check(
                bad == 0,
                f"{prefix}layer {layer} mb {i}: recompute routed {bad} of {map_TE.shape[0]} token(s) "
                "differently from its forward (recompute did not replay)",
            )
            t.check(
                bitwise_equal(probs_TE, fwd[1]),
                f"{prefix}layer {layer} mb {i}: recompute probs differ from the forward's: "
                f"{describe_mismatch(fwd[1], probs_TE)}",
            )


def check_recompute_identity(t: Tally, got, *, microbatches: int, prefix: str) -> None:
    """Backward in any order: each layer's recompute calls are its forwards, each matched exactly once.

    A recompute call matches a forward when routing map and probs are bitwise equal. The probs come
    from the recomputed micro-batch's own logits, so routes taken from another micro-batch match none.
    """
    for layer, calls in sorted(got.recompute.items()):
        if not t.check(
            len(calls) == microbatches,
            f"{prefix}layer {layer}: {len(calls)} recompute routing call(s), expected {microbatches}",
        ):
            continue
        unmatched = set(range(microbatches))
        for i, (map_TE, probs_TE) in enumerate(calls):
            match = next(
                (
                    mb
                    for mb in sorted(unmatched)
                    if (layer, mb) in got.routing
                    and map_TE.shape == got.routing[(layer, mb)][0].shape
                    and torch.equal(map_TE, got.routing[(layer, mb)][0])
                    and bitwise_equal(probs_TE, got.routing[(layer, mb)][1])
                ),
                None,
            )
            if t.check(
                match is not None,
                f"{prefix}layer {layer}: recompute call {i} (in backward order) equals no "
                "forward micro-batch's routing and probs: it replayed another micro-batch's "
                "routes",
            ):
                unmatched.discard(match)


def check_losses_close(t: Tally, got, ref_seq_loss: dict, *, dp_rank: int, batch: int, prefix: str) -> None:
    """Per-sequence CE sums of this DP rank vs the reference's same sequences, within the fp32 tolerance."""
    for mb, sums_B in sorted(got.seq_loss.items()):
        ref_B = ref_seq_loss[mb][dp_rank * batch : (dp_rank + 1) * batch]
        for b in range(sums_B.numel()):
            x, y = float(ref_B[b]), float(sums_B[b])
            t.check(
                close_within(x, y, rtol=CROSS_LAYOUT_RTOL, atol=CROSS_LAYOUT_ATOL),
                f"{prefix}mb {mb} sequence {dp_rank * batch + b}: loss {y!r} vs 1-rank reference {x!r} "
                f"(|diff| {abs(x - y):.3e} > atol {CROSS_LAYOUT_ATOL} + rtol {CROSS_LAYOUT_RTOL} * |ref|)",
            )


def layer_agreement(a: Routes, b: Routes) -> dict[int, float]:
    """Per-layer agreement of two route sets over all micro-batches they share."""
    out = {}
    for layer in sorted(set(a.layers) & set(b.layers)):
        values = [agreement(a.get(layer, mb), b.get(layer, mb)) for mb in range(min(a.microbatches, b.microbatches))]
        out[layer] = sum(values) / len(values) if values else 1.0
    return out


def reference_token_counts(calls: dict, *, layer: int, num_experts: int) -> torch.Tensor:
    """``[E]`` float32: the experts routed to by ``layer``'s calls, each non-padding token once per expert.

    ``calls``: ``(layer, mb) -> (map_TE, padding_T or None)``, padding True on a padding token (Megatron's
    convention). Counted from the expert ids of the valid tokens (``bincount``), independently of how a router
    masks its map."""
    total_E = torch.zeros(num_experts, dtype=torch.int64)
    for per_call_E in _per_call_counts(calls, layer=layer, num_experts=num_experts):
        total_E += per_call_E
    return total_E.to(torch.float32)


def held_token_counts(calls: dict, *, layer: int, num_experts: int, dtype: torch.dtype) -> torch.Tensor:
    """``[E]`` in ``dtype``: the same counts accumulated the way Megatron-Core 0.19.2 accumulates them into a
    ``dtype`` buffer (``local_tokens_per_expert += counts`` once per router call, in call order): what a
    bf16-cast buffer holds, rounding included (finding F13)."""
    held_E = torch.zeros(num_experts, dtype=dtype)
    for per_call_E in _per_call_counts(calls, layer=layer, num_experts=num_experts):
        held_E += per_call_E
    return held_E


def _per_call_counts(calls: dict, *, layer: int, num_experts: int):
    for (lay, _), (map_TE, padding_T) in sorted(calls.items()):
        if lay != layer:
            continue
        token_N, expert_N = map_TE.nonzero(as_tuple=True)
        if padding_T is not None:
            expert_N = expert_N[~padding_T[token_N]]
        yield torch.bincount(expert_N, minlength=num_experts)


def check_token_counts(t: Tally, *, reference, got, prefix: str) -> list[dict]:
    """Expert-bias counts against the reference's routes (padding left out per token), then the aux-loss inputs
    (tracked aux and z losses, ``global_aux_loss`` token totals) against the reference pass, bit for bit.

    ``reference`` / ``got``: ``token_counts.Observed`` of the native reference pass and the replayed pass. A count
    buffer Megatron holds in another dtype than fp32 (bf16 under ``Float16Module``, finding F13) is compared with the
    counts accumulated the same way in that dtype; the evidence of F13 (per layer: the dtype, how many experts' held
    counts differ from the exact ones) is returned, not failed."""
    evidence: list[dict] = []
    padded = sum(int(p.sum()) for _, p in reference.calls.values() if p is not None)
    if not padded:  # a precondition, not an item: a case without padding fails rather than passes
        t.fail(f"{prefix}no router call received a padding token: the case would prove nothing")
        return evidence
    if not (reference.counts or reference.aux or reference.global_counts):  # a precondition too, failed by name
        t.fail(
            f"{prefix}native routing's pass left nothing to compare (no expert-bias count buffer, no tracked aux or "
            "z-loss, no global_aux_loss totals) on a model token_counts.not_applicable found something on: the "
            "applicability rule and Megatron-Core disagree"
        )
        return evidence
    if set(got.counts) != set(reference.counts):
        t.fail(
            f"{prefix}layers counting tokens per expert {sorted(got.counts)} != the reference's "
            f"{sorted(reference.counts)}"
        )
    for layer, got_E in sorted(got.counts.items()):
        want_E = reference_token_counts(reference.calls, layer=layer, num_experts=got_E.numel())
        if got_E.dtype != want_E.dtype:
            exact_E = want_E
            want_E = held_token_counts(reference.calls, layer=layer, num_experts=got_E.numel(), dtype=got_E.dtype)
            evidence.append(
                {
                    "layer": layer,
                    "dtype": str(got_E.dtype),
                    "max_exact": float(exact_E.max()),
                    "experts_rounded": int((want_E.float() != exact_E).sum()),
                }
            )
        extra = got_E.float() - want_E.float()
        t.check(
            bitwise_equal(got_E, want_E),
            f"{prefix}layer {layer}: local_tokens_per_expert {got_E.tolist()} != {want_E.tolist()} (native "
            f"routing's routed experts of non-padding tokens; {int(extra.clamp(min=0).sum())} count(s) too many, "
            f"{int((-extra).clamp(min=0).sum())} too few): the expert-bias update would follow other counts",
        )
    _fill(t, *compare_maps(reference.aux, got.aux, what="tracked loss (name, layer)"), prefix)
    _fill(
        t,
        *compare_maps(
            {k: v[0] for k, v in reference.global_counts.items()},
            {k: v[0] for k, v in got.global_counts.items()},
            what="global_tokens_per_expert layer",
        ),
        prefix,
    )
    _fill(
        t,
        *compare_maps(
            {k: v[1] for k, v in reference.global_counts.items()},
            {k: v[1] for k, v in got.global_counts.items()},
            what="ga_steps layer",
        ),
        prefix,
    )
    return evidence
