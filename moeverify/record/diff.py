"""Comparing two routings of the same tokens: where do they choose different experts?

A *router* is one MoE layer's routing of one token; it *differs* when the two sides' top-k expert SETS
differ (order-insensitive). Figures, over all tokens of all micro-batches (held by ``report.DiffReport``):

- per MoE layer: **agreement** (share of tokens whose set is identical), **overlap@k** (mean
  ``|A ∩ B| / k``) and the **expert load** of both sides (tokens routed to each expert);
- per token: **routers differing** (how many of its ``L`` routers differ), summarised as their mean over
  tokens (``routers_differing_per_token``), their share of all ``N * L`` routers, and a histogram;
  **tokens_diverging_any_layer** (share with at least one differing router) and the histogram of each
  such token's **first divergent layer**; the tokens that diverge most (most experts missed);
- per sequence (request), when the caller says which tokens form each sequence (``seq_len``/``batch``
  of sequence-order routes, or per-sequence token counts): tokens, share diverging in >= 1 layer, mean
  routers differing per token, first divergent layer (the earliest over its tokens).

Two engines give the same figures. ``diff`` (in memory) takes two whole ``Routes``: rows that are
byte-identical on both sides are settled with one word compare each; the other rows are gathered from
all layers at once and compared as sets by one broadcast ``K x K`` equality over columns (rows
contiguous), in cache-sized chunks: ``|A ∩ B|`` is the number of matching pairs, and the sets are equal
when it is ``K``. ``diff_stream`` takes two ``LayerSource``s (``moeverify.record.stream``: a dump on disk
read one layer at a time) and keeps only per-layer and per-token totals, so its memory is one layer of
both sides plus ``O(N)``, never ``O(N * L)``. Legend: N = tokens (all micro-batches), L = MoE layers,
K = top-k, E = experts, R = rows of a chunk, B = heatmap buckets, C = differing routers (cells).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from moeverify.errors import RouteError, few
from moeverify.record.diff_report import DiffReport, bucket_edges
from moeverify.record.format import ids_dtype_for
from moeverify.record.stream import LayerPairs, LayerSource
from moeverify.routing.routes import Routes

__all__ = ["DiffReport", "compare_rows", "diff", "diff_stream", "sequence_spans"]

_CHUNK_CELLS = 1 << 21  # K*K*rows booleans per set-compare chunk


def sequence_spans(
    microbatch_tokens: Sequence[int],
    *,
    seq_len: int | Sequence[int] | None = None,
    batch: int | None = None,
    sequence_tokens: Sequence[Sequence[int]] | None = None,
    where: str = "diff",
) -> tuple[tuple[int, ...], ...] | None:
    """Per micro-batch, the token count of each sequence, checked against the micro-batches' token counts.

    ``seq_len``/``batch``: sequence-order micro-batches of ``batch`` sequences of ``seq_len`` tokens
    (``g = b * S + s``); ``sequence_tokens``: the counts themselves (one list per micro-batch). None: unknown.
    """
    if sequence_tokens is not None and (seq_len is not None or batch is not None):
        raise RouteError(f"{where}: give seq_len/batch or sequence_tokens, not both")
    if (seq_len is None) != (batch is None):
        raise RouteError(f"{where}: seq_len and batch go together (got seq_len {seq_len!r}, batch {batch!r})")
    if seq_len is not None and batch is not None:
        lens = [seq_len] * len(microbatch_tokens) if isinstance(seq_len, int) else list(seq_len)
        if len(lens) != len(microbatch_tokens):
            raise RouteError(f"{where}: {len(lens)} seq_len value(s) for {len(microbatch_tokens)} micro-batch(es)")
        sequence_tokens = [[length] * batch for length in lens]
    if sequence_tokens is None:
        return None
    spans = tuple(tuple(int(n) for n in seqs) for seqs in sequence_tokens)
    if len(spans) != len(microbatch_tokens):
        raise RouteError(
            f"{where}: sequences given for {len(spans)} micro-batch(es), the routes hold {len(microbatch_tokens)}"
        )
    for mb, (seqs, count) in enumerate(zip(spans, microbatch_tokens, strict=True)):
        if any(n < 0 for n in seqs) or sum(seqs) != count:
            raise RouteError(
                f"{where}: micro-batch {mb}: sequences of {few(seqs)} token(s) (sum "
                f"{sum(seqs)}) != the {count} tokens it holds"
            )
    return spans


def _cell_stats(
    layer_C: torch.Tensor, token_C: torch.Tensor, missed_C: torch.Tensor, *, width: int, tokens: int, topk: int
) -> dict:
    """Per-layer and per-token totals from the differing routers (cells) alone."""
    exact_L = tokens - torch.bincount(layer_C, minlength=width)
    missed_L = torch.zeros(width, dtype=torch.int64).index_add_(0, layer_C, missed_C.to(torch.int64))
    first = torch.full((tokens,), width, dtype=torch.int64).scatter_reduce_(0, token_C, layer_C, "amin")
    return {
        "exact_L": exact_L,
        "overlap_L": tokens * topk - missed_L,
        "differing_N": torch.bincount(token_C, minlength=tokens).to(torch.int16),
        "first_N": torch.where(first < width, first, -1).to(torch.int16),
        "missed_N": torch.zeros(tokens, dtype=torch.int32).index_add_(0, token_C, missed_C.to(torch.int32)),
    }


def diff(
    a: Routes,
    b: Routes,
    *,
    seq_len: int | Sequence[int] | None = None,
    batch: int | None = None,
    sequence_tokens: Sequence[Sequence[int]] | None = None,
    sequence_extra: Sequence[dict] | None = None,
) -> DiffReport:
    """Compare two routings of the same tokens (same layers, micro-batches and token counts), in memory.

    ``seq_len``/``batch`` (sequence-order routes) or ``sequence_tokens`` (per micro-batch, the tokens of each
    sequence in order) tell the report which tokens form each sequence; without them ``sequences()`` is None.
    """
    counts = _token_counts(a, b)
    spans = sequence_spans(counts, seq_len=seq_len, batch=batch, sequence_tokens=sequence_tokens)
    experts, layers = a.num_experts, a.layers
    tokens, width = sum(counts), len(layers)
    starts = [sum(counts[:mb]) for mb in range(len(counts))]
    # Layer-major [L, N] so that each (layer, micro-batch) is a contiguous slice written in place.
    differ_LN = torch.zeros(width, tokens, dtype=torch.bool)
    load_a_LE = torch.zeros(width, experts, dtype=torch.int64)
    for mb, (start, count) in enumerate(zip(starts, counts, strict=True)):
        for i, layer in enumerate(layers):
            ids_a_TK, ids_b_TK = _narrow(a.get(layer, mb), experts), _narrow(b.get(layer, mb), experts)
            load_a_LE[i] += torch.bincount(ids_a_TK.reshape(-1), minlength=experts)
            _rows_differ(ids_a_TK, ids_b_TK, out=differ_LN[i, start : start + count])
    overlap_LN = torch.full((width, tokens), a.topk, dtype=torch.uint8)
    load_b_LE = load_a_LE.clone()
    cell_R = differ_LN.view(-1).nonzero().squeeze(1)  # one pass over all layers; sorted, so grouped by (layer, mb)
    cells, missed = cell_R[:0], torch.zeros(0, dtype=torch.int64)
    if cell_R.numel():
        rows_a, rows_b = _gather_rows(a, b, cell_R, tokens=tokens, starts=starts)
        exact_R, overlap_R = _set_compare_chunked(rows_a, rows_b)
        differ_LN.view(-1)[cell_R] = ~exact_R  # byte-different rows with equal sets agree
        overlap_LN.view(-1)[cell_R] = overlap_R
        moved = ~exact_R  # only rows with different sets load B differently from A
        cells, missed = cell_R[moved], a.topk - overlap_R[moved].to(torch.int64)
        shift_R = ((cells // tokens) * experts)[:, None]
        size = width * experts
        load_b_LE += (
            torch.bincount((rows_b[moved].to(torch.int64) + shift_R).reshape(-1), minlength=size)
            - torch.bincount((rows_a[moved].to(torch.int64) + shift_R).reshape(-1), minlength=size)
        ).view(width, experts)
    stats = _cell_stats(
        cells // max(tokens, 1), cells % max(tokens, 1), missed, width=width, tokens=tokens, topk=a.topk
    )
    return DiffReport(
        layers=layers,
        tokens=tokens,
        num_experts=experts,
        topk=a.topk,
        load_a_LE=load_a_LE,
        load_b_LE=load_b_LE,
        microbatch_tokens=tuple(counts),
        sequence_tokens=spans,
        sequence_extra=_extra(sequence_extra, spans),
        exact_NL=(~differ_LN).t(),
        overlap_NL=overlap_LN.t(),
        **stats,
    )


def _extra(sequence_extra: Sequence[dict] | None, spans) -> tuple[dict, ...] | None:
    if sequence_extra is None:
        return None
    count = sum(len(s) for s in spans) if spans is not None else None
    if count is None or len(sequence_extra) != count:
        raise RouteError(f"sequence_extra holds {len(sequence_extra)} record(s) for {count} sequence(s)")
    return tuple(dict(e) for e in sequence_extra)


def diff_stream(
    a: LayerSource,
    b: LayerSource,
    *,
    seq_len: int | Sequence[int] | None = None,
    batch: int | None = None,
    sequence_tokens: Sequence[Sequence[int]] | None = None,
    sequence_extra: Sequence[dict] | None = None,
    buckets: int = 64,
) -> DiffReport:
    """``diff`` of two ``LayerSource``s (``moeverify.record.stream``), one layer at a time.

    Each layer is read from both sides, compared, folded into per-layer and per-token totals and dropped:
    memory is one layer of both sides plus ``O(N)``. The report holds no ``[N, L]`` matrices; its heatmap
    keeps ``buckets`` token buckets per layer.
    """
    _same_shape(a, b)
    counts_a, counts_b = list(a.microbatch_tokens()), list(b.microbatch_tokens())
    if counts_a != counts_b:
        raise RouteError(f"cannot diff: tokens per micro-batch: A {counts_a}, B {counts_b}")
    counts = counts_a
    spans = sequence_spans(counts, seq_len=seq_len, batch=batch, sequence_tokens=sequence_tokens)
    experts, topk, layers = a.num_experts, a.topk, a.layers
    tokens, width = sum(counts), len(layers)
    starts = [sum(counts[:mb]) for mb in range(len(counts))]
    nb = max(1, min(buckets, tokens))
    edges = bucket_edges(tokens, nb)
    load_a_LE = torch.zeros(width, experts, dtype=torch.int64)
    load_b_LE = torch.zeros(width, experts, dtype=torch.int64)
    cells = _Cells(width=width, tokens=tokens, edges=edges)
    pairs = LayerPairs(a, b)
    for i, layer in enumerate(layers):
        mbs_a, mbs_b, tokens_of = pairs(layer)  # rows in the order of tokens_of (None: global order)
        for side, mbs in (("A", mbs_a), ("B", mbs_b)):
            got = [t.shape[0] for t in mbs]
            if got != counts:
                raise RouteError(f"cannot diff: {side} layer {layer}: tokens per micro-batch {got} != {counts}")
        for mb, start in enumerate(starts):
            ids_a_TK, ids_b_TK = _narrow(mbs_a[mb], experts), _narrow(mbs_b[mb], experts)
            load_a_LE[i] += torch.bincount(ids_a_TK.reshape(-1), minlength=experts)
            rest = torch.from_numpy(np.flatnonzero(_rows_differ(ids_a_TK, ids_b_TK).numpy()))  # 7x torch's nonzero
            if not rest.numel():
                continue
            rows_a, rows_b = ids_a_TK.index_select(0, rest), ids_b_TK.index_select(0, rest)
            exact_R, overlap_R = _set_compare_chunked(rows_a, rows_b)
            moved = ~exact_R
            if not bool(moved.any()):
                continue
            load_b_LE[i] += torch.bincount(
                rows_b[moved].reshape(-1).to(torch.int64), minlength=experts
            ) - torch.bincount(rows_a[moved].reshape(-1).to(torch.int64), minlength=experts)
            token_T = tokens_of[mb]
            rows_C = rest[moved] if token_T is None else token_T[rest[moved]]
            cells.add(i, start + rows_C, topk - overlap_R[moved].to(torch.int32))  # distinct tokens
        del mbs_a, mbs_b
    cells.fold()
    return DiffReport(
        layers=layers,
        tokens=tokens,
        num_experts=experts,
        topk=topk,
        exact_L=cells.exact_L,
        overlap_L=tokens * topk - cells.missed_L,
        load_a_LE=load_a_LE,
        load_b_LE=load_a_LE + load_b_LE,
        differing_N=cells.differing_N,
        first_N=cells.first_N,
        missed_N=cells.missed_N,
        microbatch_tokens=tuple(counts),
        sequence_tokens=spans,
        sequence_extra=_extra(sequence_extra, spans),
        bucket_differ_LB=cells.bucket_LB,
    )


class _Cells:
    """The differing routers (cells) of streamed layers, folded into per-layer and per-token totals in batches
    of at least ``tokens`` cells (so memory stays ``O(N)``): a dozen torch calls per layer on a few rows each
    cost more than the work they do. Layers are added in order, so a token's first divergent layer is the
    first fold's."""

    def __init__(self, *, width: int, tokens: int, edges: torch.Tensor):
        self.width, self.tokens, self.edges, self.nb = width, tokens, edges, edges.numel() - 1
        self.limit = max(tokens, 1 << 16)
        self.pending: list[tuple[int, torch.Tensor, torch.Tensor]] = []
        self.count = 0
        self.exact_L = torch.full((width,), tokens, dtype=torch.int64)
        self.missed_L = torch.zeros(width, dtype=torch.int64)
        self.bucket_LB = torch.zeros(width, self.nb, dtype=torch.int64)
        self.differing_N = torch.zeros(tokens, dtype=torch.int16)
        self.first_N = torch.full((tokens,), -1, dtype=torch.int16)
        self.missed_N = torch.zeros(tokens, dtype=torch.int32)

    def add(self, layer_index: int, token_C: torch.Tensor, missed_C: torch.Tensor) -> None:
        self.pending.append((layer_index, token_C, missed_C))
        self.count += token_C.numel()
        if self.count >= self.limit:
            self.fold()

    def fold(self) -> None:
        if not self.pending:
            return
        sizes = torch.tensor([t.numel() for _, t, _ in self.pending])
        layer_C = torch.repeat_interleave(torch.tensor([i for i, _, _ in self.pending]), sizes)
        token_C = torch.cat([t for _, t, _ in self.pending])
        missed_C = torch.cat([m for _, _, m in self.pending])
        self.pending, self.count = [], 0
        width, nb = self.width, self.nb
        self.exact_L -= torch.bincount(layer_C, minlength=width)
        self.missed_L.index_add_(0, layer_C, missed_C.to(torch.int64))
        bucket_C = torch.searchsorted(self.edges, token_C, right=True) - 1
        keep = bucket_C < nb
        self.bucket_LB += torch.bincount(layer_C[keep] * nb + bucket_C[keep], minlength=width * nb).view(width, nb)
        self.differing_N += torch.bincount(token_C, minlength=self.tokens).to(torch.int16)
        first_N = torch.full((self.tokens,), width, dtype=torch.int64).scatter_reduce_(0, token_C, layer_C, "amin")
        self.first_N = torch.where((self.first_N < 0) & (first_N < width), first_N, self.first_N).to(torch.int16)
        self.missed_N.index_add_(0, token_C, missed_C)


