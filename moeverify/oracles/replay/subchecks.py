"""The replay subchecks of one router variant (what each proves: ``oracle``'s docstring).

``variant_on_layout`` runs weights, equivalence, native_parity, drift, recompute, backward_order,
validation and token_counts under the scenario layout; ``reference`` and ``cross_layout`` make the 1-rank reference
routes and replay them under the scenario layout. Every function fills the tallies it is given.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import TYPE_CHECKING

import torch

from moeverify import runtime
from moeverify.oracles.replay import drive as rd
from moeverify.oracles.replay import moved_weights, mtp_views, slot_order, toggles, token_counts
from moeverify.oracles.replay import pass_checks as rc
from moeverify.oracles.replay import setup as st
from moeverify.oracles.replay.impls import NativeReplay, ReplayImpl, pristine
from moeverify.oracles.results import Tally
from moeverify.patches.semantics import RoutingMode
from moeverify.routing import views
from moeverify.routing.routes import Routes
from moeverify.spec.checks import REPLAY_WHOLE_MODEL
from moeverify.spec.layout import Layout

if TYPE_CHECKING:  # megatron ships no types: Any to mypy, named for the reader
    from megatron.core.transformer.moe.router import TopKRouter


def reference(setup: st.Setup) -> tuple[Routes, dict[int, torch.Tensor]]:
    """cross_layout reference: global routes and per-sequence losses of a 1-rank layout (dp = world).

    Every rank runs the same global micro-batches (``dp_scenario * B`` sequences) on an unsplit model;
    data parallelism has no forward collectives, so the result is a world-1 run made in each worker.
    """
    one = Layout()
    scn_dp = setup.layout.dp(setup.ctx.world_size)
    glob = dataclasses.replace(setup.batches, batch=setup.batches.batch * scn_dp, dp=1)
    items = rd.local_microbatches(glob, one, dp_rank=0, cp_rank=0)
    with runtime.parallel(one, seed=setup.ctx.scenario.seed):
        chunks = st.build(setup, one, overrides=setup.impl.overrides())
        setup.impl.bind(chunks)
        logprob = rd.record_pass(chunks, items, seq_len=glob.seq_len, impl=setup.impl)
        plain = rd.run_pass(chunks, items, seq_len=glob.seq_len, forward_only=True)
        shape = mtp_views.router_layers(chunks)  # one stage holds every layer, MTP's too
        global_routes = Routes.to_global(
            {views.rank_coords(one, rank=0, world_size=1): logprob.routes},
            one,
            world_size=1,
            seq_len=glob.seq_len,
            batch=glob.batch,
            num_layers=shape,
            moe_layers=logprob.routes.layers,
        )
    return global_routes, plain.seq_loss


def variant_on_layout(setup: st.Setup, tallies: dict[str, Tally], notes: dict):
    """equivalence, native_parity, drift, recompute of one variant (scenario's model-parallel state set).

    One build serves them all where it can: native_parity attaches Megatron's ``RouterReplay`` to it (an
    implementation that builds as Megatron does), recompute switches each mode on over the drifted weights
    (``toggles``); a weight copy is kept only for the builds still to come. Returns the routes recorded under the
    scenario layout (cross_layout compares them to the reference).
    """
    opts, impl, p, seq = setup.opts, setup.impl, setup.prefix, setup.batches.seq_len
    want = set(opts.subchecks)
    native_here = impl.builds_natively()
    # later builds: the whole-model subchecks', and native parity's own where it cannot attach to this one
    setup.keep_copies = bool(want & set(REPLAY_WHOLE_MODEL)) or ("native_parity" in want and not native_here)
    chunks = st.build(setup, setup.layout, overrides=impl.overrides())
    impl.bind(chunks)
    plain = rd.run_pass(chunks, setup.items, seq_len=seq, forward_only=False)
    logprob = rd.record_pass(chunks, setup.items, seq_len=seq, impl=impl)
    routes = logprob.routes
    replayed = rd.replay_pass(chunks, setup.items, seq_len=seq, impl=impl, routes=routes)
    if "weights" in want:  # the training pass takes the log-prob pass's routing weights, slot order included
        rc.compare_passes(
            tallies["weights"], logprob, replayed, prefix=p + "replay vs recorded pass: ", grads=False, logits=False
        )
    if "equivalence" in want:
        t = tallies["equivalence"]
        rc.check_recorded(t, routes, plain, prefix=p + "recorded vs plain pass: ")
        expected = _equivalence_reference(setup, chunks, plain, replayed, notes)
        rc.compare_passes(t, expected, replayed, prefix=p + "replay vs plain pass: ")
        for msg in impl.check_consumed(recompute=False):
            t.fail(p + msg)
    del plain, logprob
    if "native_parity" in want and native_here:  # before drift moves the weights
        st.guarded(
            setup,
            {"native_parity": tallies["native_parity"]},
            _native_parity,
            setup,
            tallies["native_parity"],
            routes,
            replayed,
            chunks,
        )
    dependent: dict[str, Tally] = {name: tallies[name] for name in ("drift", "recompute", "weights") if name in want}
    if dependent:
        drifted = st.guarded(setup, dependent, _drift, setup, tallies, chunks, routes, notes)
        if "recompute" in want and drifted is not None:
            st.guarded(
                setup,
                {"recompute": tallies["recompute"]},
                _recompute,
                setup,
                tallies["recompute"],
                chunks,
                routes,
                drifted,
            )
        del drifted
    del chunks  # the subchecks below build models of their own: free this one first
    st.release(impl)
    if "native_parity" in want and not native_here:  # one model alive at a time: the native build after this one
        st.guarded(
            setup,
            {"native_parity": tallies["native_parity"]},
            _native_parity,
            setup,
            tallies["native_parity"],
            routes,
            replayed,
            None,
        )
    del replayed
    if "backward_order" in want:
        st.guarded(
            setup,
            {"backward_order": tallies["backward_order"]},
            _backward_order,
            setup,
            tallies["backward_order"],
            notes,
        )
    if "validation" in want:
        st.guarded(setup, {"validation": tallies["validation"]}, _validation, setup, tallies["validation"])
    if "token_counts" in want:
        st.guarded(
            setup, {"token_counts": tallies["token_counts"]}, token_counts.run, setup, tallies["token_counts"], notes
        )
    return routes


def _equivalence_reference(setup: st.Setup, chunks: list, plain, replayed, notes: dict):
    """The plain pass the replay must equal: native grad-mode routing, or, where a plain no-grad pass routes
    with other probabilities (finding ``slot_order.FINDING``, recorded in ``notes``) and the replay took the
    no-grad pass's probabilities, native grad-mode routing in the no-grad slot order."""
    seq = setup.batches.seq_len
    nograd = rd.run_pass(chunks, setup.items, seq_len=seq, forward_only=True)
    evidence = slot_order.evidence(plain, nograd)
    if not evidence:
        return plain
    notes.setdefault("findings", {})[slot_order.FINDING] = {
        "title": slot_order.TITLE,
        "evidence": evidence[:8],
        "pairs": len(evidence),
    }
    if slot_order.same_probs(replayed, plain) or not slot_order.same_probs(replayed, nograd):
        return plain
    reference = slot_order.reference_pass(
        chunks, lambda: rd.run_pass(chunks, setup.items, seq_len=seq, forward_only=False)
    )
    if not slot_order.same_probs(reference, nograd):  # not the reference it claims to be: judge by the plain pass
        notes["equivalence"] = "native routing in the no-grad slot order did not reproduce the no-grad pass"
        return plain
    notes["equivalence"] = (
        f"the replay routes with the no-grad pass's probabilities ({slot_order.FINDING}): "
        "compared with native grad-mode routing in the no-grad slot order"
    )
    return reference


