"""Router-replay oracles (docs/design.md, "The checks"; docs/replay_matrix.md, "How the oracles work"): subchecks
``equivalence, drift, recompute, cross_layout, native_parity, backward_order, validation, weights`` for one
implementation under test (``replay_impl``).

Every rank of the scenario's layout runs this; models are driven through Megatron's pipeline
schedule (``drive``), log-prob pass (forward only, record) first, training pass (forward +
backward, replay) second. Per router variant (``variants``):

- equivalence: same weights: the replayed training pass equals a plain native training pass bit for
  bit (routing maps, router probs, logits, losses, every parameter gradient; CPU fp32), and the
  recorded routes are the routes the routers took. Where a plain no-grad pass routes with other
  probabilities than the plain grad-mode pass (megatron-core's top-k slot order, finding ``F12``: reported
  in the notes with its evidence, not a failure) and the replay took the no-grad pass's probabilities,
  the reference is native grad-mode routing in the no-grad slot order (``slot_order``).
- weights: same weights: the replayed training pass routes every (layer, mb) with bitwise the routing
  map and router probs of the recorded (log-prob) pass itself: the right ids with other weights, or in
  another slot order (an ulp at top-k >= 3), fail here. Router weights perturbed (drift's pass): every replayed
  expert's combine weight is the router's scoring function of its moved logits at the replayed ids
  (``moved_weights``: within a few fp32 ulps, any slot order), so weights read from the router's own post-top-k
  probabilities (a replayed expert it no longer picks weighs 0) fail here, named by layer, token count and example.
- drift: router weights perturbed: native routing must change (else the check proves nothing) and
  the replayed pass follows the recorded routes for 100% of tokens; per-layer agreement of native vs
  replayed routes is reported (``notes``).
- recompute: full (uniform) and MoE-only (selective ``["moe"]``) recompute on perturbed weights (each
  mode switched on over the drifted build, as building with it would set it: ``toggles``): gradients
  equal the no-recompute replay bit for bit, every micro-batch is recomputed once with its forward's
  routes, and the implementation reports every route consumed.
- cross_layout: routes recorded by a 1-rank-layout reference (every rank runs it with dp = world,
  on the global micro-batches) are converted to this rank's local view (``moeverify.routing.views``) and
  replayed under the scenario layout: same per-token routing, per-sequence losses within
  ``checks.CROSS_LAYOUT_RTOL/ATOL`` of the reference (why not bitwise: see there).
- native_parity: the implementation's replay vs Megatron-Core's native ``RouterReplay`` replaying the
  same routes with the same weights: identical routing, probs, logits and gradients. Megatron's own
  routing code runs (``pristine``), its ``RouterReplay`` attached to the build under test where the
  implementation builds as Megatron does (``ReplayImpl.constructs_natively``), else on a build of its own.
- backward_order: full recompute on perturbed weights in hand-written loops (all forwards, then
  backward in reverse order, or one backward of the summed losses): every recompute call equals one
  forward micro-batch's routing and probs, and gradients equal the same loop without recompute bit for
  bit. Under pipeline parallelism (no hand loop possible) it runs on a 1-rank build of the model.
- validation: bad routes handed to the implementation (a short table, an expert twice in a row, an id
  out of range, float ids, routes of a model with one more MoE layer) must be refused (an exception)
  before the bad layer routes a token. Runs on a 1-rank build (a refusal on one pipeline stage would
  leave the other waiting).
- token_counts: expert-bias token counts (``local_tokens_per_expert``) and aux-loss inputs (tracked aux and
  z losses, ``global_aux_loss`` token totals) after a replayed training pass, with a padding mask, in router
  calls of T == E and T != E tokens: equal bit for bit to native routing's, padding left out per token
  (``token_counts``; none of these reach the pass's outputs or gradients, so equivalence cannot see them).
  Not applicable (reported so, with the reason) to a model with no expert bias, no aux loss and no z-loss.
"""

from __future__ import annotations

import contextlib
import json
from typing import Any

import torch

from moeverify import runtime
from moeverify.errors import UsageError
from moeverify.models import family_traits
from moeverify.oracles.replay import setup as st
from moeverify.oracles.replay import subchecks as sc
from moeverify.oracles.replay.impls import make_impl
from moeverify.oracles.results import Tally
from moeverify.routing import views
from moeverify.spec.checks import CHECKS, ReplayOptions

SUBCHECKS = CHECKS["replay"].subchecks


