"""Per-call state of a recording or replaying session: hooks Megatron's top-k calls.

Legend of shape suffixes: T = tokens of one router call, K = top-k.

A hook object follows Megatron-Core's ``router_replay`` protocol (``get_replay_topk(scores, topk,
num_groups, group_topk, default_compute_topk)``); it is lent to one router for one routing call.

Forward calls take micro-batches in order (forward ``i`` of a layer takes micro-batch ``i``). A
routing call made while autograd runs a backward pass is a recompute, and it is matched to its
forward by identity: a forward inside a checkpointed region binds (region, router) to its
micro-batch (``moeverify.patches.regions``), and the recompute of that region finds the binding,
whatever order the backward passes run in, and takes its forward's ids in the slot order that forward gave them
(no second slot order: the recompute repeats the forward's scores). A recompute without a binding on a router that
replayed raises ``RouteError``: it is never given another micro-batch's routes.

Slot order: Megatron-Core 0.19.2 takes the plain top-k sorted only when grad is enabled
(``sorted=torch.is_grad_enabled()`` in ``topk_routing_with_score_function``'s ``_compute_topk``), and sums the K
gathered probabilities of a row in slot order (softmax over the K gathered logits, or the sigmoid normalisation), so
a no-grad log-prob pass and a grad-mode pass differ by an ulp at top-k >= 3. The slot order of tied scores matters
too, in the backward alone: tied values sum alike, but their gradients are summed in slot order (bf16 logits tie
often: on an H200 at Qwen3-30B-A3B's width, a replay in "descending score, ties by id" order gave every forward
bitwise and the gradients of every layer below the router off by bf16 ulps). So both hooks give every row the order
of Megatron's own top-k *in grad mode* (``grad_mode_topk``), ties broken as ``torch.topk`` breaks them on this
device: the recording hook takes its top-k with grad enabled; the replay hook takes each row's native grad-mode
order when the replayed ids are the ids native routing picks (the same weights: the training pass of a log-prob
pass). Routes that differ from native are ordered by descending selection key, ties broken per device: on a CUDA
device as ``torch.topk`` orders that set (``topk_order``: one top-k of the ``[T, K]`` keys at the ascending ids,
which *is* native's order wherever native picked that set, so no native top-k is taken and nothing syncs; checked
once per shape against Megatron's own top-k of tie-heavy scores, ``_topk_order_holds``, else the CPU rule below
with a native top-k per call); on the CPU by ascending expert id
(``canonical_slots``; native's top-k only where a row's replayed keys tie; and first, where the routes give their
ids in an order of their own, that order wherever the keys strictly descend along every row of the call: with no tie
there is one descending order, whichever rule finds it, so a recording replayed on the weights it was recorded with
costs a test and native replay's gather, no sort). The selection key is the tensor the hook is handed: scores, or
scores + expert bias. So the log-prob pass, the replayed training pass and a native grad-mode pass give bitwise the
same probabilities and gradients; routes of any source (a session, rollout arrays, a dump) are summed alike.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable
from typing import Protocol

import torch

from moeverify.errors import RouteError, UsageError
from moeverify.patches import agreement, regions, semantics, token_counts
from moeverify.runtime import cpu as cpu_runtime

# region -> {id(router): (state, layer, handle)}; an entry lives exactly as long as its region's graph.
_BINDINGS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# Routers that ran a replayed forward: a recompute of theirs with no known region cannot be served.
_REPLAYED: weakref.WeakSet = weakref.WeakSet()


class RecomputeState(Protocol):
    """What a forward is bound to (``bind_forward``): redoes that forward's routing when its recompute runs."""

    def recompute(self, router, layer: int, handle: object, logits, args, kwargs):
        """Route the recompute of the forward bound with ``handle`` (what the state asked to get back)."""


