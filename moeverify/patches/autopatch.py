"""Router replay for jobs you cannot edit: an entry point (or an import) driven by an environment variable.

``MOEVERIFY_ROUTER_REPLAY=record:DIR`` records every forward routing call of the job's MoE model;
``MOEVERIFY_ROUTER_REPLAY=replay:DIR`` replays them in the same job (same layout, same
micro-batching): every forward takes the next recorded micro-batch of its layer, and every
recompute takes the routes of the forward it repeats (matched by checkpoint region, any backward
order). Run the job through the entry point, which works as torchrun's script too::

    MOEVERIFY_ROUTER_REPLAY=record:/dumps/run1 python -m moeverify.patches.autopatch train.py ARGS
    MOEVERIFY_ROUTER_REPLAY=replay:/dumps/run1 torchrun --nproc-per-node 8 -m moeverify.patches.autopatch train.py ARGS

(``import moeverify.patches.autopatch`` before the job builds its models does the same.)

Which model: models are numbered by build order (the order their ``TopKRouter`` s are constructed;
a model's routers are built in increasing global layer order, so a router whose layer does not
increase starts the next model). With one MoE model nothing needs saying. With several (an actor
beside a reference model), ``MOEVERIFY_ROUTER_REPLAY_MODEL=N`` names the one to record and replay
(0 = built first) and the others route natively; left unset, the first routing call of a second
model raises ``UsageError``. Build order does not depend on which model runs first. An integration that knows
which model trains names it instead (``choose_model``).

Steps: every ``optimizer.step()`` (any ``torch.optim.Optimizer``) closes a step. Recording writes
the step's routes then into ONE routing dump at ``DIR`` for the whole job (every rank with its real
layout coordinates and micro-batch geometry, committed by rank 0 after every rank wrote:
``autopatch_dump``), one dump step per training step, so a crash loses at most the step in flight
and ``moeverify dump inspect/diff DIR`` read the merged view. Replay checks at each step that every layer ran exactly
the recorded step's forwards and that no checkpointed forward is left without its recompute, and raises ``RouteError``
in the training process if not; at exit, routes left unused fail the job (exit 3).

Refused before the job runs: a record directory that already holds files, an unknown mode, a
replay directory without this rank's dump.

``MOEVERIFY_ROUTER_REPLAY=r2`` is in-job replay instead: each step's log-prob forwards (grad disabled) record
and the step's training forwards replay their routes, found by token identity (``moeverify.patches.injob``).
``MOEVERIFY_ROUTER_REPLAY=r3:DIR`` replays a rollout engine's routes, written to DIR by
``moeverify.routing.rollout_writer.RolloutWriter``, in every forward of the bound model, found by token identity.
"""

from __future__ import annotations

import atexit
import dataclasses
import enum
import importlib
import itertools
import os
import runpy
import sys
import types
import weakref
from pathlib import Path

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from moeverify import record
from moeverify.errors import MoEVerifyError, RouteError, UsageError, more
from moeverify.patches import agreement, batch_routes, identity, injob
from moeverify.patches import replay_state as state
from moeverify.patches import router_replay as rr
from moeverify.patches.autopatch_dump import JobDump
from moeverify.patches.routers import global_layer
from moeverify.routing.routes import Routes
from moeverify.routing.views import job_layout

ENV = "MOEVERIFY_ROUTER_REPLAY"
MODEL_ENV = "MOEVERIFY_ROUTER_REPLAY_MODEL"


class Mode(enum.StrEnum):
    """What ``MOEVERIFY_ROUTER_REPLAY`` asks for (the text before ``:DIR``)."""

    RECORD = "record"  # record every routing call of the job to a dump (record:DIR)
    REPLAY = "replay"  # replay a recorded dump (replay:DIR)
    R2 = "r2"  # in-job replay of the log-prob pass (moeverify.patches.injob); no directory
    R3 = "r3"  # in-job replay of a rollout engine's routes: r3:DIR (RolloutWriter files) or r3 (with the batch)