@contextlib.contextmanager
def _hand_loop_layout(setup: st.Setup):
    """The layout hand-written loops run under: the scenario's without PP/VPP, else a nested 1-rank one."""
    if setup.layout.pp == 1 and setup.layout.vpp_chunks == 1:
        yield setup.layout, setup.items
        return
    one = Layout()
    glob = dataclasses.replace(setup.batches, dp=1)
    with runtime.parallel(one, seed=setup.ctx.scenario.seed):
        yield one, rd.local_microbatches(glob, one, dp_rank=0, cp_rank=0)


def _global_aux_loss(chunks: list) -> bool:
    routers: dict[int, tuple[int, TopKRouter]] = st.find_routers(chunks)
    return any(router.get_aux_loss_coeff("global_aux_loss") > 0 for _, router in routers.values())


def _backward_order(setup: st.Setup, t: Tally, notes: dict) -> None:
    """Hand-written loops, full recompute against none. megatron-core 0.19.2's ``global_aux_loss`` (Qwen3-Next,
    Qwen3.5) averages tokens per expert over the forwards run with grad so far in the step; under full recompute
    those are the recomputes, in backward order, so in a loop whose backward order is not its forward order the
    aux loss (and router grads) differ from the loop without recompute by design (README finding F6). Such
    models run this subcheck with the aux loss off: it is about the routes replayed in recompute."""
    if setup.impl.recompute_unsupported:
        t.fail(f"{setup.prefix}{setup.impl.name} cannot replay in recompute: {setup.impl.recompute_unsupported}")
        return
    seq, impl = setup.batches.seq_len, setup.impl
    with _hand_loop_layout(setup) as (layout, items):
        chunks = st.build(setup, layout, overrides=impl.overrides())
        if _global_aux_loss(chunks):
            del chunks  # one model alive at a time
            chunks = st.build(setup, layout, overrides=impl.overrides(), extra={"moe_aux_loss_coeff": 0.0})
            notes["backward_order"] = (
                "global_aux_loss off: its tracker counts recompute forwards in backward order (finding F6)"
            )
        impl.bind(chunks)
        routes = rd.record_pass(chunks, items, seq_len=seq, impl=impl).routes
        st.perturb_routers(chunks, seed=setup.ctx.scenario.seed)
        for order in rd.BACKWARD_ORDERS:
            p = f"{setup.prefix}backward={order}: "
            plain = rd.loop_pass(chunks, items, seq_len=seq, impl=impl, routes=routes, order=order)
            with toggles.recompute(chunks, "full"):
                got = rd.loop_pass(chunks, items, seq_len=seq, impl=impl, routes=routes, order=order)
            rc.check_recompute_identity(t, got, microbatches=len(items), prefix=p)
            rc.compare_passes(t, plain, got, prefix=p + "vs the same loop without recompute: ")


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
    bad = {
        "short table": swap(good_TK[:-1]),
        "float ids": swap(good_TK.float()),
        "id out of range": swap(out_TK),
        "another model's layer count": Routes.unchecked(extra, num_experts=E, topk=K),
    }
    if K > 1:
        bad["expert twice in a row"] = swap(dup_TK)
    return bad


