"""In-job R3's route source: a rollout engine's routes (``moeverify.routing.rollout_writer`` files) as route tables
keyed by token identity, one per model chunk.

Legend: N = tokens of a step (all requests, concatenated), R = requests, W = layer columns in the files, L = this
chunk's MoE layers, K = top-k.

The newest ``keep()`` complete steps of the directory serve (``MOEVERIFY_ROUTER_REPLAY_KEEP``, default 2: a trainer
one step off-policy trains on the previous step's rollout while the next one is written; raise it for a longer lag);
a token found in several takes the newest step's route. The versions kept share one table, bounded by
``MOEVERIFY_ROUTER_REPLAY_MAX_TOKENS`` (the tokens of every kept version together; a table costs about 16 bytes of
keys plus ``2 * L * K`` bytes of ids a token, on the device). The directory
is looked at again at every model-chunk forward (one directory listing), and tables are rebuilt when the set of
newest complete steps changes. A step's requests are checked as ``Routes.from_rollout`` checks them: the layer
columns picked (a width that fits two numberings refused), physical expert slots mapped through the step's
``expert_map`` (or ``MOEVERIFY_ROUTER_REPLAY_EXPERT_MAP``), ids out of range refused, capture gaps (a row of -1, or
of zeros with K > 1) refused on a real token; the engine's missing last row is recorded as native: that token routes
natively (nothing in the loss reads it under causal attention).
"""

from __future__ import annotations

import abc
import os
import weakref
from pathlib import Path

import numpy as np
import torch

from moeverify.errors import RouteError, UsageError
from moeverify.patches import agreement
from moeverify.patches import token_keys as tk
from moeverify.patches.route_table import RouteTable
from moeverify.routing import layer_numbering, npy_file
from moeverify.routing import rollout_arrays as ra
from moeverify.routing import rollout_writer as rw

KEEP = 2  # newest complete steps that serve, by default (``keep()``)
KEEP_ENV = "MOEVERIFY_ROUTER_REPLAY_KEEP"
KEEP_MAX = 64  # versions one table holds at most (each version is one more lookup per forward)


def keep() -> int:
    """The rollout versions that serve at once: ``MOEVERIFY_ROUTER_REPLAY_KEEP`` (1 to ``KEEP_MAX``), default
    ``KEEP``. Memory is bounded by the table's token cap whatever it is (module docstring)."""
    value = os.environ.get(KEEP_ENV) or None
    if value is None:
        return KEEP
    if not (value.isascii() and value.isdigit()) or not 1 <= int(value[:6]) <= KEEP_MAX:
        raise UsageError(f"{KEEP_ENV}={value[:40]!r}: expected the number of rollout versions kept, 1 to {KEEP_MAX}")
    return int(value)


EXPERT_MAP_ENV = "MOEVERIFY_ROUTER_REPLAY_EXPERT_MAP"
_NUMBERING = {code: name for name, code in rw.NUMBERINGS.items()}


