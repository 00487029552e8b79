"""A rollout engine's per-token routes as the ``[tokens, L, K]`` int64 array ``Routes.from_rollout`` builds from.

Engines return routes for prompt + response minus the final token (it is sampled, never fed back). Here: the
layer columns are picked (``layer_numbering``), physical expert slots mapped to logical ids (``expert_map``),
requests lined up sequence-major, the missing last row and padding marked, and capture gaps on real tokens
refused. Legend: T = tokens, L = MoE layers (columns), K = top-k, B = requests, S = padded positions.
"""

from __future__ import annotations

import dataclasses
import numbers
import os
from collections.abc import Sequence

import torch

from moeverify.errors import RouteError
from moeverify.routing import expert_map as maps
from moeverify.routing import layer_numbering
from moeverify.routing.route_ids import INT_DTYPES, safe_routes

PICK, COUNT = 'numbering="{}"', "num_layers="


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class RolloutSpec:
    """What a rollout engine's routes mean for the model training routes: which MoE layers, how many logical
    experts, what the layer axis holds, and the expert placement. Checked once (``of``), then handed on whole
    instead of five loose arguments."""

    layers: tuple[int, ...]  # global MoE layer numbers, ascending, each once (MTP layers: num_layers + i)
    num_experts: int  # logical experts per MoE layer
    num_layers: int | None = None  # decoder layers of the model (MTP layers not counted)
    numbering: str | None = None  # what the layer axis holds: "routers", "decoder", or None (inferred)
    expert_map: maps.ExpertMap | None = None  # the engine records physical slots: slot -> logical id

    @classmethod
    def of(
        cls, *, layers, num_experts: int, num_layers: int | None = None, numbering: str | None = None, expert_map=None
    ) -> RolloutSpec:
        """Checked: ``layers`` (``check_layers``) and ``expert_map`` (a path, a parsed map or an ``ExpertMap``,
        ``load_map``)."""
        layers = tuple(check_layers(layers))
        emap = (
            None
            if expert_map is None
            else load_map(expert_map, layers=layers, num_layers=num_layers, num_experts=num_experts)
        )
        return cls(layers=layers, num_experts=num_experts, num_layers=num_layers, numbering=numbering, expert_map=emap)


def check_layers(layers) -> list[int]:
    """``layers`` as ints: global layer numbers (>= 0), each once, ascending (router column order: the MoE layers,
    then the MTP layers numbered ``num_layers + i``); ``RouteError`` naming the entry otherwise. A layer given twice
    would take two columns into one layer's routes, an order other than the columns' would swap layers."""
    if isinstance(layers, str | bytes) or not hasattr(layers, "__iter__"):
        raise RouteError(f"layers={layers!r}: expected a sequence of global layer numbers (ints >= 0)")
    given = list(layers)
    if not given:
        raise RouteError("layers=[]: expected at least one global layer number (the MoE layers the routes are of)")
    for i, layer in enumerate(given):
        if isinstance(layer, bool) or not isinstance(layer, numbers.Integral) or layer < 0:
            raise RouteError(f"layers={given!r}: entry {i} is {layer!r}; expected a global layer number (an int >= 0)")
    given = [int(layer) for layer in given]
    for i in range(1, len(given)):
        if given[i] in given[:i]:
            raise RouteError(
                f"layers={given}: layer {given[i]} is given twice (entries {given.index(given[i])} and "
                f"{i}); expected each MoE layer once"
            )
        if given[i] < given[i - 1]:
            raise RouteError(
                f"layers={given}: entry {i} ({given[i]}) comes after {given[i - 1]}; expected the layers "
                f"ascending, in router column order (MoE layers, then MTP layers): {sorted(given)}"
            )
    return given


def ndim(array) -> int:
    return len(getattr(array, "shape", ()))


