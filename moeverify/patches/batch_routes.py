"""In-job R3 with the rollout engine's routes handed over in memory, with the batch: ``MOEVERIFY_ROUTER_REPLAY=r3``.

Legend: B = rows of a padded batch, S = positions, W = layer columns of the engine's routes, K = top-k,
R = route rows of one request.

RL frameworks carry the engine's routed experts with the batch (verl's and slime's ``routed_experts``, NeMo-RL's
per-sample routes). Where the trainer builds its batch, each rank hands over the routes of the sequences it trains
on, with the step or policy version they were generated under::

    from moeverify.patches import injob
    injob.add_routes(version=step, input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                     routes=batch["routed_experts"])                       # [B, S, W, K], aligned with input_ids
    injob.add_routes(version=step, sequences=token_ids, routes=engine_routes)  # per request: [S_i - 1 or S_i, W, K]

Every forward of the bound model then replays each token's engine route, found by token identity as in-job R3 from
files does (``rollout_source``): the same checks (layer numbering, expert maps, capture gaps, ids in range), the
same provenance (each sequence served by the one version that holds it whole; ``injob.rollout_version(N)`` names
it), the same agreement guard. A rank holds only what it was handed: memory per rank follows its own tokens. The
routes of the newest ``rollout_source.keep()`` versions serve (``MOEVERIFY_ROUTER_REPLAY_KEEP``, default 2);
``drop_routes()`` forgets them. ``version=`` may give one version per request (a list as long as the requests): a
batch mixing versions is held per version, and ``injob.rollout_version(per_row)`` names each sample's at the forward.

Tokens the engine never routed (verl's zero rows after a multi-turn trajectory's last generation: a tool's output the
engine never fed back) are declared with ``native=`` (per token, True = never routed): their rows are not read, they
route natively, and the agreement guard counts them apart (``routed_natively``). Undeclared, such a row on a real
token is a capture gap, refused.
"""

from __future__ import annotations

import numpy as np
import torch

from moeverify.errors import RouteError, UsageError
from moeverify.patches.rollout_source import Step, TableSource, checked_part, keep
from moeverify.patches.route_table import MAX_TOKENS_ENV
from moeverify.routing import rollout_writer as rw
from moeverify.routing.engine_routes import EngineRoutes

_SOURCE: list = []  # the installed BatchSource (autopatch r3 with no directory), at most one


class BatchSource(TableSource):
    """The routes handed over with the batch, per version (module docstring)."""

    origin = "the routes handed over with the batch"
    remedy = (
        "hand every sequence this rank trains on to injob.add_routes() (prompt + response, every turn), under "
        "the version it was generated with"
    )

    def __init__(self, *, max_tokens: int, duplicates: str = "first"):
        super().__init__(max_tokens=max_tokens, duplicates=duplicates)
        self._parts: dict[int, list[dict]] = {}
        self._steps: dict[int, Step] = {}

    def add(self, version: int, part: dict) -> None:
        self._parts.setdefault(version, []).append(part)
        for old in sorted(self._parts, reverse=True)[keep() :]:
            del self._parts[old]
        held = sum(int(p["tokens"].shape[0]) for parts in self._parts.values() for p in parts)
        if held > self.max_tokens:
            self._parts[version].pop()
            raise UsageError(
                f"in-job replay r3: this rank now holds {held} tokens of routes (versions "
                f"{sorted(self._parts, reverse=True)}), over the cap of {self.max_tokens} "
                f"({MAX_TOKENS_ENV}); hand over only the sequences this rank trains on, "
                "or drop_routes() the versions it is done with"
            )
        self._steps = {}
        self.invalidate()

    def drop(self, version: int | None = None) -> None:
        if version is None:
            self._parts.clear()
        else:
            self._parts.pop(version, None)
        self._steps = {}
        self.invalidate()

    @property
    def tokens(self) -> int:
        return sum(int(p["tokens"].shape[0]) for parts in self._parts.values() for p in parts)

    def _serving(self) -> list[Step]:
        for version in sorted(self._parts, reverse=True):
            if version not in self._steps:
                self._steps[version] = _DeclaredStep(
                    self._parts[version], where=f"the batch routes of version {version}", step=version
                )
        return [self._steps[v] for v in sorted(self._parts, reverse=True)]

    def _empty(self, rank: int) -> str:
        return (
            f"rank {rank}: in-job replay r3 (routes with the batch): no routes handed over yet; call "
            "injob.add_routes(version=..., ...) where the batch is built, before its first forward"
        )