class Step:
    """One rollout version's requests, checked, on the host: tokens ``[N]``, request starts, routes per token.

    Args:
        parts: each ``{"tokens", "lengths", "rows", "routes", "numbering", "expert_map"?, "path"}`` as
            ``RolloutWriter`` stores a part, checked by ``checked_part``.
        where: what messages name (the step's directory, or the batch that handed the routes over).
        step: the rollout version (RL step or policy version) the requests were generated under.
    """

    def __init__(self, parts: list[dict], *, where, step: int):
        self.step = step
        self.where = where
        if not parts:
            raise RouteError(f"{where}: no requests")
        widths = {p["routes"].shape[1:] for p in parts}
        if len(widths) != 1:
            raise RouteError(f"{self.where}: parts hold routes of shapes [*, W, K] {sorted(widths)}; one engine's")
        numbering = {int(p["numbering"][0]) for p in parts}
        if len(numbering) != 1:
            raise RouteError(f"{self.where}: parts say different layer numberings {sorted(numbering)}")
        code = numbering.pop()
        if code not in _NUMBERING:
            raise RouteError(f"{self.where}: numbering code {code} is none of {sorted(_NUMBERING)}")
        self.numbering = _NUMBERING[code]
        maps = [p.get("expert_map") for p in parts]
        first = maps[0]
        if any(m is not None for m in maps) and (
            first is None or not all(m is not None and np.array_equal(m, first) for m in maps)
        ):
            raise RouteError(f"{self.where}: some parts carry an expert_map and others another or none")
        self.expert_map = maps[0]
        self.parts = parts

    @classmethod
    def read(cls, directory: Path, step: int) -> Step:
        """A complete step of a ``RolloutWriter`` directory."""
        where = rw.step_dir(directory, step)
        parts = [
            checked_part(npy_file.load_npz(where / name, error=RouteError), where / name)
            for name in rw.read_marker(directory, step)
        ]
        return cls(parts, where=where, step=step)

    @property
    def tokens(self) -> int:
        return sum(int(p["tokens"].shape[0]) for p in self.parts)

    def ids(
        self, *, layers: list[int], model_layers: list[int], num_layers: int, num_experts: int, expert_map=None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(tokens [N], starts [R + 1], ids [N, L, K], native [N])`` of ``layers`` (a subset of ``model_layers``,
        the model's MoE layers in router order): missing last rows filled and flagged native."""
        width = int(self.parts[0]["routes"].shape[1])
        cols = layer_numbering.columns(
            width,
            layers=model_layers,
            num_layers=num_layers,
            numbering=self.numbering,
            where=f"{self.where} routes",
            error=RouteError,
            pick=ra.PICK,
            count=ra.COUNT,
        )
        pick = [cols[model_layers.index(layer)] for layer in layers]
        emap = self._map(
            expert_map,
            layers=layers,
            cols=pick,
            width=width,
            num_layers=num_layers,
            num_experts=num_experts,
            model_layers=model_layers,
        )
        tokens, starts, ids, native = [], [0], [], []
        for part in self.parts:
            i, n = self.request_rows(part, pick=pick, layers=layers, num_experts=num_experts, emap=emap)
            tokens.append(torch.from_numpy(part["tokens"].astype(np.int64)))
            starts.extend((starts[-1] + np.cumsum(part["lengths"])).tolist())
            ids.append(i)
            native.append(n)
        one = len(ids) == 1  # a single part: no copy
        return torch.cat(tokens), torch.tensor(starts), ids[0] if one else torch.cat(ids), torch.cat(native)

    def _map(self, expert_map, *, layers, cols, width, num_layers, num_experts, model_layers):
        stored = self.expert_map
        if stored is not None and expert_map is not None:
            raise UsageError(
                f"{self.where}: the step's files carry an expert_map and {EXPERT_MAP_ENV} names another; give one"
            )
        if stored is None:
            return (
                None
                if expert_map is None
                else ra.load_map(expert_map, layers=layers, num_layers=num_layers, num_experts=num_experts)
            )
        if stored.shape[0] not in (1, width):
            raise RouteError(
                f"{self.where}: expert_map holds {stored.shape[0]} rows, the routes {width} columns "
                "(give one row for every layer, or one per column)"
            )
        per_layer = {
            layer: stored[0 if stored.shape[0] == 1 else col].tolist() for layer, col in zip(layers, cols, strict=True)
        }
        return ra.load_map(per_layer, layers=layers, num_layers=num_layers, num_experts=num_experts)

    @staticmethod
    def request_rows(part: dict, *, pick, layers, num_experts, emap):
        """One part's ``(ids [N, L, K], native [N])``: each token's row, each row's ids ascending (an expert set);
        the missing last rows native. Checked in the part's own narrow dtype, one sort for all rows: capture gaps,
        rows cut short, ids out of range, an expert twice (in that order)."""
        lengths, rows = part["lengths"], part["rows"]
        held = part["routes"]
        whole = list(pick) == list(range(held.shape[1]))
        routes_RLK = torch.from_numpy(held if whole else np.ascontiguousarray(held[:, pick]))
        if routes_RLK.dtype not in (torch.int16, torch.int32, torch.int64):
            routes_RLK = routes_RLK.to(torch.int64)
        n = int(lengths.sum())
        request_N = torch.repeat_interleave(torch.arange(lengths.size), torch.from_numpy(lengths))
        start_N = torch.from_numpy(np.concatenate([[0], np.cumsum(lengths)[:-1]]))[request_N]
        pos_N = torch.arange(n) - start_N
        has_row_N = pos_N < torch.from_numpy(rows)[request_N]
        low_RL, high_RL = routes_RLK.amin(dim=-1), routes_RLK.amax(dim=-1)
        k = routes_RLK.shape[2]
        gaps_RL = (high_RL == -1) | ((low_RL == 0) & (high_RL == 0) if k > 1 else False)
        where = part["path"]
        if bool(gaps_RL.any()):
            row, col = (int(i) for i in gaps_RL.nonzero()[0])
            r, s = _request_of(row, rows)
            raise RouteError(
                f"{where}: request {r} position {s} layer {layers[col]}: capture gap (a row of -1 or of "
                f"zeros: {routes_RLK[row, col].tolist()}), {int(gaps_RL.sum())} such row(s); the engine "
                "did not record this route (a real token): fix the capture, or leave the token out of the "
                "request's tokens (RolloutWriter's token_ids, add_routes' sequences= or input_ids=)"
            )
        partial_RL = low_RL == -1
        if bool(partial_RL.any()):  # not a gap (every slot -1), not an id out of range: a row cut short
            row, col = (int(i) for i in partial_RL.nonzero()[0])
            r, s = _request_of(row, rows)
            raise RouteError(
                f"{where}: request {r} position {s} layer {layers[col]}: route "
                f"{routes_RLK[row, col].tolist()} has -1 (not captured) in "
                f"{int((routes_RLK[row, col] == -1).sum())} of its {routes_RLK.shape[2]} slots "
                f"({int(partial_RL.sum())} such row(s)): a variable top-k, or a capture cut mid-row; "
                "replay needs every one of the router's top-k experts of a real token"
            )
        if emap is not None:
            routes_RLK = ra.to_logical(
                routes_RLK.to(torch.int64),
                emap=emap,
                skip_TL=torch.zeros_like(gaps_RL),
                layers=layers,
                where=str(where),
            )
        sorted_RLK = routes_RLK.sort(dim=-1).values  # an expert set, ascending (RouteTable keeps them so)
        high_RL = (sorted_RLK[..., -1] >= num_experts) | (sorted_RLK[..., 0] < 0)
        if bool(high_RL.any()):
            row, col = (int(i) for i in high_RL.nonzero()[0])
            r, s = _request_of(row, rows)
            raise RouteError(
                f"{where}: request {r} position {s} layer {layers[col]}: expert ids "
                f"{routes_RLK[row, col].tolist()} outside [0, {num_experts}) ({int(high_RL.sum())} such "
                f"row(s)); an engine that records physical expert slots (EPLB with redundant experts) "
                f"needs its map: RolloutWriter(expert_map=), add_routes(expert_map=) or {EXPERT_MAP_ENV}=PATH"
            )
        twice_RL = (sorted_RLK[..., 1:] == sorted_RLK[..., :-1]).any(dim=-1)
        if bool(twice_RL.any()):
            row, col = (int(i) for i in twice_RL.nonzero()[0])
            r, s = _request_of(row, rows)
            raise RouteError(
                f"{where}: request {r} position {s} layer {layers[col]}: route {routes_RLK[row, col].tolist()} "
                f"names one expert twice ({int(twice_RL.sum())} such row(s)); a top-k route holds k distinct "
                "experts: a corrupt capture, or an expert map sending two physical slots of one token to one "
                "expert (give the map of the step that routed these tokens)"
            )
        if bool(has_row_N.all()):
            return sorted_RLK, ~has_row_N
        ids_NLK = torch.arange(k, dtype=sorted_RLK.dtype).expand(n, len(layers), k).clone()  # native: distinct ids
        ids_NLK[has_row_N] = sorted_RLK
        return ids_NLK, ~has_row_N


def checked_part(arrays: dict, path) -> dict:
    """A part's arrays checked (``RolloutWriter``'s layout): integer arrays of the right ranks, request lengths and
    route rows that add up, each request's rows ``S - 1`` or ``S``; ``path`` is what messages name."""
    need = {"tokens": 1, "lengths": 1, "rows": 1, "routes": 3, "numbering": 1}
    for key, dims in need.items():
        if key not in arrays or arrays[key].ndim != dims or arrays[key].dtype.kind not in "iu":
            got = "missing" if key not in arrays else f"{arrays[key].ndim}-d {arrays[key].dtype}"
            raise RouteError(f"{path}: {key!r} must be a {dims}-d integer array, got {got}")
    lengths, rows = arrays["lengths"].astype(np.int64), arrays["rows"].astype(np.int64)
    if lengths.shape != rows.shape or not lengths.size or lengths.min() < 1:
        raise RouteError(f"{path}: lengths {lengths.shape} and rows {rows.shape} must give >= 1 token per request")
    if int(lengths.sum()) != arrays["tokens"].shape[0] or int(rows.sum()) != arrays["routes"].shape[0]:
        raise RouteError(
            f"{path}: {arrays['tokens'].shape[0]} tokens and {arrays['routes'].shape[0]} route rows, "
            f"the requests' lengths and rows sum to {int(lengths.sum())} and {int(rows.sum())}"
        )
    short = (rows != lengths) & (rows != lengths - 1)
    if short.any():
        r = int(short.nonzero()[0][0])
        raise RouteError(
            f"{path}: request {r} holds {int(rows[r])} route rows for {int(lengths[r])} tokens; "
            f"expected {int(lengths[r]) - 1} or {int(lengths[r])}"
        )
    if "expert_map" in arrays and arrays["expert_map"].ndim != 2:
        raise RouteError(f"{path}: expert_map must be [W or 1, P], got {arrays['expert_map'].shape}")
    arrays["lengths"], arrays["rows"], arrays["path"] = lengths, rows, path
    return arrays


def _request_of(row: int, rows: np.ndarray) -> tuple[int, int]:
    ends = np.cumsum(rows)
    r = int(np.searchsorted(ends, row, side="right"))
    return r, row - int(ends[r - 1] if r else 0)


class TableSource(abc.ABC):
    """Route tables of the serving rollout versions for the bound model's chunks: what ``RolloutSource`` (files) and
    ``BatchSource`` (routes handed over with the batch) share. Subclasses give ``_serving()`` and ``_empty()``.

    Args:
        max_tokens: refuse a table of more tokens (the serving versions together): its memory bound.
        duplicates: ``RouteTable``'s rule for one prefix routed differently within a version (R3 default: the first
            route; the engine routed identical prefixes in other batches).
    """

    origin = "the rollout routes"
    remedy = "hand over every sequence the step trains on"

    def __init__(self, *, max_tokens: int, duplicates: str = "first"):
        self.max_tokens, self.duplicates = max_tokens, duplicates
        self.expert_map = os.environ.get(EXPERT_MAP_ENV) or None
        self._tables: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # chunk -> table of the serving steps
        self.builds = 0

    @property
    def steps(self) -> tuple[int, ...]:
        """The serving versions, newest first."""
        return tuple(step.step for step in self._serving())

    @abc.abstractmethod
    def _serving(self) -> list[Step]:
        """The serving versions' checked requests, newest first."""

    @abc.abstractmethod
    def _empty(self, rank: int) -> str:
        """Why nothing serves (the message of the ``RouteError`` a forward then raises)."""

    def describe(self, versions: str) -> str:
        """What error messages call the routes of ``versions``."""
        return f"{self.origin} of step(s) {versions}"

    def refresh(self) -> None:  # noqa: B027 (a source handed its routes has nothing to look for)
        """Look for newer versions; they replace the tables."""

    def invalidate(self) -> None:
        self._tables = weakref.WeakKeyDictionary()

    def table(self, chunk, *, layers: list[int], config, rank: int) -> RouteTable:
        """The frozen table of ``chunk``'s MoE ``layers`` (global, router order) for the serving versions."""
        held = self._tables.get(chunk)
        if held is not None:
            return held
        serving = self._serving()
        if not serving:
            raise RouteError(self._empty(rank))
        model_layers = list(
            layer_numbering.moe_layers(num_layers=config.num_layers, moe_layer_freq=config.moe_layer_freq)
        )
        for step in serving:
            topk = int(step.parts[0]["routes"].shape[2])
            if topk != config.moe_router_topk:
                raise RouteError(
                    f"rank {rank}: {step.where}: the rollout routes hold top-{topk} ids, the model routes "
                    f"top-{config.moe_router_topk} (moe_router_topk): another model's routes?"
                )
        device = next(chunk.parameters()).device
        versions = ", ".join(str(step.step) for step in serving)
        table = RouteTable(
            max_tokens=self.max_tokens,
            num_experts=config.num_moe_experts,
            duplicates=self.duplicates,
            origin=(self.describe(versions), self.remedy),
        )
        for step in serving:  # newest first
            tokens_N, starts, ids_NLK, native_N = step.ids(
                layers=layers,
                model_layers=model_layers,
                num_layers=config.num_layers,
                num_experts=config.num_moe_experts,
                expert_map=self.expert_map,
            )
            keys = tk.packed_keys(tokens_N.to(device), cu_seqlens=starts.to(device))
            forward = table.add_forward(keys, rank=rank, native_T=native_N.to(device), version=step.step)
            for i, layer in enumerate(layers):
                table.add_ids(layer=layer, forward=forward, ids_TK=ids_NLK[:, i].to(device), rank=rank, canonical=True)
        table.freeze(rank=rank)
        self._tables[chunk] = table
        self.builds += 1
        agreement.routes_changed()
        return table


class RolloutSource(TableSource):
    """The route tables of a rollout directory (``RolloutWriter`` files) for the bound model's chunks (module
    docstring): the newest ``keep()`` complete steps serve; every rank reads them whole.

    Args:
        directory: the ``r3:DIR`` directory.
    """

    remedy = "write every sequence the step trains on with RolloutWriter (prompt + response, every turn)"

    def __init__(self, directory: Path | str, *, max_tokens: int, duplicates: str = "first"):
        super().__init__(max_tokens=max_tokens, duplicates=duplicates)
        self.directory = Path(directory)
        self._newest: tuple[int, ...] = ()
        self._loaded: dict[int, Step] = {}

    def describe(self, versions: str) -> str:
        return f"the rollout routes of step(s) {versions} in {self.directory}"

    def _serving(self) -> list[Step]:
        for step in self._newest:
            if step not in self._loaded:
                self._loaded[step] = Step.read(self.directory, step)
        return [self._loaded[step] for step in self._newest]

    def _empty(self, rank: int) -> str:
        return (
            f"rank {rank}: in-job replay r3:{self.directory}: no complete rollout step yet (a step's routes are "
            f"read once its {rw.MARKER} marker exists: RolloutWriter.close() or rollout_writer.mark_complete())"
        )

    def refresh(self) -> None:
        """Look at the directory again; newer complete steps replace the tables."""
        if not self.directory.is_dir():
            raise UsageError(f"r3: {self.directory} is not a directory (RolloutWriter's output)")
        newest = tuple(reversed(rw.complete_steps(self.directory, newest=keep())))
        if newest != self._newest:
            self._newest = newest
            self._loaded = {s: self._loaded[s] for s in newest if s in self._loaded}
            self.invalidate()
