"""Physical expert slots to logical expert ids, so that two routings are compared as logical experts.

Expert-parallel load balancing (EPLB; DeepSeek's, SGLang's and vLLM's) places ``P`` physical expert slots
on the EP ranks, ``P >= E`` logical experts: a hot logical expert gets several replicas. A router working
in physical slots records slot ids; a map ``physical slot -> logical id`` brings them back to the model's
experts. ``load`` reads one from a file and checks it completely before any route is mapped:

- ``.json``: a list ``[logical id of slot 0, slot 1, ...]`` (the same map for every MoE layer); a list of
  such lists, one row per MoE layer in layer order or one per decoder layer (dense rows then ignored); an
  object ``{"<global layer>": [...], ...}`` naming every MoE layer; or any of these under the single key
  ``"physical_to_logical_map"`` (SGLang's and vLLM's name for it).
- ``.npy``: ``[P]`` (every layer) or ``[rows, P]`` with the row rule above; an integer dtype. Never unpickled.

Refused (``ExpertMapError``, naming the file, layer and slot, expected vs got): a non-integer entry, a
row whose length is not the dump's expert count (its physical slots), an id outside ``[0, P)``, a layer
missing (or one that is not an MoE layer), rows that fit neither layer count or both (as many MoE layers as
decoder layers, the two readings taking other rows: ``layer_numbering``; key such a map by layer), a layer in
which some logical expert ``0 .. E-1`` has no slot (``E`` = largest id + 1; EPLB gives every logical expert at least
one replica in every layer). ``apply`` refuses a token whose top-k holds two replicas of one logical
expert: a correct router picks a logical expert once, so this is a finding, never deduplicated.
Legend: T = tokens, K = top-k, P = physical slots.
"""

from __future__ import annotations

import dataclasses
import json
import numbers
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from moeverify.errors import UsageError, few
from moeverify.routing import npy_file
from moeverify.routing.layer_numbering import ambiguous

KEY = "physical_to_logical_map"
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


class ExpertMapError(UsageError):
    """An expert map that is not a valid mapping, or routes that break it (the CLI exits 2)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExpertMap:
    """A validated ``physical slot -> logical id`` map for every MoE layer of one side."""

    path: str
    physical: int  # slots P: the ids the mapped side records lie in [0, P)
    logical: int  # logical experts E (largest id + 1); every layer maps onto all of them
    per_layer: dict[int, torch.Tensor]  # global MoE layer -> int64 [P]

    def as_json(self) -> dict:
        return {
            "file": self.path,
            "physical_slots": self.physical,
            "logical_experts": self.logical,
            "layers": sorted(self.per_layer),
            "redundant_slots_per_layer": self.physical - self.logical,
        }

    def apply(
        self, layer: int, ids_TK: torch.Tensor, *, where: str, microbatch: int = 0, token_label=None
    ) -> torch.Tensor:
        """Logical ids ``[T, K]`` (int64) of one layer's physical ids; refuses replicas of one expert in a row."""
        map_P = self.per_layer.get(layer)
        if map_P is None:
            raise ExpertMapError(f"{self.path}: no map for layer {layer} (maps layers {sorted(self.per_layer)})")
        ids = ids_TK.to(torch.int64)
        if ids.numel():
            lo, hi = int(ids.min()), int(ids.max())
            if lo < 0 or hi >= self.physical:
                raise ExpertMapError(
                    f"{where}: layer {layer} micro-batch {microbatch}: expert id "
                    f"{lo if lo < 0 else hi} is no slot of {self.path} (expected [0, "
                    f"{self.physical}))"
                )
        logical_TK = map_P[ids]
        if self.physical > self.logical and ids.shape[1] > 1:
            ordered = logical_TK.sort(dim=1).values
            dup_R = (ordered[:, 1:] == ordered[:, :-1]).any(dim=1).nonzero().flatten()
            if dup_R.numel():
                row = int(dup_R[0])
                label = token_label(microbatch, row) if token_label is not None else f"token {row}"
                raise ExpertMapError(
                    f"{where}: layer {layer} micro-batch {microbatch} {label}: top-{ids.shape[1]} physical slots "
                    f"{ids[row].tolist()} map through {self.path} to logical experts {logical_TK[row].tolist()}: "
                    f"two replicas of one logical expert in one token's top-k ({dup_R.numel()} such token(s) in "
                    f"this layer and micro-batch; later layers not checked). A router picks a logical expert "
                    f"once: this is a finding (a dispatch or map bug), not deduplicated"
                )
        return logical_TK