class _DeclaredStep(Step):
    """A version's requests whose parts may declare tokens the engine never routed (``"native"``, per token): routed
    natively like the engine's missing last rows (their rows hold placeholders, never replayed)."""

    @staticmethod
    def request_rows(part: dict, *, pick, layers, num_experts, emap):
        try:
            ids_NLK, native_N = Step.request_rows(part, pick=pick, layers=layers, num_experts=num_experts, emap=emap)
        except RouteError as exc:
            if "capture gap" not in str(exc):
                raise
            raise RouteError(
                f"{exc}; a token the engine never routed (a tool's output after the last generation) is declared "
                "with add_routes(native=) and routes natively"
            ) from None
        declared = part.get("native")
        return ids_NLK, native_N if declared is None else native_N | torch.from_numpy(declared.astype(bool))


def attach(source: BatchSource) -> None:
    _SOURCE[:] = [source]


def detach() -> None:
    _SOURCE.clear()


def _source() -> BatchSource:
    if not _SOURCE:
        raise UsageError(
            "injob.add_routes(): in-job replay of routes handed over with the batch is not installed; run "
            "the job with MOEVERIFY_ROUTER_REPLAY=r3 (no directory) under moeverify.patches.autopatch"
        )
    return _SOURCE[0]


def _array(value, what: str, *, dims: int) -> np.ndarray:
    array = np.asarray(value.detach().cpu() if hasattr(value, "detach") else value)
    if array.ndim != dims or array.dtype.kind not in "iub":
        raise UsageError(f"{what}: expected a {dims}-d integer array, got {array.ndim}-d {array.dtype}")
    return array


def _narrow(routes: np.ndarray) -> np.ndarray:
    """int16 where every id fits (host memory: 2 bytes an id), else int32."""
    small = routes.size == 0 or int(routes.max()) < np.iinfo(np.int16).max
    return routes.astype(np.int16 if small else np.int32)


def _gap_rows(routes_RWK: np.ndarray) -> np.ndarray:
    """``[R]``: rows with no route in any column (all -1, or all zeros with K > 1): never captured."""
    k = routes_RWK.shape[2]
    gap_RW = (routes_RWK == -1).all(axis=2) | ((routes_RWK == 0).all(axis=2) if k > 1 else False)
    return np.asarray(gap_RW).all(axis=1)


def _requests_of_padded(input_ids, attention_mask, routes, native=None) -> tuple[list, list, list]:
    """A padded batch (either side) -> per request ``(tokens [S_i], routes [S_i or S_i - 1, W, K], native [S_i] or
    None)``: the routes (and ``native``) are aligned with ``input_ids`` position for position; an unfilled row at a
    request's last real token is the engine's missing last row."""
    ids_BS = _array(input_ids, "input_ids", dims=2)
    native_BS = None if native is None else _array(native, "add_routes native=", dims=2).astype(bool)
    if native_BS is not None and native_BS.shape != ids_BS.shape:
        raise UsageError(f"add_routes: native= {native_BS.shape} must be [B, S] like input_ids {ids_BS.shape}")
    mask_BS = _array(attention_mask, "attention_mask", dims=2).astype(bool)
    routes_BSWK = _array(routes, "routes", dims=4)
    if mask_BS.shape != ids_BS.shape or routes_BSWK.shape[:2] != ids_BS.shape:
        raise UsageError(
            f"add_routes: input_ids {ids_BS.shape}, attention_mask {mask_BS.shape} and routes "
            f"{routes_BSWK.shape[:2]} (+ [W, K]) must agree on [B, S]"
        )
    sequences, per_request, declared = [], [], []
    for b in range(ids_BS.shape[0]):
        real = np.flatnonzero(mask_BS[b])
        if not real.size:
            raise UsageError(f"add_routes: batch row {b} has no real token (attention_mask all 0)")
        if real[-1] - real[0] + 1 != real.size:
            raise UsageError(
                f"add_routes: batch row {b}: its real tokens are not contiguous (attention_mask has a hole "
                f"at position {int(np.setdiff1d(np.arange(real[0], real[-1] + 1), real)[0])}); padding "
                "sits on either side of a sequence"
            )
        rows = routes_BSWK[b, real]
        if _gap_rows(rows[-1:])[0]:
            rows = rows[:-1]  # the engine's missing last row: that token was sampled, never fed back
        sequences.append(ids_BS[b, real])
        per_request.append(rows)
        declared.append(None if native_BS is None else native_BS[b, real])
    return sequences, per_request, declared