def one_sequence(topk_ids, spec: RolloutSpec, *, tokens: int | None, pad_T) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One sequence ``[T or T - 1, W, K]`` -> ``([tokens, L, K], pad_T or None)``."""
    where = "rollout routes"
    ids_TLK = pick_columns(as_int64(topk_ids), spec, where=where)
    tokens = int(ids_TLK.shape[0]) if tokens is None else tokens
    pad = None if pad_T is None else _as_bool(pad_T, tokens)
    ids_TLK = _one_request(ids_TLK, spec, tokens=tokens, pad_T=pad, where=where)
    return ids_TLK, pad


def pick_columns(ids_TLK: torch.Tensor, spec: RolloutSpec, *, where: str) -> torch.Tensor:
    """The columns of ``spec.layers`` in ``[T, W, K]`` (``layer_numbering.columns``: refused when two readings
    fit)."""
    layers = spec.layers
    if ids_TLK.dim() != 3:
        raise RouteError(f"{where} shape {tuple(ids_TLK.shape)} != expected (T, L={len(layers)}, K)")
    cols = layer_numbering.columns(
        ids_TLK.shape[1],
        layers=layers,
        num_layers=spec.num_layers,
        numbering=spec.numbering,
        where=where,
        error=RouteError,
        pick=PICK,
        count=COUNT,
    )
    return ids_TLK if cols == list(range(ids_TLK.shape[1])) else ids_TLK[:, cols, :]


def gap_rows(ids_TLK: torch.Tensor) -> torch.Tensor:
    """``[T, L]`` bool: rows an engine left uncaptured (all -1, or all zero when K > 1)."""
    gaps = (ids_TLK == -1).all(dim=-1)
    if ids_TLK.shape[-1] > 1:
        gaps |= (ids_TLK == 0).all(dim=-1)
    return gaps


def to_logical(
    ids_TLK: torch.Tensor, *, emap, skip_TL: torch.Tensor, layers: Sequence[int], where: str
) -> torch.Tensor:
    """Physical expert slots as logical ids through ``emap`` (``ExpertMap.apply``: a slot outside the map, or two
    replicas of one expert in a row, refused); rows in ``skip_TL`` (padding) stay as they are."""
    out_TLK = ids_TLK.clone()
    keep_TL = ~skip_TL
    for i, layer in enumerate(layers):
        rows = keep_TL[:, i].nonzero().flatten()
        out_TLK[rows, i] = emap.apply(
            layer, ids_TLK[rows, i], where=where, token_label=lambda _mb, row, rows=rows: f"token {int(rows[row])}"
        )
    return out_TLK


def _check_range(
    ids_TLK: torch.Tensor, *, skip_TL: torch.Tensor, num_experts: int, layers: Sequence[int], where: str
) -> None:
    """An id at or above the experts on a captured row: a physical slot of an expert placement read unmapped
    (EPLB with redundant experts) or another model's route; refused, naming the map argument."""
    high_TL = (ids_TLK >= num_experts).any(dim=-1) & ~skip_TL
    if bool(high_TL.any()):
        t, col = (int(i) for i in high_TL.nonzero()[0])
        raise RouteError(
            f"{where}: token {t} layer {layers[col]}: expert id {int(ids_TLK[t, col].max())} out of "
            f"range [0, {num_experts}) ({int(high_TL.sum())} such row(s)); an engine that records "
            f"physical expert slots (an expert placement with redundant experts, EPLB) needs its map: "
            f"pass expert_map= (slot -> logical id)"
        )


