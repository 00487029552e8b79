"""Router replay for Megatron-Core's ``TopKRouter``: record routes, replay them forward and in recompute.

Legend of shape suffixes: T = tokens of one router call (sequence x batch, local to the rank),
E = experts, K = top-k.

``apply()`` wraps ``TopKRouter.routing`` once per process (``revert()`` restores the original). The
wrapper does nothing for routers that no active ``ReplaySession`` holds. For a held router it lends
Megatron's own routing function a replay object through the ``router_replay=`` hook (the argument
Megatron-Core 0.16+ consults where it computes the top-k), so scores, probabilities, aux losses,
token dropping and expert-bias counts are all Megatron's code; only the selected ids change.

Sessions key routers by global layer number (0-based; an MTP layer ``i`` is ``num_layers + i``), found
by the one router finder (``moeverify.patches.routers``) from each router's own ``layer_number``, and
hold them through weak references: routers of other models are never touched, and a rebuilt model
needs a new session.

Recompute: a routing call made while autograd runs a backward pass is a recompute. It is matched
to the forward it repeats by the checkpointed region both ran in (``moeverify.patches.regions``),
so it gets that forward's routes in any backward order, also after the replay context has exited;
a recompute that matches no replayed forward of a router that replayed raises ``RouteError``.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Literal

import torch

from moeverify.errors import EnvironmentProblem, RouteError, UsageError, more
from moeverify.patches import agreement, compat, regions, replay_inputs, semantics
from moeverify.patches.replay_state import Recording, Replaying, current_rank, guard_call, route_recompute, route_unheld
from moeverify.patches.routers import find_routers, moe_stage_config
from moeverify.patches.semantics import RoutingMode
from moeverify.routing import views
from moeverify.routing.routes import Routes, validate_topk_ids
from moeverify.runtime import cpu as cpu_runtime

__all__ = ["apply", "revert", "is_applied", "ReplaySession", "RoutingMode"]

_ORIGINAL_ROUTING: Any = None  # the unpatched TopKRouter.routing while the patch is applied
# id(router) -> (active state, layer). Keyed by id, not by weak reference (a lookup on every routing call):
# an entry lives only inside a session's record()/replay() context, which holds the router strongly.
_ACTIVE: dict[int, tuple] = {}


_FALLBACK: Any = None  # router -> (state, layer) | None for routers no session holds (autopatch)
# router -> the Replaying of a replay() that exited cleanly and whose check_consumed() has not run: the next
# record()/replay() on that router, by any session, refuses micro-batches it left unused.
_UNCHECKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _refuse_unchecked(routers: dict[int, Any]) -> None:
    pending = {id(state): state for router in routers.values() if (state := _UNCHECKED.pop(router, None)) is not None}
    for state in pending.values():
        unused = state.unused()
        if unused:
            raise RouteError(
                f"the previous replay on these routers was never checked and left routes unused: "
                f"{unused[0]}{more(len(unused), 1)}; call session.check_consumed() after each replay (a forward "
                "skipped or fed twice shifts every later micro-batch onto other routes)"
            )


def _patched_routing(self, logits, *args, **kwargs):
    entry = _ACTIVE.get(id(self))
    if entry is None and _FALLBACK is not None:
        entry = _FALLBACK(self)
    if regions.in_backward():  # a recompute: served by the forward it repeats, held or not
        return route_recompute(self, entry, logits, args, kwargs, original=_ORIGINAL_ROUTING)
    if entry is None:
        return route_unheld(self, logits, args, kwargs, original=_ORIGINAL_ROUTING)
    state, layer = entry
    return state.route(self, layer, logits, args, kwargs)


def apply() -> None:
    """Patch ``TopKRouter.routing`` (idempotent); raise ``EnvironmentProblem`` on an unknown layout."""
    global _ORIGINAL_ROUTING
    if _ORIGINAL_ROUTING is not None and _current_routing() is _patched_routing:
        return
    api = compat.detect(allow_replaced=True)
    _ORIGINAL_ROUTING = api.routing
    _patched_routing.__moeverify_original__ = api.routing  # type: ignore[attr-defined]  # a marker on the function
    api.router_cls.routing = _patched_routing  # type: ignore[attr-defined]  # megatron's TopKRouter, found at run time


def revert() -> None:
    """Restore the original ``TopKRouter.routing``; refused while a session is recording or replaying."""
    global _ORIGINAL_ROUTING
    if _ORIGINAL_ROUTING is None:
        return
    if len(_ACTIVE):
        raise UsageError(
            f"cannot revert the router-replay patch while {len(_ACTIVE)} router(s) are held by an "
            "active record()/replay(); leave those contexts first"
        )
    from megatron.core.transformer.moe.router import TopKRouter  # lazy: megatron

    if _current_routing() is _patched_routing:
        TopKRouter.routing = _ORIGINAL_ROUTING
    _ORIGINAL_ROUTING = None


def _current_routing():
    from megatron.core.transformer.moe.router import TopKRouter  # lazy: megatron

    return TopKRouter.__dict__.get("routing")


def set_fallback(binder) -> None:
    """Install (or clear with None) the process-wide binder ``router -> (state, layer) | None``.

    Used by ``moeverify.patches.autopatch``; routers held by an active session never reach it.
    """
    global _FALLBACK
    _FALLBACK = binder


def original_routing():
    """Megatron's unpatched ``TopKRouter.routing`` (None while the patch is not applied)."""
    return _ORIGINAL_ROUTING


