"""Router replay for Megatron-Core's ``TopKRouter``: record routes, replay them forward and in recompute.

Legend of shape suffixes: T = tokens of one router call (sequence x batch, local to the rank),
E = experts, K = top-k.

``apply()`` wraps ``TopKRouter.routing`` once per process (``revert()`` restores the original). The
wrapper does nothing for routers that no active ``ReplaySession`` holds. For a held router it lends
Megatron's own routing function a replay object through the ``router_replay=`` hook (the argument
Megatron-Core 0.16+ consults where it computes the top-k), so scores, probabilities, aux losses,
token dropping and expert-bias counts are all Megatron's code; only the selected ids change.

Sessions key routers by global layer number (0-based; an MTP layer ``i`` is ``num_layers + i``),
found from each router's own ``layer_number``, and hold them through weak references: routers of
other models are never touched, and a rebuilt model needs a new session.

Recompute: a routing call made while autograd runs a backward pass is a recompute. It takes the
routes of the oldest replayed forward of the same layer that still waits for its recompute, so the
recomputed forward sees the same micro-batch's routes as its forward (Megatron's schedules run the
backward passes of one layer in forward order).
"""

from __future__ import annotations

import collections
import contextlib
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from moeverify.errors import RouteError, UsageError
from moeverify.patches import compat
from moeverify.patches.semantics import RoutingMode, refuse_unreplayable
from moeverify.routes import Routes

__all__ = ["apply", "revert", "is_applied", "ReplaySession", "RoutingMode"]

_ORIGINAL_ROUTING: Any = None  # the unpatched TopKRouter.routing while the patch is applied
_ACTIVE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # router -> (active state, layer)


_FALLBACK: Any = None  # router -> (state, layer) | None for routers no session holds (autopatch)


def _patched_routing(self, logits, *args, **kwargs):
    entry = _ACTIVE.get(self)
    if entry is None and _FALLBACK is not None:
        entry = _FALLBACK(self)
    if entry is None:
        return _ORIGINAL_ROUTING(self, logits, *args, **kwargs)
    state, layer = entry
    return state.route(self, layer, logits, args, kwargs)


def apply() -> None:
    """Patch ``TopKRouter.routing`` (idempotent); raise ``EnvironmentProblem`` on an unknown layout."""
    global _ORIGINAL_ROUTING
    if _ORIGINAL_ROUTING is not None and _current_routing() is _patched_routing:
        return
    api = compat.detect(allow_replaced=True)
    _ORIGINAL_ROUTING = api.routing
    _patched_routing.__moeverify_original__ = api.routing
    api.router_cls.routing = _patched_routing


def revert() -> None:
    """Restore the original ``TopKRouter.routing``; refused while a session is recording or replaying."""
    global _ORIGINAL_ROUTING
    if _ORIGINAL_ROUTING is None:
        return
    if len(_ACTIVE):
        raise UsageError(f"cannot revert the router-replay patch while {len(_ACTIVE)} router(s) are held by an "
                         "active record()/replay(); leave those contexts first")
    from megatron.core.transformer.moe.router import TopKRouter

    if _current_routing() is _patched_routing:
        TopKRouter.routing = _ORIGINAL_ROUTING
    _ORIGINAL_ROUTING = None


def _current_routing():
    from megatron.core.transformer.moe.router import TopKRouter

    return TopKRouter.__dict__.get("routing")


def set_fallback(binder) -> None:
    """Install (or clear with None) the process-wide binder ``router -> (state, layer) | None``.

    Used by ``moeverify.patches.autopatch``; routers held by an active session never reach it.
    """
    global _FALLBACK
    _FALLBACK = binder


def is_applied() -> bool:
    return _ORIGINAL_ROUTING is not None


def _in_backward() -> bool:
    """True while autograd's engine runs a backward pass (where checkpointed forwards are recomputed)."""
    return torch._C._current_graph_task_id() != -1


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_available() and torch.distributed.is_initialized() else 0


def _recompute_configured(config) -> bool:
    granularity = getattr(config, "recompute_granularity", None)
    if granularity == "full":
        return True
    return granularity == "selective" and "moe" in (getattr(config, "recompute_modules", None) or ())