def _one_request(
    ids_TLK: torch.Tensor, spec: RolloutSpec, *, tokens: int, pad_T: torch.Tensor | None, where: str
) -> torch.Tensor:
    """One request's ``[tokens, L, K]``: ids mapped, the missing last row filled, capture gaps on real tokens
    refused."""
    num_experts, layers, emap = spec.num_experts, spec.layers, spec.expert_map
    T, L, K = ids_TLK.shape
    if not 1 <= K <= num_experts:
        raise RouteError(f"{where}: top-k {K} not in [1, num_experts={num_experts}]")
    if T not in (tokens, tokens - 1):
        raise RouteError(
            f"{where} hold {T} tokens != expected {tokens} (or {tokens - 1}, the engine's missing last row)"
        )
    gaps_TL = gap_rows(ids_TLK)
    if pad_T is not None:
        gaps_TL &= ~pad_T[:T, None]
    if gaps_TL.any():
        t, col = (int(i) for i in gaps_TL.nonzero()[0])
        raise RouteError(
            f"{where}: token {t} MoE column {col}: capture gap (a row of -1 or of zeros: "
            f"{ids_TLK[t, col].tolist()}), {int(gaps_TL.sum())} such row(s); the engine did not "
            "record this route: mark those tokens as padding (one sequence: pad_T=; several requests: give each "
            "request's own rows, a left-padded batch's padding cut off, or the flat [T, L, K] form with pad_T=) "
            "or fix the capture"
        )
    pads_TL = (pad_T[:T, None] if pad_T is not None else torch.zeros(T, 1, dtype=torch.bool)).expand(T, L)
    partial_TL = (ids_TLK == -1).any(dim=-1) & ~pads_TL  # not a gap (every slot -1): a route cut short
    if partial_TL.any():
        t, col = (int(i) for i in partial_TL.nonzero()[0])
        raise RouteError(
            f"{where}: token {t} MoE column {col}: route {ids_TLK[t, col].tolist()} has -1 (not "
            f"captured) in {int((ids_TLK[t, col] == -1).sum())} of its {K} slots "
            f"({int(partial_TL.sum())} such row(s)): a variable top-k, or a capture cut mid-row; replay "
            "needs every one of the router's top-k experts of a real token"
        )
    if emap is not None:  # padding keeps what it holds: it gets a safe route later
        ids_TLK = to_logical(ids_TLK, emap=emap, skip_TL=pads_TL, layers=layers, where=where)
    else:
        _check_range(ids_TLK, skip_TL=pads_TL, num_experts=num_experts, layers=layers, where=where)
    if T == tokens - 1:
        ids_TLK = torch.cat(
            [ids_TLK, safe_routes(1, topk=K, num_experts=num_experts, start=T).unsqueeze(1).expand(1, L, K)]
        )
    return ids_TLK