MODES = (Mode.RECORD, Mode.REPLAY)  # the modes of a whole-job dump
INJOB = Mode.R2
ROLLOUT = Mode.R3
EXIT_UNUSED = 3  # exit status of a replayed job that left recorded routes unused


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Setting:
    """What the environment asked for."""

    mode: Mode
    directory: Path | None  # None in r2 mode; the rollout directory in r3 mode
    model: int | None = None  # build-order index of the model to bind; None: the only MoE model

    def __post_init__(self) -> None:
        if not isinstance(self.mode, Mode):  # a caller's "record" etc.: the mode it names, or UsageError
            try:
                object.__setattr__(self, "mode", Mode(self.mode))
            except ValueError:
                raise UsageError(f"Setting(mode={self.mode!r}): expected one of {[m.value for m in Mode]}") from None
        if self.mode in MODES and self.directory is None:
            raise UsageError(f"Setting(mode={self.mode.value!r}): a whole-job dump needs its directory")

    @property
    def dump(self) -> Path:
        """The dump directory of record / replay (always given there)."""
        assert self.directory is not None, self
        return self.directory


def parse(value: str, model: str | None = None) -> Setting:
    """``"record:DIR"`` / ``"replay:DIR"`` / ``"r2"`` / ``"r3:DIR"`` (+ the model index) -> ``Setting``;
    ``UsageError`` otherwise."""
    mode, sep, directory = value.partition(":")
    if value not in (INJOB, ROLLOUT) and (not sep or mode not in (*MODES, ROLLOUT) or not directory):
        raise UsageError(
            f"{ENV}={value!r}: expected record:DIR or replay:DIR, {INJOB} (in-job replay of the "
            f"log-prob pass), {ROLLOUT}:DIR (in-job replay of a rollout's routes written to DIR) or "
            f"{ROLLOUT} (the rollout's routes handed over with the batch: injob.add_routes)"
        )
    index = None
    if model not in (None, ""):
        if not (model.isascii() and model.isdigit()) or len(model) > 9:
            raise UsageError(f"{MODEL_ENV}={model[:40]!r}: expected a model index by build order (0, 1, ...)")
        index = int(model)
    return Setting(mode=Mode(mode), directory=Path(directory) if directory else None, model=index)


def _check_directory(setting: Setting, rank: int) -> None:
    directory = setting.directory
    if setting.mode is Mode.R2 or directory is None:  # r2, or r3 with the routes handed over with the batch
        return
    if setting.mode is Mode.R3:  # the rollout writes its steps while the job runs; the parent must exist
        if directory.exists() and not directory.is_dir():
            raise UsageError(f"{ENV}: {directory} is not a directory (the rollout routes' directory)")
        if not directory.exists() and not directory.parent.is_dir():
            raise UsageError(f"{ENV}: neither {directory} nor its parent exists (a typo?)")
        return
    if setting.mode is Mode.RECORD:
        if directory.exists() and (not directory.is_dir() or any(directory.iterdir())):
            raise UsageError(
                f"{ENV}: record directory {directory} already holds files (a previous "
                "recording?); record into a new or empty directory"
            )
    elif not (directory / "manifest.json").is_file():
        raise UsageError(
            f"{ENV}: {directory} holds no routing dump (expected "
            f"{directory / 'manifest.json'} from a record:{directory} run)"
        )


class BuildOrder:
    """Numbers routers by construction, to tell models apart by build order (see the module docstring)."""

    def __init__(self):
        self._counter = itertools.count()
        self._routers: list[weakref.ref] = []
        self._original_init = None

    def install(self) -> None:
        from megatron.core.transformer.moe.router import TopKRouter  # lazy: megatron

        if self._original_init is not None:
            return
        original = self._original_init = TopKRouter.__init__
        order = self

        def __init__(router, *args, **kwargs):
            original(router, *args, **kwargs)
            router.__dict__["_moeverify_built"] = next(order._counter)
            order._routers.append(weakref.ref(router))
            # From the first call on (binding happens inside the first routing call, after pre-hooks ran).
            router.register_forward_pre_hook(_note_input_shape)

        __init__.__wrapped__ = original  # type: ignore[attr-defined]  # undone by uninstall()
        TopKRouter.__init__ = __init__

    def uninstall(self) -> None:
        if self._original_init is not None:
            from megatron.core.transformer.moe.router import TopKRouter  # lazy: megatron

            TopKRouter.__init__ = self._original_init
            self._original_init = None

    def models(self) -> list[list]:
        """Live routers grouped into models, in build order."""
        models: list[list] = []
        last = None
        for ref in self._routers:
            router = ref()
            if router is None or router.layer_number is None:
                continue
            layer = global_layer(router)
            if last is None or layer <= last:
                models.append([])
            models[-1].append(router)
            last = layer
        return models

    def model_of(self, router) -> tuple[int, list[list]]:
        if "_moeverify_built" not in router.__dict__:
            raise UsageError(
                f"{ENV}: a TopKRouter (layer {global_layer(router)}) was built before "
                "moeverify.patches.autopatch was installed; start the job through "
                "`python -m moeverify.patches.autopatch SCRIPT` or import it before building models"
            )
        models = self.models()
        for index, routers in enumerate(models):
            if any(r is router for r in routers):
                return index, models
        raise AssertionError("a stamped router is missing from the build order")