def bind_forward(region, router, state: RecomputeState, layer: int, handle: object = None) -> None:
    """Bind ``router``'s forward routing call in checkpoint ``region`` (None: not in one, nothing to bind) to
    ``state``: its recompute inside backward is routed by ``state.recompute(router, layer, handle, ...)``.

    ``handle`` is opaque here and handed back as given: a session's micro-batch index, in-job replay's replay hook
    of that forward, None for a native forward."""
    if region is None:
        return
    table = _BINDINGS.get(region)
    if table is None:
        table = _BINDINGS[region] = {}
    table[id(router)] = (state, layer, handle)


def mark_replayed(router) -> None:
    """``router`` ran a replayed forward: a later recompute of it that matches no bound forward is refused."""
    _REPLAYED.add(router)


def route_recompute(router, held, logits, args, kwargs, *, original):
    """Route a call made inside a backward pass: the recompute of the forward it is bound to.

    Args:
        held: ``(state, layer)`` of the session holding the router now, or None.
        original: the unpatched ``TopKRouter.routing``.
    """
    matches = []
    for region in regions.recompute_regions():
        binding = _BINDINGS.get(region, {}).get(id(router))
        if binding is not None and binding not in matches:
            matches.append(binding)
    if len(matches) > 1:
        where = ", ".join(f"layer {layer} mb {handle}" for _, layer, handle in matches)
        raise RouteError(
            f"rank {current_rank()}: a recompute matches {len(matches)} replayed forwards ({where}); "
            "nested checkpoints around one router are not supported by router replay"
        )
    if matches:
        state, layer, handle = matches[0]
        return state.recompute(router, layer, handle, logits, args, kwargs)
    replaying = held is not None and isinstance(held[0], Replaying)
    if replaying or router in _REPLAYED:
        layer = held[1] if held is not None else router.layer_number - 1
        state = held[0] if replaying else None
        used = f" ({state.describe(layer)})" if state is not None else ""
        raise RouteError(
            f"layer {layer} rank {current_rank()}: a routing call inside backward is not the recompute "
            f"of any replayed forward{used}; router replay matches recomputes to their forwards through "
            "Megatron's tensor_parallel.checkpoint, torch.utils.checkpoint (either mode) and other "
            "autograd-Function checkpoints: this recompute mechanism is unknown, so its routes cannot be "
            "identified (routing it natively would silently differ from its forward)"
        )
    return original(router, logits, *args, **kwargs)


class _Native:
    """Binding of a forward no session held, on a router that replayed before: its recompute is native too."""

    def __init__(self, original):
        self.original = original

    def recompute(self, router, layer, mb, logits, args, kwargs):
        return self.original(router, logits, *args, **kwargs)


def route_unheld(router, logits, args, kwargs, *, original):
    """A forward of a router no session holds: native; bound as such where a later recompute could be ambiguous."""
    if router in _REPLAYED:
        bind_forward(regions.forward_region(), router, _Native(original), router.layer_number - 1, None)
    return original(router, logits, *args, **kwargs)


def current_rank() -> int:
    return (
        torch.distributed.get_rank() if torch.distributed.is_available() and torch.distributed.is_initialized() else 0
    )


def call_with_hook(original, router, hook, logits, args, kwargs):
    # router_replay is a plain attribute (never a parameter, buffer or module): write the instance
    # dict directly and skip nn.Module.__setattr__'s bookkeeping on the hot path.
    if agreement.ACTIVE is not None:
        hook = agreement.watch(hook, router, token_counts.padding_mask_of(args, kwargs))
    attrs = router.__dict__
    saved = attrs["router_replay"]
    attrs["router_replay"] = hook
    try:
        return token_counts.route(original, router, logits, args, kwargs)
    finally:
        attrs["router_replay"] = saved


def canonical_slots(key_TK: torch.Tensor) -> torch.Tensor:
    """``[T, K]`` permutation putting each row of ids in canonical slot order: descending ``key_TK`` (the
    selection key gathered at those ids, the ids ascending within the row), ties kept in ascending id order."""
    return key_TK.argsort(dim=1, descending=True, stable=True)


