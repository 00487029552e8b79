"""Lining a training dump up with a rollout engine's routed experts, request by request.

Rollout engines (vLLM's ``routed_experts``, SGLang's ``return_routed_experts``) return one array per request,
``[n_i, L, K]``: the routes of positions ``0 .. n_i - 1`` of that request, usually ``n_i = S_i - 1`` (the last
token is sampled, never fed back). Training sees ``B`` sequences of ``S`` positions per micro-batch
(sequence order, ``g = b * S + s``, from a dump that records its geometry). Request ``r`` is training
sequence ``r`` counted over micro-batches in order. Compared: position ``s`` of request ``r`` where the
rollout holds a row for it. Listed apart, never compared: positions the rollout did not return (the last
row, padding) and capture gaps (a position whose row in every layer is -1, or zeros with K > 1; a gap in some
layers only, a row partly -1, and ids beyond the experts are refused). Legend: N = rows, L = layers,
K = top-k, S = positions.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import torch

from moeverify.errors import UsageError
from moeverify.routing import layer_numbering
from moeverify.routing.rollout_arrays import RolloutSpec
from moeverify.routing.routes import Routes


@dataclasses.dataclass(frozen=True, kw_only=True)
class Aligned:
    train: Routes  # the compared tokens only, one micro-batch per training micro-batch
    rollout: Routes
    requests: int
    compared: int
    uncaptured: int  # training positions the rollout returned no row for
    gaps: int  # rollout rows that were capture gaps
    sequence_tokens: tuple[tuple[int, ...], ...] = ()  # per micro-batch: compared tokens of each request, in order
    per_request: tuple[dict, ...] = ()  # per request: {request, uncaptured_tokens, capture_gap_rows}

    def as_json(self) -> dict:
        return {
            "requests": self.requests,
            "compared_tokens": self.compared,
            "uncaptured_tokens": self.uncaptured,
            "capture_gap_rows": self.gaps,
        }


def _columns(
    arr: np.ndarray, *, moe_layers: Sequence[int], num_layers: int | None, numbering: str | None, where: str
) -> np.ndarray:
    """The MoE columns (``layer_numbering``: one per MoE layer, or one per decoder layer; both fitting refused)."""
    cols = layer_numbering.columns(
        arr.shape[1],
        layers=moe_layers,
        num_layers=num_layers,
        numbering=numbering,
        where=where,
        error=UsageError,
        pick="--layer-numbering {}",
        count="the training dump's num_layers",
    )
    return arr if cols == list(range(arr.shape[1])) else arr[:, cols, :]


def _check_raw_ids(arr: np.ndarray, *, limit: int, where: str, layers: Sequence[int], mapped: bool) -> None:
    """Ids beyond the experts (or the map's slots), and negatives other than -1, refused in the array's own dtype
    (a uint64 of 2**63 or more would wrap to a negative int64, and then read as a capture gap)."""
    if not arr.size:
        return
    bad = (arr >= limit) | ((arr < -1) if np.issubdtype(arr.dtype, np.signedinteger) else False)
    if bad.any():
        n, col, k = (int(i[0]) for i in np.nonzero(bad))
        value = arr[n, col, k].item()
        hint = (
            ""
            if mapped or value < limit
            else (
                "; a rollout that records physical expert slots (an expert placement with redundant experts, EPLB) "
                "needs their map to logical ids: --expert-map-b FILE"
            )
        )
        raise UsageError(
            f"{where}: position {n} layer {layers[col]} slot {k}: id {value} is "
            f"outside [0, {limit}) (and not -1, a capture gap){hint}"
        )


def _gap_rows(ids_NLK: torch.Tensor, *, where: str, layers: Sequence[int]) -> torch.Tensor:
    """``[N]`` bool: positions the engine did not capture. A row (one position, one layer) is a capture gap when
    it is all -1, or all 0 with K > 1 (no router picks expert 0 twice). A position is a gap when every layer's
    row is; a gap in some layers only, or a row partly -1, is refused: comparing the other layers would need
    another token set per layer, and dropping them would hide them."""
    neg_NLK = ids_NLK < 0
    gap_NL = neg_NLK.all(dim=2)
    if ids_NLK.shape[2] > 1:
        gap_NL |= (ids_NLK == 0).all(dim=2)
    partial_NL = neg_NLK.any(dim=2) & ~neg_NLK.all(dim=2)
    mixed_N = gap_NL.any(dim=1) & ~gap_NL.all(dim=1)
    for what, bad_N, layers_NL in (
        ("is partly -1 (a capture gap is a whole row of -1)", partial_NL.any(dim=1), partial_NL),
        ("is a capture gap in some layers only", mixed_N, gap_NL),
    ):
        if bool(bad_N.any()):
            n = int(bad_N.nonzero()[0])
            cols = layers_NL[n].nonzero().flatten().tolist()
            raise UsageError(
                f"{where}: position {n} {what}: layer(s) {[layers[c] for c in cols]} of "
                f"{list(layers)}; rows {ids_NLK[n].tolist()}"
            )
    return gap_NL.all(dim=1)


def align(
    train: Routes, spec: RolloutSpec, *, seq_len: Sequence[int], batch: int, requests: Sequence[np.ndarray], where: str
) -> Aligned:
    """Both sides restricted to the positions the rollout routed (``train`` in sequence order; ``batch``:
    sequences per merged micro-batch). ``spec``: the rollout's MoE layers and decoder layer count, what its layer
    axis holds (``numbering``; None: inferred, refused when two readings fit) and its ``expert_map`` (the rollout
    records physical expert slots: captured rows are mapped to logical ids before the comparison)."""
    moe_layers, num_layers, numbering, expert_map = spec.layers, spec.num_layers, spec.numbering, spec.expert_map
    if expert_map is not None and expert_map.logical != train.num_experts:
        raise UsageError(
            f"{expert_map.path}: maps onto {expert_map.logical} logical experts, the training side has "
            f"{train.num_experts} (both sides must be the same logical experts)"
        )
    sequences = batch * len(seq_len)
    if len(requests) != sequences:
        raise UsageError(
            f"{where}: {len(requests)} rollout request(s) != the training step's {sequences} sequences "
            f"({len(seq_len)} micro-batch(es) x batch {batch})"
        )
    train_mbs: dict[int, list] = {layer: [] for layer in train.layers}
    roll_mbs: dict[int, list] = {layer: [] for layer in train.layers}
    compared = uncaptured = gaps = 0
    spans, per_request = [], []
    for mb, length in enumerate(seq_len):
        rows_idx, rows = [], []
        for b in range(batch):
            r = mb * batch + b
            arr = requests[r]
            if arr.ndim != 3 or not np.issubdtype(arr.dtype, np.integer) or arr.shape[2] != train.topk:
                raise UsageError(
                    f"{where}: request {r}: shape {arr.shape} dtype {arr.dtype} != integer "
                    f"[positions, layers, {train.topk}]"
                )
            if arr.shape[0] > length:
                raise UsageError(
                    f"{where}: request {r}: {arr.shape[0]} rows > the training sequence's {length} "
                    "positions (is it the same request?)"
                )
            cols = _columns(
                arr, moe_layers=moe_layers, num_layers=num_layers, numbering=numbering, where=f"{where}: request {r}"
            )
            limit = expert_map.physical if expert_map is not None else train.num_experts
            _check_raw_ids(
                cols, limit=limit, where=f"{where}: request {r}", layers=train.layers, mapped=expert_map is not None
            )
            ids = torch.from_numpy(np.ascontiguousarray(cols).astype(np.int64))
            gap_N = _gap_rows(ids, where=f"{where}: request {r}", layers=train.layers)
            keep = (~gap_N).nonzero().flatten()
            if keep.numel() == 0:  # nothing of this request compared: its routes, right or wrong, would go unseen
                held = "no row" if arr.shape[0] == 0 else f"{arr.shape[0]} row(s), every one a capture gap"
                raise UsageError(
                    f"{where}: request {r} holds {held} for training sequence {r} of {length} position(s): the "
                    "engine captured nothing of it, so none of its routes can be compared (is it the request "
                    "training packed there? an engine returns a row for every position but the last)"
                )
            gaps += int(gap_N.sum())
            uncaptured += length - int(arr.shape[0])
            rows_idx.append(b * length + keep)
            rows.append(ids[keep])
            per_request.append(
                {"request": r, "uncaptured_tokens": length - int(arr.shape[0]), "capture_gap_rows": int(gap_N.sum())}
            )
        spans.append(tuple(int(i.numel()) for i in rows_idx))
        index = torch.cat(rows_idx)
        stacked = torch.cat(rows)
        compared += int(index.numel())

        def label(_mb, row, index=index, mb=mb, length=length):
            seq, pos = divmod(int(index[row]), length)
            return f"request {mb * batch + seq} position {pos}"

        for i, layer in enumerate(train.layers):
            train_mbs[layer].append(train.get(layer, mb).index_select(0, index))
            roll = stacked[:, i, :]
            if expert_map is not None:
                roll = expert_map.apply(layer, roll, where=where, microbatch=mb, token_label=label)
            roll_mbs[layer].append(roll)
    experts = train.num_experts
    high = max((int(t.max()) for mbs in roll_mbs.values() for t in mbs if t.numel()), default=0)
    if high >= experts:
        raise UsageError(f"{where}: expert id {high} >= the training dump's {experts} experts")
    return Aligned(
        train=Routes(train_mbs, num_experts=experts, topk=train.topk),
        rollout=Routes(roll_mbs, num_experts=experts, topk=train.topk),
        requests=len(requests),
        compared=compared,
        uncaptured=uncaptured,
        gaps=gaps,
        sequence_tokens=tuple(spans),
        per_request=tuple(per_request),
    )