def selected(order: BuildOrder, setting: Setting, router) -> bool:
    """Whether ``router`` belongs to the model ``setting`` names (or ``choose_model`` chose); ``UsageError`` when
    several are built and none is."""
    if _CHOSEN:
        return router in _CHOSEN[0]
    index, models = order.model_of(router)
    if setting.model is None and len(models) > 1:
        raise UsageError(
            f"{ENV}: {len(models)} MoE models are built in this process ({_describe(models)}); "
            f"set {MODEL_ENV}=N to name the model to {setting.mode} by build order "
            "(0 = built first); the others then route natively"
        )
    return index == (setting.model or 0)


def choose_model(chunks=None) -> None:
    """Bind the MoE model of ``chunks`` (its model chunks), whatever the build order; every other model routes
    natively. ``None``: no model chosen yet, every model routes natively until one is. For an integration that knows
    which model trains (``moeverify.integrations.verl``), before that model's first routing call."""
    from megatron.core.transformer.moe.router import TopKRouter  # lazy: megatron

    chosen: weakref.WeakSet = weakref.WeakSet()
    for chunk in chunks or ():
        chosen.update(m for m in chunk.modules() if isinstance(m, TopKRouter))
    _CHOSEN[:] = [chosen]


def _describe(models: list[list]) -> str:
    return "; ".join(f"model {i}: layers {[global_layer(r) for r in routers]}" for i, routers in enumerate(models))


