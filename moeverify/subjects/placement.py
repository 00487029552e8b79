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

    def full(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.positions(0, self.n), self.values(0, self.n)


def _j(a: int, b: int) -> torch.Tensor:
    return torch.arange(a, b, dtype=torch.int64)


def replicated(w: torch.Tensor) -> Placer:
    """The whole tensor, element ``j`` at HF position ``j``."""
    flat = w.reshape(-1)
    return Placer(n=flat.numel(), positions=_j, values=lambda a, b: flat[a:b])


def column(w: torch.Tensor, *, tp: int, r: int, hf_rows: int) -> Placer:
    """Rows ``r*R ..`` of the full tensor (dim-0 split); rows past ``hf_rows`` (vocab padding) dropped."""
    rows = w.shape[0]
    inner = math.prod(w.shape[1:])
    keep = max(0, min(rows, hf_rows - r * rows))
    flat = w[:keep].reshape(-1)
    offset = r * rows * inner
    return Placer(n=flat.numel(), positions=lambda a, b: _j(a + offset, b + offset), values=lambda a, b: flat[a:b])


def row(w: torch.Tensor, *, tp: int, r: int) -> Placer:
    """Columns ``r*C ..`` of the full 2-D tensor (dim-1 split)."""
    out, cols = w.shape
    flat = w.reshape(-1)

    def positions(a: int, b: int) -> torch.Tensor:
        j_J = _j(a, b)
        return (j_J // cols) * (cols * tp) + r * cols + j_J % cols

    return Placer(n=flat.numel(), positions=positions, values=lambda a, b: flat[a:b])


def qkv(w: torch.Tensor, *, heads: int, groups: int, head_dim: int, tp: int, r: int) -> tuple[Placer, Placer, Placer]:
    """Megatron's fused QKV shard ``[G, H + 2, D, I]`` (interleaved per query group) -> q, k, v."""
    H, D, G = heads // groups, head_dim, groups // tp
    inner = 1 if w.dim() == 1 else w.shape[1]
    flat = w.reshape(-1)

    def placer(first: int, count: int) -> Placer:
        # slot elements are [G, count, D, I] taken from heads first..first+count of every local group
        def unravel(j_J):
            c = j_J % inner
            d = (j_J // inner) % D
            h = (j_J // (inner * D)) % count
            g = j_J // (inner * D * count)
            return g, h, d, c

        def positions(a: int, b: int) -> torch.Tensor:
            g, h, d, c = unravel(_j(a, b))
            head = (r * G + g) * count + h  # global q head, or global group for k/v (count == 1)
            return (head * D + d) * inner + c

        def values(a: int, b: int) -> torch.Tensor:
            g, h, d, c = unravel(_j(a, b))
            return flat[((g * (H + 2) + first + h) * D + d) * inner + c]

        return Placer(n=G * count * D * inner, positions=positions, values=values)

    return placer(0, H), placer(H, 1), placer(H + 1, 1)


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
        return Placer(n=out, positions=lambda a, b: expert * out + _j(a, b), values=lambda a, b: flat[a:b])
    out, cols = w.shape
    inner = hf_shape[-2]

    def positions(a: int, b: int) -> torch.Tensor:
        j_J = _j(a, b)
        o, c = j_J // cols, j_J % cols
        return (expert * inner + r * cols + c) * out + o

    return Placer(n=flat.numel(), positions=positions, values=lambda a, b: flat[a:b])


def split_range(n: int, parts: int, k: int) -> tuple[int, int]:
    """The ``k``-th of ``parts`` near-equal contiguous ranges of ``range(n)``."""
    return n * k // parts, n * (k + 1) // parts