def _call_with_hook(router, hook, logits, args, kwargs):
    saved = router.router_replay
    router.router_replay = hook
    try:
        return _ORIGINAL_ROUTING(router, logits, *args, **kwargs)
    finally:
        router.router_replay = saved


class _RecordHook:
    """Megatron's ``router_replay`` protocol: compute the native top-k and keep the ids."""

    __slots__ = ("sink",)

    def __init__(self, sink: list):
        self.sink = sink

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        values, topk_ids_TK = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        self.sink.append(topk_ids_TK.detach())
        return values, topk_ids_TK


class _ReplayHook:
    """Megatron's ``router_replay`` protocol: use the given ids, gather scores of the current weights."""

    __slots__ = ("topk_ids_TK",)

    def __init__(self, topk_ids_TK: torch.Tensor):
        self.topk_ids_TK = topk_ids_TK

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        return scores.gather(1, self.topk_ids_TK), self.topk_ids_TK


def _tokens(router, logits) -> int:
    return logits.numel() // router.num_experts


class _Recording:
    """State of ``session.record()``: the ids of every forward routing call, FIFO per layer."""

    def __init__(self, layers: Iterable[int]):
        self.per_layer: dict[int, list[torch.Tensor]] = {layer: [] for layer in layers}

    def route(self, router, layer, logits, args, kwargs):
        _guard_call(router, layer)
        if _in_backward():  # recompute of a recorded forward: route natively, record nothing
            return _ORIGINAL_ROUTING(router, logits, *args, **kwargs)
        return _call_with_hook(router, _RecordHook(self.per_layer[layer]), logits, args, kwargs)


class _Replaying:
    """State of ``session.replay(routes)``: per layer, the next forward micro-batch and pending recomputes."""

    def __init__(self, per_layer: dict[int, tuple[torch.Tensor, ...]], *, recompute: bool | str, rank: int):
        self.per_layer = per_layer
        self.recompute = recompute
        self.rank = rank
        self.next_mb = dict.fromkeys(per_layer, 0)
        self.pending = {layer: collections.deque() for layer in per_layer}
        self.recomputed = {layer: [0] * len(mbs) for layer, mbs in per_layer.items()}
        self.expected = {layer: [False] * len(mbs) for layer, mbs in per_layer.items()}

    def _expects_recompute(self, router) -> bool:
        if self.recompute is False or torch.is_grad_enabled():
            return False
        return self.recompute is True or (router.training and _recompute_configured(router.config))

    def _ids(self, router, layer: int, mb: int, logits) -> torch.Tensor:
        topk_ids_TK = self.per_layer[layer][mb]
        tokens = _tokens(router, logits)
        if topk_ids_TK.shape[0] != tokens:
            raise RouteError(f"layer {layer} rank {self.rank} mb {mb}: replay ids shape {tuple(topk_ids_TK.shape)}"
                             f" != expected (T={tokens}, K={router.topk}) for this router call")
        if topk_ids_TK.device != logits.device:
            topk_ids_TK = topk_ids_TK.to(logits.device)
        return topk_ids_TK

    def route(self, router, layer, logits, args, kwargs):
        _guard_call(router, layer)
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
        return _call_with_hook(router, _ReplayHook(self._ids(router, layer, mb, logits)), logits, args, kwargs)

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


def _guard_call(router, layer: int) -> None:
    """Per-call checks of settings that may change after a session started."""
    if router.config.moe_router_fusion:
        raise UsageError(f"layer {layer}: moe_router_fusion was switched on while a replay session is active; "
                         "the fused path would skip replay: set config.moe_router_fusion = False")
    native = router.router_replay
    if native is not None and getattr(native, "router_replay_action", None) is not None:
        raise UsageError(f"layer {layer}: megatron-core's native RouterReplay action "
                         f"{native.router_replay_action} is set on a router held by a moeverify session; use one "
                         "replay implementation at a time (clear_global_router_replay_action())")