class ProcessSession:
    """The process-wide record or replay state behind ``autopatch``."""

    def __init__(self, setting: Setting, *, order: BuildOrder):
        self.setting = setting
        self.order = order
        self._bound: dict[int, weakref.ref] = {}
        self._native: weakref.WeakSet = weakref.WeakSet()
        self._state: _ShapedRecording | _JobReplaying | None = None
        self._shape: tuple[int, int] = (0, 0)  # the bound model's (num_experts, topk), from its first router
        self.step = 0
        # replay: recorded step (the optimizer-step count when it was written) -> cumulative forwards per layer
        # at its end; optimizer steps that recorded nothing (a critic's) have no entry
        self._step_ends: dict[int, int] = {}
        self._config = None  # the bound model's TransformerConfig
        self._dump = JobDump(setting.dump) if setting.mode is Mode.RECORD else None
        self._tokens = identity.JobTokens(rank=state.current_rank)  # token fingerprints per forward
        self._first_chunks: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # chunk -> takes fingerprints

    @property
    def rank(self) -> int:
        # Read at use: the session is installed before the job initialises torch.distributed.
        return state.current_rank()

    def _start(self, router) -> None:
        self._shape = (router.num_experts, router.topk)
        self._config = router.config
        if self.setting.mode is Mode.RECORD:
            self._state = _ShapedRecording((), original=rr.original_routing())
            return
        dump = record.load(self.setting.dump)
        _check_same_job(dump, router.config, rank=self.rank, directory=self.setting.dump)
        per_layer: dict[int, list] = {}
        for step in sorted(dump.steps):
            # The rank's own rows in its router's order: what replay feeds back to the same routers
            # (the merged, sequence-order view is for comparing, not replaying).
            routes = dump.local_routes(step=step, rank=self.rank)
            if (routes.num_experts, routes.topk) != self._shape:
                raise RouteError(
                    f"rank {self.rank}: {self.setting.directory} holds routes for (num_experts, "
                    f"topk) = ({routes.num_experts}, {routes.topk}) != this model's {self._shape}"
                )
            for layer in routes.layers:
                per_layer.setdefault(layer, []).extend(
                    routes.get(layer, mb).to(router.weight.device, dtype=torch.int64)
                    for mb in range(routes.microbatches)
                )
            self._step_ends[step] = (max(self._step_ends.values(), default=0)) + routes.microbatches
        self._state = _JobReplaying(
            {k: tuple(v) for k, v in per_layer.items()},
            session=self,
            recompute="auto",
            rank=self.rank,
            original=rr.original_routing(),
        )

    def note_forward(self, chunk, fingerprints_B) -> None:
        """A ``GPTModel`` forward (``identity.ChunkTokens``): the bound model's first chunk on this rank records
        its input sequences' fingerprints (record) or refuses tokens other than the recorded ones (replay)."""
        first = self._first_chunks.get(chunk)
        if first is None:
            routers = [r for r in identity.routers_of(chunk) if r.layer_number is not None]
            if routers:
                lowest = min(routers, key=global_layer)
                if selected(self.order, self.setting, lowest):
                    index, models = self.order.model_of(lowest)
                    first = global_layer(lowest) == min(global_layer(r) for r in models[index])
            first = self._first_chunks[chunk] = bool(first)
        if not first:
            return
        if self.setting.mode is Mode.RECORD:
            self._tokens.record(fingerprints_B)
            return
        if not self._tokens.loaded:
            dump = record.load(self.setting.dump)
            # The layout first: in another layout of the same world size a rank's tokens differ too, and the
            # token check would blame the data for what the layout changed.
            _check_same_job(dump, chunk.config, rank=self.rank, directory=self.setting.dump)
            self._tokens.load(dump, self.setting.dump)
        self._tokens.check(fingerprints_B)

    def bind(self, router):
        """``rr.set_fallback`` binder: ``(state, layer)`` for the selected model's routers, None for others."""
        if router in self._native:
            return None
        layer = global_layer(router)
        held = self._bound.get(layer)
        current = held() if held is not None else None
        if current is not router:
            if not selected(self.order, self.setting, router):
                self._native.add(router)
                return None
            if self._state is None:
                self._start(router)
            rr.refuse_config(router, layer, disable_fusion=False)
            if isinstance(self._state, state.Recording):
                self._state.per_layer.setdefault(layer, [])
            elif layer not in self._state.per_layer:
                raise RouteError(
                    f"layer {layer} rank {self.rank}: {self.setting.directory} holds no routes for this "
                    f"layer; it holds {sorted(self._state.per_layer)}"
                )
            self._bound[layer] = weakref.ref(router)
        return self._state, layer

    def routes(self):
        """What was recorded since the last step, as ``Routes`` (record mode)."""
        if not isinstance(self._state, state.Recording) or not any(self._state.per_layer.values()):
            raise UsageError(f"{ENV}: nothing recorded in this process")
        return Routes(self._state.per_layer, num_experts=self._shape[0], topk=self._shape[1]).in_order("router")

    def end_step(self) -> None:
        """Close a training step: write it (record) or check it (replay); raise ``RouteError`` on a mismatch.

        Recording is collective: every rank takes part at every step, also a rank that routed nothing."""
        if self.setting.mode is Mode.RECORD:
            assert self._dump is not None  # made with the session in record mode
            recording = self._state if isinstance(self._state, _ShapedRecording) else None
            recorded = recording is not None and any(recording.per_layer.values())
            routes = self.routes() if recorded else None
            fingerprints = self._tokens.take_step(routes.microbatches if routes is not None else 0)
            self._dump.write_step(
                step=self.step,
                routes=routes,
                config=self._config,
                shapes=recording.shapes if recording is not None and recorded else {},
                shape=self._shape,
                fingerprints=fingerprints if recorded else None,
            )
            if recording is not None and recorded:
                for mbs in recording.per_layer.values():
                    mbs.clear()
                recording.shapes.clear()
        elif self._state is not None:
            self._check_step()
        self.step += 1

    def _check_step(self) -> None:
        replaying = self._state
        assert isinstance(replaying, _JobReplaying)  # replay mode, started
        # The forwards the recording had made by the end of this optimizer step: those of the last recorded
        # step at or before it (an optimizer step that recorded nothing, say a critic's, adds none).
        done = [end for step, end in self._step_ends.items() if step <= self.step]
        want = max(done, default=0)
        got = {layer: replaying.next_mb[layer] for layer in self._bound}
        wrong = {layer: n for layer, n in got.items() if n != want}
        if wrong:
            raise RouteError(
                f"rank {self.rank} optimizer step {self.step}: forwards replayed so far per layer {wrong} "
                f"!= the recording's {want} by the end of this step (the job's micro-batching or its "
                f"optimizer steps differ from the recorded run's)"
            )
        stale = [p for p in replaying.problems() if "never recomputed" in p]
        if stale:
            raise RouteError(f"step {self.step}: {stale[0]}{more(len(stale), 1)}")

    def finish(self) -> list[str]:
        """At the end of the job: write the last step (record); return replay problems (routes left unused)."""
        if self.setting.mode is Mode.RECORD:
            assert self._dump is not None  # made with the session in record mode
            pending = isinstance(self._state, state.Recording) and any(self._state.per_layer.values())
            if pending and self._dump.world > 1 and not torch.distributed.is_initialized():
                return [
                    f"{ENV}: rank {self.rank}: forwards after the last optimizer.step() were not written: the job "
                    f"destroyed torch.distributed before exit, and committing a step needs every rank; end the "
                    f"job with an optimizer step, or keep the process group until exit"
                ]
            if pending or self._dump.world == 1:
                self.end_step()
            return []
        if not isinstance(self._state, _JobReplaying):  # replay mode that never routed
            return []
        return [f"{ENV}: {p}" for p in self._state.problems()]


