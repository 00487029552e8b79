"""Which inputs and which model a session's recording belongs to: its routes are replayed on those only.

A route table is a list of ``[T, K]`` rows per micro-batch; nothing in it says which tokens it was chosen
for. Replayed on other tokens of the same count (micro-batches fed in another order, the routes of the
previous step's recording replayed on this step's data, an actor's routes given to the reference model's
session) every token gets another token's experts and training goes on with wrong gradients, no error.

While a session records, a forward pre-hook on each of its model chunks keeps the chunk's token ids per
forward (the first positional or ``input_ids`` argument, when it is an integer tensor: ``GPTModel``'s
``input_ids``). ``session.routes()`` registers the ``Routes`` it returns here, by identity of its
tensors (weak references: nothing is kept alive). ``session.replay(routes)`` of such a ``Routes``:

- on the routers of another live model: refused at once;
- on the same model: the pre-hook keeps the token ids of every replayed forward, and when the ``replay()``
  context exits, forward ``i`` of each chunk must have had micro-batch ``i``'s recorded token ids (one
  host sync per step; compared where both sides had token ids).

``routes.take(order)`` of such a ``Routes`` (shuffled micro-batches) carries its inputs in that order: forward
``i`` must have had recorded micro-batch ``order[i]``'s token ids.

Routes built otherwise (``Routes(...)``, ``Routes.from_rollout``, ``routes.select`` / ``to_local`` /
``replace``, a dump) carry no inputs and are not checked here: they are the way to replay deliberately
on other inputs.
"""

from __future__ import annotations

import contextlib
import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from moeverify.errors import RouteError
from moeverify.runtime import cpu as cpu_runtime

# id(route tensor) -> Origin; an entry is pruned once its tensor is freed (the Routes that held it is gone).
_ORIGINS: dict[int, tuple[weakref.ref, Origin]] = {}


class InputLog:
    """Per model chunk, the token ids of each forward (None where the chunk got no integer tensor)."""

    def __init__(self, chunks: list[weakref.ref], *, like: InputLog | None = None):
        """``like``: the recording's log this one will be compared with: a chunk that got no token ids there has
        nothing to compare, and is not hooked (a hooked module leaves torch's fast call path on every forward)."""
        self.per_chunk: list[list[torch.Tensor | None]] = [[] for _ in chunks]
        self.order: tuple[int, ...] | None = None  # ``taken``'s: forward i is recorded micro-batch order[i]
        self._handles = []
        for index, ref in enumerate(chunks):
            chunk = ref()
            if like is not None and all(ids is None for ids in like.per_chunk[index]):
                continue
            if chunk is not None:
                self._handles.append(chunk.register_forward_pre_hook(self._hook(index), with_kwargs=True))
        self.hooked = bool(self._handles)  # whether any chunk's token ids are kept (and so compared)

    def taken(self, order: tuple[int, ...]) -> InputLog:
        """This log's forwards in ``order`` (``Routes.take``), per chunk, as a log of its own (no hook)."""
        log = InputLog.__new__(InputLog)
        log.per_chunk = [[forwards[mb] if mb < len(forwards) else None for mb in order] for forwards in self.per_chunk]
        log._handles, log.hooked = [], False
        log.order = order if self.order is None else tuple(self.order[mb] for mb in order)
        return log

    def kept_ids(self) -> bool:
        """Whether any forward logged token ids (a replay compared with this log has something to compare)."""
        return any(ids is not None for forwards in self.per_chunk for ids in forwards)

    def _hook(self, index: int):
        def pre_hook(_module, args, kwargs):
            if torch._C._current_graph_task_id() != -1:  # a recompute of the whole chunk: not a new forward
                return
            ids = args[0] if args else kwargs.get("input_ids")
            if not isinstance(ids, torch.Tensor):
                self.per_chunk[index].append(None)
                return
            # on CPU ranks outside the CPU runtime's redirection: these reads and copies name no device
            with torch._C.DisableTorchFunction() if cpu_runtime.installed() else contextlib.nullcontext():
                keep = not ids.is_floating_point() and not ids.is_complex()
                self.per_chunk[index].append(ids.detach().clone() if keep else None)

        return pre_hook

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


class Origin:
    """The model (its routers, weakly) and the recorded inputs a session's ``Routes`` came from."""

    def __init__(self, routers: dict[int, weakref.ref], inputs: InputLog):
        self.routers = routers
        self.inputs = inputs
        self.compared = inputs.kept_ids()  # a replay logs its inputs only when the recording kept some token ids