def _routers_of(model_chunks) -> list:
    from megatron.core.transformer.moe.router import TopKRouter

    chunks = [model_chunks] if isinstance(model_chunks, torch.nn.Module) else list(model_chunks)
    if not chunks:
        raise UsageError("ReplaySession needs at least one model chunk")
    found, seen = [], set()
    for chunk in chunks:
        for module in chunk.modules():
            if isinstance(module, TopKRouter) and id(module) not in seen:
                seen.add(id(module))
                found.append(module)
    return found


def global_layer(router) -> int:
    """0-based global layer number of a router; an MTP router of depth ``i`` is ``num_layers + i``."""
    number = router.layer_number
    if number is None:
        raise UsageError("a TopKRouter has no layer_number (built outside a TransformerLayer); call "
                         "router.set_layer_number(n) with its 1-based global layer number")
    if getattr(router, "is_mtp_layer", False):
        return router.config.num_layers + number - 1
    return number - 1


def _refuse_config(config, layer: int, *, disable_fusion: bool) -> None:
    mode = RoutingMode.from_config(config)
    if disable_fusion:
        mode = RoutingMode(**{**{f: getattr(mode, f) for f in mode.__dataclass_fields__}, "fused": False})
    refuse_unreplayable(mode, where=f"layer {layer}")
    impl = getattr(config, "cuda_graph_impl", "none")
    if (impl not in (None, "none")) or getattr(config, "enable_cuda_graph", False):
        raise UsageError(f"layer {layer}: CUDA-graph capture (cuda_graph_impl={impl!r}) would replay a captured "
                         "top-k and skip the routing hook; turn CUDA graphs off for replayed passes")
    if getattr(config, "mtp_use_repeated_layer", False) and getattr(config, "mtp_num_layers", None):
        raise UsageError(f"layer {layer}: mtp_use_repeated_layer calls one MTP router several times per "
                         "micro-batch; router replay keys one call per layer and micro-batch")