def grad_mode_topk(default_compute_topk, scores, topk, num_groups=None, group_topk=None):
    """Megatron's native top-k ``(values, ids)`` of ``scores`` as a grad-mode (training) pass takes it, slot order and
    ties included, whatever the grad mode of the pass calling it (``scores`` of a no-grad pass need no grad, so no
    graph is made)."""
    if torch.is_grad_enabled():  # a training pass: no context to enter on the hot path
        return default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
    with torch.enable_grad():
        return default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)


def topk_order(key_TE: torch.Tensor, sorted_ids_TK: torch.Tensor) -> torch.Tensor:
    """The ids of each row (ascending) in the slot order ``torch.topk(..., sorted=True)`` gives them when they are
    the top-k of ``key_TE``: one top-k of the ``[T, K]`` keys gathered at them, no ``[T, E]`` work.

    On a CUDA device ``torch.topk`` selects a row's top-k as the elements above its k-th value, then those equal to
    it, each group in ascending position, and sorts those k (key, id) pairs by key alone, so the order of a selected
    set depends on its keys in ascending-id order only: a top-k of all K keys laid out in ascending id order gives
    the same order as the top-k of the whole row (or of a group-masked row) that selected that set. Checked on the
    device before it is relied on (``_topk_order_holds``)."""
    _, pos_TK = torch.topk(key_TE.gather(1, sorted_ids_TK), sorted_ids_TK.shape[1], dim=1, sorted=True)
    return sorted_ids_TK.gather(1, pos_TK)


# (device, dtype, experts, topk, groups, group top-k) -> whether ``topk_order`` gives native's grad-mode order there
_TOPK_ORDER: dict[tuple, bool] = {}


def _topk_order_holds(default_compute_topk, scores: torch.Tensor, topk: int, num_groups, group_topk) -> bool:
    """Once per device, dtype and routing shape: native grad-mode top-k of tie-heavy scores (a few distinct values a
    row: every tie case) against ``topk_order`` of the set it picked. One host read per shape and process."""
    key = (scores.device, scores.dtype, scores.shape[1], topk, num_groups, group_topk)
    holds = _TOPK_ORDER.get(key)
    if holds is None:
        g = torch.Generator(device=scores.device).manual_seed(12)
        rows = scores.shape[0]  # the call's token count: Megatron's group-limited top-k is bound to it
        probe_TE = torch.randint(0, 6, (rows, scores.shape[1]), generator=g, device=scores.device)
        probe_TE = (probe_TE.to(scores.dtype) * 0.25 - 0.5).where(
            probe_TE < 5, torch.rand(rows, scores.shape[1], generator=g, device=scores.device).to(scores.dtype)
        )
        with torch.no_grad():
            _, native_TK = grad_mode_topk(default_compute_topk, probe_TE, topk, num_groups, group_topk)
            ours_TK = topk_order(probe_TE, native_TK.sort(dim=1).values)
        holds = _TOPK_ORDER[key] = bool(torch.equal(ours_TK, native_TK))
    return holds


def canonical_replay(
    scores: torch.Tensor, sorted_ids_TK: torch.Tensor, default_compute_topk=None, **options
) -> tuple[torch.Tensor, torch.Tensor]:
    """Replayed ids (ascending per row) in the slot order a grad-mode pass gives them (the module's rule), and the
    scores gathered at them. ``options``: ``replay_plan``'s (``topk``; ``native_TK``, the native grad-mode top-k ids
    when the caller already has them; ``given_TK``, the same ids in the order they were given, a recording's own
    grad-mode order, tried first on the CPU: where the scores at them strictly descend along every row, that is the
    one order any rule gives)."""
    values_TK, ids_TK, _, _ = replay_plan(scores, sorted_ids_TK, default_compute_topk, **options)
    return values_TK, ids_TK


