"""Token keys under context parallel, on synthetic tensors: each CP rank's zigzag halves (BSHD rows, THD slots),
put back together and keyed as the full sequences, give every token the key it has without CP.

The references are written here from megatron-core 0.19.2's ``_get_batch_on_this_cp_rank_per_sequence_balancing``
(view into ``2 * cp`` chunks, ``index_select`` of chunks ``r`` and ``2 * cp - 1 - r``) and Transformer Engine's
``thd_partition_indices_kernel`` (per packed slot, the same split), not from ``token_keys``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from moeverify.errors import RouteError
from moeverify.patches import token_keys as tk
from moeverify.routing.views import sequence_positions
from moeverify.spec.layout import Layout

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "special_distributed" / "jobs"))
from te_reference import te_thd_indices  # noqa: E402 (shared with the torchrun job)

VOCAB = 50


def megatron_cp_split(val_BS: torch.Tensor, *, cp: int, rank: int) -> torch.Tensor:
    """megatron-core 0.19.2 ``get_batch_on_this_cp_rank`` (no cu_seqlens) on one ``[B, S]`` tensor."""
    val = val_BS.view(val_BS.shape[0], 2 * cp, val_BS.shape[1] // (2 * cp))
    val = val.index_select(1, torch.tensor([rank, 2 * cp - rank - 1]))
    return val.reshape(val_BS.shape[0], -1)


def by_position(keys: tk.TokenKeys) -> dict:
    """(row or packed sequence, position) -> key pair, padding left out."""
    return {
        keys.locate(t): tuple(keys.keys_2T[:, t].tolist())
        for t in range(keys.tokens)
        if keys.pad_T is None or not bool(keys.pad_T[t])
    }


@pytest.mark.parametrize("cp", [2, 3])
def test_token_keys_cp_zigzag_index_is_megatrons_split(cp):
    positions = torch.arange(4 * cp * 3).expand(2, -1)
    for rank in range(cp):
        expected = megatron_cp_split(positions, cp=cp, rank=rank)[0]
        assert torch.equal(tk.zigzag_index(positions.shape[1], rank=rank, size=cp), expected)
        assert torch.equal(
            expected, sequence_positions(Layout(cp=cp), tp_rank=0, cp_rank=rank, seq_len=positions.shape[1])
        )


@pytest.mark.parametrize("cp", [2, 3])
def test_token_keys_cp_halves_keyed_as_the_full_rows(cp):
    g = torch.Generator().manual_seed(0)
    ids_BS = torch.randint(0, VOCAB, (3, 4 * cp), generator=g)
    pad_BS = torch.zeros_like(ids_BS, dtype=torch.bool)
    pad_BS[1, 5:] = True
    full = tk.row_keys(ids_BS, padding_mask_BS=pad_BS)
    reference = by_position(full)
    parts = [megatron_cp_split(ids_BS, cp=cp, rank=r) for r in range(cp)]
    indices = [tk.zigzag_index(ids_BS.shape[1], rank=r, size=cp) for r in range(cp)]
    assert torch.equal(tk.unshard(parts, indices, length=ids_BS.shape[1]), ids_BS)
    seen = {}
    for rank in range(cp):
        local_pad = megatron_cp_split(pad_BS, cp=cp, rank=rank)
        local = tk.take(full, tk.row_zigzag_tokens(indices[rank], batch=3), pad_T=local_pad.t().reshape(-1))
        assert local.tokens == parts[rank].numel()
        got = by_position(local)
        # local router order s_local * B + b: the position of each token is this rank's zigzag position
        assert [local.locate(t) for t in range(3)] == [(b, int(indices[rank][0])) for b in range(3)]
        assert got == {k: reference[k] for k in got}
        seen.update(got)
    assert seen == reference  # every real token on exactly one CP rank, with its full-row key


def test_token_keys_cp_then_sequence_parallel_slice_is_views_order():
    cp, tp, s = 2, 2, 16
    ids_BS = torch.randint(0, VOCAB, (2, s), generator=torch.Generator().manual_seed(1))
    full = tk.row_keys(ids_BS)
    layout = Layout(tp=tp, cp=cp, sp=True)
    for cp_rank in range(cp):
        index = tk.zigzag_index(s, rank=cp_rank, size=cp)
        local = tk.take(full, tk.row_zigzag_tokens(index, batch=2))
        for tp_rank in range(tp):
            router = tk.sequence_slice(local, rank=tp_rank, size=tp)
            expected_S = sequence_positions(layout, tp_rank=tp_rank, cp_rank=cp_rank, seq_len=s)
            assert [router.locate(t) for t in range(router.tokens)] == [
                (b, int(p)) for p in expected_S for b in range(2)
            ]
            assert torch.equal(router.keys_2T, full.keys_2T[:, (expected_S[:, None] * 2 + torch.arange(2)).reshape(-1)])


def test_token_keys_cp_packed_slots_split_per_document_as_transformer_engine():
    cp = 2
    g = torch.Generator().manual_seed(2)
    lengths, slots = [5, 8, 3], [8, 8, 4]
    cu = torch.tensor([0] + lengths).cumsum(0)
    cu_pad = torch.tensor([0] + slots).cumsum(0)
    ids = torch.zeros(int(cu_pad[-1]), dtype=torch.long)
    data = [torch.randint(0, VOCAB, (n,), generator=g) for n in lengths]
    for i, d in enumerate(data):
        ids[int(cu_pad[i]) : int(cu_pad[i]) + len(d)] = d
    full = tk.packed_keys(ids[None], cu_seqlens=cu, cu_seqlens_padded=cu_pad)
    indices = [tk.thd_zigzag_index(cu_pad, rank=r, size=cp) for r in range(cp)]
    for r in range(cp):
        assert indices[r].tolist() == te_thd_indices(cu_pad.tolist(), cp=cp, rank=r)
    parts = [ids[indices[r]][None] for r in range(cp)]
    assert torch.equal(tk.unshard(parts, indices, length=ids.numel()), ids[None])
    seen = {}
    for r in range(cp):
        seen.update(by_position(tk.take(full, indices[r])))
    # each real token keeps its key from an unpacked, unsplit row: identity survives packing and CP together
    for i, d in enumerate(data):
        alone = by_position(tk.row_keys(d[None]))
        assert {pos: seen[(i, pos)] for pos in range(len(d))} == {pos: alone[(0, pos)] for pos in range(len(d))}
    assert len(seen) == sum(lengths)


def test_token_keys_cp_refuses_splits_megatron_cannot_make():
    with pytest.raises(RouteError, match=r"a row of 6 tokens is not divisible by 2 \* cp = 4"):
        tk.zigzag_index(6, rank=0, size=2)
    with pytest.raises(RouteError, match=r"slot 1 holds 6 tokens, not a multiple of 2 \* cp = 4"):
        tk.thd_zigzag_index(torch.tensor([0, 8, 14]), rank=0, size=2)
    index = [tk.zigzag_index(8, rank=r, size=2) for r in range(2)]
    with pytest.raises(RouteError, match=r"do not cover every token exactly once"):
        tk.unshard([torch.zeros(1, 4), torch.zeros(1, 4)], [index[0], index[0]], length=8)
