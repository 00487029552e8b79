"""Per-call state of a recording or replaying session: hooks Megatron's top-k calls, FIFO per layer.

Legend of shape suffixes: T = tokens of one router call, K = top-k.

A hook object follows Megatron-Core's ``router_replay`` protocol (``get_replay_topk(scores, topk,
num_groups, group_topk, default_compute_topk)``); it is lent to one router for one routing call.
Recompute is told from forward by autograd: a routing call made while a backward pass runs is the
recompute of a checkpointed forward.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable

import torch

from moeverify.errors import RouteError, UsageError


def _in_backward() -> bool:
    """True while autograd's engine runs a backward pass (where checkpointed forwards are recomputed)."""
    return torch._C._current_graph_task_id() != -1


def current_rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_available() and torch.distributed.is_initialized() else 0


def _recompute_configured(config) -> bool:
    granularity = getattr(config, "recompute_granularity", None)
    if granularity == "full":
        return True
    return granularity == "selective" and "moe" in (getattr(config, "recompute_modules", None) or ())


def _call_with_hook(original, router, hook, logits, args, kwargs):
    # router_replay is a plain attribute (never a parameter, buffer or module): write the instance
    # dict directly and skip nn.Module.__setattr__'s bookkeeping on the hot path.
    attrs = router.__dict__
    saved = attrs["router_replay"]
    attrs["router_replay"] = hook
    try:
        return original(router, logits, *args, **kwargs)
    finally:
        attrs["router_replay"] = saved


class _RecordHook:
    """Megatron's ``router_replay`` protocol: compute the native top-k and keep the ids."""

    __slots__ = ("sink",)

    def __init__(self, sink: list):
        self.sink = sink

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        values, topk_ids_TK = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        self.sink.append(topk_ids_TK)  # integer ids carry no autograd history: nothing to detach
        return values, topk_ids_TK


class _ReplayHook:
    """Megatron's ``router_replay`` protocol: use the given ids, gather scores of the current weights."""

    __slots__ = ("topk_ids_TK",)

    def __init__(self, topk_ids_TK: torch.Tensor):
        self.topk_ids_TK = topk_ids_TK

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        return scores.gather(1, self.topk_ids_TK), self.topk_ids_TK


class Recording:
    """State of ``session.record()``: the ids of every forward routing call, FIFO per layer."""

    def __init__(self, layers: Iterable[int], *, original):
        self.original = original  # the unpatched TopKRouter.routing
        self.per_layer: dict[int, list[torch.Tensor]] = {layer: [] for layer in layers}
        self._hooks: dict[int, _RecordHook] = {}

    def route(self, router, layer, logits, args, kwargs):
        guard_call(router, layer)
        if _in_backward():  # recompute of a recorded forward: route natively, record nothing
            return self.original(router, logits, *args, **kwargs)
        hook = self._hooks.get(layer)
        if hook is None:
            hook = self._hooks[layer] = _RecordHook(self.per_layer.setdefault(layer, []))
        return _call_with_hook(self.original, router, hook, logits, args, kwargs)


class Replaying:
    """State of ``session.replay(routes)``: per layer, the next forward micro-batch and pending recomputes."""

    def __init__(self, per_layer: dict[int, tuple[torch.Tensor, ...]], *, recompute: bool | str, rank: int,
                 original):
        self.original = original  # the unpatched TopKRouter.routing
        self.per_layer = per_layer
        self.tokens = {layer: [int(t.shape[0]) for t in mbs] for layer, mbs in per_layer.items()}
        self.recompute = recompute
        self.rank = rank
        self.next_mb = dict.fromkeys(per_layer, 0)
        self.pending = {layer: collections.deque() for layer in per_layer}
        self.recomputed = {layer: [0] * len(mbs) for layer, mbs in per_layer.items()}
        self.expected = {layer: [False] * len(mbs) for layer, mbs in per_layer.items()}

    def _expects_recompute(self, router) -> bool:
        if self.recompute is True:  # e.g. non-reentrant checkpointing, whose first forward keeps grad on
            return True
        if self.recompute is False or torch.is_grad_enabled():
            return False
        return router.training and _recompute_configured(router.config)

    def _ids(self, router, layer: int, mb: int, logits) -> torch.Tensor:
        # Token counts are host ints taken once, and the ids already sit on the router's device
        # (ReplaySession.replay moved them): one tensor query per call keeps the hot path short.
        tokens = logits.numel() // router.num_experts
        if self.tokens[layer][mb] != tokens:
            shape = tuple(self.per_layer[layer][mb].shape)
            raise RouteError(f"layer {layer} rank {self.rank} mb {mb}: replay ids shape {shape}"
                             f" != expected (T={tokens}, K={router.topk}) for this router call")
        return self.per_layer[layer][mb]

    def route(self, router, layer, logits, args, kwargs):
        guard_call(router, layer)
        total = len(self.per_layer[layer])
        if _in_backward():
            if not self.pending[layer]:
                raise RouteError(f"layer {layer} rank {self.rank}: a recompute asked for routes but no replayed "
                                 f"forward of this layer waits for one ({self.next_mb[layer]} of {total} forward "
                                 f"micro-batch(es) used, {sum(self.recomputed[layer])} recomputed)")
            mb = self.pending[layer].popleft()
            self.recomputed[layer][mb] += 1
        else:
            mb = self.next_mb[layer]
            if mb >= total:
                raise RouteError(f"layer {layer} rank {self.rank} mb {mb}: forward asked for micro-batch {mb} but "
                                 f"only {total} were given to replay (expected {total} forward(s), got more)")
            self.next_mb[layer] = mb + 1
            if self._expects_recompute(router):
                self.expected[layer][mb] = True
                self.pending[layer].append(mb)
        hook = _ReplayHook(self._ids(router, layer, mb, logits))
        return _call_with_hook(self.original, router, hook, logits, args, kwargs)

    def problems(self) -> list[str]:
        found = []
        for layer, mbs in self.per_layer.items():
            unused = list(range(self.next_mb[layer], len(mbs)))
            if unused:
                found.append(f"layer {layer} rank {self.rank} mb {unused[0]}: {len(unused)} of {len(mbs)} replayed "
                             f"micro-batch(es) never used in a forward (expected {len(mbs)} forwards, "
                             f"got {self.next_mb[layer]})")
            for mb, (want, got) in enumerate(zip(self.expected[layer], self.recomputed[layer])):
                if want and got != 1:
                    found.append(f"layer {layer} rank {self.rank} mb {mb}: recomputed {got} time(s), expected "
                                 "exactly 1 (the backward pass did not run, or ran twice)")
        return found


def guard_call(router, layer: int) -> None:
    """Per-call checks of settings that may change after a session started."""
    if router.config.moe_router_fusion:
        raise UsageError(f"layer {layer}: moe_router_fusion was switched on while a replay session is active; "
                         "the fused path would skip replay: set config.moe_router_fusion = False")
    native = router.router_replay
    if native is not None and getattr(native, "router_replay_action", None) is not None:
        raise UsageError(f"layer {layer}: megatron-core's native RouterReplay action "
                         f"{native.router_replay_action} is set on a router held by a moeverify session; use one "
                         "replay implementation at a time (clear_global_router_replay_action())")
