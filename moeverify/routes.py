"""``Routes``: top-k expert ids per MoE layer and micro-batch, plain tensors only.

Legend of shape suffixes: T = tokens (in a router's own order), K = top-k, L = MoE layers,
M = micro-batches. ``topk_ids_TK`` is one layer's routing of one micro-batch.

Layer numbers are 0-based global decoder layer indices, as in HF names (``model.layers.N``); a
multi-token-prediction layer ``i`` is numbered ``num_layers + i``. They are never construction order.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from moeverify.errors import RouteError

_INT_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


def validate_topk_ids(topk_ids_TK: object, *, layer: int, microbatch: int, num_experts: int, topk: int,
                      tokens: int | None = None, rank: int | str = "?") -> torch.Tensor:
    """Check one route tensor before it is used; raise ``RouteError`` naming where and expected vs got."""
    where = f"layer {layer} rank {rank} mb {microbatch}"
    if not isinstance(topk_ids_TK, torch.Tensor):
        raise RouteError(f"{where}: route must be a torch.Tensor, got {type(topk_ids_TK).__name__}")
    if topk_ids_TK.dtype not in _INT_DTYPES:
        raise RouteError(f"{where}: route dtype {topk_ids_TK.dtype} is not an integer dtype")
    expected = f"(T={tokens if tokens is not None else 'any'}, K={topk})"
    if topk_ids_TK.dim() != 2 or topk_ids_TK.shape[1] != topk or (tokens is not None and topk_ids_TK.shape[0] != tokens):
        raise RouteError(f"{where}: route shape {tuple(topk_ids_TK.shape)} != expected {expected}")
    if topk_ids_TK.numel():
        lo, hi = int(topk_ids_TK.min()), int(topk_ids_TK.max())
        if lo < 0 or hi >= num_experts:
            bad = lo if lo < 0 else hi
            raise RouteError(f"{where}: expert id {bad} out of range [0, {num_experts})")
        if topk > 1:
            ordered = topk_ids_TK.to(torch.int64).sort(dim=1).values
            dup_rows = (ordered[:, 1:] == ordered[:, :-1]).any(dim=1).nonzero().flatten()
            if dup_rows.numel():
                row = int(dup_rows[0])
                raise RouteError(f"{where}: token {row} routes to expert(s) twice: {topk_ids_TK[row].tolist()}"
                                 f" ({dup_rows.numel()} such row(s))")
    return topk_ids_TK


class Routes:
    """Routing decisions: ``{layer: [topk_ids_TK per micro-batch]}``, immutable.

    Args:
        per_layer: global layer number -> sequence of int ``[T, K]`` tensors, one per micro-batch.
        num_experts: experts per MoE layer (ids live in ``[0, num_experts)``).
        topk: experts per token.
    """

    __slots__ = ("_data", "num_experts", "topk")

    def __init__(self, per_layer: Mapping[int, Sequence[torch.Tensor]], *, num_experts: int, topk: int):
        if num_experts < 1 or topk < 1 or topk > num_experts:
            raise RouteError(f"need 1 <= topk <= num_experts, got topk {topk}, num_experts {num_experts}")
        counts = {layer: len(mbs) for layer, mbs in per_layer.items()}
        if len(set(counts.values())) > 1:
            raise RouteError(f"micro-batch count differs between layers: {counts}")
        data = {}
        for layer in sorted(per_layer):
            mbs = tuple(per_layer[layer])
            for mb, t in enumerate(mbs):
                validate_topk_ids(t, layer=layer, microbatch=mb, num_experts=num_experts, topk=topk)
            data[int(layer)] = mbs
        self._data = data
        self.num_experts = num_experts
        self.topk = topk

    @property
    def layers(self) -> tuple[int, ...]:
        """Sorted global layer numbers of the MoE layers held."""
        return tuple(self._data)

    @property
    def microbatches(self) -> int:
        return len(next(iter(self._data.values()))) if self._data else 0

    def get(self, layer: int, microbatch: int) -> torch.Tensor:
        """The ``[T, K]`` route of ``layer`` in ``microbatch``."""
        if layer not in self._data:
            raise RouteError(f"layer {layer}: no routes held; layers held: {list(self.layers)}")
        mbs = self._data[layer]
        if not 0 <= microbatch < len(mbs):
            raise RouteError(f"layer {layer} mb {microbatch}: only {len(mbs)} micro-batch(es) held")
        return mbs[microbatch]

    def replace(self, layer: int, microbatch: int, topk_ids_TK: torch.Tensor) -> Routes:
        """A new ``Routes`` with one tensor replaced (validated like every other)."""
        self.get(layer, microbatch)
        data = {k: list(v) for k, v in self._data.items()}
        data[layer][microbatch] = topk_ids_TK
        return Routes(data, num_experts=self.num_experts, topk=self.topk)

    def stacked(self, microbatch: int) -> torch.Tensor:
        """``[T, L, K]`` int64 view of one micro-batch over all held layers."""
        return torch.stack([self.get(layer, microbatch).to(torch.int64) for layer in self.layers], dim=1)

    @classmethod
    def from_stacked(cls, topk_ids_MTLK: Sequence[torch.Tensor], *, layers: Sequence[int], num_experts: int) -> Routes:
        """Inverse of ``stacked``: one ``[T, L, K]`` tensor per micro-batch."""
        if not topk_ids_MTLK:
            raise RouteError("from_stacked needs at least one micro-batch")
        first = topk_ids_MTLK[0]
        if first.dim() != 3 or first.shape[1] != len(layers):
            raise RouteError(f"stacked routes shape {tuple(first.shape)} != expected (T, L={len(layers)}, K)")
        per_layer = {int(layer): [t[:, i, :] for t in topk_ids_MTLK] for i, layer in enumerate(layers)}
        return cls(per_layer, num_experts=num_experts, topk=first.shape[2])

    def select(self, layers: Sequence[int]) -> Routes:
        """A ``Routes`` holding only ``layers`` (e.g. the MoE layers of one pipeline stage)."""
        missing = sorted(set(layers) - set(self.layers))
        if missing:
            raise RouteError(f"select: layer(s) {missing} not held; layers held: {list(self.layers)}")
        return Routes({layer: self._data[layer] for layer in layers}, num_experts=self.num_experts, topk=self.topk)

    def to_local(self, layout, *, coords, seq_len, batch: int, num_layers: int, zigzag: bool = True) -> Routes:
        """This global view as one rank's routers see it (delegates to ``moeverify.views.to_local``)."""
        from moeverify import views

        return views.to_local(self, layout, coords=coords, seq_len=seq_len, batch=batch, num_layers=num_layers,
                              zigzag=zigzag)

    @staticmethod
    def to_global(local_by_rank, layout, *, world_size: int, seq_len, batch: int, num_layers: int,
                  moe_layers: Sequence[int], zigzag: bool = True) -> Routes:
        """Merge ranks' local routes into the global view (delegates to ``moeverify.views.to_global``)."""
        from moeverify import views

        return views.to_global(local_by_rank, layout, world_size=world_size, seq_len=seq_len, batch=batch,
                               num_layers=num_layers, moe_layers=moe_layers, zigzag=zigzag)

    @classmethod
    def from_rollout(cls, topk_ids_TLK, *, layers: Sequence[int], num_experts: int, tokens: int | None = None,
                     pad_T=None, split: Sequence[int] | None = None) -> Routes:
        """Routes from a rollout engine's per-token routes ``[T, L, K]`` (numpy or torch), global view.

        Args:
            topk_ids_TLK: the engine's routes, tokens in sequence order, one column per MoE layer.
            layers: global layer numbers of the ``L`` columns.
            num_experts: experts per MoE layer.
            tokens: the token count training will route. Engines return routes for prompt + response
                minus the final token (it is sampled, never fed back): one row short is filled with a
                safe route; any other difference is an error.
            pad_T: bool ``[tokens]``, True where the token is padding; those rows (whatever the engine
                put there, e.g. -1) get a safe route.
            split: token counts of consecutive micro-batches (sum == tokens); default one micro-batch.

        The safe route of row ``t`` is experts ``(t * K + j) % E`` for ``j < K``: distinct within the row
        and spread round-robin over all experts, so filler rows never pile onto expert 0.
        """
        ids_TLK = _as_int64(topk_ids_TLK)
        if ids_TLK.dim() != 3 or ids_TLK.shape[1] != len(layers):
            raise RouteError(f"rollout routes shape {tuple(ids_TLK.shape)} != expected (T, L={len(layers)}, K)")
        T, _, K = ids_TLK.shape
        if not 1 <= K <= num_experts:
            raise RouteError(f"rollout routes top-k {K} not in [1, num_experts={num_experts}]")
        tokens = T if tokens is None else tokens
        if T == tokens - 1:
            ids_TLK = torch.cat([ids_TLK, safe_routes(1, topk=K, num_experts=num_experts, start=T)
                                 .unsqueeze(1).expand(1, len(layers), K)])
        elif T != tokens:
            raise RouteError(f"rollout routes hold {T} tokens != expected {tokens} (or {tokens - 1}, the engine's "
                             "missing last row)")
        if pad_T is not None:
            ids_TLK = _fill_pads(ids_TLK, _as_bool(pad_T, tokens), num_experts=num_experts)
        sizes = [tokens] if split is None else [int(n) for n in split]
        if sum(sizes) != tokens or any(n < 0 for n in sizes):
            raise RouteError(f"split {sizes} does not partition {tokens} tokens")
        chunks = torch.split(ids_TLK, sizes)
        return cls({layer: [c[:, i, :] for c in chunks] for i, layer in enumerate(layers)},
                   num_experts=num_experts, topk=K)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Routes):
            return NotImplemented
        if (self.layers, self.microbatches, self.num_experts, self.topk) != (
                other.layers, other.microbatches, other.num_experts, other.topk):
            return False
        return all(torch.equal(a.to(torch.int64), b.to(torch.int64))
                   for layer in self.layers for a, b in zip(self._data[layer], other._data[layer]))

    def __repr__(self) -> str:
        tokens = [int(t.shape[0]) for t in self._data[self.layers[0]]] if self._data else []
        return (f"Routes(layers={list(self.layers)}, microbatches={self.microbatches}, tokens={tokens}, "
                f"num_experts={self.num_experts}, topk={self.topk})")