def batch_of_requests(
    topk_ids, spec: RolloutSpec, *, lengths: Sequence[int], rows: Sequence[int] | None, seq_len: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Several requests -> sequence-major ``[B * seq_len, L, K]`` and its pad mask."""
    lengths = [int(n) for n in lengths]
    if isinstance(topk_ids, (list, tuple)):
        requests = [as_int64(a) for a in topk_ids]
    else:
        requests = _unpad(as_int64(topk_ids), lengths=lengths, rows=rows)
    if len(requests) != len(lengths) or not requests:
        raise RouteError(f"rollout routes hold {len(requests)} request(s) != {len(lengths)} lengths")
    seq_len = max(lengths) if seq_len is None else int(seq_len)
    if min(lengths) < 1 or max(lengths) > seq_len:
        raise RouteError(f"request lengths {lengths} must lie in [1, seq_len={seq_len}]")
    out: list[torch.Tensor] = []
    for b, (ids_TLK, n) in enumerate(zip(requests, lengths, strict=True)):
        where = f"rollout request {b}"
        ids_TLK = pick_columns(ids_TLK, spec, where=where)
        ids_TLK = _one_request(ids_TLK, spec, tokens=n, pad_T=None, where=where)
        if out and ids_TLK.shape[2] != out[0].shape[2]:
            raise RouteError(f"{where}: top-k {ids_TLK.shape[2]} != request 0's {out[0].shape[2]}")
        filler = torch.zeros(seq_len - n, *ids_TLK.shape[1:], dtype=torch.int64)
        out.append(torch.cat([ids_TLK, filler]))
    pad_BS = torch.arange(seq_len)[None, :] >= torch.tensor(lengths)[:, None]
    return torch.cat(out), pad_BS.reshape(-1)


def _unpad(batch_BSLK: torch.Tensor, *, lengths: list[int], rows: Sequence[int] | None) -> list[torch.Tensor]:
    """Each request's own rows of a padded batch, as the list form would hold them.

    ``rows`` given: request ``b`` is its first ``rows[b]`` rows, exactly. Not given: its first ``lengths[b]`` rows,
    less the last of them when that position is uncaptured in every column (-1, or zeros with K > 1): the
    engine's missing last row, padded like the positions after it. A gap on an earlier position is a gap."""
    if batch_BSLK.dim() != 4:
        raise RouteError(f"padded rollout routes shape {tuple(batch_BSLK.shape)} != expected (B, S, L, K)")
    B, S = batch_BSLK.shape[:2]
    if rows is not None:
        rows = [int(n) for n in rows]
        if len(rows) != B:
            raise RouteError(f"rows= gives {len(rows)} request(s), the padded batch holds {B}")
        bad = [(b, n) for b, n in enumerate(rows) if not 0 <= n <= S]
        if bad:
            raise RouteError(f"rows= request {bad[0][0]}: {bad[0][1]} rows outside the padded batch's [0, {S}]")
        return [batch_BSLK[b, :n] for b, n in enumerate(rows)]
    out = []
    for b, n in enumerate(lengths[:B]):
        request_TLK = batch_BSLK[b, : min(n, S)]
        last = request_TLK.shape[0] - 1
        if last == n - 1 and last >= 0 and bool(gap_rows(request_TLK[last:]).all()):
            request_TLK = request_TLK[:last]
        out.append(request_TLK)
    return out


def as_int64(array) -> torch.Tensor:
    try:
        tensor = array if isinstance(array, torch.Tensor) else torch.as_tensor(array)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise RouteError(f"rollout routes must be an integer array, got {type(array).__name__}: {exc}") from exc
    if tensor.dtype not in INT_DTYPES + (torch.uint16, torch.uint32, torch.uint64):
        raise RouteError(f"rollout routes dtype {tensor.dtype} is not an integer dtype")
    return tensor.to(torch.int64)


def _as_bool(array, tokens: int) -> torch.Tensor:
    pad_T = (array if isinstance(array, torch.Tensor) else torch.as_tensor(array)).to(torch.bool)
    if pad_T.shape != (tokens,):
        raise RouteError(f"pad mask shape {tuple(pad_T.shape)} != expected ({tokens},)")
    return pad_T


def fill_pads(ids_TLK: torch.Tensor, pad_T: torch.Tensor, *, num_experts: int) -> torch.Tensor:
    rows = pad_T.nonzero().flatten()
    if not rows.numel():
        return ids_TLK
    T, L, K = ids_TLK.shape
    safe_TK = safe_routes(T, topk=K, num_experts=num_experts)
    out_TLK = ids_TLK.clone()
    out_TLK[rows] = safe_TK[rows].unsqueeze(1).expand(-1, L, K)
    return out_TLK


def load_map(expert_map, *, layers: Sequence[int], num_layers: int | None, num_experts: int):
    """``expert_map`` (a path, an ``ExpertMap``, or a parsed map: list, list of lists, layer-keyed dict,
    array) read and checked by ``moeverify.routing.expert_map``, the dump commands' one loader."""
    if isinstance(expert_map, maps.ExpertMap):
        emap = expert_map
        missing = sorted(set(layers) - set(emap.per_layer))
        if missing:
            raise maps.ExpertMapError(
                f"{emap.path}: no map for layer(s) {missing} (maps layers {sorted(emap.per_layer)})"
            )
    elif isinstance(expert_map, (str, os.PathLike)):
        emap = maps.load(os.fspath(expert_map), moe_layers=layers, num_layers=num_layers, what="the rollout routes")
    else:
        emap = maps.from_object(
            expert_map, moe_layers=layers, num_layers=num_layers, what="the rollout routes", name="expert_map="
        )
    if emap.logical != num_experts:
        raise maps.ExpertMapError(
            f"{emap.path}: maps onto {emap.logical} logical experts, num_experts is "
            f"{num_experts} (the map's logical ids are the experts training routes to)"
        )
    return emap