def is_applied() -> bool:
    return _ORIGINAL_ROUTING is not None


def graphs_built(chunks) -> bool:
    """Whether any module of ``chunks`` was built with Megatron-Core's own CUDA-graph manager (``cudagraph_manager``,
    made at construction when ``cuda_graph_impl="local"``): only such a layer captures and replays its forward.
    Version assumption: megatron-core 0.19's ``GraphableMegatronModule`` / ``TransformerLayer`` set that attribute."""
    return any(hasattr(m, "cudagraph_manager") for chunk in chunks for m in chunk.modules())


def refuse_config(router, layer: int, *, disable_fusion: bool, graphs: bool | None = None) -> None:
    """Refuse a router replay cannot serve: its routing mode read from what Megatron routes by (the router's
    own copies of its settings, ``RoutingMode.from_router``), then the config-wide settings.

    ``graphs``: whether the router's model holds Megatron-Core's CUDA-graph managers (``graphs_built``); where
    known, ``cuda_graph_impl="local"`` is refused only then (a config switched to it after the model was built
    captures nothing: Megatron-LM's RL loop sets it around every rollout). None: judged from the config."""
    config = router.config
    # the fields refuse_unreplayable reads, taken as RoutingMode.from_router takes them (no dataclass per step)
    problem = semantics.problem_of(
        score_function=router.score_function,
        load_balancing=semantics.balancing_types(router.routing_type),
        fused=not disable_fusion and bool(config.moe_router_fusion),
    )
    if problem is not None:
        raise UsageError(f"layer {layer}: {problem}")
    impl = getattr(config, "cuda_graph_impl", "none")
    captured = (impl not in (None, "none", "local")) or (impl == "local" and graphs is not False)
    if captured or getattr(config, "enable_cuda_graph", False):
        raise UsageError(
            f"layer {layer}: CUDA-graph capture (cuda_graph_impl={impl!r}) would replay a captured "
            "top-k and skip the routing hook; turn CUDA graphs off for replayed passes"
        )
    if getattr(config, "mtp_use_repeated_layer", False) and getattr(config, "mtp_num_layers", None):
        raise UsageError(
            f"layer {layer}: mtp_use_repeated_layer calls one MTP router several times per "
            "micro-batch; router replay keys one call per layer and micro-batch"
        )