def replay_plan(
    scores: torch.Tensor,
    sorted_ids_TK: torch.Tensor,
    default_compute_topk=None,
    *,
    topk: int,
    num_groups=None,
    group_topk=None,
    native_TK: torch.Tensor | None = None,
    given_TK: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``canonical_replay``'s ``(values, ids)`` and how the values were taken: ``(base_TK, pos_TK)``, the values
    being ``scores.gather(1, base_TK)``, then ``.gather(1, pos_TK)`` where ``pos_TK`` is not None (the ids are
    ``base_TK`` reordered the same way). A recompute repeats exactly those ops (``replay_values``): under torch's
    non-reentrant checkpoint a recomputed forward must save the tensors its forward saved, one for one.

    On a GPU whose top-k order passed its check: ``topk_order`` on detached keys, then native replay's gather; on the
    CPU with ``given_TK``: the gather at the given order and a test of it, kept where it passes (no sort)."""
    if cpu_runtime.installed():
        # CPU ranks: these ops name no device, so they skip the CPU runtime's redirection (a torch function mode
        # that every op and every tensor attribute read of the process goes through, microseconds each)
        with torch._C.DisableTorchFunction():
            return _replay_plan(
                scores, sorted_ids_TK, default_compute_topk, topk, num_groups, group_topk, native_TK, given_TK
            )
    return _replay_plan(scores, sorted_ids_TK, default_compute_topk, topk, num_groups, group_topk, native_TK, given_TK)


def _replay_plan(scores, sorted_ids_TK, default_compute_topk, topk, num_groups, group_topk, native_TK, given_TK):
    at_TK = None  # the scores at the given order, where it was tried
    if scores.is_cuda:
        if (
            native_TK is None
            and default_compute_topk is not None
            and _topk_order_holds(default_compute_topk, scores, topk, num_groups, group_topk)
        ):
            # torch.topk's own order of the replayed set: native's where native picked that set (``topk_order``),
            # found on detached keys (a top-k with grad adds its scatter to the backward: 0.27 ms a step on an H100)
            ids_TK = topk_order(scores.detach(), sorted_ids_TK)
            return scores.gather(1, ids_TK), ids_TK, ids_TK, None
    elif given_TK is not None:
        at_TK = scores.gather(1, given_TK)
        # the test reads the gathered keys detached (no autograd node: nothing saved beyond the gather)
        if _strictly_descending(at_TK.detach()):
            return at_TK, given_TK, given_TK, None
    # the order is found on detached keys
    ids_TK = canonical_ids(
        scores,
        sorted_ids_TK,
        default_compute_topk,
        topk=topk,
        num_groups=num_groups,
        group_topk=group_topk,
        native_TK=native_TK,
    )
    if at_TK is None:  # the scores gathered once at the ordered ids, native replay's own op
        return scores.gather(1, ids_TK), ids_TK, ids_TK, None
    # each id's slot in the given order: the values are taken from the gather already made
    pos_TK = (given_TK[:, None, :] == ids_TK[:, :, None]).to(torch.uint8).argmax(dim=2)
    return at_TK.gather(1, pos_TK), ids_TK, given_TK, pos_TK


def replay_values(
    scores: torch.Tensor, ids_TK: torch.Tensor, base_TK: torch.Tensor, pos_TK: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """A ``replay_plan``'s ``(values, ids)`` taken again by the same ops (a recompute; ``ids_TK``: the forward's)."""
    values_TK = scores.gather(1, base_TK)
    return (values_TK, ids_TK) if pos_TK is None else (values_TK.gather(1, pos_TK), ids_TK)


def canonical_ids(
    scores: torch.Tensor,
    sorted_ids_TK: torch.Tensor,
    default_compute_topk=None,
    *,
    topk: int,
    num_groups=None,
    group_topk=None,
    native_TK: torch.Tensor | None = None,
) -> torch.Tensor:
    """``canonical_replay``'s ids alone."""
    key_TE = scores.detach()
    # without Megatron's top-k (``default_compute_topk`` None: the ``ties_by_id`` mutant) the rule below, ties by id
    if (
        key_TE.is_cuda
        and default_compute_topk is not None
        and _topk_order_holds(default_compute_topk, key_TE, topk, num_groups, group_topk)
    ):
        # torch.topk's own order of the replayed set: native's where native picked that set (no native top-k, no
        # [T, E] work, no host sync: two [T, K] kernels and a small top-k)
        return topk_order(key_TE, sorted_ids_TK)
    with _plain_ops(key_TE):
        key_TK = key_TE.gather(1, sorted_ids_TK)
        # a row without ties has one descending order, whichever sort or top-k gives it: the stable order and the
        # native top-k are needed only where the replayed keys tie (or are NaN); on a GPU whose top-k order fails
        # the check, always taken (checking would sync)
        if scores.is_cuda:
            tied, order_TK = True, canonical_slots(key_TK)
        else:
            ranked_TK, order_TK = key_TK.sort(dim=1, descending=True)  # half a stable sort's time on the CPU
            tied = not bool((ranked_TK[:, :-1] > ranked_TK[:, 1:]).all())
            if tied:
                order_TK = canonical_slots(key_TK)
        ids_TK = sorted_ids_TK.gather(1, order_TK)
        if native_TK is None and default_compute_topk is not None and tied:
            with torch.no_grad():
                _, native_TK = grad_mode_topk(default_compute_topk, key_TE, topk, num_groups, group_topk)
        if native_TK is not None:
            same_T = (native_TK.sort(dim=1).values == sorted_ids_TK).all(dim=1)
            ids_TK = torch.where(same_T[:, None], native_TK, ids_TK)
    return ids_TK


