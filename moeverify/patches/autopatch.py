"""Router replay for jobs you cannot edit: ``import moeverify.patches.autopatch`` with an env var set.

``MOEVERIFY_ROUTER_REPLAY=record:DIR`` records every forward routing call of the process's MoE
model; at exit each rank writes its routes to ``DIR/rank{R:05d}`` (a one-rank routing dump in that
rank's local view, written with ``moeverify.record.save``). ``MOEVERIFY_ROUTER_REPLAY=replay:DIR``
replays them: the same job under the same layout and micro-batching routes every forward, and every
recompute, exactly as recorded (FIFO per layer over the whole process). At exit a replay reports
routes left unused or recomputes that never came, on stderr.

The process-wide session binds routers lazily, on their first routing call, keyed by global layer
number. The first router seen for a layer wins; a second model's router of the same layer (e.g. a
reference model beside the actor) is left native and named once in a warning.

Import it where the job starts (``python -c "import moeverify.patches.autopatch; ..."``, a
``sitecustomize``, or ``PYTHONSTARTUP``); with the variable unset, importing does nothing.
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import sys
import warnings
import weakref
from pathlib import Path

import torch

from moeverify.errors import RouteError, UsageError
from moeverify.patches import replay_state as state
from moeverify.patches import router_replay as rr

ENV = "MOEVERIFY_ROUTER_REPLAY"
MODES = ("record", "replay")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Setting:
    """What the environment asked for."""

    mode: str
    directory: Path

    def rank_dir(self, rank: int) -> Path:
        return self.directory / f"rank{rank:05d}"


def parse(value: str) -> Setting:
    """``"record:DIR"`` / ``"replay:DIR"`` -> ``Setting``; ``UsageError`` naming the variable otherwise."""
    mode, sep, directory = value.partition(":")
    if not sep or mode not in MODES or not directory:
        raise UsageError(f"{ENV}={value!r}: expected record:DIR or replay:DIR")
    return Setting(mode=mode, directory=Path(directory))


class ProcessSession:
    """The process-wide record or replay state behind ``autopatch``."""

    def __init__(self, setting: Setting):
        self.setting = setting
        self._bound: dict[int, weakref.ref] = {}
        self._ignored: weakref.WeakSet = weakref.WeakSet()
        self._state = None
        self._shape: tuple[int, int] | None = None

    def _start(self, router) -> None:
        rank = state.current_rank()
        self._shape = (router.num_experts, router.topk)
        if self.setting.mode == "record":
            self._state = state.Recording((), original=rr.original_routing())
            return
        from moeverify import record

        routes = record.load(self.setting.rank_dir(rank)).routes(step=0)
        if (routes.num_experts, routes.topk) != self._shape:
            raise RouteError(f"rank {rank}: {self.setting.rank_dir(rank)} holds routes for (num_experts, topk) = "
                             f"({routes.num_experts}, {routes.topk}) != this model's {self._shape}")
        per_layer = {layer: tuple(routes.get(layer, mb).to(router.weight.device, dtype=torch.int64)
                                  for mb in range(routes.microbatches)) for layer in routes.layers}
        self._state = state.Replaying(per_layer, recompute="auto", rank=rank, original=rr.original_routing())

    def bind(self, router):
        """``rr.set_fallback`` binder: ``(state, layer)`` for this process's model, None for others."""
        if router in self._ignored:
            return None
        layer = rr.global_layer(router)
        held = self._bound.get(layer)
        current = held() if held is not None else None
        if current is not None and current is not router:
            self._ignored.add(router)
            warnings.warn(f"{ENV}: a second router claims layer {layer} (another model in this process); it "
                          "routes natively", stacklevel=2)
            return None
        if self._state is None:
            self._start(router)
        if current is None:  # first call of this layer, or its model was rebuilt
            rr.refuse_config(router.config, layer, disable_fusion=False)
            if isinstance(self._state, state.Recording):
                self._state.per_layer.setdefault(layer, [])
            elif layer not in self._state.per_layer:
                raise RouteError(f"layer {layer} rank {self._state.rank}: {self.setting.directory} holds no routes "
                                 f"for this layer; it holds {sorted(self._state.per_layer)}")
            self._bound[layer] = weakref.ref(router)
        return self._state, layer

    def routes(self):
        """What was recorded so far, as ``Routes`` (record mode)."""
        from moeverify.routes import Routes

        if not isinstance(self._state, state.Recording) or not self._state.per_layer:
            raise UsageError(f"{ENV}: nothing recorded in this process")
        return Routes(self._state.per_layer, num_experts=self._shape[0], topk=self._shape[1])

    def finish(self) -> None:
        """Write the recording (record) or report unconsumed routes (replay); run at exit."""
        if self._state is None:
            return
        if isinstance(self._state, state.Recording):
            from moeverify import record

            record.save(self.setting.rank_dir(state.current_rank()), self.routes(), step=0)
            return
        for problem in self._state.problems():
            print(f"{ENV}: {problem}", file=sys.stderr)


_SESSION: ProcessSession | None = None


def install(setting: Setting) -> ProcessSession:
    """Apply the patch and route every unbound router through a process-wide session."""
    global _SESSION
    rr.apply()
    _SESSION = ProcessSession(setting)
    rr.set_fallback(_SESSION.bind)
    atexit.register(_SESSION.finish)
    return _SESSION


def uninstall() -> None:
    """Remove the process-wide session (the patch itself stays applied)."""
    global _SESSION
    if _SESSION is not None:
        atexit.unregister(_SESSION.finish)
    rr.set_fallback(None)
    _SESSION = None


def session() -> ProcessSession | None:
    return _SESSION


if os.environ.get(ENV):
    install(parse(os.environ[ENV]))
