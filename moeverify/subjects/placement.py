"""Where a rank's local Megatron shard lands in an HF tensor: pure index arithmetic, no Megatron.

A ``Placer`` describes one HF slot of one local tensor: ``n`` elements, and for any sub-range
``[a, b)`` of them their flat HF positions and their values. Ranges let the sharded exporter cut a
large tensor into several rows so that no row ever materialises positions for a whole shard.

Legend: ``G`` = query groups on this rank, ``H`` = q heads per group, ``D`` = head dim,
``I`` = inner size (hidden; 1 for a bias), ``J`` = elements of the requested range.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch


@dataclasses.dataclass(frozen=True, kw_only=True)
class Placer:
    """``n`` local elements; ``positions(a, b)`` and ``values(a, b)`` for elements ``a..b-1``."""

    n: int
    positions: Callable[[int, int], torch.Tensor]
    values: Callable[[int, int], torch.Tensor]
    offset: int | None = None  # set when positions(a, b) is the range a + offset .. b + offset - 1
    # set when positions(a, b) are runs of consecutive indices: runs(a, b) -> (starts_R, lengths_R), in order
    runs: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]] | None = None

    def full(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.positions(0, self.n), self.values(0, self.n)


def _j(a: int, b: int) -> torch.Tensor:
    return torch.arange(a, b, dtype=torch.int64)


def _by_units(a: int, b: int, unit: int, base_of: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Elements ``a..b-1`` of a sequence of ``unit``-long blocks, block ``u`` being ``base_of(u) + 0..unit-1``.

    One broadcast add over the blocks that hold the range (instead of a div/mod pass per coordinate).
    """
    if b <= a:
        return torch.zeros(0, dtype=torch.int64)
    u0, u1 = a // unit, -(-b // unit)
    base_U = base_of(torch.arange(u0, u1, dtype=torch.int64))
    return (base_U[:, None] + torch.arange(unit, dtype=torch.int64)[None, :]).reshape(-1)[a - u0 * unit : b - u0 * unit]


def _unit_runs(a: int, b: int, unit: int, base_of: Callable[[torch.Tensor], torch.Tensor]):
    """The same elements as ``_by_units(a, b, ...)``, as ``(starts_R, lengths_R)``: one run per block (the first
    and last cut to the range), none built element by element."""
    if b <= a:
        empty = torch.zeros(0, dtype=torch.int64)
        return empty, empty
    u0, u1 = a // unit, -(-b // unit)
    starts_R = base_of(torch.arange(u0, u1, dtype=torch.int64)).clone()
    lengths_R = torch.full_like(starts_R, unit)
    head = a - u0 * unit
    starts_R[0] += head
    lengths_R[0] -= head
    lengths_R[-1] -= u1 * unit - b
    return starts_R, lengths_R


def _blocks(n: int, unit: int, base_of, values) -> Placer:
    """A placer of ``n`` elements in ``unit``-long blocks, block ``u`` at HF ``base_of(u)``."""
    return Placer(
        n=n,
        positions=lambda a, b: _by_units(a, b, unit, base_of),
        values=values,
        runs=lambda a, b: _unit_runs(a, b, unit, base_of),
    )


def replicated(w: torch.Tensor) -> Placer:
    """The whole tensor, element ``j`` at HF position ``j``."""
    flat = w.reshape(-1)
    return Placer(n=flat.numel(), positions=_j, values=lambda a, b: flat[a:b], offset=0)


def column(w: torch.Tensor, *, tp: int, r: int, hf_rows: int) -> Placer:
    """Rows ``r*R ..`` of the full tensor (dim-0 split); rows past ``hf_rows`` (vocab padding) dropped."""
    rows = w.shape[0]
    inner = math.prod(w.shape[1:])
    keep = max(0, min(rows, hf_rows - r * rows))
    flat = w[:keep].reshape(-1)
    offset = r * rows * inner
    return Placer(
        n=flat.numel(), positions=lambda a, b: _j(a + offset, b + offset), values=lambda a, b: flat[a:b], offset=offset
    )


def row(w: torch.Tensor, *, tp: int, r: int) -> Placer:
    """Columns ``r*C ..`` of the full 2-D tensor (dim-1 split)."""
    out, cols = w.shape
    flat = w.reshape(-1)

    # output row o's columns start at o * cols * tp + r * cols
    return _blocks(flat.numel(), cols, lambda o_U: o_U * (cols * tp) + r * cols, lambda a, b: flat[a:b])