def _gather(tallies: dict[str, Tally], *, rank: int, label: str) -> dict[str, Tally]:
    """Rank 0 gets every rank's counts and failures (prefixed with the rank)."""
    mine = {
        name: (t.checked, [f"{label}: {m}" for m in t.failures], t.dropped, t.not_applicable)
        for name, t in tallies.items()
    }
    everyone: list[Any] = [mine]  # every rank's ``mine``, in rank order
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        everyone = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(everyone, mine)
    merged = {}
    for name in tallies:
        t = Tally()
        for per_rank in everyone:
            checked, failures, dropped, not_applicable = per_rank[name]
            if not_applicable is not None and t.not_applicable is None:
                t.not_applicable = not_applicable
            t.checked += checked - len(failures)
            for msg in failures:
                t.fail(msg)
            t.dropped += dropped
        merged[name] = t
    return merged if rank == 0 else tallies


def run(ctx) -> dict[str, Tally]:
    """The replay check on this rank; rank 0's return value holds every rank's results.

    Phase 1 runs every variant's same-layout subchecks under the scenario's model-parallel state
    (the runner's, when it set one); phase 2 makes the 1-rank references (their own, nested parallel
    state) and replays them under the scenario layout, which the nesting restores.
    """
    from megatron.core import parallel_state  # lazy: megatron

    opts = ReplayOptions.from_options(ctx.options, where="replay check options")
    scenario, layout = ctx.scenario, ctx.scenario.layout
    impl = make_impl(opts.impl)
    impl.apply()
    coords = views.rank_coords(layout, rank=ctx.rank, world_size=ctx.world_size)
    outer = parallel_state.model_parallel_is_initialized()
    traits = family_traits(scenario.model)
    skipped = {
        v.name: why for v in opts.variants if (why := v.not_applicable(scenario.family, traits=traits)) is not None
    }
    setups = [st.make_setup(ctx, opts, impl, v, coords) for v in opts.variants if v.name not in skipped]
    if not setups:
        raise UsageError(
            f"no router variant of {[v.name for v in opts.variants]} applies to {scenario.family}: {skipped}"
        )
    tallies = {s.variant.name: {name: Tally() for name in opts.subchecks} for s in setups}
    notes: dict[str, dict] = {s.variant.name: {} for s in setups}
    own: dict[str, object] = {}
    # runtime.parallel() nests: the 1-rank references below enter their own layout and hand the
    # scenario's layout back on exit, for phase 2 and for the checks that run after this one.
    with contextlib.nullcontext() if outer else runtime.parallel(layout, seed=scenario.seed):
        for s in setups:
            own[s.variant.name] = st.guarded(
                s, tallies[s.variant.name], sc.variant_on_layout, s, tallies[s.variant.name], notes[s.variant.name]
            )
        if "cross_layout" in opts.subchecks:
            refs = {s.variant.name: st.guarded(s, tallies[s.variant.name], sc.reference, s) for s in setups}
            for s in setups:
                name = s.variant.name
                if refs[name] is not None:
                    st.guarded(
                        s,
                        tallies[name],
                        sc.cross_layout,
                        s,
                        tallies[name]["cross_layout"],
                        refs[name],
                        own[name],
                        notes[name],
                    )
    for s in setups:
        notes[s.variant.name]["builds"] = dict(s.builds)
        notes[s.variant.name]["weight_copies"] = {
            lay.name(ctx.world_size): {"bytes": c.nbytes, "on": c.device} for lay, c in s.weights.items()
        }
        notes[s.variant.name]["handed_over"] = s.handed_over
        notes[s.variant.name]["seconds"] = dict(s.seconds)  # each step alone (a step's nested steps apart)
        s.weights.clear()
        s.kept = None
    return _report(ctx, opts, coords, tallies, notes, skipped)


def _report(
    ctx, opts: ReplayOptions, coords: views.RankCoords, tallies: dict, notes: dict, skipped: dict[str, str]
) -> dict[str, Tally]:
    total = {name: Tally() for name in opts.subchecks}
    per_variant: dict[str, dict] = {}
    reasons: dict[str, list[str]] = {}
    for variant, per_check in tallies.items():
        merged = _gather(per_check, rank=ctx.rank, label=coords.label())
        for name, t in merged.items():
            total[name].checked += t.checked - len(t.failures)
            for msg in t.failures:
                total[name].fail(msg)
            total[name].dropped += t.dropped
            if t.not_applicable is not None:
                reasons.setdefault(name, []).append(f"[{variant}] {t.not_applicable}")
        per_variant[variant] = {"subchecks": {n: t.as_dict() for n, t in merged.items()}, "notes": notes[variant]}
    for name, why in reasons.items():  # not applicable to any variant: reported so, with the reasons
        if total[name].checked == 0 and len(why) == len(tallies):
            total[name].skip("; ".join(why))
    if ctx.rank == 0 and opts.notes_path:
        with open(opts.notes_path, "w") as f:
            json.dump(
                {"scenario": ctx.scenario.name, "impl": opts.impl, "variants": per_variant, "not_applicable": skipped},
                f,
                indent=1,
            )
    return total