def _device_of(routers: dict[int, Any]):
    """The routers' device (None: a dense stage, no router). Read every step: on CPU ranks outside the CPU runtime's
    redirection (a tensor attribute read goes through its torch function mode, microseconds each)."""
    if not routers:
        return None
    weight = next(iter(routers.values())).weight
    if cpu_runtime.installed():
        with torch._C.DisableTorchFunction():
            return weight.device
    return weight.device


def _check_view(view_of: tuple, rank: int) -> None:
    """Refuse a ``to_local`` view made for another rank: coordinates of another global rank, or of another place
    than Megatron gives this rank (a layout or rank order other than the job's), or the global rows read as another
    number of data-parallel batches than the job has (a wrong ``batch``). Each replays other tokens' routes.

    Megatron's ranks read from its ``parallel_state`` (``views.megatron_coords``), where it is initialized."""
    coords, dp_batches = view_of
    if coords.rank != rank:
        raise RouteError(
            f"rank {rank}: these routes are {coords.label()}'s view (to_local(coords=) of another rank); give "
            f"each rank its own: views.rank_coords(layout, rank=torch.distributed.get_rank(), world_size=...)"
        )
    from megatron.core import parallel_state as ps  # lazy: megatron

    if not ps.model_parallel_is_initialized():
        return
    placed = views.megatron_coords(rank)
    mine = {name: getattr(placed, name) for name in ("tp", "pp", "cp", "dp")}
    given = {name: getattr(coords, name) for name in mine}
    if given != mine:
        where = " ".join(f"{name}{value}" for name, value in mine.items())
        raise RouteError(
            f"rank {rank}: to_local was given {coords.label()}, but Megatron places this rank at {where}: the "
            f"layout (or rank order) given to views.rank_coords is not the job's"
        )
    world = ps.get_data_parallel_world_size()
    if dp_batches is not None and dp_batches != world:
        raise RouteError(
            f"rank {rank}: to_local read the global routes as {dp_batches} data-parallel batch(es) of batch x "
            f"seq_len tokens, this job has {world} data-parallel rank(s): check to_local's batch (the micro-batch "
            f"size of one data-parallel rank) and seq_len"
        )


def _layers_fix(routes: Routes, expected: tuple[int, ...]) -> str:
    given = routes.layers
    if len(given) == len(expected) and not set(expected) <= set(given):
        # As many layers as expected, numbered otherwise: MoE-only indices where dense layers come first.
        return (
            "routes are keyed by 0-based global layer number, dense layers counted (an MoE-only index is "
            f"not a layer number): key them by session.layers = {list(expected)}"
        )
    if getattr(routes, "order", None) == "sequence":
        # Every layer in sequence order (a rollout's or a merged recording): a stage needs its layers, and its own
        # tokens in router order, which to_local gives together.
        return (
            "these are global routes (sequence order): give this rank routes.to_local(layout, coords=..., "
            "seq_len=..., batch=..., num_layers=...), which keeps its stage's layers and its own tokens"
        )
    return "select this rank's layers with routes.select(session.layers)"