class _JobReplaying(state.Replaying):
    """Whole-job replay: one queue of forwards per layer over every recorded step; its messages name steps (a queue
    index is a forward of the job, not a micro-batch of a step)."""

    def __init__(self, per_layer, *, session: ProcessSession, **kwargs):
        super().__init__(per_layer, **kwargs)
        self.session = session

    def exhausted(self, layer: int, total: int) -> str:
        s = self.session
        return (
            f"layer {layer} rank {self.rank}: optimizer step {s.step} runs forward {total + 1} of the job, but "
            f"{s.setting.directory} holds {total} ({len(s._step_ends)} recorded step(s)): the job runs more steps "
            "or micro-batches than the recorded run"
        )

    def unused(self) -> list[str]:
        found, ends = [], sorted(self.session._step_ends.items())
        for layer, mbs in self.per_layer.items():
            ran = self.next_mb[layer]
            if ran < len(mbs):
                short = [step for step, end in ends if end > ran]
                found.append(
                    f"layer {layer} rank {self.rank}: the job ran {ran} of the {len(mbs)} forwards "
                    f"{self.session.setting.directory} holds; recorded step(s) {short} did not run in full (the job "
                    "ended before the recorded run did)"
                )
        return found


class _ShapedRecording(state.Recording):
    """Recording that also keeps each forward's router input ``[s_local, b]`` (the micro-batch geometry)."""

    def __init__(self, layers, *, original):
        super().__init__(layers, original=original)
        self.shapes: dict[int, list] = {}

    def route(self, router, layer, logits, args, kwargs):
        self.shapes.setdefault(layer, []).append(router.__dict__.get("_moeverify_input_sb"))
        return super().route(router, layer, logits, args, kwargs)


def _note_input_shape(router, args) -> None:
    hidden = args[0] if args else None
    router.__dict__["_moeverify_input_sb"] = (
        tuple(int(n) for n in hidden.shape[:2]) if isinstance(hidden, torch.Tensor) and hidden.dim() == 3 else None
    )


def _check_same_job(dump, config, *, rank: int, directory: Path) -> None:
    """Replay only into the job that was recorded: same world size and layout (and so the same ranks' rows)."""
    layout, coords, world = job_layout(sp=bool(getattr(config, "sequence_parallel", False)))
    if dump.world_size != world or (world > 1 and (dump.layout != layout or dump.coords.get(rank) != coords)):
        raise UsageError(
            f"{ENV}: {directory} was recorded on {dump.world_size} rank(s) with layout "
            f"{dump.layout.name(dump.world_size)}; this job runs {world} rank(s) with layout "
            f"{layout.name(world)} ({coords.label()}"
            + (f", recorded there: {dump.coords[rank].label()}" if rank in dump.coords else "")
            + "); replay in the recorded layout"
        )


_SESSION: ProcessSession | injob.InJobSession | None = None  # injob.InJobSession in r2 / r3 mode
_HOOKS: list = []
_ORDER = BuildOrder()  # one per process: routers built under an earlier install stay numbered
_CHOSEN: list[weakref.WeakSet] = []  # choose_model(): the chosen model's routers, which alone are bound
_CHUNKS: injob.ChunkHooks | identity.ChunkTokens | None = None  # ChunkHooks in r2 / r3; ChunkTokens otherwise