def _request(tokens, routes, where: str) -> tuple[np.ndarray, np.ndarray, str | None, bool]:
    """One request's ``(tokens [S], routes [R, W, K], numbering or None, physical)``; rows as given (``_declare``
    fills the rows of tokens declared native)."""
    tokens_S = _array(tokens, f"{where}: sequence", dims=1)
    numbering, physical = None, False
    if isinstance(routes, EngineRoutes):
        if routes.start:
            raise UsageError(
                f"{where}: the engine's rows start at position {routes.start}, not 0; join them to the "
                "earlier rows of the request first (moeverify.routing.engine_routes.splice)"
            )
        numbering, physical, routes = routes.numbering, routes.physical, routes.routes
    routes_RWK = _array(routes, f"{where}: routes", dims=3)
    if tokens_S.size and routes_RWK.shape[0] == tokens_S.size and _gap_rows(routes_RWK[-1:])[0]:
        routes_RWK = routes_RWK[:-1]  # the engine's missing last row, unfilled: as the padded form reads it
    if not tokens_S.size or routes_RWK.shape[0] not in (tokens_S.size - 1, tokens_S.size):
        raise UsageError(
            f"{where}: {routes_RWK.shape[0]} route rows for {tokens_S.size} tokens; expected "
            f"{tokens_S.size - 1} (the engine's missing last row) or {tokens_S.size}"
        )
    if tokens_S.min() < 0:
        raise UsageError(f"{where}: the sequence holds a negative token id {int(tokens_S.min())}")
    return tokens_S.astype(np.int64), routes_RWK, numbering, physical


def _declared(native, tokens: int, where: str) -> np.ndarray | None:
    """``native=`` of one request: ``[S]`` bool (True = a token the engine never routed), or None."""
    if native is None:
        return None
    native_S = _array(native, f"{where}: native=", dims=1)
    if native_S.shape[0] != tokens:
        raise UsageError(f"{where}: native= holds {native_S.shape[0]} entries for {tokens} tokens; one per token")
    return native_S.astype(bool)


def _placeholder_WK(width: int, k: int, expert_map) -> np.ndarray:
    """The row held for a token declared native (never replayed): distinct valid ids in every column, ``0..K-1``, or
    under an expert map the first ``K`` slots holding distinct experts."""
    if expert_map is None:
        return np.tile(np.arange(k), (width, 1))
    rows = []
    for w in range(width):
        slots_P = expert_map[min(w, expert_map.shape[0] - 1)]
        _, first = np.unique(slots_P, return_index=True)
        rows.append(np.sort(first)[:k])
    return np.stack(rows)


def _declare(routes_RWK: np.ndarray, native_S: np.ndarray | None, expert_map) -> np.ndarray:
    """Rows of the tokens declared native replaced by placeholders (whatever the engine left there: zeros)."""
    if native_S is None:
        return routes_RWK
    rows_R = native_S[: routes_RWK.shape[0]]
    if not rows_R.any():
        return routes_RWK
    out = routes_RWK.copy()
    out[rows_R] = _placeholder_WK(routes_RWK.shape[1], routes_RWK.shape[2], expert_map)
    return out