def _strictly_descending(key_TK: torch.Tensor) -> bool:
    """Whether every row of ``key_TK`` strictly descends (one host read: CPU tensors only). The differences of
    distinct IEEE floats are never zero (gradual underflow) and a NaN or an infinity makes the maximum NaN or
    non-negative: only a row with no tie, no NaN and no infinity passes. Under flush-to-zero a tiny difference
    can read as a tie: the caller's full rule runs then, never a wrong order."""
    if key_TK.shape[0] == 0 or key_TK.shape[1] < 2:
        return True
    return key_TK.diff(dim=1).amax().item() < 0


def _plain_ops(tensor: torch.Tensor):
    """On CPU ranks, the slot order's own ops skip the CPU runtime's CUDA-to-CPU redirection (a torch function mode
    every op of the process goes through, a few microseconds an op; these ops name no device). A no-op elsewhere."""
    if tensor.is_cuda or not cpu_runtime.installed():
        return contextlib.nullcontext()
    return torch._C.DisableTorchFunction()


class _RecordHook:
    """Megatron's ``router_replay`` protocol: compute the native top-k in grad-mode slot order, keep the ids."""

    __slots__ = ("sink",)

    def __init__(self, sink: list):
        self.sink = sink

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        values_TK, ids_TK = grad_mode_topk(default_compute_topk, scores, topk, num_groups, group_topk)
        self.sink.append(ids_TK)  # integer ids carry no autograd history: nothing to detach
        return values_TK, ids_TK


class ReplayHook:
    """Megatron's ``router_replay`` protocol: use the given ids (ascending per row), in the slot order a grad-mode
    pass gives them (``replay_plan``), and gather those scores."""

    __slots__ = ("sorted_ids_TK", "given_TK", "ordered_TK", "plan")
    REPLAYS = True  # counted by the agreement guard

    def __init__(self, sorted_ids_TK: torch.Tensor, given_TK: torch.Tensor | None = None):
        self.sorted_ids_TK = sorted_ids_TK
        self.given_TK = given_TK  # the ids in the order the routes gave them (``replay_plan``'s first try)
        self.ordered_TK: torch.Tensor | None = None  # the ids in the slot order this call gave them
        self.plan: tuple | None = None  # (ordered ids, base, pos): what a recompute of this call repeats

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        values_TK, ordered_TK, base_TK, pos_TK = replay_plan(
            scores,
            self.sorted_ids_TK,
            default_compute_topk,
            topk=topk,
            num_groups=num_groups,
            group_topk=group_topk,
            given_TK=self.given_TK,
        )
        self.ordered_TK = ordered_TK
        self.plan = (ordered_TK, base_TK, pos_TK)
        return values_TK, ordered_TK