def _validation(setup: st.Setup, t: Tally) -> None:
    impl, one = setup.impl, Layout()
    glob = dataclasses.replace(setup.batches, dp=1)
    with runtime.parallel(one, seed=setup.ctx.scenario.seed):
        items = rd.local_microbatches(glob, one, dp_rank=0, cp_rank=0)
        chunks = st.build(setup, one, overrides=impl.overrides())
        impl.bind(chunks)
        # the first micro-batch's routes alone: a control forward uses every route it is given, so the next replay
        # starts clean (a replay left with unused micro-batches is refused by a session, whatever the next routes)
        routes = rd.record_pass(chunks, items, seq_len=glob.seq_len, impl=impl).routes.take([0])
        layer = routes.layers[0]
        for case, bad in _bad_routes(routes, layer, 0).items():
            # Control first, on a model a failed forward has not left half-way (dispatchers keep state):
            # the valid routes must route the layer, else a refusal below would prove nothing.
            routed, error = _one_forward(chunks, items[0], impl=impl, routes=routes)
            if error is not None:
                impl.unbind()
                del chunks  # one model alive at a time
                chunks = st.build(setup, one, overrides=impl.overrides())
                impl.bind(chunks)
                routed, error = _one_forward(chunks, items[0], impl=impl, routes=routes)
            if not t.check(
                error is None and (layer, 0) in routed,
                f"{setup.prefix}validation: the control forward with valid routes failed ({error})",
            ):
                return
            routed, error = _one_forward(chunks, items[0], impl=impl, routes=bad)
            t.check(
                error is not None and (layer, 0) not in routed,
                f"{setup.prefix}validation: {impl.name} accepted routes with {case} (layer {layer} mb 0) and "
                f"routed tokens with them (then: {error or 'no error'}); expected a refusal before routing",
            )


def _one_forward(chunks: list, item, *, impl: ReplayImpl, routes) -> tuple[set, str | None]:
    """One forward of ``item`` under ``impl.replay(routes)``: the (layer, mb) the routers completed, and the
    error it ended with (None when it finished)."""
    probe = rd.RouterProbe(chunks)
    try:
        with torch.no_grad(), impl.replay(routes), probe:
            impl.begin_pass(rd.geometry(chunks, [item], seq_len=item.tokens_BS.shape[1], forward_only=True))
            rd.forward_one(chunks[0], 0, item, impl=impl, probe=probe)
    except Exception as exc:  # noqa: BLE001 - any refusal counts; what matters is whether the layer routed
        return set(probe.forward), f"{type(exc).__name__}: {str(exc)[:160]}"
    return set(probe.forward), None


