"""Live agreement guard: per step and global layer, the share of replayed tokens whose top-k expert set is the one
native routing would choose now.

Legend of shape suffixes: T = tokens of one router call, K = top-k.

Off by default. ``MOEVERIFY_AGREEMENT=PATH.jsonl`` turns it on for every replay mode of the patch (session
``replay()``, autopatch ``replay:DIR``, in-job ``r2``); ``MOEVERIFY_AGREEMENT_MIN=0.99`` fails the job with
``RouteError`` (step, layer, rank, agreement vs minimum) at the end of a step whose agreement in some layer falls
below it. Code users call ``agreement.guard(path=..., minimum=..., writer=...)`` instead.

What is counted: each forward routing call served by a replay hook (never a log-prob or native call, never a
recompute inside backward), every token of the call: its replayed ids against megatron-core's own top-k of the
same selection scores (``default_compute_topk``: score function, expert bias, groups as the router has them),
compared as sets. Counts stay on the device; the host reads them once per step.

A step ends at each ``optimizer.step()`` of any torch optimizer in the process (a global post-hook; Megatron's
optimizers step torch optimizers inside) that follows counted calls, or at ``Guard.end_step()``. Per step one
JSON line per layer goes to the rank's file (``PATH`` on one rank, ``STEM.rankR.jsonl`` beside it otherwise), and
one scalar per layer to the job's logger where one is found: the ``writer=`` given, else Megatron's TensorBoard
writer (``megatron.training.global_vars``) and an active wandb run, only if the job imported them.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from moeverify.errors import RouteError, UsageError

ENV = "MOEVERIFY_AGREEMENT"
MIN_ENV = "MOEVERIFY_AGREEMENT_MIN"
TAG = "moeverify/agreement/layer{layer}"

ACTIVE: Guard | None = None  # read on the routing hot path: None costs one global load per call


class Guard:
    """Per-layer agreement counts of replayed router calls, flushed per step (see the module docstring)."""

    def __init__(self, *, path: str | os.PathLike | None = None, minimum: float | None = None, writer=None):
        if minimum is not None and not (isinstance(minimum, (int, float)) and 0.0 <= minimum <= 1.0):
            raise UsageError(f"agreement minimum {minimum!r}: expected a share in [0, 1]")
        self.path = Path(path) if path is not None else None
        self.minimum = minimum
        self.writer = writer
        self.step = 0  # steps flushed with counted calls
        self.history: list[dict] = []  # every row written, for code users and tests
        self._counts: dict[int, list] = {}  # layer -> [agreeing tokens (device tensor), tokens]
        self._file = None
        self._hook = register_optimizer_step_post_hook(self._after_optimizer_step)

    def count(self, layer: int, replayed_TK: torch.Tensor, native_TK: torch.Tensor) -> None:
        with torch.no_grad():
            agree = (replayed_TK.sort(dim=1).values == native_TK.sort(dim=1).values).all(dim=1).sum()
        counts = self._counts.get(layer)
        if counts is None:
            self._counts[layer] = [agree, int(replayed_TK.shape[0])]
        else:
            counts[0] = counts[0] + agree
            counts[1] += int(replayed_TK.shape[0])

    def _after_optimizer_step(self, optimizer, args, kwargs) -> None:
        if self._counts:
            self.end_step()

    def end_step(self) -> dict[int, float]:
        """Flush this step's counts: ``{layer: agreement}``; raises ``RouteError`` below the minimum."""
        if not self._counts:
            return {}
        self.step += 1
        rank = _rank()
        shares = {layer: int(agree) / tokens for layer, (agree, tokens) in sorted(self._counts.items())}
        rows = [{"step": self.step, "layer": layer, "rank": rank, "agreement": share,
                 "tokens": self._counts[layer][1]} for layer, share in shares.items()]
        self._counts.clear()
        self.history.extend(rows)
        self._write(rows, rank)
        self._log(shares)
        if self.minimum is not None:
            below = {layer: share for layer, share in shares.items() if share < self.minimum}
            if below:
                layer, share = min(below.items(), key=lambda item: item[1])
                raise RouteError(f"agreement guard: step {self.step} layer {layer} rank {rank}: {share:.4%} of "
                                 f"replayed tokens have native routing's top-k, expected at least "
                                 f"{self.minimum:.4%} ({MIN_ENV}); {len(below)} layer(s) below")
        return shares

    def _write(self, rows: list[dict], rank: int) -> None:
        if self.path is None:
            return
        if self._file is None:
            path = self.path
            if _world() > 1:
                path = path.with_name(f"{path.stem}.rank{rank}{path.suffix or '.jsonl'}")
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 (open for the job's lifetime)
        self._file.write("".join(json.dumps(row) + "\n" for row in rows))
        self._file.flush()

    def _log(self, shares: dict[int, float]) -> None:
        for writer in self._writers():
            for layer, share in shares.items():
                writer.add_scalar(TAG.format(layer=layer), share, self.step)
        wandb = sys.modules.get("wandb")  # only a job that imported wandb and started a run
        if self.writer is None and wandb is not None and getattr(wandb, "run", None) is not None:
            wandb.log({TAG.format(layer=layer): share for layer, share in shares.items()}, commit=False)

    def _writers(self) -> list:
        if self.writer is not None:
            return [self.writer]
        global_vars = sys.modules.get("megatron.training.global_vars")
        getter = getattr(global_vars, "get_tensorboard_writer", None)
        writer = getter() if getter is not None else None
        return [writer] if writer is not None else []

    def close(self) -> None:
        self._hook.remove()
        if self._file is not None:
            self._file.close()
            self._file = None


class Watched:
    """A replay hook (Megatron's ``router_replay`` protocol) whose replayed ids are counted against native's."""

    __slots__ = ("inner", "guard", "layer")

    def __init__(self, inner, guard: Guard, layer: int):
        self.inner, self.guard, self.layer = inner, guard, layer

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        values_TK, ids_TK = self.inner.get_replay_topk(scores, topk, num_groups, group_topk, default_compute_topk)
        with torch.no_grad():
            _, native_TK = default_compute_topk(scores.detach(), topk, num_groups=num_groups, group_topk=group_topk)
        self.guard.count(self.layer, ids_TK, native_TK)
        return values_TK, ids_TK


def watch(hook, router):
    """``hook``, counted by the active guard when it replays and this is a forward (not a recompute in backward)."""
    guard = ACTIVE
    if guard is None or not getattr(hook, "REPLAYS", False) or torch._C._current_graph_task_id() != -1:
        return hook
    return Watched(hook, guard, router.layer_number - 1 + (router.config.num_layers
                                                           if getattr(router, "is_mtp_layer", False) else 0))


def guard(*, path: str | os.PathLike | None = None, minimum: float | None = None, writer=None) -> Guard:
    """Start the process's agreement guard (one at a time); ``stop()`` ends it."""
    global ACTIVE
    if ACTIVE is not None:
        raise UsageError("an agreement guard is already active in this process: call agreement.stop() first")
    ACTIVE = Guard(path=path, minimum=minimum, writer=writer)
    return ACTIVE


def stop() -> None:
    global ACTIVE
    if ACTIVE is not None:
        ACTIVE.close()
        ACTIVE = None


def from_env() -> Guard | None:
    """Start the guard from ``MOEVERIFY_AGREEMENT`` / ``MOEVERIFY_AGREEMENT_MIN`` if set (autopatch calls it)."""
    path, minimum = os.environ.get(ENV) or None, os.environ.get(MIN_ENV) or None
    if path is None and minimum is None:
        return None
    if path is None:
        raise UsageError(f"{MIN_ENV}={minimum} needs {ENV}=PATH.jsonl (where the per-step agreement goes)")
    try:
        share = float(minimum) if minimum is not None else None
    except ValueError:
        share = math.nan
    if share is not None and not 0.0 <= share <= 1.0:
        raise UsageError(f"{MIN_ENV}={minimum!r}: expected a share in [0, 1], e.g. 0.99")
    return guard(path=path, minimum=share)


def _rank() -> int:
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _world() -> int:
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