class ReplaySession:
    """Record and replay the routes of one model's routers.

    Args:
        model_chunks: the model (a module or a list of VPP chunks); every ``TopKRouter`` inside is bound,
            keyed by its global layer number.
        disable_fusion: switch ``config.moe_router_fusion`` off while recording or replaying (restored on
            exit) instead of refusing a fused router.
    """

    def __init__(self, model_chunks, *, disable_fusion: bool = False):
        if not isinstance(model_chunks, torch.nn.Module):
            model_chunks = list(model_chunks)
            if not model_chunks:
                raise UsageError("ReplaySession needs at least one model chunk")
        found = find_routers(model_chunks)
        stage = None if found else moe_stage_config(model_chunks)
        if not found and stage is None:
            raise UsageError(
                "ReplaySession found no TopKRouter in the model chunks (a dense model has nothing to replay)"
            )
        routers: list[Any] = [router for _, router in found.values()]  # megatron's TopKRouters
        for router in routers:
            if "router_replay" not in router.__dict__:
                raise EnvironmentProblem(
                    f"a {type(router).__name__} has no router_replay attribute; expected "
                    "megatron-core >= 0.16's TopKRouter.__init__ (it sets one)"
                )
        self._routers: dict[int, weakref.ref] = {layer: weakref.ref(router) for layer, (_, router) in found.items()}
        chunks = [model_chunks] if isinstance(model_chunks, torch.nn.Module) else model_chunks
        self._chunks = [weakref.ref(chunk) for chunk in chunks if isinstance(chunk, torch.nn.Module)]
        self._graphs = graphs_built([chunk for chunk in chunks if isinstance(chunk, torch.nn.Module)])
        # A pipeline stage of an MoE model holding only dense layers binds no router: it records and
        # replays no layer, with the model's expert count and top-k.
        shapes: set[tuple[int, int]] = {(r.num_experts, r.topk) for r in routers}
        if not shapes:
            assert stage is not None  # a dense stage: found no router, so moe_stage_config gave its config
            shapes = {(int(stage.num_moe_experts), int(stage.moe_router_topk))}
        if len(shapes) > 1:
            raise UsageError(f"routers of one session disagree on (num_experts, topk): {sorted(shapes)}")
        ((num_experts, topk),) = shapes
        self.num_experts: int = num_experts
        self.topk: int = topk
        self.disable_fusion = disable_fusion
        self._state: Recording | Replaying | None = None
        self._recording: Recording | None = None
        self._origin: replay_inputs.Origin | None = None
        self._replayed: Replaying | None = None
        self._prepared: tuple | None = None  # (Routes, its key fields, the routers' device, what _prepare made)

    @property
    def layers(self) -> tuple[int, ...]:
        """Sorted global layer numbers of the bound MoE layers."""
        return tuple(sorted(self._routers))

    @property
    def replaying(self) -> Replaying | None:
        """The state of the last ``replay()`` block (its routes, what it replayed and recomputed); None before."""
        return self._replayed

    def live_routers(self) -> dict[int, Any]:
        """``{global layer: router}`` of this session, each still alive (``UsageError`` for a freed one)."""
        live = {}
        for layer, ref in self._routers.items():
            router = ref()
            if router is None:
                raise UsageError(
                    f"the router of layer {layer} no longer exists (the model was rebuilt or freed); "
                    "create a new ReplaySession for the new model"
                )
            live[layer] = router
        return live

    def _check_startable(self) -> None:
        if not is_applied():
            raise UsageError("the router-replay patch is not applied; call router_replay.apply() first")
        if self._state is not None:
            raise UsageError(
                f"this session is already {type(self._state).__name__.strip('_').lower()}; "
                "record() and replay() cannot nest"
            )

    def _hold(self, state, routers: dict[int, Any]) -> dict[int, tuple]:
        """Check ``routers`` can be held by ``state`` and hold them: the enter half of a record()/replay() block.
        Returns the fusion settings to restore on release."""
        for layer, router in routers.items():
            if id(router) in _ACTIVE:
                raise UsageError(f"layer {layer}: its router is held by another active session")
        _refuse_unchecked(routers)
        saved_fusion: dict[int, tuple] = {}
        try:
            for layer, router in routers.items():
                refuse_config(  # per router: its own settings
                    router, layer, disable_fusion=self.disable_fusion, graphs=self._graphs
                )
                if self.disable_fusion and router.config.moe_router_fusion:
                    saved_fusion[id(router.config)] = (router.config, True)
                    router.config.moe_router_fusion = False
                guard_call(router, layer)
        except BaseException:  # a refused block leaves no router's fusion switched off
            for config, value in saved_fusion.values():
                config.moe_router_fusion = value
            raise
        for layer, router in routers.items():
            _ACTIVE[id(router)] = (state, layer)
        self._state = state
        return saved_fusion

    def _release(self, routers: dict[int, Any], saved_fusion: dict[int, tuple]) -> None:
        for router in routers.values():
            _ACTIVE.pop(id(router), None)
        for config, value in saved_fusion.values():
            config.moe_router_fusion = value
        self._state = None

    def record(self) -> contextlib.AbstractContextManager[None]:
        """Record the ids chosen by every forward routing call (several micro-batches: in order per layer)."""
        return _RecordBlock(self)

    def routes(self) -> Routes:
        """The routes of the last ``record()``: per layer, one ``[T, K]`` tensor per micro-batch."""
        if isinstance(self._state, Recording):
            raise UsageError(
                "routes() inside record(): the recording is complete when the record() block exits; "
                "call routes() after it"
            )
        if self._recording is None:
            raise UsageError("nothing recorded yet: run the forward passes inside `with session.record():`")
        counts = {layer: len(mbs) for layer, mbs in self._recording.per_layer.items()}
        if not self._routers:  # a dense stage: no layer, nothing recorded
            return Routes({}, num_experts=self.num_experts, topk=self.topk)
        if len(set(counts.values())) != 1 or not next(iter(counts.values())):
            raise RouteError(
                f"rank {current_rank()}: recorded micro-batch counts per layer are {counts}; every layer "
                "must record the same number (> 0) of forwards"
            )
        routes = Routes(self._recording.per_layer, num_experts=self.num_experts, topk=self.topk).in_order("router")
        assert self._origin is not None  # set with the recording when its block exited
        replay_inputs.register(routes, self._origin)  # replay checks the model and the token ids against these
        return routes

    def _check_routes(self, routes: Routes, rank: int) -> None:
        if not isinstance(routes, Routes):
            raise RouteError(f"rank {rank}: replay needs a Routes object, got {type(routes).__name__}")
        if (routes.num_experts, routes.topk) != (self.num_experts, self.topk):
            raise RouteError(
                f"rank {rank}: routes of another model: (num_experts, topk) = "
                f"({routes.num_experts}, {routes.topk}) != expected ({self.num_experts}, {self.topk})"
            )
        if routes.layers != self.layers:
            missing = sorted(set(self.layers) - set(routes.layers))
            extra = sorted(set(routes.layers) - set(self.layers))
            raise RouteError(
                f"rank {rank}: routes layers {list(routes.layers)} != expected {list(self.layers)} "
                f"(missing {missing}, extra {extra}); {_layers_fix(routes, self.layers)}"
            )
        if self.layers and routes.microbatches < 1:  # a dense stage replays no layer, and so no micro-batch
            raise RouteError(f"rank {rank}: routes hold no micro-batch")
        if routes.view_of is not None:
            _check_view(routes.view_of, rank)
        if getattr(routes, "order", None) == "sequence":
            raise RouteError(
                f"rank {rank}: these routes are in sequence order (row b * S + s: Routes.from_rollout, "
                f"Dump.routes, Routes.to_global), but a rank's routers see router "
                f"order (s * B + b) and only their own tokens; give this rank's view, "
                f"routes.to_local(layout, coords=, seq_len=, batch=, num_layers=) (on one rank "
                f"too: there it reorders the rows)"
            )

    def _prepare(self, routes: Routes) -> tuple[dict[int, Any], tuple]:
        """The live routers, and ``routes`` checked against this session and its model with their replay table:
        once per validated ``Routes`` (a trainer replays one every step; its ids are private copies once made, so
        what was checked stays so), every time for one built unchecked."""
        key = (routes.num_experts, routes.topk, routes.order)
        if isinstance(routes, Routes):
            routes.check_unwritten()  # its replay table is private copies: a write since would go unseen
        if self._prepared is not None and self._prepared[0] is routes and self._prepared[1] == key:
            routers = self.live_routers()
            if _device_of(routers) == self._prepared[2]:  # a model moved to another device takes a new table
                return routers, self._prepared[3]
        rank = current_rank()
        self._check_routes(routes, rank)
        routers = self.live_routers()
        device = _device_of(routers)
        # Replay routes with the Routes' private int64 copy on the router's device (made once per Routes). A
        # Routes built unchecked (``Routes.unchecked``) is checked here; a checked one was validated when built,
        # and checking it again would cost host syncs on every step.
        if not routes.validated:
            for layer in routes.layers:
                for mb in range(routes.microbatches):
                    validate_topk_ids(
                        routes.get(layer, mb),
                        layer=layer,
                        microbatch=mb,
                        num_experts=self.num_experts,
                        topk=self.topk,
                        rank=rank,
                    )
        given, ascending, tokens = routes.replay_table(device) if routers else ({}, {}, {})
        origin = replay_inputs.origin_of(routes)
        if origin is not None:
            replay_inputs.check_model(origin, routers, rank=rank)
        prepared = (given, ascending, tokens, origin)
        # kept for the next step only when nothing about these routes can change (``Routes.unchecked``: never)
        self._prepared = (routes, key, device, prepared) if routes.validated else None
        return routers, prepared

    def replay(
        self,
        routes: Routes,
        *,
        recompute: bool | Literal["auto"] = "auto",
        fidelity: bool = False,
        guard: bool | None = None,
    ) -> contextlib.AbstractContextManager[None]:
        """Replay ``routes`` in the forward passes run inside (in order per layer) and in their recomputes.

        Args:
            routes: this rank's routes for exactly this session's layers.
            recompute: ``"auto"``: a checkpointed forward is recomputed with its own routes whenever its
                backward runs (in any order, even after this context exits); ``check_consumed()`` flags a
                checkpointed forward whose graph is alive but was never recomputed. ``True``:
                ``check_consumed()`` also requires every forward to have been recomputed at least once.
                ``False``: a recompute of a replayed forward raises (forward-only passes).
            fidelity: also count, per layer, the tokens whose replayed top-k equals what native routing would
                pick with the current weights (``session.fidelity()`` after the block): the train/rollout
                routing agreement. Off by default; its cost is in ``bench/router_replay.py --fidelity``.
            guard: judge the replayed routes against native routing (``moeverify.patches.agreement``: the numbering
                check, an engine expert id that routes like another trainer expert, and the chance floor), before
                any optimizer step inside the block and when it exits, raising ``RouteError``. None (default): on
                for routes another process chose (``routes.provenance``: ``Routes.from_rollout``, a dump's
                ``routes()``), off for others; False turns it off. Its settings are in-job R3's
                (``MOEVERIFY_AGREEMENT=off``, ``MOEVERIFY_AGREEMENT_FLOOR``, ``MOEVERIFY_AGREEMENT_NUMBERING``); a
                guard the job started (``agreement.guard()``) counts the block instead.
        """
        if not isinstance(routes, Routes):
            raise UsageError(
                f"replay(routes): routes is a {type(routes).__name__}; replay takes a Routes (session.routes() after "
                f"record(), Routes.from_rollout(...) for an engine's arrays, record.load(dump).routes(), or "
                f"Routes({{layer: [ids per micro-batch]}}, num_experts=, topk=))"
            )
        if guard not in (None, True, False):
            raise UsageError(
                f"replay(guard={guard!r}): expected None (on for an engine's or a dump's routes), True or False"
            )
        return _ReplayBlock(
            self, routes, recompute, fidelity, routes.provenance is not None if guard is None else guard
        )

    def fidelity(self) -> dict[int, float]:
        """After ``replay(routes, fidelity=True)``: ``{layer: share of forward tokens whose replayed top-k expert
        set equals native routing's with the current weights}`` (1.0: replay changed nothing)."""
        if self._replayed is None:
            raise UsageError("fidelity() needs a replay first (`with session.replay(routes, fidelity=True): ...`)")
        return self._replayed.fidelity_report()

    def check_consumed(self) -> None:
        """Raise ``RouteError`` for a replayed micro-batch never used forward, or a checkpointed one never
        recomputed."""
        if self._replayed is None:
            raise UsageError("check_consumed() needs a replay first (`with session.replay(routes): ...`)")
        if self._state is self._replayed:
            raise UsageError("check_consumed() runs after the replay context has exited")
        for router in [r for r, state in list(_UNCHECKED.items()) if state is self._replayed]:
            _UNCHECKED.pop(router, None)
        problems = self._replayed.problems()
        if problems:
            raise RouteError(problems[0] + more(len(problems), 1))