def safe_routes(tokens: int, *, topk: int, num_experts: int, start: int = 0) -> torch.Tensor:
    """``[tokens, topk]`` int64 filler routes: row ``t`` takes experts ``((start + t) * K + j) % E``."""
    if not 1 <= topk <= num_experts:
        raise RouteError(f"need 1 <= topk <= num_experts, got topk {topk}, num_experts {num_experts}")
    rows_T = torch.arange(start, start + tokens, dtype=torch.int64)
    return (rows_T[:, None] * topk + torch.arange(topk, dtype=torch.int64)[None, :]) % num_experts


def _as_int64(array) -> torch.Tensor:
    tensor = array if isinstance(array, torch.Tensor) else torch.as_tensor(array)
    if tensor.dtype not in _INT_DTYPES + (torch.uint16, torch.uint32, torch.uint64):
        raise RouteError(f"rollout routes dtype {tensor.dtype} is not an integer dtype")
    return tensor.to(torch.int64)


def _as_bool(array, tokens: int) -> torch.Tensor:
    pad_T = (array if isinstance(array, torch.Tensor) else torch.as_tensor(array)).to(torch.bool)
    if pad_T.shape != (tokens,):
        raise RouteError(f"pad mask shape {tuple(pad_T.shape)} != expected ({tokens},)")
    return pad_T


def _fill_pads(ids_TLK: torch.Tensor, pad_T: torch.Tensor, *, num_experts: int) -> torch.Tensor:
    rows = pad_T.nonzero().flatten()
    if not rows.numel():
        return ids_TLK
    T, L, K = ids_TLK.shape
    safe_TK = safe_routes(T, topk=K, num_experts=num_experts)
    out_TLK = ids_TLK.clone()
    out_TLK[rows] = safe_TK[rows].unsqueeze(1).expand(-1, L, K)
    return out_TLK
