"""Which tokens and MoE layers a rank's routers see under a Layout, and routes between views.

Plain tensor math (``job_layout`` alone reads Megatron's parallel state), and no import of ``moeverify.routes``:
``Routes.to_local``/``to_global`` call into this module, whose results are built as the given routes' own class.
Conventions:

- **Global token index** of a micro-batch of ``B`` sequences of length ``S`` (per data-parallel
  rank) is sequence-major: ``g = b * S + s``, the order rollout engines return tokens in, sequence
  by sequence. With data parallel ``dp > 1`` the global micro-batch holds ``dp * B`` sequences and
  DP rank ``d`` holds sequences ``[d * B, (d + 1) * B)`` (each DP rank sees different data).
- **Local router order**: Megatron's router flattens hidden states ``[s, b, h]``, so a rank's
  ``i``-th routed token is ``(s_local, b)`` with ``i = s_local * B + b``.
- **CP** (``cp > 1``): the sequence is split into ``2 * cp`` equal chunks and CP rank ``r`` holds
  chunks ``r`` and ``2 * cp - 1 - r`` in that order (Megatron's load-balanced zigzag,
  ``get_batch_on_this_cp_rank``); ``zigzag=False`` gives contiguous slices ``[r * S / cp, ...)``.
- **SP** (``tp > 1`` with ``sp``): TP rank ``t`` holds the ``t``-th contiguous ``1 / tp`` slice of
  the CP-local sequence (``scatter_to_sequence_parallel_region`` splits dim 0). Without SP every
  TP rank sees all of the CP-local tokens, so TP ranks are replicas that must agree.
- **EP/ETP** do not change what a router sees: the router runs before token dispatch.
- **PP/VPP**: with ``L`` decoder layers, ``pp`` stages and ``v`` virtual chunks (``n = L / (pp * v)``)
  model chunk ``c`` of stage ``p`` holds layers ``[(c * pp + p) * n, (c * pp + p + 1) * n)``. This is
  megatron-core 0.19.2's ``get_transformer_layer_offset`` for even splits
  (``vp_stage * L / v + pp_rank * L / (pp * v)``; without VPP ``pp_rank * L / pp``). Uneven splits
  (``Layout.pp_first``/``pp_last``: Megatron's ``num_layers_in_first/last_pipeline_stage``) follow the same
  function: stage ``p`` holds ``n_p`` layers, its chunk ``c`` the ``n_p / v`` layers from
  ``c * L / v + (n_0 + ... + n_{p-1}) / v``. A ``Layout.pp_layout`` string (Megatron's
  ``pipeline_model_parallel_layout``) gives every chunk's count itself; ``Layout.chunk_counts`` holds them
  all, and a chunk starts after every chunk placed before it (chunk 0 of every stage, then chunk 1, ...).
  Only MoE layers carry routes.
- **Rank numbering** (``rank_coords``): Megatron's default order ``tp-cp-ep-dp-pp``. The decoder grid
  is ``rank = tp + TP * (cp + CP * (dp + DP * pp))``; the expert grid
  ``rank = etp + ETP * (ep + EP * (edp + EDP * pp))``.

Legend of shape suffixes: T = tokens (local router order unless named ``global``), K = top-k,
S = positions in a sequence, B = sequences.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from moeverify.errors import LayoutError, RouteError, UsageError
from moeverify.layout import Layout

if TYPE_CHECKING:  # annotations only: routes.py imports this module
    from moeverify.routes import Routes


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class RankCoords:
    """A rank's place in the layout: global ``rank`` and its tp/pp/cp/dp (and ep) ranks."""

    rank: int
    tp: int = 0
    pp: int = 0
    cp: int = 0
    dp: int = 0
    ep: int = 0

    def label(self) -> str:
        return f"rank {self.rank} (tp{self.tp} pp{self.pp} cp{self.cp} dp{self.dp} ep{self.ep})"

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def rank_coords(layout: Layout, *, rank: int, world_size: int) -> RankCoords:
    """Coordinates of global ``rank`` under Megatron's default rank order ``tp-cp-ep-dp-pp``."""
    layout.validate(world_size=world_size)
    if not 0 <= rank < world_size:
        raise LayoutError(f"rank {rank} is outside world_size {world_size}")
    dp = layout.dp(world_size)
    tp_r, rest = rank % layout.tp, rank // layout.tp
    cp_r, rest = rest % layout.cp, rest // layout.cp
    dp_r, pp_r = rest % dp, rest // dp
    etp, ep = layout.expert_tp, layout.ep
    ep_r = (rank // etp) % ep
    return RankCoords(rank=rank, tp=tp_r, pp=pp_r, cp=cp_r, dp=dp_r, ep=ep_r)


def all_rank_coords(layout: Layout, *, world_size: int) -> tuple[RankCoords, ...]:
    """``rank_coords`` of every rank, in rank order."""
    return tuple(rank_coords(layout, rank=r, world_size=world_size) for r in range(world_size))


def sequence_positions(layout: Layout, *, tp_rank: int, cp_rank: int, seq_len: int,
                       zigzag: bool = True) -> torch.Tensor:
    """Positions ``[S_local]`` within a sequence that a rank's router sees, in local order."""
    _check_rank("tp", tp_rank, layout.tp)
    _check_rank("cp", cp_rank, layout.cp)
    cp = layout.cp
    if cp > 1:
        chunks = 2 * cp if zigzag else cp
        if seq_len % chunks:
            kind = "2*cp (zigzag)" if zigzag else "cp"
            raise LayoutError(f"seq_len {seq_len} is not divisible by {kind} = {chunks}")
        size = seq_len // chunks
        starts = (cp_rank, 2 * cp - 1 - cp_rank) if zigzag else (cp_rank,)
        positions_S = torch.cat([torch.arange(c * size, (c + 1) * size) for c in starts])
    else:
        positions_S = torch.arange(seq_len)
    if layout.sp:
        local = positions_S.numel()
        if local % layout.tp:
            raise LayoutError(f"CP-local sequence length {local} (seq_len {seq_len}) is not divisible by tp "
                              f"{layout.tp} under sequence parallel")
        size = local // layout.tp
        positions_S = positions_S[tp_rank * size:(tp_rank + 1) * size]
    return positions_S


def token_index(layout: Layout, *, tp_rank: int, cp_rank: int, seq_len: int, batch: int,
                dp_rank: int = 0, zigzag: bool = True) -> torch.Tensor:
    """Global token ids ``[T_local]`` in a rank's local router order ``(s_local, b)``.

    Args:
        seq_len: ``S``, the full sequence length.
        batch: ``B``, sequences per micro-batch on one DP rank.
        dp_rank: offsets the sequences by ``dp_rank * B`` (see module conventions).
    """
    if seq_len < 1 or batch < 1 or dp_rank < 0:
        raise LayoutError(f"need seq_len >= 1, batch >= 1, dp_rank >= 0; got {seq_len}, {batch}, {dp_rank}")
    positions_S = sequence_positions(layout, tp_rank=tp_rank, cp_rank=cp_rank, seq_len=seq_len, zigzag=zigzag)
    seqs_B = dp_rank * batch + torch.arange(batch)
    return (positions_S[:, None] + seqs_B[None, :] * seq_len).reshape(-1)


def chunk_layers(layout: Layout, *, pp_rank: int, vp_stage: int, num_layers: int) -> range:
    """Global decoder layers of model chunk ``vp_stage`` on pipeline stage ``pp_rank``."""
    _check_rank("pp", pp_rank, layout.pp)
    _check_rank("vp_stage", vp_stage, layout.vpp_chunks)
    if num_layers < 1:
        raise LayoutError(f"num_layers must be >= 1, got {num_layers}")
    counts = layout.chunk_counts(num_layers)  # [vp_stage][pp_rank], placed chunk 0 of every stage first
    first = sum(sum(row) for row in counts[:vp_stage]) + sum(counts[vp_stage][:pp_rank])
    return range(first, first + counts[vp_stage][pp_rank])


def layers_of(layout: Layout, *, pp_rank: int, num_layers: int, moe_layers: Sequence[int],
              vp_stage: int | None = None) -> tuple[int, ...]:
    """Sorted MoE layers held by pipeline stage ``pp_rank`` (all its chunks, or only ``vp_stage``).

    ``num_layers`` counts decoder layers; a MoE layer numbered ``num_layers + i`` is MTP layer ``i``, which
    Megatron-Core 0.19 builds on the last pipeline stage, in its last virtual chunk (``mtp_on_this_rank``)."""
    stages = range(layout.vpp_chunks) if vp_stage is None else (vp_stage,)
    moe = set(moe_layers)
    mtp = sorted(layer for layer in moe if layer >= num_layers)
    bad = sorted(layer for layer in moe if layer < 0) + ([] if mtp == list(range(num_layers, num_layers + len(mtp)))
                                                           else mtp)
    if bad:
        raise LayoutError(f"moe_layers {bad} outside [0, num_layers={num_layers}), and not MTP layers numbered "
                          f"num_layers + i ({num_layers}, {num_layers + 1}, ...)")
    held = set()
    for c in stages:
        held.update(chunk_layers(layout, pp_rank=pp_rank, vp_stage=c, num_layers=num_layers))
    if pp_rank == layout.pp - 1 and layout.vpp_chunks - 1 in stages:
        held.update(layer for layer in moe if layer >= num_layers)
    return tuple(sorted(held & moe))


def to_local(global_routes: Routes, layout: Layout, *, coords: RankCoords, seq_len: int | Sequence[int],
             batch: int, num_layers: int, zigzag: bool = True) -> Routes:
    """The routes a rank's routers see: its MoE layers, its tokens in local router order.

    ``seq_len`` may be one length or one per micro-batch.
    """
    lens = _per_microbatch(seq_len, global_routes.microbatches)
    layers = layers_of(layout, pp_rank=coords.pp, num_layers=num_layers, moe_layers=global_routes.layers)
    per_layer: dict[int, list[torch.Tensor]] = {layer: [] for layer in layers}
    for mb, length in enumerate(lens):
        idx_T = token_index(layout, tp_rank=coords.tp, cp_rank=coords.cp, seq_len=length, batch=batch,
                            dp_rank=coords.dp, zigzag=zigzag)
        for layer in layers:
            global_TK = global_routes.get(layer, mb)
            if idx_T.numel() and int(idx_T.max()) >= global_TK.shape[0]:
                raise RouteError(f"layer {layer} mb {mb}: global routes hold {global_TK.shape[0]} tokens, "
                                 f"{coords.label()} needs token {int(idx_T.max())} (seq_len {length}, batch {batch})")
            per_layer[layer].append(global_TK[idx_T])
    return type(global_routes)(per_layer, num_experts=global_routes.num_experts,
                               topk=global_routes.topk).in_order("router")


def to_global(local_by_rank: Mapping[RankCoords, Routes], layout: Layout, *, world_size: int,
              seq_len: int | Sequence[int], batch: int, num_layers: int, moe_layers: Sequence[int],
              zigzag: bool = True) -> Routes:
    """Merge ranks' local routes into the global view; replicas must agree.

    Every (pp, dp, cp) group, and under SP every TP rank of it, must be present. TP ranks without SP
    see the same tokens and are checked equal; a disagreement raises ``RouteError`` naming both ranks.
    """
    if not local_by_rank:
        raise RouteError("to_global needs at least one rank's routes")
    layout.validate(world_size=world_size)
    holding = [r for r in local_by_rank.values() if r.layers] or list(local_by_rank.values())
    first = holding[0]
    experts, topk, mbs = first.num_experts, first.topk, first.microbatches
    _check_holders(local_by_rank, layout, world_size=world_size)
    lens = _per_microbatch(seq_len, mbs)
    moe = tuple(sorted(set(moe_layers)))
    dtype = first.get(first.layers[0], 0).dtype if first.layers and mbs else torch.int64
    for coords, routes in local_by_rank.items():
        expect = layers_of(layout, pp_rank=coords.pp, num_layers=num_layers, moe_layers=moe)
        got = (routes.num_experts, routes.topk, routes.layers, routes.microbatches if routes.layers else mbs)
        if got != (experts, topk, expect, mbs):
            raise RouteError(f"{coords.label()}: (num_experts, topk, layers, microbatches) {got} != expected "
                             f"{(experts, topk, expect, mbs)}")
        for layer in routes.layers:
            dtype = torch.promote_types(dtype, routes.get(layer, 0).dtype)
    dp = layout.dp(world_size)
    per_layer = {layer: [] for layer in moe}
    for mb, length in enumerate(lens):
        tokens = dp * batch * length
        for layer in moe:
            per_layer[layer].append(_merge_one(local_by_rank, layout, layer=layer, mb=mb, seq_len=length,
                                               batch=batch, tokens=tokens, topk=topk, dtype=dtype, zigzag=zigzag))
    return type(first)(per_layer, num_experts=experts, topk=topk).in_order("sequence" if dp * batch > 1 else None)


def _merge_one(local_by_rank: Mapping[RankCoords, Routes], layout: Layout, *, layer: int, mb: int, seq_len: int,
               batch: int, tokens: int, topk: int, dtype: torch.dtype, zigzag: bool) -> torch.Tensor:
    holders = []
    for coords in sorted(local_by_rank, key=lambda c: c.rank):
        routes = local_by_rank[coords]
        if layer not in routes.layers:
            continue
        idx_T = token_index(layout, tp_rank=coords.tp, cp_rank=coords.cp, seq_len=seq_len, batch=batch,
                            dp_rank=coords.dp, zigzag=zigzag)
        local_TK = routes.get(layer, mb)
        if local_TK.shape[0] != idx_T.numel():
            raise RouteError(f"layer {layer} {coords.label()} mb {mb}: local routes hold {local_TK.shape[0]} tokens"
                             f" != expected T={idx_T.numel()} (seq_len {seq_len}, batch {batch})")
        holders.append((coords, idx_T, local_TK.to(dtype)))
    out_TK = torch.empty(tokens, topk, dtype=dtype)  # every row is written or named missing below
    if len(holders) == 1 and holders[0][1].numel() == tokens:  # one rank holds every token (token_index
        _, idx_T, local_TK = holders[0]                          # never repeats one): nothing to compare
        word_rows(out_TK).index_copy_(0, idx_T, word_rows(local_TK))
        return out_TK
    owner_T = torch.full((tokens,), -1, dtype=torch.int64)
    for n, (coords, idx_T, local_TK) in enumerate(holders):
        seen_T = owner_T[idx_T] >= 0 if n else None  # the first holder meets no replica
        if seen_T is not None and bool(seen_T.any()):
            differ_T = (out_TK[idx_T[seen_T]] != local_TK[seen_T]).any(dim=1)
            if bool(differ_T.any()):
                i = int(differ_T.nonzero()[0])
                token = int(idx_T[seen_T][i])
                other = _find(local_by_rank, int(owner_T[token]))
                raise RouteError(
                    f"layer {layer} mb {mb}: replicas disagree on {int(differ_T.sum())} token(s); first global token"
                    f" {token}: {coords.label()} has {local_TK[seen_T][i].tolist()}, {other.label()} has "
                    f"{out_TK[token].tolist()}")
            fresh_T = ~seen_T
            out_TK[idx_T[fresh_T]] = local_TK[fresh_T]
            owner_T[idx_T[fresh_T]] = coords.rank
        else:
            word_rows(out_TK).index_copy_(0, idx_T, word_rows(local_TK))
            owner_T[idx_T] = coords.rank
    if bool((owner_T < 0).any()):
        missing = int((owner_T < 0).sum())
        raise RouteError(f"layer {layer} mb {mb}: {missing} of {tokens} global tokens held by no rank "
                         f"(first: token {int((owner_T < 0).nonzero()[0])})")
    return out_TK


_WORDS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def word_rows(t_TK: torch.Tensor) -> torch.Tensor:
    """A contiguous ``[T, K]`` tensor viewed as ``[T, W]`` machine words (top-8 uint8 ids: one int64 per
    row), so that moving whole rows by index moves words, not bytes (about 4x faster on CPU)."""
    t_TK = t_TK.contiguous()
    row_bytes = t_TK.shape[1] * t_TK.element_size()
    word = next(w for w in _WORDS if row_bytes % w == 0)
    return t_TK.view(torch.uint8).view(t_TK.shape[0], row_bytes).view(_WORDS[word])


def _check_holders(local_by_rank: Mapping[RankCoords, Routes], layout: Layout, *, world_size: int) -> None:
    """Every distinct token holder (pp, dp, cp and, under SP, tp) needs at least one rank present."""
    dp = layout.dp(world_size)
    tps = range(layout.tp) if layout.sp else (None,)
    present = {(c.pp, c.dp, c.cp, c.tp if layout.sp else None) for c in local_by_rank}
    for c in local_by_rank:
        for name, value, size in (("tp", c.tp, layout.tp), ("pp", c.pp, layout.pp), ("cp", c.cp, layout.cp),
                                  ("dp", c.dp, dp)):
            if not 0 <= value < size:
                raise RouteError(f"{c.label()}: {name} rank {value} outside [0, {size}) for layout "
                                 f"{layout.name(world_size)}")
    for pp in range(layout.pp):
        for d in range(dp):
            for cp in range(layout.cp):
                for tp in tps:
                    if (pp, d, cp, tp) not in present:
                        who = f"pp{pp} dp{d} cp{cp}" + ("" if tp is None else f" tp{tp}")
                        raise RouteError(f"no routes from any rank with {who}: the global view would have a hole "
                                         f"(layout {layout.name(world_size)}, {len(local_by_rank)} rank(s) given)")


def _find(local_by_rank: Mapping[RankCoords, Routes], rank: int) -> RankCoords:
    return next(c for c in local_by_rank if c.rank == rank)


def _per_microbatch(seq_len: int | Sequence[int], microbatches: int) -> tuple[int, ...]:
    if isinstance(seq_len, int):
        return (seq_len,) * microbatches
    lens = tuple(int(s) for s in seq_len)
    if len(lens) != microbatches:
        raise RouteError(f"seq_len gives {len(lens)} length(s) but routes hold {microbatches} micro-batch(es)")
    return lens


def _check_rank(name: str, value: int, size: int) -> None:
    if not 0 <= value < size:
        raise LayoutError(f"{name} rank {value} outside [0, {size})")


def job_layout(*, sp: bool) -> tuple[Layout, RankCoords, int]:
    """This process's layout, coordinates and world size, read from Megatron's parallel state (inside a job).

    Refuses (``UsageError``) a multi-rank job without model-parallel state, and a rank order other than
    Megatron's default ``tp-cp-ep-dp-pp`` (the one ``rank_coords`` and the dump format assume)."""
    from megatron.core import parallel_state as ps  # lazy: megatron

    dist = torch.distributed if torch.distributed.is_available() and torch.distributed.is_initialized() else None
    world, rank = (dist.get_world_size(), dist.get_rank()) if dist else (1, 0)
    if world == 1:
        return Layout(), RankCoords(rank=0), 1
    if not ps.model_parallel_is_initialized():
        raise UsageError(f"rank {rank}: {world} ranks but Megatron's model-parallel state is not initialised; the "
                         "recording needs it to place each rank in the layout")
    tp, vpp = ps.get_tensor_model_parallel_world_size(), ps.get_virtual_pipeline_model_parallel_world_size()
    etp = ps.get_expert_tensor_parallel_world_size()
    try:
        layout = Layout(tp=tp, pp=ps.get_pipeline_model_parallel_world_size(), vpp=vpp if vpp and vpp > 1 else None,
                        ep=ps.get_expert_model_parallel_world_size(), etp=None if etp == tp else etp,
                        cp=ps.get_context_parallel_world_size(), sp=sp)
        expected = rank_coords(layout, rank=rank, world_size=world)
    except LayoutError as exc:
        raise UsageError(f"rank {rank}: the job's layout cannot be recorded: {exc}") from None
    actual = RankCoords(rank=rank, tp=ps.get_tensor_model_parallel_rank(), pp=ps.get_pipeline_model_parallel_rank(),
                        cp=ps.get_context_parallel_rank(), dp=ps.get_data_parallel_rank(),
                        ep=ps.get_expert_model_parallel_rank())
    if actual != expected:
        raise UsageError(f"rank {rank}: Megatron placed this rank at {actual.label()}, but the dump format assumes "
                         f"the default rank order tp-cp-ep-dp-pp ({expected.label()}); record with the default order")
    return layout, actual, world
