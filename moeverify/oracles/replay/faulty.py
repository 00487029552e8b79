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
- ``one_rank_crash``: raises while replaying on rank 1 only, the other ranks going on into the
  collectives it left. Not a subcheck's catch: the check must end quickly, naming rank 1
  (``runtime.outcome``), instead of waiting for the collective timeout.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from moeverify.oracles.replay.impls import MoeverifyReplay, NativeReplay
from moeverify.patches import replay_state


class _WrongMicrobatch(NativeReplay):
    name = "wrong_microbatch"

    def target(self, layer: int, mb: int) -> torch.Tensor:
        return self._replaying.get(layer, (mb + 1) % self._replaying.microbatches)


class _LayerShift(NativeReplay):
    name = "layer_shift"

    def target(self, layer: int, mb: int) -> torch.Tensor:
        layers = self._replaying.layers
        return self._replaying.get(layers[(layers.index(layer) + 1) % len(layers)], mb)


class _DetachedProbs(NativeReplay):
    name = "detached_probs"

    def bind(self, model_chunks: list) -> None:
        super().bind(model_chunks)
        replays = (self.action_enum.REPLAY_FORWARD, self.action_enum.REPLAY_BACKWARD)
        for _, router in self._routers.values():
            rr = router.router_replay
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
        return self._replaying.get(layer, mb).flip(1)


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
            state = self._session._replayed
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
        handles = [router.register_forward_hook(_count_padding_too, with_kwargs=True)
                   for router in self._session._live_routers().values()]
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
        hook = replay_state._ReplayHook
        original = hook.get_replay_topk

        def by_id(self_, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
            return replay_state.canonical_replay(scores, self_.sorted_ids_TK, None, topk=topk)

        hook.get_replay_topk = by_id
        try:
            with super().replay(routes):
                yield self
        finally:
            hook.get_replay_topk = original


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


MUTANTS = {"wrong_microbatch": "equivalence", "layer_shift": "drift", "detached_probs": "equivalence",
           "no_recompute_replay": "recompute", "fifo_recompute": "backward_order",
           "counts_padding": "token_counts", "reversed_slots": "weights", "ties_by_id": "equivalence"}