class _RecordBlock:
    """``session.record()``: a class, not a generator context (a trainer enters one every step)."""

    __slots__ = ("session", "recording", "routers", "inputs", "saved_fusion")

    def __init__(self, session: ReplaySession):
        self.session = session

    def __enter__(self) -> None:
        session = self.session
        self.recording = Recording(session._routers, original=_ORIGINAL_ROUTING)
        session._check_startable()
        self.routers = session.live_routers()
        self.inputs = replay_inputs.InputLog(session._chunks)
        try:
            self.saved_fusion = session._hold(self.recording, self.routers)
        except BaseException:
            self.inputs.close()
            raise

    def __exit__(self, exc_type, exc, tb) -> None:
        session = self.session
        try:
            session._release(self.routers, self.saved_fusion)
        finally:
            self.inputs.close()
        if exc_type is None:
            session._recording = self.recording
            session._origin = replay_inputs.Origin(session._routers, self.inputs)


class _ReplayBlock:
    """``session.replay(routes)``: a class, not a generator context (a trainer enters one every step)."""

    __slots__ = (
        "session",
        "routes",
        "recompute",
        "fidelity",
        "routers",
        "replaying",
        "inputs",
        "origin",
        "saved_fusion",
        "guard",
        "judge",
        "agreement",
    )

    def __init__(self, session: ReplaySession, routes: Routes, recompute, fidelity: bool, judge: bool):
        self.session, self.routes, self.recompute, self.fidelity = session, routes, recompute, fidelity
        self.judge = judge
        self.agreement: agreement.Guard | None = (
            None  # the block's own agreement guard (``judge`` and no guard of the job's)
        )

    def __enter__(self) -> None:
        if self.recompute not in ("auto", True, False):
            raise UsageError(f"recompute must be 'auto', True or False, got {self.recompute!r}")
        session = self.session
        session._check_startable()
        self.routers, (given, ascending, tokens, self.origin) = session._prepare(self.routes)
        self.replaying = Replaying(
            given,
            recompute=self.recompute,
            rank=None,
            original=_ORIGINAL_ROUTING,
            fidelity=self.fidelity,
            sorted_ids=ascending,
            tokens=tokens,
        )
        session._replayed = self.replaying
        origin = self.origin
        self.inputs = (
            replay_inputs.InputLog(session._chunks, like=origin.inputs)
            if origin is not None and origin.compared
            else None
        )
        self.guard = None
        try:
            # the forwards' token ids checked before any optimizer step inside the block, the rest at its exit
            if self.inputs is not None:
                self.guard = replay_inputs.StepGuard(origin.inputs, self.inputs, lambda: self.replaying.rank)
            self.saved_fusion = session._hold(self.replaying, self.routers)
            if self.judge and agreement.ACTIVE is None:  # the settings of in-job R3 (MOEVERIFY_AGREEMENT_*)
                self.agreement = agreement.from_env(in_job=True, floor_default=agreement.CHANCE, numbering_default=True)
                agreement.note_forward()  # every rank decides at the next optimizer step, a dense stage's too
        except BaseException:
            if self.inputs is not None:
                self.inputs.close()
            if self.guard is not None:
                self.guard.close()
            raise

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            self.session._release(self.routers, self.saved_fusion)
        finally:
            if self.inputs is not None:
                self.inputs.close()
            if self.guard is not None:
                self.guard.close()
            judged, self.agreement = self.agreement, None
            if judged is not None:
                agreement.stop()
        if exc_type is not None:  # never masks the block's own error
            return
        replaying = self.replaying
        for router in self.routers.values():
            _UNCHECKED[router] = replaying
        if self.guard is not None:
            self.guard.check()
        if judged is not None:
            judged.end_step()  # the forwards' routes against native routing, before any update after the block