class _RecomputeHook:
    """A recompute's ``router_replay``: its forward's ids in the slot order that forward gave them (a recompute
    repeats the forward's scores, so native routing would order them alike), the scores taken by the forward's own
    ops (``replay_values``); no slot order taken again."""

    __slots__ = ("plan",)

    def __init__(self, plan: tuple):
        self.plan = plan

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        return replay_values(scores, *self.plan)


class Recording:
    """State of ``session.record()``: the ids of every forward routing call, in order per layer."""

    def __init__(self, layers: Iterable[int], *, original):
        self.original = original  # the unpatched TopKRouter.routing
        self.per_layer: dict[int, list[torch.Tensor]] = {layer: [] for layer in layers}
        self._hooks: dict[int, _RecordHook] = {}

    def route(self, router, layer, logits, args, kwargs):
        guard_call(router, layer)
        # A recorded forward routed natively; its recompute (found by region) does so again.
        bind_forward(regions.forward_region(), router, self, layer, None)
        hook = self._hooks.get(layer)
        if hook is None:
            hook = self._hooks[layer] = _RecordHook(self.per_layer.setdefault(layer, []))
        return call_with_hook(self.original, router, hook, logits, args, kwargs)

    def recompute(self, router, layer, mb, logits, args, kwargs):
        return token_counts.route(self.original, router, logits, args, kwargs)


