"""How full-tensor ``(name, tensor)`` pairs from several ranks merge (docs/export.md, "Full-tensor pairs from several
ranks"): each pair is a row of one whole-tensor piece; rank 0's contributes, every other rank's is a replica compared
with rank 0's bits; a name yielded twice on one rank is written twice. Followed through ``rows`` and ``TensorMerge``
as the oracle feeds them (contributing pieces written, the others compared), two ranks in one process."""

from __future__ import annotations

import torch

from moeverify.oracles.export.merge import TensorMerge
from moeverify.oracles.export.rows import drain, pieces
from moeverify.oracles.results import Tally

W = "model.norm.weight"


def _merged(streams: dict[int, list[tuple[str, torch.Tensor]]]) -> dict[str, Tally]:
    t = {k: Tally() for k in ("conflicts", "replicas")}
    merge = TensorMerge(name=W, shape=(4,), dtype=torch.bfloat16, world_size=2, **t)
    for rank in sorted(streams):  # rank order, as rank 0 takes every rank's pieces of a row
        for row in drain(iter(streams[rank]), rank=rank):
            for piece in pieces(row, rank=rank):
                positions = slice(0, piece.values_P.numel())  # a whole tensor: one range from 0
                if row.contributes:
                    merge.write(rank=rank, positions_P=positions, values_P=piece.values_P)
                else:
                    merge.compare_replica(rank=rank, positions_P=torch.arange(4), values_P=piece.values_P)
    return t


def test_full_pairs_rank_zero_contributes_and_the_others_are_replicas():
    ref = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.bfloat16)
    other = ref.clone()
    other[0] = 1.5
    assert [r.contributes for rank in (0, 1) for r in drain(iter([(W, ref)]), rank=rank)] == [True, False]
    same = _merged({0: [(W, ref)], 1: [(W, ref.clone())]})
    assert all(x.passed for x in same.values()) and same["replicas"].checked == 4
    rank1_differs = _merged({0: [(W, ref)], 1: [(W, other)]})
    assert rank1_differs["conflicts"].passed  # only rank 0 writes: two ranks' copies never conflict
    assert rank1_differs["replicas"].failures == [
        f"{W}: rank 1's replica differs from the merged value at 1 element(s), flat [0]; first: merged (rank 0) "
        "0x3f80 vs replica 0x3fc0"
    ]


def test_full_pairs_a_name_twice_on_one_rank_with_other_bits_conflicts():
    ref = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.bfloat16)
    other = ref.clone()
    other[0] = 1.5
    twice = _merged({0: [(W, ref), (W, other)]})
    assert twice["conflicts"].failures == [
        f"{W}: 1 element(s) written twice with different bits, flat [0]; first: rank 0 wrote 0x3f80, rank 0 wrote "
        "0x3fc0"
    ]
