"""Coverage bookkeeping by index runs instead of one writer byte per element.

While every piece written into a merge has the reference's bits (``merge.TensorMerge`` in run mode),
the merge needs only *which* elements were written, and by whom first: a list of runs
``(start, length, rank)`` in the order they were written. Coverage is then interval arithmetic over a
few hundred or thousand runs, not a pass over a writer mask as large as the tensor; the mask is built
from the runs only when an ordinary merge needs it (a piece with other bits, a replica to compare).

Legend: ``R`` = runs, ``N`` = elements of the HF tensor.
"""

from __future__ import annotations

import torch

from moeverify.errors import SHOW
from moeverify.oracles.bits import bits
from moeverify.oracles.export.rows import expand_runs


def as_runs(starts_R: torch.Tensor, lengths_R: torch.Tensor, rank: int) -> torch.Tensor:
    """``[R, 3]`` int64 rows ``(start, length, rank)``."""
    return torch.stack(
        [starts_R.to(torch.int64), lengths_R.to(torch.int64), torch.full_like(starts_R, rank, dtype=torch.int64)], dim=1
    )


def index_runs(
    positions_P: torch.Tensor, *, limit: int, chunk: int = 1 << 20
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``positions_P`` as ``(starts_R, lengths_R)`` of consecutive indices, in order; None past ``limit`` runs.

    Breaks are found ``chunk`` positions at a time (bounded temporaries), stopping as soon as ``limit`` is passed.
    """
    n = positions_P.numel()
    if n == 0:
        empty = torch.zeros(0, dtype=torch.int64)
        return empty, empty
    heads = [torch.zeros(1, dtype=torch.int64)]
    count = 1
    for a in range(0, n - 1, chunk):
        c = positions_P[a : min(a + chunk + 1, n)]
        brk = ((c[1:] - c[:-1]) != 1).nonzero().flatten() + (a + 1)
        count += brk.numel()
        if count > limit:
            return None
        heads.append(brk)
    heads_R = torch.cat(heads)
    lengths_R = torch.diff(heads_R, append=torch.tensor([n], dtype=torch.int64))
    return positions_P[heads_R], lengths_R


def gaps(runs_R3: torch.Tensor, numel: int) -> tuple[int, list[int]]:
    """``(elements never written, the first few of them)`` for runs over ``[0, numel)`` (runs may overlap)."""
    runs_R3 = runs_R3[runs_R3[:, 1] > 0]
    if not runs_R3.shape[0]:
        return numel, list(range(min(numel, SHOW)))
    order = torch.argsort(runs_R3[:, 0], stable=True)
    s_R = runs_R3[order, 0]
    e_R = s_R + runs_R3[order, 1]
    reach_R = torch.cummax(e_R, dim=0).values  # furthest end written by runs 0..i
    before_R = torch.cat([torch.zeros(1, dtype=torch.int64), reach_R[:-1]])  # furthest end before run i
    covered = int(torch.clamp(e_R - torch.maximum(s_R, before_R), min=0).sum())
    holes = [
        (int(a), int(b)) for a, b in zip(before_R[s_R > before_R].tolist(), s_R[s_R > before_R].tolist(), strict=True)
    ]
    if int(reach_R[-1]) < numel:
        holes.append((int(reach_R[-1]), numel))
    shown: list[int] = []
    for a, b in holes:
        shown += range(a, min(b, a + SHOW - len(shown)))
        if len(shown) >= SHOW:
            break
    return numel - covered, shown


def writer_mask(runs_R3: torch.Tensor, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """The writer mask the runs describe: ``rank + 1`` of the first run that wrote each element, 0 if none."""
    writer_N = torch.zeros(numel, dtype=dtype)
    for start, length, rank in reversed(runs_R3.tolist()):  # the earliest write is applied last: it wins
        if length:
            writer_N[start : start + length] = rank + 1
    return writer_N


def same_bits_at_runs(values_P: torch.Tensor, runs_R2: torch.Tensor, ref_N: torch.Tensor) -> bool:
    """Whether ``values_P`` (in run order) has ``ref_N``'s raw bits at the runs ``[R, 2]`` (start, length).

    Runs of one length at one stride (a row-split or per-head shard, maybe cut at either end) are compared as
    one strided 2-D view of the reference, the cut ends as slices: no index built, no gather. Other runs
    fall back to a gather by their expanded positions.
    """
    R = runs_R2.shape[0]
    starts, lengths = runs_R2[:, 0], runs_R2[:, 1]
    offsets = [0, *torch.cumsum(lengths, 0).tolist()]
    if R > 3:
        mid_s, mid_n = starts[1:-1], lengths[1:-1]
        step = mid_s[1:] - mid_s[:-1]
        L, S = int(mid_n[0]), int(step[0]) if step.numel() else 0
        if bool((mid_n == L).all()) and (not step.numel() or bool((step == S).all())) and S >= L > 0:
            view = ref_N.as_strided((R - 2, L), (S, 1), ref_N.storage_offset() + int(mid_s[0]))
            if not torch.equal(bits(values_P[offsets[1] : offsets[R - 1]].view(R - 2, L)), bits(view)):
                return False
            return all(
                torch.equal(
                    bits(values_P[offsets[i] : offsets[i + 1]]),
                    bits(ref_N[int(starts[i]) : int(starts[i]) + int(lengths[i])]),
                )
                for i in (0, R - 1)
            )
    if R <= 64:
        return all(
            torch.equal(
                bits(values_P[offsets[i] : offsets[i + 1]]),
                bits(ref_N[int(starts[i]) : int(starts[i]) + int(lengths[i])]),
            )
            for i in range(R)
        )
    return torch.equal(bits(values_P), bits(ref_N[expand_runs(starts, lengths)]))