def _gather_rows(
    a: Routes, b: Routes, cell_R: torch.Tensor, *, tokens: int, starts: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``[R, K]`` rows of both sides at sorted layer-major cells ``layer_index * tokens + token``."""
    experts = a.num_experts
    bounds = torch.tensor([i * tokens + s for i in range(len(a.layers)) for s in starts] + [len(a.layers) * tokens])
    edges = torch.searchsorted(cell_R, bounds).tolist()
    rows_a, rows_b = [], []
    for pair, (lo, hi) in enumerate(zip(edges[:-1], edges[1:], strict=True)):
        if lo == hi:
            continue
        i, mb = divmod(pair, len(starts))
        layer = a.layers[i]
        idx = cell_R[lo:hi] - int(bounds[pair])
        rows_a.append(_narrow(a.get(layer, mb), experts).index_select(0, idx))
        rows_b.append(_narrow(b.get(layer, mb), experts).index_select(0, idx))
    return torch.cat(rows_a), torch.cat(rows_b)


def _same_shape(a: LayerSource | Routes, b: LayerSource | Routes) -> None:
    """Both sides hold the same layers, micro-batches, top-k and experts; else ``RouteError`` naming each that
    differs, A's and B's."""
    fields = ("layers", "microbatches", "topk", "num_experts")
    got = {name: (getattr(a, name), getattr(b, name)) for name in fields}
    differ = [
        f"{name}: A {list(x) if name == 'layers' else x}, B {list(y) if name == 'layers' else y}"
        for name, (x, y) in got.items()
        if x != y
    ]
    if differ:
        raise RouteError(f"cannot diff: {'; '.join(differ)}")


def _token_counts(a: Routes, b: Routes) -> list[int]:
    """Tokens per micro-batch, after checking both sides route the same tokens of the same layers."""
    _same_shape(a, b)
    layers = a.layers
    counts = [a.get(layers[0], mb).shape[0] for mb in range(a.microbatches)] if layers else []
    for mb in range(a.microbatches):
        for layer in layers:
            ta, tb = a.get(layer, mb).shape[0], b.get(layer, mb).shape[0]
            if ta != tb or ta != counts[mb]:
                raise RouteError(
                    f"cannot diff: layer {layer} mb {mb}: {ta} tokens vs {tb} tokens "
                    f"(layer {layers[0]} has {counts[mb]})"
                )
    return counts


def compare_rows(
    ids_a_TK: torch.Tensor, ids_b_TK: torch.Tensor, *, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor]:
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
        exact_T[rest], overlap_T[rest] = _set_compare_chunked(
            ids_a_TK.index_select(0, rest), ids_b_TK.index_select(0, rest)
        )
    return exact_T, overlap_T


def _set_compare_chunked(a_RK: torch.Tensor, b_RK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    k = a_RK.shape[1]
    step = max(256, _CHUNK_CELLS // (k * k))
    exact, overlap = [], []
    for start in range(0, a_RK.shape[0], step):
        e, o = _set_compare(a_RK[start : start + step], b_RK[start : start + step])
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