def qkv(
    w: torch.Tensor, *, heads: int, groups: int, head_dim: int, tp: int, r: int, output_gate: bool = False
) -> tuple[Placer, Placer, Placer]:
    """Megatron's fused QKV shard ``[G, H + 2, D, I]`` (interleaved per query group) -> q, k, v. With an attention
    output gate (Qwen3-Next) the shard is ``[G, 2H + 2, D, I]`` (q heads, their gates, k, v) and HF's q_proj holds
    each head's query and gate one after the other (``[heads, 2D, I]``): q's slot gets both."""
    H, D, G = heads // groups, head_dim, groups // tp
    per_group = 2 * H + 2 if output_gate else H + 2
    inner = 1 if w.dim() == 1 else w.shape[1]
    flat = w.reshape(-1)

    def placer(first: int, count: int, *, stride: int = 1, shift: int = 0) -> Placer:
        # slot elements are [G, count, D, I] taken from heads first..first+count of every local group, in blocks
        # of D * I (one head); block u = g * count + h. In HF, head ``h``'s rows start at ``(h * stride + shift) * D``
        # (stride 2 and shift 0/1 for q/gate), the global head being r * G * count + u
        def values(a: int, b: int) -> torch.Tensor:
            local = _by_units(
                a, b, D * inner, lambda u_U: ((u_U // count) * per_group + first + u_U % count) * D * inner
            )
            return flat[local]

        return _blocks(
            G * count * D * inner, D * inner, lambda u_U: ((r * G * count + u_U) * stride + shift) * D * inner, values
        )

    k, v = placer(per_group - 2, 1), placer(per_group - 1, 1)
    if not output_gate:
        return placer(0, H), k, v
    return concat(placer(0, H, stride=2), placer(H, H, stride=2, shift=1)), k, v


def concat(*parts: Placer) -> Placer:
    """One slot filled by several placers, their elements one after the other."""
    starts = [0]
    for part in parts:
        starts.append(starts[-1] + part.n)

    def pieces(a: int, b: int, fn: str) -> torch.Tensor:
        out = [
            getattr(part, fn)(max(a, lo) - lo, min(b, hi) - lo)
            for part, lo, hi in zip(parts, starts[:-1], starts[1:], strict=True)
            if max(a, lo) < min(b, hi)
        ]
        return torch.cat(out) if out else getattr(parts[0], fn)(0, 0)

    part_runs = [part.runs for part in parts if part.runs is not None]  # used only when every part has runs

    def runs(a: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        got = [
            part_run(max(a, lo) - lo, min(b, hi) - lo)
            for part_run, lo, hi in zip(part_runs, starts[:-1], starts[1:], strict=True)
            if max(a, lo) < min(b, hi)
        ]
        got = got or [part_runs[0](0, 0)]
        return torch.cat([s for s, _ in got]), torch.cat([n for _, n in got])

    return Placer(
        n=starts[-1],
        positions=lambda a, b: pieces(a, b, "positions"),
        values=lambda a, b: pieces(a, b, "values"),
        runs=runs if len(part_runs) == len(parts) else None,
    )


def gated(w: torch.Tensor, *, tp: int, r: int, hf_rows: int) -> tuple[Placer, Placer]:
    """Megatron's fused ``[gate; up]`` shard -> gate and up, each a dim-0 split."""
    gate, up = torch.chunk(w, 2, dim=0)
    return column(gate, tp=tp, r=r, hf_rows=hf_rows), column(up, tp=tp, r=r, hf_rows=hf_rows)


def stacked_gate_up(w: torch.Tensor, *, expert: int, tp: int, r: int, hf_shape: tuple) -> Placer:
    """An expert's fc1 shard (rows ``r*R ..`` of ``[gate; up]``, ``[R, I]`` or a bias ``[R]``) into an HF tensor
    that stacks every expert with gate and up interleaved (GPT-OSS ``gate_up_proj`` ``[E, I, 2F]``, bias
    ``[E, 2F]``): row ``f`` of gate is column ``2f``, of up ``2f + 1``."""
    rows = w.shape[0]
    inner = 1 if w.dim() == 1 else w.shape[1]
    two_f = hf_shape[-1]
    flat = w.reshape(-1)

    def positions(a: int, b: int) -> torch.Tensor:
        j_J = _j(a, b)
        row = r * rows + j_J // inner  # row of the whole [gate; up]
        col = torch.where(row < two_f // 2, 2 * row, 2 * (row - two_f // 2) + 1)
        return (expert * inner + j_J % inner) * two_f + col

    return Placer(n=flat.numel(), positions=positions, values=lambda a, b: flat[a:b])


def stacked_down(w: torch.Tensor, *, expert: int, tp: int, r: int, hf_shape: tuple) -> Placer:
    """An expert's fc2 shard (columns ``r*C ..`` of ``[O, F]``, or a bias ``[O]``) into an HF tensor that stacks
    every expert transposed (GPT-OSS ``down_proj`` ``[E, F, O]``, bias ``[E, O]``)."""
    flat = w.reshape(-1)
    if w.dim() == 1:
        out = w.shape[0]
        return Placer(
            n=out, positions=lambda a, b: expert * out + _j(a, b), values=lambda a, b: flat[a:b], offset=expert * out
        )
    out, cols = w.shape
    inner = hf_shape[-2]

    def positions(a: int, b: int) -> torch.Tensor:
        j_J = _j(a, b)
        o, c = j_J // cols, j_J % cols
        return (expert * inner + r * cols + c) * out + o

    return Placer(n=flat.numel(), positions=positions, values=lambda a, b: flat[a:b])


def row_map(w: torch.Tensor, *, local_rows: torch.Tensor, hf_rows: torch.Tensor) -> Placer:
    """Local rows ``local_rows[i]`` (dim 0; the rest flattened) to HF rows ``hf_rows[i]``."""
    inner = math.prod(w.shape[1:])
    flat = w.reshape(-1)

    def values(a: int, b: int) -> torch.Tensor:
        return flat[_by_units(a, b, inner, lambda i_U: local_rows[i_U] * inner)]

    return _blocks(len(local_rows) * inner, inner, lambda i_U: hf_rows[i_U] * inner, values)


@dataclasses.dataclass(frozen=True, kw_only=True)
class GdnDims:
    """Gated delta net sizes: key/value head dims and head counts (megatron-core's ``linear_*`` config)."""

    dk: int
    dv: int
    nk: int
    nv: int

    @property
    def group(self) -> int:  # value heads per key head
        return self.nv // self.nk


def gdn_sections(dims: GdnDims, *, tp: int, r: int, gates: bool) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """megatron-core's GDN shard, section by section: ``in_proj`` holds ``[q, k, v, z, b, a]`` of this TP rank's
    heads (``gates``), ``conv1d`` ``[q, k, v]``. Per section: (local rows, their global index in the section)."""
    qk, v = dims.nk * dims.dk, dims.nv * dims.dv
    sizes = [("q", qk), ("k", qk), ("v", v)] + ([("z", v), ("b", dims.nv), ("a", dims.nv)] if gates else [])
    out, start = {}, 0
    for name, full in sizes:
        n = full // tp
        out[name] = (_j(start, start + n), _j(r * n, (r + 1) * n))
        start += n
    return out


def gdn_flat_row(dims: GdnDims, section: str, j_R: torch.Tensor) -> torch.Tensor:
    """HF row of global section index ``j`` in the flat ``[Q; K; V]`` layout (conv1d, Qwen3.5's in_proj_qkv);
    z, b, a are tensors of their own (row ``j``)."""
    qk = dims.nk * dims.dk
    return j_R + {"q": 0, "k": qk, "v": 2 * qk}.get(section, 0)


def gdn_grouped_row(dims: GdnDims, section: str, j_R: torch.Tensor) -> torch.Tensor:
    """HF row of global section index ``j`` in Qwen3-Next's head-grouped layout: ``in_proj_qkvz`` is, per key
    head, ``[q (dk), k (dk), v (g*dv), z (g*dv)]``; ``in_proj_ba`` per key head ``[b (g), a (g)]``."""
    dk, gv, g = dims.dk, dims.group * dims.dv, dims.group
    width = 2 * dk + 2 * gv
    if section in ("q", "k"):
        return (j_R // dk) * width + (dk if section == "k" else 0) + j_R % dk
    if section in ("v", "z"):
        return (j_R // gv) * width + 2 * dk + (gv if section == "z" else 0) + j_R % gv
    return (j_R // g) * 2 * g + (g if section == "a" else 0) + j_R % g


def split_range(n: int, parts: int, k: int) -> tuple[int, int]:
    """The ``k``-th of ``parts`` near-equal contiguous ranges of ``range(n)``."""
    return n * k // parts, n * (k + 1) // parts
