"""Comparing two routings of the same tokens: where do they choose different experts?

Metrics, per MoE layer over all tokens of all micro-batches:
- **agreement**: fraction of tokens whose top-k expert *set* is identical (order-insensitive);
- **overlap@k**: mean ``|A ∩ B| / k``;
- **tokens_diverging_any_layer**: fraction of tokens that differ in at least one layer, and the
  histogram of each such token's first divergent layer;
- **expert load** of both sides (tokens routed to each expert) and its difference;
- the tokens that diverge most (most experts missed over all layers).

Vectorised: rows that are byte-identical on both sides are settled with one word compare each;
the other rows are gathered from all layers at once and compared as sets by one broadcast
``K x K`` equality over columns (rows contiguous), in cache-sized chunks: ``|A ∩ B|`` is the
number of matching pairs, and the sets are equal when it is ``K``. Legend: N = tokens (all micro-batches), L = MoE layers, K = top-k,
E = experts, R = rows of a chunk.
"""

from __future__ import annotations

import dataclasses

import torch

from moeverify.errors import RouteError
from moeverify.record.format import ids_dtype_for
from moeverify.routes import Routes

_CHUNK_CELLS = 1 << 21  # K*K*rows booleans per set-compare chunk


@dataclasses.dataclass(frozen=True, kw_only=True)
class DiffReport:
    """Result of ``diff``; ``to_json()`` gives the DESIGN.md record."""

    layers: tuple[int, ...]
    tokens: int
    num_experts: int
    topk: int
    exact_NL: torch.Tensor  # bool: top-k sets identical
    overlap_NL: torch.Tensor  # uint8: |A ∩ B|
    load_a_LE: torch.Tensor  # int64 tokens per expert
    load_b_LE: torch.Tensor
    microbatch_tokens: tuple[int, ...] = ()  # tokens per micro-batch; token N of the report is in that order

    @property
    def agreement_L(self) -> torch.Tensor:
        return self.exact_NL.float().mean(dim=0) if self.tokens else torch.ones(len(self.layers))

    @property
    def overlap_at_k_L(self) -> torch.Tensor:
        if not self.tokens:
            return torch.ones(len(self.layers))
        return self.overlap_NL.sum(dim=0, dtype=torch.int64).double().div(self.tokens * self.topk).float()

    @property
    def diverging_N(self) -> torch.Tensor:
        return ~self.exact_NL.all(dim=1)

    @property
    def tokens_diverging_any_layer(self) -> float:
        return float(self.diverging_N.float().mean()) if self.tokens else 0.0

    def first_divergent_layer(self) -> dict[int, int]:
        """``{layer: tokens whose first divergent layer it is}`` (layers with zero omitted)."""
        diverging_N = self.diverging_N
        first_N = (~self.exact_NL[diverging_N]).to(torch.uint8).argmax(dim=1)
        counts = torch.bincount(first_N, minlength=len(self.layers))
        return {self.layers[i]: int(c) for i, c in enumerate(counts.tolist()) if c}

    def worst_tokens(self, n: int = 10) -> list[dict]:
        """Tokens with most experts missed over all layers.

        Each is ``{token, microbatch, token_in_microbatch, missed, layers_diverging}``; ``token`` counts
        over the micro-batches in order.
        """
        if not self.tokens:
            return []
        missed_N = len(self.layers) * self.topk - self.overlap_NL.sum(dim=1, dtype=torch.int64)
        values, idx = missed_N.topk(min(n, self.tokens))
        layers_N = (~self.exact_NL[idx]).sum(dim=1)
        starts = torch.tensor([0, *self.microbatch_tokens]).cumsum(0)[:-1] if self.microbatch_tokens else None
        out = []
        for t, v, c in zip(idx.tolist(), values.tolist(), layers_N.tolist()):
            if v <= 0:
                continue
            mb = int(torch.searchsorted(starts, t, right=True)) - 1 if starts is not None else 0
            offset = int(starts[mb]) if starts is not None else 0
            out.append({"token": t, "microbatch": mb, "token_in_microbatch": t - offset, "missed": v,
                        "layers_diverging": c})
        return out

    def bucket_disagreement(self, buckets: int = 64) -> torch.Tensor:
        """``[L, buckets]`` fraction of tokens with differing sets, tokens cut in contiguous buckets."""
        buckets = max(1, min(buckets, self.tokens))
        edges = torch.linspace(0, self.tokens, buckets + 1).round().long()
        cum_NL = torch.cat([torch.zeros(1, len(self.layers)), (~self.exact_NL).float().cumsum(dim=0)])
        sums = cum_NL[edges[1:]] - cum_NL[edges[:-1]]
        return (sums / (edges[1:] - edges[:-1]).clamp(min=1)[:, None]).t()

    def to_json(self, *, worst: int = 10) -> dict:
        agreement, overlap = self.agreement_L.tolist(), self.overlap_at_k_L.tolist()
        load_delta = (self.load_b_LE - self.load_a_LE)
        layers = {str(layer): {"agreement": agreement[i], "overlap_at_k": overlap[i], "tokens": self.tokens,
                               "load_a": self.load_a_LE[i].tolist(), "load_b": self.load_b_LE[i].tolist(),
                               "load_max_abs_delta": int(load_delta[i].abs().max()) if self.num_experts else 0}
                  for i, layer in enumerate(self.layers)}
        return {"layers": layers, "tokens": self.tokens, "num_experts": self.num_experts, "topk": self.topk,
                "tokens_diverging_any_layer": self.tokens_diverging_any_layer,
                "agreement_all_layers": float(self.exact_NL.float().mean()) if self.tokens else 1.0,
                "first_divergent_layer": {str(k): v for k, v in self.first_divergent_layer().items()},
                "worst_tokens": self.worst_tokens(worst)}

    def table(self):
        """A ``rich`` table: one row per layer."""
        from rich.table import Table

        table = Table(title=f"routing diff: {self.tokens} tokens, top-{self.topk} of {self.num_experts}, "
                            f"{self.tokens_diverging_any_layer:.2%} diverge in >= 1 layer")
        for col in ("layer", "agreement", "overlap@k", "tokens first diverging here", "max |load delta|"):
            table.add_column(col, justify="right")
        first = self.first_divergent_layer()
        agreement, overlap = self.agreement_L.tolist(), self.overlap_at_k_L.tolist()
        delta = (self.load_b_LE - self.load_a_LE).abs()
        for i, layer in enumerate(self.layers):
            style = None if agreement[i] == 1.0 else "red"
            table.add_row(str(layer), f"{agreement[i]:.4%}", f"{overlap[i]:.4f}", str(first.get(layer, 0)),
                          str(int(delta[i].max())) if self.num_experts else "0", style=style)
        return table


