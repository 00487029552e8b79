"""Deliberately broken replay implementations (mutants) that the replay oracles must catch.

Each is Megatron-Core's native ``RouterReplay`` driven like ``NativeReplay`` with one classic RL
router-replay bug. Select one with ``--replay-impl moeverify.oracles.replay.faulty:NAME``; the test
suite asserts the named subcheck fails for each (an oracle that cannot fail proves nothing).

- ``wrong_microbatch``: replays micro-batch ``mb + 1``'s routes in micro-batch ``mb``.
- ``layer_shift``: replays the next MoE layer's routes (off by one layer).
- ``detached_probs``: replayed probabilities detached, so no gradient reaches the router.
- ``no_recompute_replay``: forwards replay, but recompute during backward routes natively.
- ``fifo_recompute``: moeverify's patch with recompute served in queue order (the next micro-batch
  of the layer) instead of by identity: right when backward runs in forward order, wrong otherwise.
- ``counts_padding``: moeverify's patch, but padding tokens are counted into the expert-bias token counts
  (``local_tokens_per_expert``) of replayed calls; routes, probs, losses and gradients are all right.
- ``reversed_slots``: replays the right ids with each row's slots reversed (ids handed over in another order
  than the recording took them, as rollout arrays may be): the probabilities are summed in another order, an
  ulp off at top-k >= 3 (a top-2 sum is order-free, so only a top-k >= 3 family can show it).
- ``ties_by_id``: moeverify's patch with replayed slots ordered by descending score, ties by expert id, instead of
  the order Megatron's own grad-mode top-k gives tied scores: every forward is bitwise, but the tied slots'
  gradients are summed in another order (found on an H200 in bf16 at Qwen3-30B-A3B's width; on CPU the
  ``tied_scores`` variant shows it).
- Minimal mutants, the smallest unit each subcheck is shown to see (``moeverify.spec.bug_classes``' ``minimal``):
  ``one_token_one_layer_route`` hands one token (the first of micro-batch 0) of one layer (the first MoE layer)
  another expert in its last slot; ``one_ulp_one_prob`` replays the right ids but the first replayed call's first
  token weighs its first expert one ulp higher; ``one_layer_no_recompute_replay`` lets one layer's recompute route
  natively; ``one_layer_fifo_recompute`` serves one layer's recomputes in queue order; ``one_count_extra`` counts
  one token twice, for one expert of one layer, in the expert-bias token counts of each replayed pass.
- ``masked_probs`` (ISEEKYAN/Megatron-LM #79, the first version of #49): moeverify's patch, but the replayed experts'
  combine weights are read from the post-top-k probabilities of the router's own native routing (zero off its
  top-k): a replayed expert the current router no longer picks weighs 0. On the weights the routes were recorded
  with, the router picks the replayed experts and every weight is right; only a moved router shows it.
  ``one_masked_weight`` is its minimal form: one such weight, in the first replayed call of the first MoE layer
  (and in that call's recompute), the others right.
- ``one_rank_crash``: raises while replaying on rank 1 only, the other ranks going on into the
  collectives it left. Not a subcheck's catch: the check must end quickly, naming rank 1
  (``runtime.outcome``), instead of waiting for the collective timeout.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from moeverify.oracles.replay.impls import MoeverifyReplay, NativeReplay, replay_object
from moeverify.patches import replay_state


class _WrongMicrobatch(NativeReplay):
    name = "wrong_microbatch"

    def target(self, layer: int, mb: int) -> torch.Tensor:
        routes = self._replayed()
        return routes.get(layer, (mb + 1) % routes.microbatches)


class _LayerShift(NativeReplay):
    name = "layer_shift"

    def target(self, layer: int, mb: int) -> torch.Tensor:
        routes = self._replayed()
        return routes.get(routes.layers[(routes.layers.index(layer) + 1) % len(routes.layers)], mb)


class _DetachedProbs(NativeReplay):
    name = "detached_probs"

    def bind(self, model_chunks: list) -> None:
        super().bind(model_chunks)
        replays = (self.action_enum.REPLAY_FORWARD, self.action_enum.REPLAY_BACKWARD)
        for _, router in self._routers.values():
            rr = replay_object(router)
            original = type(rr).get_replay_topk.__get__(rr)

            def detached(*args, _original=original, _rr=rr, **kwargs):
                probs, ids = _original(*args, **kwargs)
                return (probs.detach(), ids) if _rr.router_replay_action in replays else (probs, ids)

            rr.get_replay_topk = detached


class _NoRecomputeReplay(NativeReplay):
    name = "no_recompute_replay"

    def after_forward(self, chunk: int, mb: int) -> None:
        if self._mode == "replay":
            for _, rr in self._chunk_routers(chunk):
                rr.clear_router_replay_action()
        else:
            super().after_forward(chunk, mb)


class _ReversedSlots(NativeReplay):
    name = "reversed_slots"

    def target(self, layer: int, mb: int) -> torch.Tensor:
        return self._replayed().get(layer, mb).flip(1)


class _OneRankCrash(NativeReplay):
    name = "one_rank_crash"

    def target(self, layer: int, mb: int) -> torch.Tensor:
        if dist.is_initialized() and dist.get_rank() == 1:
            raise RuntimeError(f"one_rank_crash: rank 1 fails replaying layer {layer} micro-batch {mb}")
        return super().target(layer, mb)


class _FifoRecompute(MoeverifyReplay):
    name = "fifo_recompute"

    @contextlib.contextmanager
    def replay(self, routes):
        with super().replay(routes):
            state = self._session.replaying
            served = dict.fromkeys(state.per_layer, 0)
            by_identity = state.recompute

            def in_queue_order(router, layer, mb, *args):
                mb, served[layer] = served[layer] % len(state.per_layer[layer]), served[layer] + 1
                return by_identity(router, layer, mb, *args)

            state.recompute = in_queue_order
            yield self


class _CountsPadding(MoeverifyReplay):
    name = "counts_padding"

    @contextlib.contextmanager
    def replay(self, routes):
        handles = [
            router.register_forward_hook(_count_padding_too, with_kwargs=True)
            for router in self._session.live_routers().values()
        ]
        try:
            with super().replay(routes):
                yield self
        finally:
            for handle in handles:
                handle.remove()


class _TiesById(MoeverifyReplay):
    name = "ties_by_id"

    @contextlib.contextmanager
    def replay(self, routes):
        hook = replay_state.ReplayHook
        original = hook.get_replay_topk

        def by_id(self_, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
            return replay_state.canonical_replay(scores, self_.sorted_ids_TK, None, topk=topk)

        hook.get_replay_topk = by_id
        try:
            with super().replay(routes):
                yield self
        finally:
            hook.get_replay_topk = original


@contextlib.contextmanager
def _topk_routing_wrapped(wrap):
    """Megatron-Core's ``topk_routing_with_score_function`` as ``TopKRouter.routing`` calls it, replaced by
    ``wrap(original)`` for the duration (read by name from the router module at every call)."""
    from megatron.core.transformer.moe import router as mcore_router  # lazy: megatron

    original = mcore_router.topk_routing_with_score_function
    mcore_router.topk_routing_with_score_function = wrap(original)
    try:
        yield
    finally:
        mcore_router.topk_routing_with_score_function = original


class _MaskedProbs(MoeverifyReplay):
    name = "masked_probs"

    @contextlib.contextmanager
    def replay(self, routes):
        def wrap(original):
            def masked(logits, topk, *args, router_replay=None, **kwargs):
                probs_TE, map_TE = original(logits, topk, *args, router_replay=router_replay, **kwargs)
                if router_replay is None:  # a router the session does not hold: native, untouched
                    return probs_TE, map_TE
                # the router's own routing of these logits: post-top-k probabilities, zero off its top-k
                native_TE, _ = original(logits, topk, *args, router_replay=None, **kwargs)
                return native_TE * map_TE, map_TE

            return masked

        with _topk_routing_wrapped(wrap), super().replay(routes):
            yield self


# -- minimal mutants: the smallest unit a replay subcheck is shown to see (``moeverify.spec.bug_classes``'
# ``minimal``) ----
class _OneTokenOneLayerRoute(NativeReplay):
    name = "one_token_one_layer_route"

    def target(self, layer: int, mb: int) -> torch.Tensor:
        routes_TK = super().target(layer, mb)
        if layer != self._replayed().layers[0] or mb != 0:
            return routes_TK
        routes_TK = routes_TK.clone()
        row = set(routes_TK[0].tolist())
        routes_TK[0, -1] = next(e for e in range(self._num_experts) if e not in row)
        return routes_TK


class _OneUlpOneProb(NativeReplay):
    name = "one_ulp_one_prob"

    def bind(self, model_chunks: list) -> None:
        super().bind(model_chunks)
        _, router = self._routers[min(self._routers)]
        rr = replay_object(router)
        original = type(rr).get_replay_topk.__get__(rr)
        pending = [True]  # the first replayed forward call of this build only

        def one_ulp(*args, **kwargs):
            probs, ids = original(*args, **kwargs)
            if rr.router_replay_action == self.action_enum.REPLAY_FORWARD and pending:
                pending.clear()
                first = probs[0, 0].detach()
                bump = torch.zeros_like(probs)
                bump[0, 0] = torch.nextafter(first, torch.full_like(first, float("inf"))) - first
                probs = probs + bump  # exact: the sum is the next representable value
            return probs, ids

        rr.get_replay_topk = one_ulp


class _OneLayerNoRecomputeReplay(NativeReplay):
    name = "one_layer_no_recompute_replay"

    def after_forward(self, chunk: int, mb: int) -> None:
        super().after_forward(chunk, mb)
        if self._mode == "replay":
            for layer, rr in self._chunk_routers(chunk):
                if layer == min(self._routers):
                    rr.clear_router_replay_action()


class _OneLayerFifoRecompute(MoeverifyReplay):
    name = "one_layer_fifo_recompute"

    @contextlib.contextmanager
    def replay(self, routes):
        with super().replay(routes):
            state = self._session.replaying
            first, served = min(state.per_layer), [0]
            by_identity = state.recompute

            def first_layer_in_queue_order(router, layer, mb, *args):
                if layer == first:
                    mb, served[0] = served[0] % len(state.per_layer[layer]), served[0] + 1
                return by_identity(router, layer, mb, *args)

            state.recompute = first_layer_in_queue_order
            yield self


class _OneCountExtra(MoeverifyReplay):
    name = "one_count_extra"

    @contextlib.contextmanager
    def replay(self, routes):
        routers = self._session.live_routers()
        pending = [True]  # once per replayed pass: one token counted twice, for one expert of one layer

        def once(router, args, kwargs, output):
            if pending and router.enable_expert_bias and torch.is_grad_enabled():
                pending.clear()
                with torch.no_grad():
                    router.local_tokens_per_expert[int(output[1][0].nonzero()[0])] += 1

        handle = routers[min(routers)].register_forward_hook(once, with_kwargs=True)
        try:
            with super().replay(routes):
                yield self
        finally:
            handle.remove()


class _OneMaskedWeight(MoeverifyReplay):
    name = "one_masked_weight"

    @contextlib.contextmanager
    def replay(self, routes):
        routers = self._session.live_routers()
        first = routers[min(routers)]
        inside = [False]  # the first MoE layer's router is routing now
        chosen: list = []  # (logits of the call it changed, token, expert): its recompute changes the same weight

        def wrap(original):
            def one_masked(logits, topk, *args, router_replay=None, **kwargs):
                probs_TE, map_TE = original(logits, topk, *args, router_replay=router_replay, **kwargs)
                if router_replay is None or not inside[0]:
                    return probs_TE, map_TE
                if chosen and torch.equal(chosen[0], logits.detach()):
                    _, t, e = chosen
                elif not chosen:
                    _, native_map_TE = original(logits, topk, *args, router_replay=None, **kwargs)
                    unpicked = (map_TE & ~native_map_TE).nonzero()  # replayed experts the router no longer picks
                    if not len(unpicked):
                        return probs_TE, map_TE
                    t, e = (int(i) for i in unpicked[0])
                    chosen.extend((logits.detach().clone(), t, e))
                else:
                    return probs_TE, map_TE
                keep_TE = torch.ones_like(probs_TE)
                keep_TE[t, e] = 0  # that one weight as the masked probabilities give it
                return probs_TE * keep_TE, map_TE

            return one_masked

        def enter(*_):
            inside[0] = True

        def leave(*_):
            inside[0] = False

        handles = [first.register_forward_pre_hook(enter), first.register_forward_hook(leave)]
        try:
            with _topk_routing_wrapped(wrap), super().replay(routes):
                yield self
        finally:
            for handle in handles:
                handle.remove()


def masked_probs() -> MoeverifyReplay:
    return _MaskedProbs()


def one_masked_weight() -> MoeverifyReplay:
    return _OneMaskedWeight()


def one_token_one_layer_route() -> NativeReplay:
    return _OneTokenOneLayerRoute()


def one_ulp_one_prob() -> NativeReplay:
    return _OneUlpOneProb()


def one_layer_no_recompute_replay() -> NativeReplay:
    return _OneLayerNoRecomputeReplay()


def one_layer_fifo_recompute() -> MoeverifyReplay:
    return _OneLayerFifoRecompute()


def one_count_extra() -> MoeverifyReplay:
    return _OneCountExtra()


def _count_padding_too(router, args, kwargs, output) -> None:
    padding = args[1] if len(args) > 1 else kwargs.get("padding_mask")
    if padding is None or not router.enable_expert_bias or not torch.is_grad_enabled():
        return
    with torch.no_grad():
        router.local_tokens_per_expert += (output[1] & padding.reshape(-1, 1)).sum(dim=0)


def counts_padding() -> MoeverifyReplay:
    return _CountsPadding()


def ties_by_id() -> MoeverifyReplay:
    return _TiesById()


def fifo_recompute() -> MoeverifyReplay:
    return _FifoRecompute()


def wrong_microbatch() -> NativeReplay:
    return _WrongMicrobatch()


def layer_shift() -> NativeReplay:
    return _LayerShift()


def detached_probs() -> NativeReplay:
    return _DetachedProbs()


def no_recompute_replay() -> NativeReplay:
    return _NoRecomputeReplay()


def reversed_slots() -> NativeReplay:
    return _ReversedSlots()


def one_rank_crash() -> NativeReplay:
    return _OneRankCrash()


MUTANTS = {
    "wrong_microbatch": "equivalence",
    "layer_shift": "drift",
    "detached_probs": "equivalence",
    "no_recompute_replay": "recompute",
    "fifo_recompute": "backward_order",
    "counts_padding": "token_counts",
    "reversed_slots": "weights",
    "ties_by_id": "equivalence",
    "one_token_one_layer_route": "drift",
    "one_ulp_one_prob": "weights",
    "one_layer_no_recompute_replay": "recompute",
    "one_layer_fifo_recompute": "backward_order",
    "one_count_extra": "token_counts",
    "masked_probs": "weights",
    "one_masked_weight": "weights",
}
# the coarse mutants, each with a subcheck that sees it and words its failures must include (tests hold them to it)
CAUGHT_BY = {
    ("wrong_microbatch", "equivalence"): "replay vs plain pass: routing map",
    ("wrong_microbatch", "cross_layout"): "did not follow the 1-rank reference routes",
    ("layer_shift", "drift"): "did not follow the recorded routes",
    ("layer_shift", "native_parity"): "vs native RouterReplay: routing map",
    ("detached_probs", "equivalence"): "replay vs plain pass: grad",
    ("no_recompute_replay", "recompute"): "recompute routed",
    ("fifo_recompute", "backward_order"): "it replayed another micro-batch's routes",
    ("masked_probs", "weights"): "router moved: layer 0 mb 0: ",
}

# the other subchecks a mutant is shown failing (``tests/unit/test_replay_minimal_mutants.py``)
ALSO_FAILS = {
    "one_token_one_layer_route": ("equivalence", "cross_layout", "native_parity", "weights"),
    "one_ulp_one_prob": ("equivalence", "native_parity"),
}