def add_routes(
    *,
    version,
    routes,
    sequences=None,
    input_ids=None,
    attention_mask=None,
    numbering: str | None = None,
    expert_map=None,
    native=None,
) -> int:
    """Hand this rank's share of a batch's rollout routes to in-job R3 (module docstring); returns the tokens held.

    Args:
        version: the RL step or policy version the sequences were generated under (an integer >= 0), or one per
            request (a list or 1-d array as long as the requests: a batch mixing versions).
        routes: per request (with ``sequences``) a list of ``[S_i - 1 or S_i, W, K]`` arrays or
            ``moeverify.routing.engine_routes.EngineRoutes``; or (with ``input_ids``) ``[B, S, W, K]`` aligned with
            them.
        sequences: per request, the token ids training feeds (prompt + response, every turn).
        input_ids, attention_mask: a padded ``[B, S]`` batch (padding on either side; mask 1 = real token).
        numbering: the layer axis, ``"routers"`` (MoE layers) or ``"decoder"`` (every decoder layer); None: taken
            from ``EngineRoutes``, else inferred and refused where both readings fit.
        expert_map: ``slot -> logical expert`` (``[P]`` or ``[W, P]``) where the engine recorded physical slots.
        native: tokens the engine never routed (True), which route natively whatever their rows hold: per request
            (with ``sequences``) a list of ``[S_i]`` (or None entries), or (with ``input_ids``) ``[B, S]``.
    """
    if (sequences is None) == (input_ids is None):
        raise UsageError(
            "add_routes: give either sequences= (per request) or input_ids= with attention_mask= (a "
            "padded batch), with routes="
        )
    if numbering not in rw.NUMBERINGS:
        raise UsageError(f"add_routes(numbering={numbering!r}): expected 'routers', 'decoder' or None")
    source = _source()
    if input_ids is not None:
        if attention_mask is None:
            raise UsageError("add_routes(input_ids=...): the attention_mask is needed to tell padding from tokens")
        sequences, routes, native = _requests_of_padded(input_ids, attention_mask, routes, native)
    sequences, routes = list(sequences), list(routes)
    if len(sequences) != len(routes) or not sequences:
        raise UsageError(f"add_routes: {len(sequences)} sequences and {len(routes)} routes; one per request, >= 1")
    native = [None] * len(sequences) if native is None else list(native)
    if len(native) != len(sequences):
        raise UsageError(f"add_routes: native= holds {len(native)} entries for {len(sequences)} requests; one each")
    versions = _versions(version, len(sequences))
    emap = None if expert_map is None else np.atleast_2d(_array(expert_map, "expert_map", dims=np.ndim(expert_map)))
    requests, declared = [], []
    for i, (s, r, v, n) in enumerate(zip(sequences, routes, versions, native, strict=True)):
        where = f"add_routes version {v} request {i}"
        tokens_S, routes_RWK, said, physical = _request(s, r, where)
        native_S = _declared(n, tokens_S.size, where)
        requests.append((tokens_S, _declare(routes_RWK, native_S, emap), said, physical))
        declared.append(native_S)
    named = {n for _, _, n, _ in requests if n is not None} | ({numbering} if numbering else set())
    if len(named) > 1:
        raise UsageError(f"add_routes: the routes say layer numberings {sorted(named)}; one engine's")
    if any(p for _, _, _, p in requests) and expert_map is None:
        raise UsageError(
            "add_routes: the engine recorded physical expert slots (EPLB); give "
            "expert_map= (slot -> logical expert, docs/engine_routes.md says where each engine keeps it)"
        )
    widths = {r.shape[1:] for _, r, _, _ in requests}
    if len(widths) != 1:
        raise UsageError(f"add_routes: routes of shapes [*, W, K] {sorted(widths)}; one engine's")
    code = rw.NUMBERINGS[named.pop() if named else None]
    for v in sorted(set(versions)):
        at = [i for i, rv in enumerate(versions) if rv == v]
        held = [requests[i] for i in at]
        arrays = {
            "tokens": np.concatenate([t for t, _, _, _ in held]),
            "lengths": np.array([t.size for t, _, _, _ in held], dtype=np.int64),
            "rows": np.array([r.shape[0] for _, r, _, _ in held], dtype=np.int64),
            "routes": _narrow(np.concatenate([r for _, r, _, _ in held])),
            "numbering": np.array([code], dtype=np.int8),
        }
        if emap is not None:
            arrays["expert_map"] = emap
        if any(declared[i] is not None for i in at):
            arrays["native"] = np.concatenate(
                [declared[i] if declared[i] is not None else np.zeros(requests[i][0].size, dtype=bool) for i in at]
            )
        source.add(v, checked_part(arrays, f"the batch routes of version {v}"))
    return source.tokens


def _versions(version, requests: int) -> list[int]:
    """``add_routes``' ``version``: one integer for every request, or one per request."""

    def one(v) -> int:
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
            raise UsageError(f"add_routes(version={v!r}): expected the step or policy version, an integer >= 0")
        return int(v)

    if isinstance(version, (int, np.integer)) or isinstance(version, bool):
        return [one(version)] * requests
    per = version.tolist() if hasattr(version, "tolist") else version
    if not isinstance(per, (list, tuple)) or len(per) != requests:
        raise UsageError(
            f"add_routes(version=...): one version for the batch, or one per request ({requests}), got "
            f"{type(version).__name__} of {len(per) if isinstance(per, (list, tuple)) else 'no'} entries"
        )
    return [one(v) for v in per]


def drop_routes(version: int | None = None) -> None:
    """Forget the routes handed over for ``version`` (all versions: None)."""
    _source().drop(version)