def load(
    path: str | Path,
    *,
    moe_layers: Sequence[int],
    num_layers: int | None = None,
    physical_experts: int | None = None,
    what: str = "the dump",
) -> ExpertMap:
    """Read and check the map at ``path`` for ``moe_layers``; ``physical_experts``: the mapped side's expert
    count (every row must have that many slots); None (an array side) takes the map's own length."""
    path = Path(path)
    name = str(path)
    if path.exists() and not path.is_file():
        raise ExpertMapError(
            f"{name}: not a regular file (a FIFO, device or directory); an expert map is a .json or .npy file"
        )
    if not path.is_file():
        raise ExpertMapError(f"{name}: expert map not found (a .json or .npy file)")
    if path.suffix == ".json":
        try:
            obj = json.loads(path.read_text(), object_pairs_hook=_refuse_repeated_keys)
        except (OSError, ValueError, RecursionError) as exc:
            why = "nested too deeply to be an expert map" if isinstance(exc, RecursionError) else exc
            raise ExpertMapError(f"{name}: not valid JSON: {why}") from None
    elif path.suffix == ".npy":
        obj = npy_file.load_npy(path, error=ExpertMapError, where=name)
        if not np.issubdtype(obj.dtype, np.integer):
            raise ExpertMapError(f"{name}: dtype {obj.dtype} is not an integer dtype (logical expert ids)")
    else:
        raise ExpertMapError(f"{name}: an expert map is a .json or .npy file, got suffix {path.suffix!r}")
    return from_object(
        obj, moe_layers=moe_layers, num_layers=num_layers, physical_experts=physical_experts, what=what, name=name
    )


def from_object(
    obj,
    *,
    moe_layers: Sequence[int],
    num_layers: int | None = None,
    physical_experts: int | None = None,
    what: str = "the dump",
    name: str = "expert map",
) -> ExpertMap:
    """``load`` of a map already parsed (a list, list of lists, layer-keyed dict or integer array)."""
    if isinstance(obj, dict) and KEY in obj:
        if set(obj) != {KEY}:
            raise ExpertMapError(f"{name}: an object holding {KEY!r} must hold nothing else, got keys {sorted(obj)}")
        obj = obj[KEY]
    moe = list(moe_layers)
    rows = _rows(obj, name=name, moe=moe, num_layers=num_layers)
    per_layer = {layer: _row(value, name=name, layer=layer) for layer, value in rows.items()}
    physical = physical_experts if physical_experts is not None else len(next(iter(per_layer.values())))
    for layer, map_P in per_layer.items():
        if map_P.numel() != physical:
            whose = (
                f"{what}'s {physical} experts (its physical slots)"
                if physical_experts is not None
                else f"layer {moe[0]}'s {physical} slots"
            )
            raise ExpertMapError(f"{name}: layer {layer}: {map_P.numel()} slot(s) != {whose}")
    for layer, map_P in per_layer.items():
        bad = ((map_P < 0) | (map_P >= physical)).nonzero().flatten()
        if bad.numel():
            slot = int(bad[0])
            raise ExpertMapError(
                f"{name}: layer {layer} slot {slot}: logical id {int(map_P[slot])} out of range "
                f"[0, {physical}) (a logical id is below the {physical} physical slots)"
            )
    logical = 1 + max(int(m.max()) for m in per_layer.values())
    for layer, map_P in per_layer.items():
        unplaced = (torch.bincount(map_P, minlength=logical) == 0).nonzero().flatten().tolist()
        if unplaced:
            raise ExpertMapError(
                f"{name}: layer {layer}: logical expert(s) {few(unplaced)} have no physical slot (the map's logical "
                f"experts are 0..{logical - 1}; every one needs at least one slot in every layer)"
            )
    return ExpertMap(path=name, physical=physical, logical=logical, per_layer=per_layer)


def _refuse_repeated_keys(pairs):
    keys = [key for key, _ in pairs]
    repeated = sorted({key for key in keys if keys.count(key) > 1})
    if repeated:
        raise ValueError(f"key(s) {repeated} given twice (one would silently replace the other)")
    return dict(pairs)