def _at_exit() -> None:
    if _SESSION is None:
        return
    try:
        problems = _SESSION.finish()
    except MoEVerifyError as exc:
        problems = [f"{ENV}: {exc}"]
    if problems:
        print("\n".join(problems), file=sys.stderr)
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(EXIT_UNUSED)  # atexit cannot change the exit status otherwise: a warning alone is not a refusal


def install(setting: Setting):
    """Apply the patch and route the selected model's routers through a process-wide session."""
    global _SESSION, _CHUNKS
    if _SESSION is not None:
        raise UsageError(f"{ENV}: autopatch is already installed in this process")
    _check_directory(setting, state.current_rank())
    guard = agreement.from_env(
        in_job=setting.mode in (Mode.R2, Mode.R3),  # a bad setting refused before installing
        floor_default=agreement.CHANCE if setting.mode is Mode.R3 else None,
        numbering_default=setting.mode is Mode.R3,
    )
    rr.apply()
    _ORDER.install()
    session_: ProcessSession | injob.InJobSession
    if setting.mode in (Mode.R2, Mode.R3):
        _CHUNKS = injob.ChunkHooks()
        _CHUNKS.install()
        session_ = injob.InJobSession(
            selected=lambda router: selected(_ORDER, setting, router),
            original=rr.original_routing(),
            directory=setting.directory if setting.mode is Mode.R3 else None,
            rollout=setting.mode is Mode.R3,
        )
    else:
        process = ProcessSession(setting, order=_ORDER)
        _CHUNKS = identity.ChunkTokens(process.note_forward)  # token identity of each forward
        _CHUNKS.install()
        session_ = process
    _HOOKS.append(register_optimizer_step_pre_hook(lambda opt, args, kwargs: session_.end_step()))
    if guard is not None:  # MOEVERIFY_AGREEMENT: the live agreement guard, ended with the session
        _HOOKS.append(types.SimpleNamespace(remove=agreement.stop))
    rr.set_fallback(session_.bind)
    _SESSION = session_
    atexit.register(_at_exit)
    return _SESSION


def uninstall() -> None:
    """Remove the process-wide session (the patch itself stays applied)."""
    global _SESSION, _CHUNKS
    if _SESSION is not None:
        atexit.unregister(_at_exit)
    _ORDER.uninstall()
    if _CHUNKS is not None:
        _CHUNKS.uninstall()
        _CHUNKS = None
    while _HOOKS:
        _HOOKS.pop().remove()
    rr.set_fallback(None)
    batch_routes.detach()
    _CHOSEN.clear()
    _SESSION = None


def session():
    """The installed session (``ProcessSession``; ``injob.InJobSession`` in r2 mode), or None."""
    return _SESSION


def install_from_env():
    value = os.environ.get(ENV)
    return install(parse(value, os.environ.get(MODEL_ENV))) if value else None


def main(argv: list[str] | None = None) -> int:
    """``python -m moeverify.patches.autopatch SCRIPT [ARGS...]``: run SCRIPT under the environment's setting."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--"]:
        argv = argv[1:]
    try:
        if not argv or argv[0].startswith("-"):
            raise UsageError(
                "usage: python -m moeverify.patches.autopatch SCRIPT [ARGS...] (with "
                f"{ENV}=record:DIR, replay:DIR, {INJOB} or {ROLLOUT}:DIR set)"
            )
        if not os.environ.get(ENV):
            raise UsageError(
                f"{ENV} is not set: expected record:DIR, replay:DIR, {INJOB} or {ROLLOUT}:DIR (nothing "
                "would be recorded or replayed)"
            )
        if not Path(argv[0]).is_file():
            raise UsageError(f"script {argv[0]!r} not found")
        # This file runs as __main__; the job may import moeverify.patches.autopatch too: one instance only,
        # the package module, which installs itself from the environment when imported.
        module = importlib.import_module("moeverify.patches.autopatch")
        if module.session() is None:
            module.install_from_env()
    except UsageError as exc:
        print(f"moeverify autopatch: {exc}", file=sys.stderr)
        return 2
    sys.argv = argv
    sys.path.insert(0, str(Path(argv[0]).resolve().parent))
    runpy.run_path(argv[0], run_name="__main__")
    return 0  # routes left unused end the process through the exit hook (status 3)


if __name__ == "__main__":
    sys.exit(main())
elif os.environ.get(ENV):
    install_from_env()