def diff(a: Routes, b: Routes) -> DiffReport:
    """Compare two routings of the same tokens (same layers, micro-batches and token counts)."""
    counts = _token_counts(a, b)
    experts, layers = a.num_experts, a.layers
    tokens, width = sum(counts), len(layers)
    starts = [sum(counts[:mb]) for mb in range(len(counts))]
    # Layer-major [L, N] so that each (layer, micro-batch) is a contiguous slice written in place.
    differ_LN = torch.zeros(width, tokens, dtype=torch.bool)
    load_a_LE = torch.zeros(width, experts, dtype=torch.int64)
    for mb, (start, count) in enumerate(zip(starts, counts)):
        for i, layer in enumerate(layers):
            ids_a_TK, ids_b_TK = _narrow(a.get(layer, mb), experts), _narrow(b.get(layer, mb), experts)
            load_a_LE[i] += torch.bincount(ids_a_TK.reshape(-1), minlength=experts)
            _rows_differ(ids_a_TK, ids_b_TK, out=differ_LN[i, start:start + count])
    overlap_LN = torch.full((width, tokens), a.topk, dtype=torch.uint8)
    load_b_LE = load_a_LE.clone()
    cell_R = differ_LN.view(-1).nonzero().squeeze(1)  # one pass over all layers; sorted, so grouped by (layer, mb)
    if cell_R.numel():
        rows_a, rows_b = _gather_rows(a, b, cell_R, tokens=tokens, starts=starts)
        exact_R, overlap_R = _set_compare_chunked(rows_a, rows_b)
        differ_LN.view(-1)[cell_R] = ~exact_R  # byte-different rows with equal sets agree
        overlap_LN.view(-1)[cell_R] = overlap_R
        moved = ~exact_R  # only rows with different sets load B differently from A
        shift_R = ((cell_R[moved] // tokens) * experts)[:, None]
        size = width * experts
        load_b_LE += (torch.bincount((rows_b[moved].to(torch.int64) + shift_R).reshape(-1), minlength=size)
                      - torch.bincount((rows_a[moved].to(torch.int64) + shift_R).reshape(-1), minlength=size)
                      ).view(width, experts)
    return DiffReport(layers=layers, tokens=tokens, num_experts=experts, topk=a.topk, exact_NL=(~differ_LN).t(),
                      overlap_NL=overlap_LN.t(), load_a_LE=load_a_LE, load_b_LE=load_b_LE,
                      microbatch_tokens=tuple(counts))


def _gather_rows(a: Routes, b: Routes, cell_R: torch.Tensor, *, tokens: int,
                 starts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``[R, K]`` rows of both sides at sorted layer-major cells ``layer_index * tokens + token``."""
    experts = a.num_experts
    bounds = torch.tensor([i * tokens + s for i in range(len(a.layers)) for s in starts] + [len(a.layers) * tokens])
    edges = torch.searchsorted(cell_R, bounds).tolist()
    rows_a, rows_b = [], []
    for pair, (lo, hi) in enumerate(zip(edges[:-1], edges[1:])):
        if lo == hi:
            continue
        i, mb = divmod(pair, len(starts))
        layer = a.layers[i]
        idx = cell_R[lo:hi] - int(bounds[pair])
        rows_a.append(_narrow(a.get(layer, mb), experts).index_select(0, idx))
        rows_b.append(_narrow(b.get(layer, mb), experts).index_select(0, idx))
    return torch.cat(rows_a), torch.cat(rows_b)


def _token_counts(a: Routes, b: Routes) -> list[int]:
    """Tokens per micro-batch, after checking both sides route the same tokens of the same layers."""
    if (a.layers, a.microbatches, a.topk, a.num_experts) != (b.layers, b.microbatches, b.topk, b.num_experts):
        raise RouteError(f"cannot diff: (layers, microbatches, topk, num_experts) "
                         f"{(list(a.layers), a.microbatches, a.topk, a.num_experts)} != "
                         f"{(list(b.layers), b.microbatches, b.topk, b.num_experts)}")
    layers = a.layers
    counts = [a.get(layers[0], mb).shape[0] for mb in range(a.microbatches)] if layers else []
    for mb in range(a.microbatches):
        for layer in layers:
            ta, tb = a.get(layer, mb).shape[0], b.get(layer, mb).shape[0]
            if ta != tb or ta != counts[mb]:
                raise RouteError(f"cannot diff: layer {layer} mb {mb}: {ta} tokens vs {tb} tokens "
                                 f"(layer {layers[0]} has {counts[mb]})")
    return counts


def compare_rows(ids_a_TK: torch.Tensor, ids_b_TK: torch.Tensor, *,
                 num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(exact_T bool, overlap_T uint8)`` of two ``[T, K]`` id tensors.

    Rows that are byte-identical (the common case: same experts in the same order) are settled by
    one word compare per row; only the others are sorted and compared as sets.
    """
    ids_a_TK, ids_b_TK = _narrow(ids_a_TK, num_experts), _narrow(ids_b_TK, num_experts)
    differ_T = _rows_differ(ids_a_TK, ids_b_TK)
    exact_T = ~differ_T
    overlap_T = torch.full(differ_T.shape, ids_a_TK.shape[1], dtype=torch.uint8)
    rest = differ_T.nonzero().squeeze(1)
    if rest.numel():
        exact_T[rest], overlap_T[rest] = _set_compare_chunked(ids_a_TK.index_select(0, rest),
                                                              ids_b_TK.index_select(0, rest))
    return exact_T, overlap_T


def _set_compare_chunked(a_RK: torch.Tensor, b_RK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    k = a_RK.shape[1]
    step = max(256, _CHUNK_CELLS // (k * k))
    exact, overlap = [], []
    for start in range(0, a_RK.shape[0], step):
        e, o = _set_compare(a_RK[start:start + step], b_RK[start:start + step])
        exact.append(e)
        overlap.append(o)
    return torch.cat(exact), torch.cat(overlap)


def _set_compare(a_RK: torch.Tensor, b_RK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows as sets: ``|A ∩ B|`` from all ``K x K`` id pairs, compared column-wise (rows contiguous).

    Ids within a row are distinct, so each A id matches at most one B id, and the sets are equal
    exactly when all ``K`` match.
    """
    k, rows = a_RK.shape[1], a_RK.shape[0]
    a_KR, b_KR = a_RK.t().contiguous(), b_RK.t().contiguous()
    matches = (a_KR[:, None, :] == b_KR[None, :, :]).view(k * k, rows)
    overlap_R = matches.sum(dim=0, dtype=torch.uint8)
    return overlap_R == k, overlap_R


def _rows_differ(a_TK: torch.Tensor, b_TK: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """``[T]`` bool: rows not byte-identical (one word compare per row where the row fits a word)."""
    width = a_TK.shape[1] * a_TK.element_size()
    word = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}.get(width)
    if word is not None:
        return torch.ne(a_TK.view(word).view(-1), b_TK.view(word).view(-1), out=out)
    return torch.any(a_TK != b_TK, dim=1, out=out)


def _narrow(ids_TK: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Ids in the dump's narrow dtype (values were validated in ``[0, num_experts)`` by ``Routes``)."""
    return ids_TK.to(ids_dtype_for(num_experts)).contiguous()