def _rows(obj, *, name: str, moe: list[int], num_layers: int | None) -> dict[int, object]:
    """``{global MoE layer: its row}`` of a parsed map (list, list of lists, layer-keyed object, array)."""
    if isinstance(obj, dict):
        per = {}
        for key, value in obj.items():
            plain_int = isinstance(key, int) and not isinstance(key, bool) and key >= 0
            plain_text = isinstance(key, str) and key.isascii() and key.isdigit() and str(int(key)) == key
            if not (plain_int or plain_text):
                raise ExpertMapError(
                    f"{name}: key {key!r} is not a global layer number written plainly (0, 1, ...; or {KEY!r})"
                )
            if int(key) in per:
                raise ExpertMapError(f"{name}: layer {int(key)} is given twice")
            per[int(key)] = value
        missing, extra = sorted(set(moe) - set(per)), sorted(set(per) - set(moe))
        if missing:
            raise ExpertMapError(
                f"{name}: MoE layer(s) {missing} missing (the map names layers {sorted(per)}; the MoE layers are {moe})"
            )
        # A decoder-layer-keyed map (SGLang's placement has a row per decoder layer) may name dense layers too:
        # their rows place no expert. Only with the layer count known; a key past it is no layer at all.
        if extra and (num_layers is None or max(extra) >= num_layers):
            raise ExpertMapError(
                f"{name}: layer(s) {extra} are not MoE layers of {moe}"
                + (f" (the model has {num_layers} decoder layers)" if num_layers is not None else "")
            )
        return {layer: per[layer] for layer in moe}
    if isinstance(obj, np.ndarray):
        if obj.ndim == 1:
            return {layer: obj for layer in moe}
        if obj.ndim != 2:
            raise ExpertMapError(f"{name}: shape {obj.shape} is neither [slots] nor [layers, slots]")
        table = list(obj)
    elif isinstance(obj, list):
        if not obj or not all(isinstance(v, list) for v in obj):
            if any(isinstance(v, list) for v in obj):
                raise ExpertMapError(f"{name}: a list mixing numbers and lists; give one row, or one row per layer")
            return {layer: obj for layer in moe}
        table = obj
    else:
        raise ExpertMapError(
            f"{name}: expected a list, a list of lists, an object keyed by layer or an array; got {type(obj).__name__}"
        )
    if num_layers is not None and ambiguous(len(table), layers=moe, num_layers=num_layers):  # without the count,
        # rows are one per MoE layer: no other reading is offered
        raise ExpertMapError(
            f"{name}: {len(table)} rows fit both one row per MoE layer {moe} and one row per decoder "
            f"layer ({num_layers} decoder layers; row r is layer r): refusing to guess; key the rows "
            f'by layer ({{"<global layer>": [...], ...}}), which cannot be misread'
        )
    if len(table) == len(moe):
        return dict(zip(moe, table, strict=True))
    if num_layers is not None and len(table) == num_layers:
        return {layer: table[layer] for layer in moe}  # one row per decoder layer: the MoE rows by global layer
    raise ExpertMapError(
        f"{name}: {len(table)} row(s) fit neither the {len(moe)} MoE layers {moe}"
        + ("" if num_layers is None else f" nor all {num_layers} decoder layers")
    )


def _row(value, *, name: str, layer: int) -> torch.Tensor:
    if isinstance(value, np.ndarray):
        if value.size == 0:
            raise ExpertMapError(
                f"{name}: layer {layer}: the map row is empty (shape {value.shape}); expected one "
                f"logical id per physical slot"
            )
        wide = value.astype(object)  # exact: an unsigned or 64-bit id beyond int64 is never wrapped
        value = [int(v) for v in wide]
    elif not isinstance(value, list) or not value:
        raise ExpertMapError(
            f"{name}: layer {layer}: expected a non-empty list of logical ids, got {type(value).__name__} {value!r:.60}"
        )
    for slot, v in enumerate(value):
        if not isinstance(v, numbers.Integral) or isinstance(v, bool):
            raise ExpertMapError(f"{name}: layer {layer} slot {slot}: {v!r} is not an integer logical id")
        if not _INT64_MIN <= int(v) <= _INT64_MAX:
            raise ExpertMapError(
                f"{name}: layer {layer} slot {slot}: logical id {v} out of range (expected a slot number [0, slots))"
            )
    return torch.tensor(value, dtype=torch.int64)
