"""Router-replay oracles (DESIGN.md "Router replay: contract"): subchecks ``equivalence, drift,
recompute, cross_layout, native_parity`` for one implementation under test (``replay_impl``).

Every rank of the scenario's layout runs this; models are driven through Megatron's pipeline
schedule (``replay_drive``), log-prob pass (forward only, record) first, training pass (forward +
backward, replay) second. Per router variant (``replay_variants``):

- equivalence: same weights: the replayed training pass equals a plain native training pass bit for
  bit (routing maps, router probs, logits, losses, every parameter gradient; CPU fp32), and the
  recorded routes are the routes the routers took.
- drift: router weights perturbed: native routing must change (else the check proves nothing) and
  the replayed pass follows the recorded routes for 100% of tokens; per-layer agreement of native vs
  replayed routes is reported (``notes``).
- recompute: full (uniform) and MoE-only (selective ``["moe"]``) recompute on perturbed weights:
  gradients equal the no-recompute replay bit for bit, every micro-batch is recomputed once with
  its forward's routes, and the implementation reports every route consumed.
- cross_layout: routes recorded by a 1-rank-layout reference (every rank runs it with dp = world,
  on the global micro-batches) are converted to this rank's local view (``moeverify.views``) and
  replayed under the scenario layout: same per-token routing, per-sequence losses within
  ``replay_checks.CROSS_LAYOUT_RTOL/ATOL`` of the reference (why not bitwise: see there).
- native_parity: the implementation's replay vs Megatron-Core's native ``RouterReplay`` replaying the
  same routes on a second build of the same weights: identical routing, probs, logits and gradients.
- backward_order: full recompute on perturbed weights in hand-written loops (all forwards, then
  backward in reverse order, or one backward of the summed losses): every recompute call equals one
  forward micro-batch's routing and probs, and gradients equal the same loop without recompute bit for
  bit. Under pipeline parallelism (no hand loop possible) it runs on a 1-rank build of the model.
- validation: bad routes handed to the implementation (a short table, an expert twice in a row, an id
  out of range, float ids, routes of a model with one more MoE layer) must be refused (an exception)
  before the bad layer routes a token. Runs on a 1-rank build (a refusal on one pipeline stage would
  leave the other waiting).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json

import torch

from moeverify import runtime, views
from moeverify.errors import UsageError
from moeverify.layout import Layout
from moeverify.oracles import replay_checks as rc
from moeverify.oracles import replay_drive as rd
from moeverify.oracles.replay_impls import NativeReplay, ReplayImpl, find_routers, make_impl, pristine
from moeverify.oracles.replay_variants import RouterVariant, select
from moeverify.oracles.results import Tally
from moeverify.options import RECOMPUTE_MODES as _RECOMPUTE_NAMES
from moeverify.options import REPLAY_SUBCHECKS
from moeverify.routes import Routes

SUBCHECKS = REPLAY_SUBCHECKS  # declared in moeverify.options (validated there without torch)
RECOMPUTE_MODES = {
    "full": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    "moe": dict(recompute_granularity="selective", recompute_modules=["moe"]),
}
assert tuple(RECOMPUTE_MODES) == _RECOMPUTE_NAMES, "moeverify.options.RECOMPUTE_MODES is out of date"
# fp32, no dropout: bit-for-bit comparisons need deterministic, full-precision passes
_EXACT = dict(bf16=False, fp16=False, params_dtype=torch.float32, pipeline_dtype=torch.float32,
              hidden_dropout=0.0, attention_dropout=0.0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReplayOptions:
    impl: str = "moeverify"
    variants: tuple[RouterVariant, ...] = ()
    subchecks: tuple[str, ...] = SUBCHECKS
    recompute: tuple[str, ...] = tuple(RECOMPUTE_MODES)
    seq_len: int = 16
    batch: int = 2
    microbatches: int | None = None  # default: 3, or 2 * pp under interleaving (the schedule needs M % pp == 0)
    notes_path: str | None = None  # rank 0 writes per-variant notes (drift agreement) here as JSON

    @classmethod
    def from_options(cls, options: dict) -> ReplayOptions:
        subchecks = tuple(options.get("replay_subchecks") or SUBCHECKS)
        recompute = tuple(options.get("replay_recompute") or RECOMPUTE_MODES)
        bad = [s for s in subchecks if s not in SUBCHECKS] + [m for m in recompute if m not in RECOMPUTE_MODES]
        if bad:
            raise UsageError(f"unknown replay subcheck or recompute mode {bad}; subchecks: {', '.join(SUBCHECKS)}; "
                             f"recompute modes: {', '.join(RECOMPUTE_MODES)}")
        return cls(impl=str(options.get("replay_impl") or "moeverify"),
                   variants=select(options.get("router_variants")), subchecks=subchecks, recompute=recompute,
                   seq_len=int(options.get("replay_seq_len", 16)), batch=int(options.get("replay_batch", 2)),
                   microbatches=options.get("replay_microbatches"), notes_path=options.get("replay_notes_path"))

    def num_microbatches(self, layout: Layout) -> int:
        if self.microbatches:
            return int(self.microbatches)
        return 2 * layout.pp if layout.vpp_chunks > 1 else 3


@dataclasses.dataclass(kw_only=True)
class _Setup:
    """What every subcheck of one variant shares on this rank."""

    ctx: object
    opts: ReplayOptions
    impl: ReplayImpl
    variant: RouterVariant
    layout: Layout
    coords: views.RankCoords
    batches: rd.Batches
    items: list

    @property
    def prefix(self) -> str:
        return f"[{self.variant.name}] "


def _build(setup: _Setup, layout: Layout, *, overrides: dict, extra: dict | None = None) -> list:
    from moeverify import models

    scenario = setup.ctx.scenario
    built = models.build(scenario.family, layout, seed=scenario.seed,
                         overrides={**_EXACT, **setup.variant.overrides, **overrides, **(extra or {})})
    if setup.variant.random_expert_bias:
        _seed_expert_bias(built.model_chunks, seed=scenario.seed)
    return built.model_chunks


def _seed_expert_bias(chunks: list, *, seed: int) -> None:
    """Seeded non-zero expert biases (a fresh model's are zeros, which would not steer routing)."""
    for layer, (_, router) in find_routers(chunks).items():
        if router.expert_bias is not None:
            gen = torch.Generator().manual_seed(7919 * (seed + 1) + layer)
            with torch.no_grad():
                router.expert_bias.copy_(0.1 * torch.randn(router.expert_bias.shape, generator=gen))


def _perturb_routers(chunks: list, *, seed: int) -> None:
    """Add seeded noise of the weights' own scale to every router weight (identical on every rank)."""
    for layer, (_, router) in find_routers(chunks).items():
        gen = torch.Generator().manual_seed(104_729 * (seed + 1) + layer)
        with torch.no_grad():
            w = router.weight
            w.add_(w.detach().float().std() * torch.randn(w.shape, generator=gen).to(w.device, w.dtype))


def _reference(setup: _Setup) -> tuple[object, dict]:
    """cross_layout reference: global routes and per-sequence losses of a 1-rank layout (dp = world).

    Every rank runs the same global micro-batches (``dp_scenario * B`` sequences) on an unsplit model;
    data parallelism has no forward collectives, so the result is a world-1 run made in each worker.
    """
    one = Layout()
    scn_dp = setup.layout.dp(setup.ctx.world_size)
    glob = dataclasses.replace(setup.batches, batch=setup.batches.batch * scn_dp, dp=1)
    items = rd.local_microbatches(glob, one, dp_rank=0, cp_rank=0)
    with runtime.parallel(one, seed=setup.ctx.scenario.seed):
        chunks = _build(setup, one, overrides=setup.impl.overrides())
        setup.impl.bind(chunks)
        logprob = rd.record_pass(chunks, items, seq_len=glob.seq_len, impl=setup.impl)
        plain = rd.run_pass(chunks, items, seq_len=glob.seq_len, forward_only=True)
        shape = _num_layers(chunks)
        global_routes = views.to_global({views.rank_coords(one, rank=0, world_size=1): logprob.routes}, one,
                                        world_size=1, seq_len=glob.seq_len, batch=glob.batch, num_layers=shape,
                                        moe_layers=logprob.routes.layers)
    return global_routes, plain.seq_loss


def _num_layers(chunks: list) -> int:
    return int(chunks[0].config.num_layers)


def _variant_on_layout(setup: _Setup, tallies: dict[str, Tally], notes: dict):
    """equivalence, native_parity, drift, recompute of one variant (scenario's model-parallel state set).

    Returns the routes recorded under the scenario layout (cross_layout compares them to the reference).
    """
    opts, impl, p, seq = setup.opts, setup.impl, setup.prefix, setup.batches.seq_len
    want = set(opts.subchecks)
    chunks = _build(setup, setup.layout, overrides=impl.overrides())
    impl.bind(chunks)
    plain = rd.run_pass(chunks, setup.items, seq_len=seq, forward_only=False)
    logprob = rd.record_pass(chunks, setup.items, seq_len=seq, impl=impl)
    routes = logprob.routes
    replayed = rd.replay_pass(chunks, setup.items, seq_len=seq, impl=impl, routes=routes)
    if "equivalence" in want:
        t = tallies["equivalence"]
        rc.check_recorded(t, routes, plain, prefix=p + "recorded vs plain pass: ")
        rc.compare_passes(t, plain, replayed, prefix=p + "replay vs plain pass: ")
        for msg in impl.check_consumed(recompute=False):
            t.fail(p + msg)
    if "native_parity" in want:
        _guarded(setup, {"native_parity": tallies["native_parity"]}, _native_parity, setup,
                 tallies["native_parity"], routes, replayed)
    dependent = {name: tallies[name] for name in ("drift", "recompute") if name in want}
    if dependent:
        _guarded(setup, dependent, _drift_and_recompute, setup, tallies, chunks, routes, notes)
    for name, fn in (("backward_order", _backward_order), ("validation", _validation)):
        if name in want:
            _guarded(setup, {name: tallies[name]}, fn, setup, tallies[name])
    return routes


@contextlib.contextmanager
def _hand_loop_layout(setup: _Setup):
    """The layout hand-written loops run under: the scenario's without PP/VPP, else a nested 1-rank one."""
    if setup.layout.pp == 1 and setup.layout.vpp_chunks == 1:
        yield setup.layout, setup.items
        return
    one = Layout()
    glob = dataclasses.replace(setup.batches, dp=1)
    with runtime.parallel(one, seed=setup.ctx.scenario.seed):
        yield one, rd.local_microbatches(glob, one, dp_rank=0, cp_rank=0)


def _backward_order(setup: _Setup, t: Tally) -> None:
    if setup.impl.recompute_unsupported:
        t.fail(f"{setup.prefix}{setup.impl.name} cannot replay in recompute: {setup.impl.recompute_unsupported}")
        return
    seq, impl = setup.batches.seq_len, setup.impl
    with _hand_loop_layout(setup) as (layout, items):
        chunks = _build(setup, layout, overrides=impl.overrides())
        impl.bind(chunks)
        routes = rd.record_pass(chunks, items, seq_len=seq, impl=impl).routes
        _perturb_routers(chunks, seed=setup.ctx.scenario.seed)
        for order in rd.BACKWARD_ORDERS:
            p = f"{setup.prefix}backward={order}: "
            _set_full_recompute(chunks, False)
            plain = rd.loop_pass(chunks, items, seq_len=seq, impl=impl, routes=routes, order=order)
            _set_full_recompute(chunks, True)
            try:
                got = rd.loop_pass(chunks, items, seq_len=seq, impl=impl, routes=routes, order=order)
            finally:
                _set_full_recompute(chunks, False)
            rc.check_recompute_identity(t, got, microbatches=len(items), prefix=p)
            rc.compare_passes(t, plain, got, prefix=p + "vs the same loop without recompute: ")


def _set_full_recompute(chunks: list, on: bool) -> None:
    """Switch full recompute (read by the decoder at every forward) on or off for a built model."""
    configs = {id(m.config): m.config for chunk in chunks for m in chunk.modules()
               if hasattr(getattr(m, "config", None), "recompute_granularity")}
    for config in configs.values():
        for key, value in RECOMPUTE_MODES["full"].items():
            setattr(config, key, value if on else None)


def _bad_routes(routes, layer: int, microbatch: int) -> dict[str, object]:
    """Named corruptions of ``routes`` in ``layer``'s ``microbatch`` (built without validation)."""
    good_TK = routes.get(layer, microbatch).to(torch.int64)
    E, K = routes.num_experts, routes.topk

    def swap(tensor):
        data = {lay: [routes.get(lay, mb) for mb in range(routes.microbatches)] for lay in routes.layers}
        data[layer][microbatch] = tensor
        return Routes.unchecked(data, num_experts=E, topk=K)

    dup_TK, out_TK = good_TK.clone(), good_TK.clone()
    dup_TK[0, 1:] = dup_TK[0, 0]
    out_TK[0, 0] = E
    extra = {lay: [routes.get(lay, mb) for mb in range(routes.microbatches)] for lay in routes.layers}
    extra[max(routes.layers) + 1] = [routes.get(layer, mb) for mb in range(routes.microbatches)]
    bad = {"short table": swap(good_TK[:-1]), "float ids": swap(good_TK.float()),
           "id out of range": swap(out_TK), "another model's layer count": Routes.unchecked(extra, num_experts=E,
                                                                                             topk=K)}
    if K > 1:
        bad["expert twice in a row"] = swap(dup_TK)
    return bad


def _validation(setup: _Setup, t: Tally) -> None:
    impl, one = setup.impl, Layout()
    glob = dataclasses.replace(setup.batches, dp=1)
    with runtime.parallel(one, seed=setup.ctx.scenario.seed):
        items = rd.local_microbatches(glob, one, dp_rank=0, cp_rank=0)
        chunks = _build(setup, one, overrides=impl.overrides())
        impl.bind(chunks)
        routes = rd.record_pass(chunks, items, seq_len=glob.seq_len, impl=impl).routes
        layer = routes.layers[0]
        for case, bad in _bad_routes(routes, layer, 0).items():
            # Control first, on a model a failed forward has not left half-way (dispatchers keep state):
            # the valid routes must route the layer, else a refusal below would prove nothing.
            routed, error = _one_forward(chunks, items[0], impl=impl, routes=routes)
            if error is not None:
                chunks = _build(setup, one, overrides=impl.overrides())
                impl.bind(chunks)
                routed, error = _one_forward(chunks, items[0], impl=impl, routes=routes)
            if not t.check(error is None and (layer, 0) in routed,
                           f"{setup.prefix}validation: the control forward with valid routes failed ({error})"):
                return
            routed, error = _one_forward(chunks, items[0], impl=impl, routes=bad)
            t.check(error is not None and (layer, 0) not in routed,
                    f"{setup.prefix}validation: {impl.name} accepted routes with {case} (layer {layer} mb 0) and "
                    f"routed tokens with them (then: {error or 'no error'}); expected a refusal before routing")


def _one_forward(chunks: list, item, *, impl: ReplayImpl, routes) -> tuple[set, str | None]:
    """One forward of ``item`` under ``impl.replay(routes)``: the (layer, mb) the routers completed, and the
    error it ended with (None when it finished)."""
    probe = rd.RouterProbe(chunks)
    try:
        with torch.no_grad(), impl.replay(routes), probe:
            rd.forward_one(chunks[0], 0, item, impl=impl, probe=probe)
    except Exception as exc:  # noqa: BLE001 - any refusal counts; what matters is whether the layer routed
        return set(probe.forward), f"{type(exc).__name__}: {str(exc)[:160]}"
    return set(probe.forward), None


def _drift_and_recompute(setup: _Setup, tallies: dict[str, Tally], chunks: list, routes, notes: dict) -> None:
    """Perturb the router weights of ``chunks``; drift on them, then recompute on fresh perturbed builds."""
    p, seq, impl = setup.prefix, setup.batches.seq_len, setup.impl
    _perturb_routers(chunks, seed=setup.ctx.scenario.seed)
    native = rd.run_pass(chunks, setup.items, seq_len=seq, forward_only=False)
    drifted = rd.replay_pass(chunks, setup.items, seq_len=seq, impl=impl, routes=routes)
    if "drift" in tallies:
        t = tallies["drift"]
        counts = rc.drift_agreement(routes, native)
        rc.check_drift_moved(t, counts, prefix=p)
        rc.check_follows(t, routes, drifted, prefix=p, what="recorded")
        notes.setdefault("drift_agreement", {}).update({str(k): v for k, v in counts.items()})
    if "recompute" in tallies:
        _guarded(setup, {"recompute": tallies["recompute"]}, _recompute, setup, tallies["recompute"], routes,
                 drifted)


def _native_parity(setup: _Setup, t: Tally, routes, replayed) -> None:
    native_impl = NativeReplay()
    with pristine():
        chunks = _build(setup, setup.layout, overrides=native_impl.overrides())
        native_impl.bind(chunks)
        native = rd.replay_pass(chunks, setup.items, seq_len=setup.batches.seq_len, impl=native_impl, routes=routes)
    rc.compare_passes(t, native, replayed, prefix=setup.prefix + "vs native RouterReplay: ")


def _cross_layout(setup: _Setup, t: Tally, reference, own_routes, notes: dict) -> None:
    global_routes, ref_seq_loss = reference
    b = setup.batches
    chunks = _build(setup, setup.layout, overrides=setup.impl.overrides())
    setup.impl.bind(chunks)
    local = views.to_local(global_routes, setup.layout, coords=setup.coords, seq_len=b.seq_len, batch=b.batch,
                           num_layers=_num_layers(chunks))
    got = rd.replay_pass(chunks, setup.items, seq_len=b.seq_len, impl=setup.impl, routes=local)
    rc.check_follows(t, local, got, prefix=setup.prefix, what="1-rank reference")
    rc.check_losses_close(t, got, ref_seq_loss, dp_rank=setup.coords.dp, batch=b.batch, prefix=setup.prefix)
    if own_routes is not None:
        notes["native_vs_reference_agreement"] = {str(k): v for k, v in rc.layer_agreement(local, own_routes).items()}


def _recompute(setup: _Setup, t: Tally, routes, drifted) -> None:
    if setup.impl.recompute_unsupported:
        t.fail(f"{setup.prefix}{setup.impl.name} cannot replay in recompute: {setup.impl.recompute_unsupported}")
        return
    for mode in setup.opts.recompute:
        p = f"{setup.prefix}recompute={mode}: "
        chunks = _build(setup, setup.layout, overrides=setup.impl.overrides(), extra=RECOMPUTE_MODES[mode])
        _perturb_routers(chunks, seed=setup.ctx.scenario.seed)
        setup.impl.bind(chunks)
        got = rd.replay_pass(chunks, setup.items, seq_len=setup.batches.seq_len, impl=setup.impl, routes=routes)
        # root causes (routes of the recompute calls) first, their consequences (gradients) after
        rc.check_recompute_calls(t, got, microbatches=routes.microbatches, prefix=p)
        for msg in setup.impl.check_consumed(recompute=True):
            t.fail(p + msg)
        rc.compare_passes(t, drifted, got, prefix=p + "vs no-recompute replay: ")


def _gather(tallies: dict[str, Tally], *, rank: int, label: str) -> dict[str, Tally]:
    """Rank 0 gets every rank's counts and failures (prefixed with the rank)."""
    mine = {name: (t.checked, [f"{label}: {m}" for m in t.failures], t.dropped) for name, t in tallies.items()}
    if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
        everyone = [mine]
    else:
        everyone = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(everyone, mine)
    merged = {}
    for name in tallies:
        t = Tally()
        for per_rank in everyone:
            checked, failures, dropped = per_rank[name]
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
    from megatron.core import parallel_state

    opts = ReplayOptions.from_options(ctx.options)
    scenario, layout = ctx.scenario, ctx.scenario.layout
    impl = make_impl(opts.impl)
    impl.apply()
    coords = views.rank_coords(layout, rank=ctx.rank, world_size=ctx.world_size)
    outer = parallel_state.model_parallel_is_initialized()
    skipped = {v.name: v.not_applicable(scenario.family) for v in opts.variants if v.not_applicable(scenario.family)}
    setups = [_setup(ctx, opts, impl, v, coords) for v in opts.variants if v.name not in skipped]
    if not setups:
        raise UsageError(f"no router variant of {[v.name for v in opts.variants]} applies to {scenario.family}: "
                         f"{skipped}")
    tallies = {s.variant.name: {name: Tally() for name in opts.subchecks} for s in setups}
    notes: dict[str, dict] = {s.variant.name: {} for s in setups}
    own: dict[str, object] = {}
    # runtime.parallel() nests: the 1-rank references below enter their own layout and hand the
    # scenario's layout back on exit, for phase 2 and for the checks that run after this one.
    with contextlib.nullcontext() if outer else runtime.parallel(layout, seed=scenario.seed):
        for s in setups:
            own[s.variant.name] = _guarded(s, tallies[s.variant.name], _variant_on_layout, s,
                                           tallies[s.variant.name], notes[s.variant.name])
        if "cross_layout" in opts.subchecks:
            refs = {s.variant.name: _guarded(s, tallies[s.variant.name], _reference, s) for s in setups}
            for s in setups:
                name = s.variant.name
                if refs[name] is not None:
                    _guarded(s, tallies[name], _cross_layout, s, tallies[name]["cross_layout"], refs[name],
                             own[name], notes[name])
    return _report(ctx, opts, coords, tallies, notes, skipped)


def _setup(ctx, opts: ReplayOptions, impl: ReplayImpl, variant: RouterVariant, coords: views.RankCoords) -> _Setup:
    scenario, layout = ctx.scenario, ctx.scenario.layout
    batches = rd.Batches(seq_len=opts.seq_len, batch=opts.batch, microbatches=opts.num_microbatches(layout),
                         dp=layout.dp(ctx.world_size), vocab_size=_vocab_size(scenario.family), seed=scenario.seed,
                         padding=variant.padding)
    items = rd.local_microbatches(batches, layout, dp_rank=coords.dp, cp_rank=coords.cp)
    return _Setup(ctx=ctx, opts=opts, impl=impl, variant=variant, layout=layout, coords=coords,
                  batches=batches, items=items)


def _guarded(setup: _Setup, tallies: dict[str, Tally], fn, *args):
    """``fn(*args)``; an exception fails the subchecks in ``tallies`` (those that depend on it) instead.

    An implementation that refuses or crashes on a variant fails that variant (verl raises
    ValueError on sqrtsoftplus, for example). Routing config is identical on every rank, so such
    errors are raised symmetrically; a one-rank error ends in the collective timeout.
    """
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001
        for t in tallies.values():
            t.fail(f"{setup.prefix}{type(e).__name__}: {str(e)[:500]}")
        return None


def _report(ctx, opts: ReplayOptions, coords: views.RankCoords, tallies: dict, notes: dict,
            skipped: dict[str, str]) -> dict[str, Tally]:
    total = {name: Tally() for name in opts.subchecks}
    per_variant = {}
    for variant, per_check in tallies.items():
        merged = _gather(per_check, rank=ctx.rank, label=coords.label())
        for name, t in merged.items():
            total[name].checked += t.checked - len(t.failures)
            for msg in t.failures:
                total[name].fail(msg)
            total[name].dropped += t.dropped
        per_variant[variant] = {"subchecks": {n: t.as_dict() for n, t in merged.items()}, "notes": notes[variant]}
    if ctx.rank == 0 and opts.notes_path:
        with open(opts.notes_path, "w") as f:
            json.dump({"scenario": ctx.scenario.name, "impl": opts.impl, "variants": per_variant,
                       "not_applicable": skipped}, f, indent=1)
    return total


def _vocab_size(family: str) -> int:
    from moeverify.models import hf_config_dict

    return int(hf_config_dict(family)["vocab_size"])