def register(routes, origin: Origin) -> None:
    """Remember that ``routes`` (just built by ``session.routes()``) came from ``origin``."""
    for key in [k for k, (ref, _) in _ORIGINS.items() if ref() is None]:
        del _ORIGINS[key]
    for layer in routes.layers:
        tensor = routes.get(layer, 0)
        _ORIGINS[id(tensor)] = (weakref.ref(tensor), origin)


def origin_of(routes) -> Origin | None:
    """The origin ``register`` noted for ``routes``, or for the routes ``routes.take`` took them from, in its order
    (None: built otherwise)."""
    taken_from = getattr(routes, "taken_from", None)
    if taken_from is not None:
        source, order = taken_from
        origin = origin_of(source)
        return None if origin is None else Origin(origin.routers, origin.inputs.taken(order))
    for layer in routes.layers:
        tensor = routes.get(layer, 0)
        entry = _ORIGINS.get(id(tensor))
        if entry is not None and entry[0]() is tensor:
            return entry[1]
    return None


def check_model(origin: Origin, routers: dict[int, object], *, rank: int) -> None:
    """Refuse routes recorded on the routers of another live model."""
    for layer, router in routers.items():
        ref = origin.routers.get(layer)
        recorded_on = ref() if ref is not None else None
        if recorded_on is not None and recorded_on is not router:
            raise RouteError(
                f"layer {layer} rank {rank}: these routes were recorded by the session of another model "
                "(another set of routers, e.g. the actor's routes given to the reference model's "
                "session); replay a model's own session.routes(), or rebuild them deliberately with "
                "Routes({layer: [...]}, num_experts=, topk=)"
            )


def check_inputs(recorded: InputLog, replayed: InputLog, *, rank: int, done: list[int] | None = None) -> None:
    """Forward ``i`` of every chunk must have had the token ids recorded for micro-batch ``i``.

    ``done``: per chunk, the forwards already checked (skipped, then advanced): a block checks the forwards so far
    before every optimizer step inside it, then the rest when it exits."""
    for chunk, (rec, rep) in enumerate(
        zip(recorded.per_chunk, replayed.per_chunk, strict=False)
    ):  # counts: the consumption check
        first = done[chunk] if done is not None else 0
        for mb in range(first, min(len(rec), len(rep))):
            a, b = rec[mb], rep[mb]
            if a is None or b is None:
                continue
            if a.shape != b.shape or not torch.equal(a, b.to(a.device)):
                moved = [
                    i
                    for i, r in enumerate(rec)
                    if r is not None and r.shape == b.shape and torch.equal(r, b.to(r.device))
                ]
                order = recorded.order
                which = (
                    f"it equals recorded micro-batch {moved[0] if order is None else order[moved[0]]}'s"
                    if moved
                    else "they match no recorded micro-batch"
                )
                if order is None:
                    raise RouteError(
                        f"chunk {chunk} rank {rank} mb {mb}: the token ids of replayed forward {mb} are not "
                        f"those micro-batch {mb}'s routes were recorded on ({which}); forward i replays "
                        "micro-batch i: feed the micro-batches in the recorded order, and record again for "
                        "new data (session.routes() returns the last record()'s routes)"
                    )
                raise RouteError(
                    f"chunk {chunk} rank {rank} mb {mb}: the token ids of replayed forward {mb} are not those "
                    f"recorded micro-batch {order[mb]}'s routes were recorded on ({which}); routes.take(order) "
                    f"replays recorded micro-batch order[i] in forward i (order {list(order)}): feed the "
                    "micro-batches in that order"
                )
        if done is not None:
            done[chunk] = max(first, min(len(rec), len(rep)))


class StepGuard:
    """While a replay block whose inputs are compared is open: the forwards so far are checked before any torch
    optimizer's step (``torch.optim.optimizer.register_optimizer_step_pre_hook``, a process-wide hook every
    ``torch.optim.Optimizer`` runs, Megatron's and Transformer Engine's inner optimizers included; torch 2.x), so a
    replay on the wrong tokens is refused before it changes the weights, not only when the block exits."""

    def __init__(self, recorded: InputLog, replayed: InputLog, rank):
        self.recorded, self.replayed, self.rank = recorded, replayed, rank
        self.done = [0] * len(recorded.per_chunk)
        self._handle = register_optimizer_step_pre_hook(self._before_step)

    def _before_step(self, optimizer, args, kwargs) -> None:
        self.check()

    def check(self) -> None:
        if self.replayed.hooked:
            check_inputs(self.recorded, self.replayed, rank=self.rank(), done=self.done)

    def close(self) -> None:
        self._handle.remove()