class ReplaySession:
    """Record and replay the routes of one model's routers.

    Args:
        model_chunks: the model (a module or a list of VPP chunks); every ``TopKRouter`` inside is bound,
            keyed by its global layer number.
        disable_fusion: switch ``config.moe_router_fusion`` off while recording or replaying (restored on
            exit) instead of refusing a fused router.
    """

    def __init__(self, model_chunks, *, disable_fusion: bool = False):
        routers = _routers_of(model_chunks)
        if not routers:
            raise UsageError("ReplaySession found no TopKRouter in the model chunks (a dense model has nothing "
                             "to replay)")
        self._routers: dict[int, weakref.ref] = {}
        for router in routers:
            layer = global_layer(router)
            if layer in self._routers:
                raise UsageError(f"two routers claim global layer {layer}; pass the chunks of one model only")
            self._routers[layer] = weakref.ref(router)
        shapes = {(r.num_experts, r.topk) for r in routers}
        if len(shapes) > 1:
            raise UsageError(f"routers of one session disagree on (num_experts, topk): {sorted(shapes)}")
        (self.num_experts, self.topk), = shapes
        self.disable_fusion = disable_fusion
        self._state: _Recording | _Replaying | None = None
        self._recording: _Recording | None = None
        self._replayed: _Replaying | None = None

    @property
    def layers(self) -> tuple[int, ...]:
        """Sorted global layer numbers of the bound MoE layers."""
        return tuple(sorted(self._routers))

    def _live_routers(self) -> dict[int, Any]:
        live = {}
        for layer, ref in self._routers.items():
            router = ref()
            if router is None:
                raise UsageError(f"the router of layer {layer} no longer exists (the model was rebuilt or freed); "
                                 "create a new ReplaySession for the new model")
            live[layer] = router
        return live

    @contextlib.contextmanager
    def _active(self, state) -> Iterator[None]:
        if not is_applied():
            raise UsageError("the router-replay patch is not applied; call router_replay.apply() first")
        if self._state is not None:
            raise UsageError(f"this session is already {type(self._state).__name__.strip('_').lower()}; "
                             "record() and replay() cannot nest")
        routers = self._live_routers()
        for layer, router in routers.items():
            if router in _ACTIVE:
                raise UsageError(f"layer {layer}: its router is held by another active session")
        saved_fusion = {}
        for layer, router in routers.items():
            _refuse_config(router.config, layer, disable_fusion=self.disable_fusion)
            if self.disable_fusion and router.config.moe_router_fusion:
                saved_fusion[id(router.config)] = (router.config, True)
                router.config.moe_router_fusion = False
            _guard_call(router, layer)
        for layer, router in routers.items():
            _ACTIVE[router] = (state, layer)
        self._state = state
        try:
            yield
        finally:
            for router in routers.values():
                _ACTIVE.pop(router, None)
            for config, value in saved_fusion.values():
                config.moe_router_fusion = value
            self._state = None

    @contextlib.contextmanager
    def record(self) -> Iterator[None]:
        """Record the ids chosen by every forward routing call (several micro-batches: FIFO per layer)."""
        recording = _Recording(self._routers)
        with self._active(recording):
            yield
        self._recording = recording

    def routes(self) -> Routes:
        """The routes of the last ``record()``: per layer, one ``[T, K]`` tensor per micro-batch."""
        if self._recording is None:
            raise UsageError("nothing recorded yet: run the forward passes inside `with session.record():`")
        counts = {layer: len(mbs) for layer, mbs in self._recording.per_layer.items()}
        if len(set(counts.values())) != 1 or not next(iter(counts.values())):
            raise RouteError(f"rank {_rank()}: recorded micro-batch counts per layer are {counts}; every layer "
                             "must record the same number (> 0) of forwards")
        return Routes(self._recording.per_layer, num_experts=self.num_experts, topk=self.topk)

    def _check_routes(self, routes: Routes) -> None:
        rank = _rank()
        if not isinstance(routes, Routes):
            raise RouteError(f"rank {rank}: replay needs a Routes object, got {type(routes).__name__}")
        if (routes.num_experts, routes.topk) != (self.num_experts, self.topk):
            raise RouteError(f"rank {rank}: routes of another model: (num_experts, topk) = "
                             f"({routes.num_experts}, {routes.topk}) != expected ({self.num_experts}, {self.topk})")
        if routes.layers != self.layers:
            missing = sorted(set(self.layers) - set(routes.layers))
            extra = sorted(set(routes.layers) - set(self.layers))
            raise RouteError(f"rank {rank}: routes layers {list(routes.layers)} != expected {list(self.layers)} "
                             f"(missing {missing}, extra {extra}); select this rank's layers with "
                             "routes.select(session.layers)")
        if routes.microbatches < 1:
            raise RouteError(f"rank {rank}: routes hold no micro-batch")

    @contextlib.contextmanager
    def replay(self, routes: Routes, *, recompute: bool | str = "auto") -> Iterator[None]:
        """Replay ``routes`` in the forward passes run inside (FIFO per layer) and in their recomputes.

        Args:
            routes: this rank's routes for exactly this session's layers.
            recompute: ``"auto"``: a forward expects its recompute when the router is in training mode,
                grad is off (a checkpointed forward) and the config recomputes (full, or selective with
                "moe"); ``True``: every no-grad forward expects one; ``False``: none does (forward-only).
        """
        if recompute not in ("auto", True, False):
            raise UsageError(f"recompute must be 'auto', True or False, got {recompute!r}")
        self._check_routes(routes)
        device = next(iter(self._live_routers().values())).weight.device
        per_layer = {layer: tuple(routes.get(layer, mb).to(device=device, dtype=torch.int64)
                                  for mb in range(routes.microbatches)) for layer in routes.layers}
        replaying = _Replaying(per_layer, recompute=recompute, rank=_rank())
        self._replayed = replaying
        with self._active(replaying):
            yield

    def check_consumed(self) -> None:
        """Raise ``RouteError`` unless every replayed micro-batch was used once forward and once per recompute."""
        if self._replayed is None:
            raise UsageError("check_consumed() needs a replay first (`with session.replay(routes): ...`)")
        if self._state is self._replayed:
            raise UsageError("check_consumed() runs after the replay context has exited")
        problems = self._replayed.problems()
        if problems:
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            raise RouteError(problems[0] + more)
