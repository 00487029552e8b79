"""Router-replay implementations under test, behind one small adapter interface.

An adapter is what an RL trainer does around Megatron's pipeline schedule to record routes in the
log-prob pass and replay them in the training pass. The replay oracles drive every implementation
through the same schedule and only talk to it through this interface:

- ``overrides()``: TransformerConfig attributes the implementation needs at build time;
- ``apply()``: process-wide patching, before any model is built (idempotent);
- ``bind(model_chunks)``: attach to one built model (its routers, keyed by global layer);
- ``record()`` / ``replay(routes)``: context managers around a whole pass;
- ``begin_pass(geometry)``: called inside ``record()`` / ``replay(routes)`` (or around a pass that does neither)
  before the pass's first forward, with its ``PassGeometry``: sequence length, sequences per micro-batch,
  micro-batches and the positions this rank's routers see, so a plugin can put the ``[T, K]`` routes of a router
  call (router order: token ``i`` is sequence ``i % B`` at ``positions[i // B]``) into sequences (optional);
- ``before_forward(chunk, mb)`` / ``after_forward(chunk, mb)``: called by the driver around every
  forward step of one model chunk, the hook points RL trainers use (verl sets per-micro-batch
  targets and flips REPLAY_FORWARD/REPLAY_BACKWARD there);
- ``routes()``: the recorded ``Routes``; ``check_consumed(recompute=...)``: failure messages.

Implementations: ``moeverify`` (moeverify.patches.router_replay), ``native`` (Megatron-Core's
``RouterReplay`` enabled by ``moe_enable_routing_replay``), ``verl`` (verl 0.9.1's
``router_replay_patch``, loaded by file path so that ``verl/__init__`` never runs), or
``module:factory`` for a user's own adapter (for example the mutants in ``faulty``).

Legend of shape suffixes: T = tokens (router order), K = top-k.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import importlib
import importlib.util
import io
import os
import sys
import types
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch

from moeverify.errors import MoEVerifyError, UsageError
from moeverify.patches import router_replay as rr
from moeverify.patches.routers import find_routers
from moeverify.routing.routes import Routes
from moeverify.spec import plugins
from moeverify.spec.checks import REPLAY_IMPLS

if TYPE_CHECKING:  # megatron ships no types: Any to mypy, named for the reader
    from megatron.core.transformer.moe.router import TopKRouter

IMPLS = REPLAY_IMPLS  # declared in moeverify.spec.checks


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class PassGeometry:
    """The tokens of one pass, as every router of this rank sees them (``ReplayImpl.begin_pass``).

    A router call of one micro-batch routes ``tokens = len(positions) * batch`` tokens in Megatron's router order
    (hidden states ``[s, b, h]`` flattened): token ``i`` is sequence ``i % batch`` of this rank's micro-batch at
    position ``positions[i // batch]`` of that sequence. ``positions`` is every position ``0 .. seq_len - 1``
    without context or sequence parallelism; under CP a rank holds two zigzag chunks, under SP its TP slice of them
    (``moeverify.routing.views.sequence_positions``). Sequences are this data-parallel rank's own."""

    seq_len: int  # S: tokens per sequence
    batch: int  # B: sequences per micro-batch on this rank
    microbatches: int  # M: micro-batches in the pass (router calls per MoE layer, recomputes aside)
    positions: tuple[int, ...]  # positions within a sequence this rank's routers see, in router order
    forward_only: bool  # a forward-only pass without grad (the log-prob pass), else forward and backward

    def __post_init__(self) -> None:
        self._validate()

    def _validate(self) -> None:
        if min(self.seq_len, self.batch, self.microbatches, len(self.positions)) < 1:
            raise UsageError(
                f"pass geometry: seq_len {self.seq_len}, batch {self.batch}, microbatches {self.microbatches} and "
                f"{len(self.positions)} position(s): each must be at least 1"
            )
        if not all(0 <= p < self.seq_len for p in self.positions):
            raise UsageError(f"pass geometry: positions {list(self.positions)} outside 0 .. {self.seq_len - 1}")

    @property
    def tokens(self) -> int:
        """``T``: tokens of one router call."""
        return len(self.positions) * self.batch

    def by_sequence(self, ids_TK: torch.Tensor) -> torch.Tensor:
        """One router call's ``[T, K]`` routes as ``[B, S_local, K]``: row ``b`` is sequence ``b`` at
        ``positions``."""
        if ids_TK.dim() != 2 or ids_TK.shape[0] != self.tokens:
            raise UsageError(
                f"pass geometry: routes of shape {tuple(ids_TK.shape)}, expected [T={self.tokens}, K] "
                f"({len(self.positions)} position(s) x batch {self.batch})"
            )
        return ids_TK.view(len(self.positions), self.batch, -1).transpose(0, 1)


class ReplayImpl(abc.ABC):
    """Base adapter: no patching, no per-step hooks. Subclasses fill in what they need."""

    name = "base"
    #: why this implementation cannot replay in recompute, or None when it can
    recompute_unsupported: str | None = None
    #: its models are Megatron-Core's own construction (``apply`` patches methods, never ``TopKRouter.__init__``):
    #: with no ``overrides``, Megatron's native replay can be attached to its build (``toggles.native_replay``)
    constructs_natively: bool = False

    def overrides(self) -> dict:
        return {}

    def builds_natively(self) -> bool:
        """Its build is the one Megatron's native replay and a pristine reference would make (``constructs_natively``
        and no ``overrides``): they may run on it instead of a build of their own."""
        return self.constructs_natively and not self.overrides()

    def apply(self) -> None:  # noqa: B027 (an optional hook: nothing to install by default)
        """Install what the adapter patches, before the model is built (optional)."""

    @abc.abstractmethod
    def bind(self, model_chunks: list) -> None:
        """Implemented by every adapter."""

    def unbind(self) -> None:  # noqa: B027 (an optional hook)
        """Drop every reference to the bound model, so that its memory is freed before the oracle builds the next
        one (optional: an adapter that keeps the model only costs memory)."""

    @abc.abstractmethod
    def record(self) -> contextlib.AbstractContextManager:
        """Implemented by every adapter."""

    @abc.abstractmethod
    def replay(self, routes: Routes) -> contextlib.AbstractContextManager:
        """Implemented by every adapter."""

    @abc.abstractmethod
    def routes(self) -> Routes:
        """Implemented by every adapter."""

    def begin_pass(self, geometry: PassGeometry) -> None:  # noqa: B027 (an optional hook)
        """Called at the start of every pass, inside ``record()`` / ``replay()``, with the tokens its routers see
        (optional): routes arrive and are recorded in router order, ``geometry`` says which token each row is."""

    def before_forward(self, chunk: int, mb: int) -> None:  # noqa: B027 (an optional hook)
        """Called before each forward of a model chunk and micro-batch (optional)."""

    def after_forward(self, chunk: int, mb: int) -> None:  # noqa: B027 (an optional hook)
        """Called after each forward of a model chunk and micro-batch (optional)."""

    def check_consumed(self, *, recompute: bool) -> list[str]:
        return []


class RouterReplayObject(Protocol):
    """A router's ``router_replay`` object as ``ActionReplay`` drives it (Megatron-Core's ``RouterReplay``, verl's
    copy)."""

    router_replay_action: Any  # the implementation's RouterReplayAction member, or None
    replay_backward_list: list[torch.Tensor]  # the targets queued for recompute
    # the replayed (probs, ids) of a router call; faulty's mutants wrap it on the instance
    get_replay_topk: Callable[..., tuple[torch.Tensor, torch.Tensor]]

    def set_target_indices(self, topk_indices: torch.Tensor) -> None: ...

    def get_recorded_indices(self) -> torch.Tensor | None: ...

    def set_router_replay_action(self, router_replay_action: Any) -> None: ...

    def clear_router_replay_action(self) -> None: ...

    def clear_indices(self) -> None: ...


def replay_object(router: TopKRouter) -> RouterReplayObject:
    """``router``'s ``router_replay`` object (``ActionReplay.bind`` checked that it has one)."""
    return cast(RouterReplayObject, router.router_replay)


class ActionReplay(ReplayImpl):
    """Drives a per-router ``router_replay`` object with RECORD / REPLAY_FORWARD / REPLAY_BACKWARD actions.

    Megatron-Core's native ``RouterReplay`` and verl's copy share this protocol: ``set_target_indices``
    sets the forward target and queues it for recompute, ``REPLAY_BACKWARD`` pops that queue.
    Routers are addressed through the bound model (never the process-global instance list, which
    also holds routers of every model built earlier in the process).
    """

    action_enum: Any = None  # the implementation's RouterReplayAction (an Enum class), set by subclasses

    def __init__(self) -> None:
        self._routers: dict[int, tuple[int, TopKRouter]] = {}
        self._recorded: dict[int, dict[int, torch.Tensor]] = {}
        self._replaying: Routes | None = None
        self._mode: str | None = None
        self._num_experts = 0
        self._topk = 0
        self._recompute_left: dict[int, int] = {}

    def overrides(self) -> dict:
        return {"moe_enable_routing_replay": True}

    def bind(self, model_chunks: list) -> None:
        routers: dict[int, tuple[int, TopKRouter]] = find_routers(model_chunks)
        self._routers = routers
        missing = [layer for layer, (_, r) in self._routers.items() if getattr(r, "router_replay", None) is None]
        if missing:
            raise MoEVerifyError(
                f"{self.name} replay: routers of layers {missing} have no router_replay object; "
                "was the model built with moe_enable_routing_replay=True after apply()?"
            )
        if self._routers:
            any_router = next(iter(self._routers.values()))[1]
            self._num_experts = int(any_router.config.num_moe_experts)
            self._topk = int(any_router.topk)

    def unbind(self) -> None:
        self._routers, self._recorded, self._replaying = {}, {}, None

    def _chunk_routers(self, chunk: int) -> Iterator[tuple[int, RouterReplayObject]]:
        for layer, (c, router) in self._routers.items():
            if c == chunk:
                yield layer, replay_object(router)

    def _set_all(self, action: Any) -> None:
        for _, router in self._routers.values():
            if action is None:
                replay_object(router).clear_router_replay_action()
            else:
                replay_object(router).set_router_replay_action(action)

    def _clear(self) -> None:
        for _, router in self._routers.values():
            replay_object(router).clear_indices()

    def _replayed(self) -> Routes:
        """The routes of the replay under way (``target`` is called inside ``replay()`` only)."""
        assert self._replaying is not None, "a replay target asked for outside replay()"
        return self._replaying

    @contextlib.contextmanager
    def record(self) -> Iterator[ActionReplay]:
        self._recorded = {layer: {} for layer in self._routers}
        self._mode = "record"
        self._set_all(self.action_enum.RECORD)
        try:
            yield self
        finally:
            self._mode = None
            self._set_all(None)
            self._clear()

    @contextlib.contextmanager
    def replay(self, routes: Routes) -> Iterator[ActionReplay]:
        self._replaying = routes
        self._mode = "replay"
        self._clear()
        try:
            yield self
        finally:
            self._recompute_left = {
                layer: len(replay_object(router).replay_backward_list) for layer, (_, router) in self._routers.items()
            }
            self._mode = None
            self._replaying = None
            self._set_all(None)
            self._clear()

    def target(self, layer: int, mb: int) -> torch.Tensor:
        """The route handed to ``layer`` for micro-batch ``mb`` (mutants override this)."""
        return self._replayed().get(layer, mb)

    def before_forward(self, chunk: int, mb: int) -> None:
        if self._mode == "replay":
            for layer, rr in self._chunk_routers(chunk):
                target_TK = self.target(layer, mb)
                # integer routes (uint8 from dumps) widened as trainers do; anything else passed as given
                rr.set_target_indices(target_TK if target_TK.is_floating_point() else target_TK.to(torch.int64))
                rr.set_router_replay_action(self.action_enum.REPLAY_FORWARD)

    def after_forward(self, chunk: int, mb: int) -> None:
        if self._mode == "record":
            for layer, rr in self._chunk_routers(chunk):
                ids_TK = rr.get_recorded_indices()
                if ids_TK is None:
                    raise MoEVerifyError(f"{self.name} replay: layer {layer} mb {mb}: nothing recorded")
                self._recorded[layer][mb] = ids_TK.detach().clone()
        elif self._mode == "replay":
            for _, rr in self._chunk_routers(chunk):
                rr.set_router_replay_action(self.action_enum.REPLAY_BACKWARD)

    def routes(self) -> Routes:
        per_layer = {layer: [mbs[m] for m in sorted(mbs)] for layer, mbs in self._recorded.items()}
        return Routes(per_layer, num_experts=self._num_experts, topk=self._topk)

    def check_consumed(self, *, recompute: bool) -> list[str]:
        # Without recompute nothing pops the recompute queue: entries left over are expected there.
        if not recompute:
            return []
        return [
            f"{self.name} replay: layer {layer}: {left} recompute route(s) never consumed"
            for layer, left in sorted(self._recompute_left.items())
            if left
        ]


class NativeReplay(ActionReplay):
    """Megatron-Core 0.19.2's ``RouterReplay`` (``moe_enable_routing_replay=True``)."""

    name = "native"

    def __init__(self) -> None:
        super().__init__()
        from megatron.core.transformer.moe.router_replay import RouterReplayAction  # lazy: megatron

        self.action_enum = RouterReplayAction


class VerlReplay(ActionReplay):
    """verl 0.9.1's ``router_replay_patch``: replaces ``TopKRouter.__init__``/``routing`` wholesale."""

    name = "verl"

    def __init__(self) -> None:
        super().__init__()
        self._module = load_verl_router_replay_patch()
        self.action_enum = self._module.RouterReplayAction

    def apply(self) -> None:
        pristine_snapshot()
        with contextlib.redirect_stdout(io.StringIO()):  # it prints a banner on every call
            self._module.apply_router_replay_patch()


class MoeverifyReplay(ReplayImpl):
    """moeverify's own patch (``moeverify.patches.router_replay``)."""

    name = "moeverify"
    constructs_natively = True  # patches TopKRouter.routing only

    def __init__(self) -> None:

        self._rr = rr
        self._session: rr.ReplaySession | None = None

    def apply(self) -> None:
        pristine_snapshot()
        self._rr.apply()

    def bind(self, model_chunks: list) -> None:
        self._session = self._rr.ReplaySession(model_chunks)

    def unbind(self) -> None:
        self._session = None

    def _bound(self) -> rr.ReplaySession:
        """The session of the bound model (every pass runs between ``bind`` and ``unbind``)."""
        assert self._session is not None, "moeverify replay used before bind()"
        return self._session

    def record(self) -> contextlib.AbstractContextManager:
        return self._bound().record()

    def replay(self, routes: Routes) -> contextlib.AbstractContextManager:
        return self._bound().replay(routes)

    def routes(self) -> Routes:
        return self._bound().routes()

    def check_consumed(self, *, recompute: bool) -> list[str]:
        try:
            self._bound().check_consumed()
        except MoEVerifyError as e:
            return [f"moeverify replay: {e}"]
        return []


def make_impl(spec: str) -> ReplayImpl:
    """The adapter named ``spec``: one of ``IMPLS``, ``module:factory`` or ``path/file.py:factory``."""
    factory = plugins.load(spec, what="replay implementation", builtins=IMPLS)
    impl = factory()
    if not isinstance(impl, ReplayImpl):
        raise UsageError(f"replay implementation {spec!r} returned {type(impl).__name__}, expected a ReplayImpl")
    return impl


# -- verl, loaded without running verl/__init__.py (it imports ray, tensordict, ...) -------------

_VERL_MODULE = "verl.utils.megatron.router_replay_patch"


def load_verl_router_replay_patch() -> types.ModuleType:
    """verl's router_replay_patch module, its parent packages registered as empty namespaces."""
    if _VERL_MODULE in sys.modules:
        return sys.modules[_VERL_MODULE]
    spec = importlib.util.find_spec("verl")
    if spec is None or not spec.submodule_search_locations:
        raise UsageError("--replay-impl verl needs the verl package (pip install --no-deps verl==0.9.1)")
    root = list(spec.submodule_search_locations)[0]
    path = root
    for name in ("verl", "verl.utils", "verl.utils.megatron"):
        if name != "verl":
            path = os.path.join(path, name.rsplit(".", 1)[1])
        if name not in sys.modules:
            pkg = types.ModuleType(name)
            pkg.__path__ = [path]
            sys.modules[name] = pkg
    file = os.path.join(root, "utils", "megatron", "router_replay_patch.py")
    mod_spec = importlib.util.spec_from_file_location(_VERL_MODULE, file)
    if mod_spec is None or mod_spec.loader is None:  # a .py path always has a source loader
        raise UsageError(f"--replay-impl verl: cannot load {file} (verl 0.9.1's router_replay_patch)")
    module = importlib.util.module_from_spec(mod_spec)
    sys.modules[_VERL_MODULE] = module
    mod_spec.loader.exec_module(module)
    return module


# -- Megatron-Core's own routing, restorable while a patch is applied ----------------------------

_PRISTINE: list[tuple[object, str, object]] | None = None


def _patch_points() -> list[tuple[object, str]]:
    from megatron.core.transformer.moe import moe_utils, router, token_dispatcher  # lazy: megatron

    return [
        (router.TopKRouter, "__init__"),
        (router.TopKRouter, "routing"),
        (router.TopKRouter, "forward"),
        (router, "topk_routing_with_score_function"),
        (moe_utils, "topk_routing_with_score_function"),
        (token_dispatcher.MoEAlltoAllTokenDispatcher, "preprocess"),
    ]


def pristine_snapshot() -> None:
    """Remember megatron-core's routing entry points; call before applying any replay patch."""
    global _PRISTINE
    if _PRISTINE is None:
        _PRISTINE = [
            (
                owner,
                name,
                owner.__dict__.get(name, getattr(owner, name)) if isinstance(owner, type) else getattr(owner, name),
            )
            for owner, name in _patch_points()
        ]


@contextlib.contextmanager
def pristine():
    """Megatron-Core's own routing entry points for the duration (patched ones restored after).

    Lets the native reference of ``native_parity`` run in a process where another implementation
    replaced ``TopKRouter`` methods; models built and run inside get Megatron's code only.
    """
    pristine_snapshot()
    current = [
        (owner, name, owner.__dict__.get(name) if isinstance(owner, type) else getattr(owner, name))
        for owner, name, _ in _PRISTINE
    ]
    try:
        for owner, name, value in _PRISTINE:
            setattr(owner, name, value)
        yield
    finally:
        for owner, name, value in current:
            if value is None:
                with contextlib.suppress(AttributeError):
                    delattr(owner, name)
            else:
                setattr(owner, name, value)
