"""Which tokens and MoE layers a rank's routers see under a Layout, and routes between views.

Plain tensor and layout math (``job_layout`` alone reads Megatron's parallel state); it never sees a ``Routes``:
``Routes.to_local``/``to_global`` (``routes.py``) walk layers and micro-batches with the functions here.
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
from collections.abc import Sequence

import torch

from moeverify.errors import LayoutError, UsageError
from moeverify.spec.layout import Layout


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


def sequence_positions(
    layout: Layout, *, tp_rank: int, cp_rank: int, seq_len: int, zigzag: bool = True
) -> torch.Tensor:
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
            raise LayoutError(
                f"CP-local sequence length {local} (seq_len {seq_len}) is not divisible by tp "
                f"{layout.tp} under sequence parallel"
            )
        size = local // layout.tp
        positions_S = positions_S[tp_rank * size : (tp_rank + 1) * size]
    return positions_S


def token_index(
    layout: Layout, *, tp_rank: int, cp_rank: int, seq_len: int, batch: int, dp_rank: int = 0, zigzag: bool = True
) -> torch.Tensor:
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


def layers_of(
    layout: Layout, *, pp_rank: int, num_layers: int, moe_layers: Sequence[int], vp_stage: int | None = None
) -> tuple[int, ...]:
    """Sorted MoE layers held by pipeline stage ``pp_rank`` (all its chunks, or only ``vp_stage``).

    ``num_layers`` counts decoder layers; a MoE layer numbered ``num_layers + i`` is MTP layer ``i``, which
    Megatron-Core 0.19 builds on the last pipeline stage, in its last virtual chunk (``mtp_on_this_rank``)."""
    stages = range(layout.vpp_chunks) if vp_stage is None else (vp_stage,)
    moe = set(moe_layers)
    mtp = sorted(layer for layer in moe if layer >= num_layers)
    bad = sorted(layer for layer in moe if layer < 0) + (
        [] if mtp == list(range(num_layers, num_layers + len(mtp))) else mtp
    )
    if bad:
        raise LayoutError(
            f"moe_layers {bad} outside [0, num_layers={num_layers}), and not MTP layers numbered "
            f"num_layers + i ({num_layers}, {num_layers + 1}, ...)"
        )
    held: set[int] = set()
    for c in stages:
        held.update(chunk_layers(layout, pp_rank=pp_rank, vp_stage=c, num_layers=num_layers))
    if pp_rank == layout.pp - 1 and layout.vpp_chunks - 1 in stages:
        held.update(layer for layer in moe if layer >= num_layers)
    return tuple(sorted(held & moe))


_WORDS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def word_rows(t_TK: torch.Tensor) -> torch.Tensor:
    """A contiguous ``[T, K]`` tensor viewed as ``[T, W]`` machine words (top-8 uint8 ids: one int64 per
    row), so that moving whole rows by index moves words, not bytes (about 4x faster on CPU)."""
    t_TK = t_TK.contiguous()
    row_bytes = t_TK.shape[1] * t_TK.element_size()
    word = next(w for w in _WORDS if row_bytes % w == 0)
    return t_TK.view(torch.uint8).view(t_TK.shape[0], row_bytes).view(_WORDS[word])


def _check_rank(name: str, value: int, size: int) -> None:
    if not 0 <= value < size:
        raise LayoutError(f"{name} rank {value} outside [0, {size})")


def megatron_coords(rank: int) -> RankCoords:
    """Where Megatron's initialised parallel state places this process (data-parallel rank without CP, as
    ``rank_coords`` counts it); megatron-core 0.19.2's ``parallel_state`` getters."""
    from megatron.core import parallel_state as ps  # lazy: megatron

    return RankCoords(
        rank=rank,
        tp=ps.get_tensor_model_parallel_rank(),
        pp=ps.get_pipeline_model_parallel_rank(),
        cp=ps.get_context_parallel_rank(),
        dp=ps.get_data_parallel_rank(),
        ep=ps.get_expert_model_parallel_rank(),
    )


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
        raise UsageError(
            f"rank {rank}: {world} ranks but Megatron's model-parallel state is not initialised; the "
            "recording needs it to place each rank in the layout"
        )
    tp, vpp = ps.get_tensor_model_parallel_world_size(), ps.get_virtual_pipeline_model_parallel_world_size()
    etp = ps.get_expert_tensor_parallel_world_size()
    try:
        layout = Layout(
            tp=tp,
            pp=ps.get_pipeline_model_parallel_world_size(),
            vpp=vpp if vpp and vpp > 1 else None,
            ep=ps.get_expert_model_parallel_world_size(),
            etp=None if etp == tp else etp,
            cp=ps.get_context_parallel_world_size(),
            sp=sp,
        )
        expected = rank_coords(layout, rank=rank, world_size=world)
    except LayoutError as exc:
        raise UsageError(f"rank {rank}: the job's layout cannot be recorded: {exc}") from None
    actual = megatron_coords(rank)
    if actual != expected:
        raise UsageError(
            f"rank {rank}: Megatron placed this rank at {actual.label()}, but the dump format assumes "
            f"the default rank order tp-cp-ep-dp-pp ({expected.label()}); record with the default order"
        )
    return layout, actual, world