def _drift(setup: st.Setup, tallies: dict[str, Tally], chunks: list, routes, notes: dict):
    """Perturb the router weights of ``chunks`` and replay on them: drift, and the weights the moved router gives
    the replayed experts (``moved_weights``); returns that pass, the reference of the recompute subcheck."""
    p, seq, impl = setup.prefix, setup.batches.seq_len, setup.impl
    st.perturb_routers(chunks, seed=setup.ctx.scenario.seed)
    # where native routing now sends each token (expert sets only): a forward, no backward to fingerprint
    native = rd.run_pass(chunks, setup.items, seq_len=seq, forward_only=True)
    weights = "weights" in tallies
    drifted = rd.replay_pass(chunks, setup.items, seq_len=seq, impl=impl, routes=routes, router_logits=weights)
    counts = rc.drift_agreement(routes, native)
    if weights:  # the routes must have moved off native somewhere, else every weight is native top-k's anyway
        t = tallies["weights"]
        rc.check_drift_moved(t, counts, prefix=p + "router moved: ", stage_layers=setup.stage_moe_layers())
        modes = {layer: RoutingMode.from_router(router) for layer, (_, router) in st.find_routers(chunks).items()}
        moved_weights.check(t, routes, drifted, modes=modes, prefix=p + "router moved: ")
        drifted.router_logits = {}
    if "drift" in tallies:
        t = tallies["drift"]
        rc.check_drift_moved(t, counts, prefix=p, stage_layers=setup.stage_moe_layers())
        rc.check_follows(t, routes, drifted, prefix=p, what="recorded", stage_layers=setup.stage_moe_layers())
        notes.setdefault("drift_agreement", {}).update({str(k): v for k, v in counts.items()})
    return drifted


def _native_parity(setup: st.Setup, t: Tally, routes, replayed, chunks: list | None) -> None:
    """Megatron-Core's native ``RouterReplay`` replays ``routes``: attached to ``chunks`` (the build under test,
    its weights as the replayed pass had them), or on a build of its own when ``chunks`` is None."""
    native_impl = NativeReplay()
    with pristine():
        if chunks is None:
            own = st.build(setup, setup.layout, overrides=native_impl.overrides())
            native_impl.bind(own)
            native = rd.replay_pass(own, setup.items, seq_len=setup.batches.seq_len, impl=native_impl, routes=routes)
            del own
            st.release(native_impl)
        else:
            with toggles.native_replay(chunks):
                native_impl.bind(chunks)
                native = rd.replay_pass(
                    chunks, setup.items, seq_len=setup.batches.seq_len, impl=native_impl, routes=routes
                )
                native_impl.unbind()
    rc.compare_passes(t, native, replayed, prefix=setup.prefix + "vs native RouterReplay: ")


def cross_layout(setup: st.Setup, t: Tally, reference, own_routes, notes: dict) -> None:
    global_routes, ref_seq_loss = reference
    b = setup.batches
    chunks = st.build(setup, setup.layout, overrides=setup.impl.overrides())
    setup.impl.bind(chunks)
    mtp_views.check_placement(
        chunks, setup.layout, coords=setup.coords, num_layers=st.num_layers(chunks), routers=st.find_routers(chunks)
    )
    local = mtp_views.to_local(
        global_routes,
        setup.layout,
        coords=setup.coords,
        seq_len=b.seq_len,
        batch=b.batch,
        num_layers=st.num_layers(chunks),
    )
    got = rd.replay_pass(chunks, setup.items, seq_len=b.seq_len, impl=setup.impl, routes=local)
    rc.check_follows(t, local, got, prefix=setup.prefix, what="1-rank reference", stage_layers=setup.stage_moe_layers())
    rc.check_losses_close(t, got, ref_seq_loss, dp_rank=setup.coords.dp, batch=b.batch, prefix=setup.prefix)
    if own_routes is not None:
        notes["native_vs_reference_agreement"] = {str(k): v for k, v in rc.layer_agreement(local, own_routes).items()}


def _recompute(setup: st.Setup, t: Tally, chunks: list, routes, drifted) -> None:
    """Each recompute mode switched on over the drifted build (``toggles.recompute``): the replayed pass equals the
    drifted pass without recompute, and every recompute call replays its forward's routes."""
    if setup.impl.recompute_unsupported:
        t.fail(f"{setup.prefix}{setup.impl.name} cannot replay in recompute: {setup.impl.recompute_unsupported}")
        return
    for mode in setup.opts.recompute:
        p = f"{setup.prefix}recompute={mode}: "
        with toggles.recompute(chunks, mode):
            got = rd.replay_pass(chunks, setup.items, seq_len=setup.batches.seq_len, impl=setup.impl, routes=routes)
        # root causes (routes of the recompute calls) first, their consequences (gradients) after
        rc.check_recompute_calls(t, got, microbatches=routes.microbatches, prefix=p)
        for msg in setup.impl.check_consumed(recompute=True):
            t.fail(p + msg)
        rc.compare_passes(t, drifted, got, prefix=p + "vs no-recompute replay: ")
        del got
