"""The rollout side of in-job R3: routes a rollout engine returned, written with the token ids they were routed on.

Legend: N = tokens (all requests of a part, concatenated), R = requests, W = layer columns, K = top-k.

A rollout worker writes, per RL step, what its engine returned for each request: the request's token ids (prompt +
response, multi-turn concatenated: every token training will feed) and its routes ``[S_i - 1 or S_i, W, K]`` (vLLM's
``routed_experts``, SGLang's ``return_routed_experts``: the last row is usually missing, that token being sampled and
never fed back). The training job, run under ``MOEVERIFY_ROUTER_REPLAY=r3:DIR``, finds each training token's route
by token identity (content and position from the sequence start), whatever the micro-batching, shuffling or packing.

Layout of ``DIR``::

    step-<N>/part-<name>.npz   one per writer: tokens [N], lengths [R], rows [R], routes [sum(rows), W, K],
                               numbering [1] (0 not said, 1 one column per router, 2 one per decoder layer),
                               expert_map [W or 1, P] (optional: physical slot -> logical expert)
    step-<N>/COMPLETE          JSON {"format", "version", "step", "parts": [file names]}: the step is whole

Every file is written atomically (temporary file, fsync, rename); a step is read only once ``COMPLETE`` exists,
and nothing in it is ever unpickled. Torch-free: numpy only, so it runs inside any rollout worker.

One writer (one engine)::

    with RolloutWriter(DIR, step=7) as w:
        for request in outputs:
            w.add(request.token_ids, request.routed_experts)

Several workers of one step write ``part=`` names of their own with ``complete=False``, then one of them (or the
driver) calls ``complete(DIR, step=7)`` once all parts are written.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np

from moeverify.errors import UsageError
from moeverify.files import atomic_write_json, atomic_writer
from moeverify.routing.engine_routes import EngineRoutes

FORMAT = "moeverify-rollout-routes"
VERSION = 1
MARKER = "COMPLETE"
NUMBERINGS = {None: 0, "routers": 1, "decoder": 2}  # numbering= -> the code stored in a part
_PART = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def step_dir(directory: Path | str, step: int) -> Path:
    return Path(directory) / f"step-{int(step)}"


def _integers(array, what: str, *, dims: int) -> np.ndarray:
    value = np.asarray(array.cpu() if hasattr(array, "cpu") else array)
    if value.dtype.kind not in "iu" or value.ndim != dims:
        raise UsageError(f"{what}: expected a {dims}-d integer array, got {value.ndim}-d {value.dtype}")
    return value


class RolloutWriter:
    """One part of one RL step's rollout routes (module docstring).

    Args:
        directory: the directory the training job names in ``r3:DIR``.
        step: the RL step (an integer >= 0); the training job replays the newest complete steps.
        part: this writer's name within the step (letters, digits, ``_.-``); one file per part.
        numbering: what the routes' layer axis holds: ``"routers"`` (one column per MoE layer) or ``"decoder"`` (one
            column per decoder layer, dense ones included); None: inferred by the training job, which refuses a
            width that fits both.
        expert_map: the engine records physical expert slots (an expert placement with redundant experts): the
            ``slot -> logical expert`` map, ``[P]`` for every layer or ``[W, P]`` per layer column.
    """

    def __init__(
        self, directory: Path | str, *, step: int, part: str = "0", numbering: str | None = None, expert_map=None
    ):
        if not isinstance(step, (int, np.integer)) or isinstance(step, bool) or step < 0:
            raise UsageError(f"RolloutWriter step={step!r}: expected an integer >= 0")
        if not isinstance(part, str) or not _PART.fullmatch(part):
            raise UsageError(f"RolloutWriter part={part!r}: expected 1-64 letters, digits, '_', '.' or '-'")
        if numbering not in NUMBERINGS:
            raise UsageError(f"RolloutWriter numbering={numbering!r}: expected 'routers', 'decoder' or None")
        self.dir = step_dir(directory, step)
        self.step, self.part, self.numbering = int(step), part, numbering
        self.path = self.dir / f"part-{part}.npz"
        if (self.dir / MARKER).exists():
            raise UsageError(
                f"{self.dir}: step {step} is already complete ({MARKER} written); a step's routes are written once"
            )
        if self.path.exists():
            raise UsageError(f"{self.path} already exists: each writer of a step needs its own part= name")
        self.expert_map = None if expert_map is None else _integers(expert_map, "expert_map", dims=np.ndim(expert_map))
        if self.expert_map is not None and self.expert_map.ndim not in (1, 2):
            raise UsageError(
                f"expert_map: expected [P] or [W, P] slot -> logical expert, got shape {self.expert_map.shape}"
            )
        self._tokens: list[np.ndarray] = []
        self._routes: list[np.ndarray] = []
        self._closed = False

    def add(self, token_ids, routes) -> None:
        """One request: ``token_ids`` ``[S]`` (every token training feeds for it) and the engine's routes
        ``[S - 1 or S, W, K]`` (numpy or torch, any integer dtype; a row of -1 is a capture gap the training job
        refuses on a real token), or a decoded payload (``moeverify.routing.engine_routes.EngineRoutes``: its layer
        numbering is taken, and physical slots need the writer's ``expert_map``)."""
        if self._closed:
            raise UsageError(f"{self.path}: add() after close()")
        where = f"request {len(self._tokens)} of {self.path.name}"
        routes = self._payload(routes, where)
        tokens_S = _integers(token_ids, f"{where}: token_ids", dims=1)
        routes_SWK = _integers(routes, f"{where}: routes", dims=3)
        s = tokens_S.shape[0]
        if s < 1:
            raise UsageError(f"{where}: token_ids is empty")
        if routes_SWK.shape[0] not in (s - 1, s):
            raise UsageError(
                f"{where}: routes hold {routes_SWK.shape[0]} rows for {s} tokens; expected {s - 1} (the "
                f"engine's missing last row) or {s}"
            )
        if self._routes and routes_SWK.shape[1:] != self._routes[0].shape[1:]:
            raise UsageError(
                f"{where}: routes [*, W, K] = {routes_SWK.shape[1:]} != request 0's {self._routes[0].shape[1:]}"
            )
        if tokens_S.min() < 0:
            raise UsageError(f"{where}: token_ids hold a negative id {int(tokens_S.min())}")
        if routes_SWK.size and routes_SWK.min() < -1:
            raise UsageError(f"{where}: routes hold {int(routes_SWK.min())}; expert ids are >= 0 (-1: not captured)")
        self._tokens.append(tokens_S.astype(np.int64, copy=False))
        self._routes.append(routes_SWK)

    def _payload(self, routes, where: str):
        """An ``EngineRoutes``' array, its numbering and placement checked against the writer's; else ``routes``."""
        if not isinstance(routes, EngineRoutes):
            return routes
        if routes.start:
            raise UsageError(
                f"{where}: the engine's rows start at position {routes.start}, not 0; join them to the "
                "request's earlier rows first (moeverify.routing.engine_routes.splice)"
            )
        if self.numbering is None and not self._routes:
            self.numbering = routes.numbering
        if routes.numbering != self.numbering:
            raise UsageError(
                f"{where}: the payload numbers layers {routes.numbering!r}, this part "
                f"{self.numbering!r}; one engine's routes per part"
            )
        if routes.physical and self.expert_map is None:
            raise UsageError(
                f"{where}: the engine recorded physical expert slots (EPLB): give RolloutWriter("
                "expert_map=) (slot -> logical expert; docs/engine_routes.md says where each engine "
                "keeps it)"
            )
        return routes.routes

    def close(self, *, complete: bool = True) -> Path:
        """Write this part (atomically); with ``complete`` also mark the step whole. Returns the part's path."""
        if self._closed:
            raise UsageError(f"{self.path}: closed twice")
        if not self._tokens:
            raise UsageError(f"{self.path}: no request added")
        self._closed = True
        routes = np.concatenate(self._routes)
        small = routes.size == 0 or routes.max() < np.iinfo(np.int16).max
        arrays = {
            "tokens": np.concatenate(self._tokens),
            "lengths": np.array([t.shape[0] for t in self._tokens], dtype=np.int64),
            "rows": np.array([r.shape[0] for r in self._routes], dtype=np.int64),
            "routes": routes.astype(np.int16 if small else np.int32),
            "numbering": np.array([NUMBERINGS[self.numbering]], dtype=np.int8),
        }
        if self.expert_map is not None:
            arrays["expert_map"] = np.atleast_2d(self.expert_map).astype(np.int64)
        self.dir.mkdir(parents=True, exist_ok=True)
        with atomic_writer(self.path) as f:
            np.savez(f, **arrays)  # type: ignore[arg-type]  # numpy's stub types **kwds as allow_pickle's bool
        self._tokens.clear()
        self._routes.clear()
        if complete:
            mark_complete(self.dir.parent, step=self.step)
        return self.path

    def __enter__(self) -> RolloutWriter:
        return self

    def __exit__(self, kind, value, traceback) -> None:
        if kind is None and not self._closed:
            self.close()


def mark_complete(directory: Path | str, *, step: int) -> Path:
    """Mark step ``step`` of ``directory`` whole: every ``part-*.npz`` written so far is listed in its ``COMPLETE``
    marker, and the training job reads exactly those. Refused without parts, or when the step is complete."""
    where = step_dir(directory, step)
    marker = where / MARKER
    if marker.exists():
        raise UsageError(f"{where}: step {step} is already complete")
    parts = sorted(p.name for p in where.glob("part-*.npz")) if where.is_dir() else []
    if not parts:
        raise UsageError(f"{where}: no part-*.npz written; nothing to mark complete")
    atomic_write_json(marker, {"format": FORMAT, "version": VERSION, "step": int(step), "parts": parts})
    return marker


def complete_steps(directory: Path | str, *, newest: int | None = None) -> list[int]:
    """The steps of ``directory`` whose ``COMPLETE`` marker exists, ascending; with ``newest``, only the newest that
    many (markers looked up from the highest step down: a few file checks however many steps the directory holds)."""
    numbers = []
    with os.scandir(directory) as entries:
        for entry in entries:
            number = entry.name[len("step-") :]
            if entry.name.startswith("step-") and number.isdigit():
                numbers.append(int(number))
    steps = []
    for step in sorted(numbers, reverse=True):
        if (step_dir(directory, step) / MARKER).is_file():
            steps.append(step)
            if newest is not None and len(steps) == newest:
                break
    return sorted(steps)


def read_marker(directory: Path | str, step: int) -> list[str]:
    """The part file names step ``step``'s ``COMPLETE`` marker lists (format and version checked)."""
    marker = step_dir(directory, step) / MARKER
    try:
        data = json.loads(marker.read_text())
    except (OSError, ValueError) as exc:
        raise UsageError(f"{marker}: cannot read the step marker: {exc}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("version") != VERSION:
        found = (data.get("format"), data.get("version")) if isinstance(data, dict) else type(data).__name__
        raise UsageError(f"{marker}: not a {FORMAT} version {VERSION} marker: (format, version) = {found!r}")
    parts = data.get("parts")
    if (
        not isinstance(parts, list)
        or not parts
        or not all(isinstance(p, str) and re.fullmatch(r"part-[A-Za-z0-9_.-]{1,64}\.npz", p) for p in parts)
    ):
        raise UsageError(f"{marker}: 'parts' must list the step's part-<name>.npz files, got {parts!r}")
    return parts