class Replaying:
    """State of ``session.replay(routes)``: per layer, the next forward micro-batch and recompute counts."""

    def __init__(
        self,
        per_layer: dict[int, tuple[torch.Tensor, ...]],
        *,
        recompute: bool | str,
        rank: int | None,
        original,
        fidelity: bool = False,
        sorted_ids: dict[int, tuple[torch.Tensor, ...]] | None = None,
        tokens: dict[int, tuple[int, ...]] | None = None,
    ):
        self.original = original  # the unpatched TopKRouter.routing
        # layer -> [tokens whose replayed top-k equals native top-k (device tensor), tokens] over forwards
        self.fidelity: dict[int, list] | None = {} if fidelity else None
        self.per_layer = per_layer  # the ids in the order given (a recording's own slot order)
        # the same ids ascending per row (``sorted_ids``: made once per Routes, else here): the hooks order the
        # slots from there where the given order is not already the one (canonical_replay)
        self.sorted_ids = (
            sorted_ids
            if sorted_ids is not None
            else {layer: tuple(ids_TK.sort(dim=1).values for ids_TK in mbs) for layer, mbs in per_layer.items()}
        )
        # token counts per call: given with a table made once per Routes, else read here
        self.tokens = (
            tokens
            if tokens is not None
            else {layer: [int(t.shape[0]) for t in mbs] for layer, mbs in per_layer.items()}
        )
        self.recompute_mode = recompute
        self._rank = rank  # None: read when a message names it (torch.distributed's query is not free per step)
        self.next_mb = dict.fromkeys(per_layer, 0)
        self.recomputed = {layer: [0] * len(mbs) for layer, mbs in per_layer.items()}
        # layer -> mb -> weak reference to the checkpointed region of that forward (None: not checkpointed)
        self.regions: dict[int, list] = {layer: [None] * len(mbs) for layer, mbs in per_layer.items()}
        # (layer, mb) -> a checkpointed forward's ``ReplayHook.plan``, until its first recompute takes it
        self.ordered: dict[tuple[int, int], torch.Tensor] = {}

    @property
    def rank(self) -> int:
        if self._rank is None:
            self._rank = current_rank()
        return self._rank

    def _ids(self, router, layer: int, mb: int, logits) -> torch.Tensor:
        # Token counts are host ints taken once, and the ids already sit on the router's device
        # (ReplaySession.replay moved them): one tensor query per call keeps the hot path short.
        tokens = logits.numel() // router.num_experts
        if self.tokens[layer][mb] != tokens:
            shape = tuple(self.per_layer[layer][mb].shape)
            raise RouteError(
                f"layer {layer} rank {self.rank} mb {mb}: replay ids shape {shape}"
                f" != expected (T={tokens}, K={router.topk}) for this router call: forward {mb} replays micro-batch "
                f"{mb}'s routes, so the training micro-batches must be the recorded ones, in order (routes.take(order) "
                "for shuffled ones); micro-batches regrouped between the passes (another size, dynamic batching) need "
                "in-job R2 (MOEVERIFY_ROUTER_REPLAY=r2), which follows each token"
            )
        return self.sorted_ids[layer][mb]

    def exhausted(self, layer: int, total: int) -> str:
        """Why a forward past the last replayed micro-batch of ``layer`` is refused."""
        return (
            f"layer {layer} rank {self.rank}: forward {total + 1} of this replay, but {total} micro-batch(es) were "
            f"given to it (the training step runs more forwards than the routes hold)"
        )

    def describe(self, layer) -> str:
        if layer not in self.next_mb:
            return "no routes for this layer"
        return (
            f"{self.next_mb[layer]} of {len(self.per_layer[layer])} forward micro-batch(es) used, "
            f"{sum(self.recomputed[layer])} recompute(s) served"
        )

    def route(self, router, layer, logits, args, kwargs):
        guard_call(router, layer)
        total = len(self.per_layer[layer])
        mb = self.next_mb[layer]
        if mb >= total:
            raise RouteError(self.exhausted(layer, total))
        self.next_mb[layer] = mb + 1
        region = regions.forward_region()
        if region is not None:
            bind_forward(region, router, self, layer, mb)
            self.regions[layer][mb] = weakref.ref(region)
        mark_replayed(router)
        ids_TK = self._ids(router, layer, mb, logits)
        if self.fidelity is not None:
            self._count_agreement(router, layer, logits, ids_TK)
        hook = ReplayHook(ids_TK, self.per_layer[layer][mb])
        result = call_with_hook(self.original, router, hook, logits, args, kwargs)
        if region is not None and hook.plan is not None:  # its recompute repeats this call's ops (_RecomputeHook)
            self.ordered[(layer, mb)] = hook.plan
        return result

    def _count_agreement(self, router, layer: int, logits, ids_TK) -> None:
        """Tokens whose replayed experts are the ones native routing picks with the current weights.

        Native's choice is megatron-core's own ``topk_routing_with_score_function`` with the router's
        settings (score function, pre-softmax, groups, scaling, expert bias), before capacity dropping;
        read against megatron-core 0.19.2's ``TopKRouter.routing``. No side effects, no host sync."""
        from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function  # lazy: megatron

        config = router.config
        with torch.no_grad():
            _, native_TE = topk_routing_with_score_function(
                logits.detach().reshape(-1, router.num_experts),
                router.topk,
                use_pre_softmax=config.moe_router_pre_softmax,
                num_groups=config.moe_router_num_groups,
                group_topk=config.moe_router_group_topk,
                scaling_factor=config.moe_router_topk_scaling_factor,
                score_function=router.score_function,
                expert_bias=router.expert_bias,
                fused=False,
            )
            agree = native_TE.gather(1, ids_TK).all(dim=1).sum()
        assert self.fidelity is not None  # counted only when asked (``fidelity=True``)
        counts = self.fidelity.setdefault(layer, [torch.zeros((), dtype=torch.int64, device=agree.device), 0])
        counts[0] += agree
        counts[1] += int(ids_TK.shape[0])

    def fidelity_report(self) -> dict[int, float]:
        """``{layer: share of replayed tokens whose top-k equals native's}`` over the forwards so far."""
        if self.fidelity is None:
            raise UsageError("fidelity was not asked for: use session.replay(routes, fidelity=True)")
        return {
            layer: (int(agree) / tokens if tokens else 1.0) for layer, (agree, tokens) in sorted(self.fidelity.items())
        }

    def recompute(self, router, layer, mb, logits, args, kwargs):
        if self.recompute_mode is False:
            raise RouteError(
                f"layer {layer} rank {self.rank} mb {mb}: recompute of a replayed forward, but the "
                "replay was started with recompute=False (no recompute expected)"
            )
        self.recomputed[layer][mb] += 1
        ids_TK = self._ids(router, layer, mb, logits)
        plan = self.ordered.pop((layer, mb), None)  # a second recompute of one forward orders its ids again
        hook = ReplayHook(ids_TK, self.per_layer[layer][mb]) if plan is None else _RecomputeHook(plan)
        return call_with_hook(self.original, router, hook, logits, args, kwargs)

    def unused(self) -> list[str]:
        """One message per layer that left replayed micro-batches unused in a forward."""
        found = []
        for layer, mbs in self.per_layer.items():
            unused = list(range(self.next_mb[layer], len(mbs)))
            if unused:
                found.append(
                    f"layer {layer} rank {self.rank} mb {unused[0]}: {len(unused)} of {len(mbs)} replayed "
                    f"micro-batch(es) never used in a forward (expected {len(mbs)} forwards, "
                    f"got {self.next_mb[layer]})"
                )
        return found

    def problems(self) -> list[str]:
        found, unused = [], iter(self.unused())
        for layer, mbs in self.per_layer.items():
            if self.next_mb[layer] < len(mbs):  # unused() has one message per such layer, in this order
                found.append(next(unused))
            for mb in range(self.next_mb[layer]):
                got, ref = self.recomputed[layer][mb], self.regions[layer][mb]
                if got:
                    continue
                if self.recompute_mode is True:
                    why = (
                        "this forward ran in no checkpointed region, so nothing recomputes it: turn the model's "
                        "activation recompute on, or replay with recompute='auto'"
                        if ref is None
                        else "its backward pass did not run"
                    )
                    found.append(
                        f"layer {layer} rank {self.rank} mb {mb}: recomputed 0 time(s), expected at least 1 "
                        f"(recompute=True; {why})"
                    )
                elif ref is not None and ref() is not None:
                    found.append(
                        f"layer {layer} rank {self.rank} mb {mb}: its checkpointed forward's graph is alive "
                        "but was never recomputed (its backward has not run yet)"
                    )
        return found


def guard_call(router, layer: int) -> None:
    """Per-call checks of what Megatron routes this call by, which may change after a session started.

    The router's own copies of its settings (``semantics.ROUTER_COPIES``: ``routing_type``, ``score_function``,
    ``topk``, ...) are read, not its config: Megatron copies them at build time and routes by the copies.
    """
    if router.config.moe_router_fusion:
        raise UsageError(
            f"layer {layer}: moe_router_fusion was switched on while a replay session is active; "
            "the fused path would skip replay: set config.moe_router_fusion = False"
        )
    problem = semantics.router_problem(router, fusion=False)
    if problem is not None:
        raise UsageError(f"layer {layer} rank {current_rank()}: {problem}")
    native = router.router_replay
    if native is not None and getattr(native, "router_replay_action", None) is not None:
        raise UsageError(
            f"layer {layer}: megatron-core's native RouterReplay action "
            f"{native.router_replay_action} is set on a router held by a moeverify session; use one "
            "replay implementation at a time (clear_global_router_replay_action())"
        )
