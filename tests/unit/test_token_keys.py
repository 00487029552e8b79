"""Token keys and the route table on synthetic tensors: identity is content + position, never batch layout."""

from __future__ import annotations

import pytest
import torch

from moeverify.errors import RouteError
from moeverify.patches import token_keys as tk
from moeverify.patches.route_table import RouteTable

VOCAB = 50


def seqs(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g) for n in lengths]


def by_token(keys: tk.TokenKeys, uids) -> dict:
    """(uid, position) -> (key1, key2) for the real tokens of one forward."""
    out = {}
    for t in range(keys.tokens):
        if keys.pad_T is not None and bool(keys.pad_T[t]):
            continue
        seq, pos = keys.locate(t)
        out[(uids[seq], pos)] = tuple(keys.keys_2T[:, t].tolist())
    return out


def padded(batch, width):
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    pad = torch.ones(len(batch), width, dtype=torch.bool)
    for b, s in enumerate(batch):
        ids[b, : len(s)], pad[b, : len(s)] = s, False
    return ids, pad


def packed(batch, *, slot=None):
    lengths = [len(s) for s in batch]
    slots = [slot or n for n in lengths]
    cu = torch.tensor([0] + lengths).cumsum(0)
    cu_pad = torch.tensor([0] + slots).cumsum(0)
    ids = torch.zeros(int(cu_pad[-1]) + 3, dtype=torch.long)  # 3 trailing pad tokens past the last slot
    for i, s in enumerate(batch):
        ids[int(cu_pad[i]) : int(cu_pad[i]) + len(s)] = s
    return tk.packed_keys(ids[None], cu_seqlens=cu, cu_seqlens_padded=cu_pad)


def test_token_keys_invariant_to_batching_padding_and_packing():
    data = seqs([5, 8, 3, 8])
    whole_ids, whole_pad = padded(data, 8)
    reference = by_token(tk.row_keys(whole_ids, padding_mask_BS=whole_pad), [0, 1, 2, 3])
    assert len(reference) == 24
    ids, pad = padded([data[3], data[0]], 11)  # other rows, order and right padding
    assert by_token(tk.row_keys(ids, padding_mask_BS=pad), [3, 0]) == {
        k: v for k, v in reference.items() if k[0] in (3, 0)
    }
    thd = packed([data[2], data[1], data[0]], slot=9)  # packed, padded slots, trailing padding
    assert by_token(thd, [2, 1, 0]) == {k: v for k, v in reference.items() if k[0] in (2, 1, 0)}
    assert int(thd.pad_T.sum()) == thd.tokens - 16


def test_token_keys_left_and_both_side_padding_key_the_unpadded_sequence():
    # verl's BSHD batches pad prompts on the left; an engine never sees that padding: with the padding mask, a row's
    # real tokens are numbered from its first real token and keyed as the unpadded (packed) sequence
    data = seqs([5, 8, 3], seed=4)
    reference = by_token(packed(data), [0, 1, 2])
    width = 12
    for offsets in ([7, 4, 9], [2, 1, 5]):  # left padding only; padding on both sides
        ids = torch.zeros(len(data), width, dtype=torch.long)
        pad = torch.ones(len(data), width, dtype=torch.bool)
        for b, (s, first) in enumerate(zip(data, offsets, strict=True)):
            ids[b, first : first + len(s)], pad[b, first : first + len(s)] = s, False
        keys = tk.row_keys(ids, padding_mask_BS=pad)
        assert by_token(keys, [0, 1, 2]) == reference
        pad_T = pad.t().reshape(-1)
        assert torch.equal(keys.pad_T, pad_T)
        assert bool((keys.keys_2T[:, pad_T] == tk.PAD_KEY[:, None]).all())  # one key, no real token's
        real = keys.keys_2T[:, ~pad_T]
        assert not bool((real == tk.PAD_KEY[:, None]).all(dim=0).any())
    # without the mask the padding is content: the same rows key other (unmatched) tokens
    assert not set(by_token(tk.row_keys(ids), [0, 1, 2]).values()) & set(reference.values())
    with pytest.raises(RouteError, match=r"padding_mask \(3, 11\) does not match input_ids \(3, 12\)"):
        tk.row_keys(ids, padding_mask_BS=pad[:, :11])


def test_token_keys_differ_for_other_prefixes_and_agree_on_shared_prompts():
    prompt = torch.tensor([7, 8, 9])
    a, b = torch.cat([prompt, torch.tensor([1, 2])]), torch.cat([prompt, torch.tensor([1, 3])])
    keys = by_token(tk.row_keys(torch.stack([a, b])), ["a", "b"])
    assert [keys[("a", s)] == keys[("b", s)] for s in range(5)] == [True, True, True, True, False]
    shifted = by_token(tk.row_keys(torch.cat([torch.tensor([0]), a])[None]), ["x"])
    assert [shifted[("x", s + 1)] == keys[("a", s)] for s in range(5)] == [
        False
    ] * 5  # position counts, not just content
    rows = torch.randint(0, 4, (64, 32), generator=torch.Generator().manual_seed(1))  # many shared prefixes
    many = tk.row_keys(rows)
    prefixes = {tuple(row[: s + 1].tolist()) for row in rows for s in range(32)}
    assert torch.unique(many.keys_2T[0]).numel() == torch.unique(many.keys_2T, dim=1).shape[1] == len(prefixes)


def test_token_keys_router_order_and_sequence_parallel_slice():
    ids = torch.arange(12).view(2, 6)
    keys = tk.row_keys(ids)
    assert [keys.locate(t) for t in range(4)] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    part = tk.sequence_slice(keys, rank=1, size=2)
    assert [part.locate(t)[1] for t in range(6)] == [3, 3, 4, 4, 5, 5]
    assert torch.equal(part.keys_2T, keys.keys_2T[:, 6:])


def look(table, keys):
    found = table.lookup(keys)
    table.check(found, layer=0, rank=0)
    return found


def table_of(forwards, *, duplicates="refuse"):
    table = RouteTable(max_tokens=1000, num_experts=8, duplicates=duplicates)
    for keys, ids_TK in forwards:
        table.add_ids(layer=0, forward=table.add_forward(keys, rank=0), ids_TK=ids_TK, rank=0)
    table.freeze(rank=0)
    return table


def test_route_table_finds_routes_across_batching_and_refuses_unknown_tokens():
    data = seqs([4, 4, 4])
    ids, _ = padded(data, 4)
    recorded = tk.row_keys(ids)
    ids_TK = torch.arange(recorded.tokens * 2).view(-1, 2) % 8
    table = table_of([(recorded, ids_TK)])
    assert table.nbytes() == 12 * (8 + 8 + 1 + 1 + 2 * 2)  # keys, conflict and native flags, K = 2 int16 ids
    again = tk.row_keys(ids[[2, 0]])
    found = table.ids(0, look(table, again))
    want = ids_TK.view(4, 3, 2)[:, [2, 0]].reshape(-1, 2)  # router order s * B + b
    assert torch.equal(found, want)
    other, _ = padded(seqs([4], seed=5), 4)
    with pytest.raises(
        RouteError,
        match=r"layer 0 rank 0: training token 1 \(sequence 1 of this forward, position 0\)"
        r" has no route recorded by this step's log-prob pass \(4 of 8 tokens",
    ):
        look(table, tk.row_keys(torch.cat([ids[:1], other])))


def test_route_table_duplicate_keys_with_different_routes_refused_unless_first():
    ids, _ = padded(seqs([3]), 3)
    keys = tk.row_keys(ids)
    one, two = torch.tensor([[0, 1]] * 3), torch.tensor([[1, 0], [0, 1], [2, 1]])  # token 0 same set, token 2 not
    with pytest.raises(RouteError, match=r"position 2\) was recorded more than once with different expert sets"):
        look(table_of([(keys, one), (keys, two)]), keys)
    first = table_of([(keys, one), (keys, two)], duplicates="first")
    assert torch.equal(first.ids(0, look(first, keys)), one)


def test_route_table_cap_on_recorded_tokens():
    table = RouteTable(max_tokens=10, num_experts=8)
    table.add_forward(tk.row_keys(torch.zeros(2, 4, dtype=torch.long)), rank=0)
    with pytest.raises(
        RouteError,
        match=r"rank 0: 16 tokens of this step.s log-prob pass for one model chunk, "
        r"over the cap of 10",
    ):
        table.add_forward(tk.row_keys(torch.ones(2, 4, dtype=torch.long)), rank=0)


def versioned_table(entries) -> RouteTable:
    """A frozen table of rollout versions: ``entries`` = [(version, [sequences], expert id of every token)]."""
    table = RouteTable(max_tokens=1000, num_experts=8, duplicates="first")
    for version, sequences, expert in entries:
        keys = packed(sequences)
        forward = table.add_forward(keys, rank=0, version=version)
        ids = torch.tensor([[expert, (expert + 1) % 8]]).expand(keys.tokens, 2)
        table.add_ids(layer=0, forward=forward, ids_TK=ids, rank=0)
    table.freeze(rank=0)
    return table


def test_route_table_versions_serve_each_sequence_from_the_version_that_holds_it_whole():
    prompt, a, b, c = seqs([4, 3, 2, 5], seed=7)
    one, two, three = torch.cat([prompt, a]), torch.cat([prompt, b]), torch.cat([prompt, c])
    table = versioned_table([(6, [two, three], 5), (5, [one, three], 1)])  # newest first; the prompt in both
    ids, pad = padded([one, one[:5]], len(one))  # a sample of version 5, and a prefix of it
    keys = tk.row_keys(ids, padding_mask_BS=pad)
    found = table.lookup(keys)
    assert not bool(found.bad_T.any())
    real = ~pad.t().reshape(-1)
    assert table.ids(0, found)[real, 0].tolist() == [1] * int(real.sum())  # version 5's, on the shared prompt too
    found = table.lookup(tk.row_keys(two[None]))
    assert table.ids(0, found)[:, 0].tolist() == [5] * len(two)
    # `three` was rolled out whole in both versions with other routes: refused unless a version is named
    found = table.lookup(tk.row_keys(three[None]))
    assert bool(found.ambiguous_T.all()) and bool(found.bad_T.all())
    with pytest.raises(RouteError, match=r"rolled out under several versions \(6, 5\), routed differently"):
        table.check(found, layer=0, rank=0)
    for version, expert in ((5, 1), (6, 5)):
        found = table.lookup(tk.row_keys(three[None]), version=version)
        assert not bool(found.bad_T.any()) and table.ids(0, found)[:, 0].tolist() == [expert] * len(three)
    found = table.lookup(tk.row_keys(one[None]), version=6)  # not rolled out under version 6
    with pytest.raises(RouteError, match=r"version 6, which the forward names .*did not roll out"):
        table.check(found, layer=0, rank=0)
    same = versioned_table([(6, [three], 2), (5, [three], 2)])  # whole in both, routed alike: served
    assert not bool(same.lookup(tk.row_keys(three[None])).bad_T.any())


def test_token_keys_sequence_key_is_the_last_real_tokens_in_every_layout():
    # the key that picks a sequence's rollout version: the same under BSHD (padding either side), THD (padded slots,
    # trailing padding), a sequence-parallel slice and a CP take
    data = seqs([5, 8, 3], seed=9)
    last = {i: by_token(packed([s]), [i])[(i, len(s) - 1)] for i, s in enumerate(data)}
    ids, pad = padded(data, 10)
    for keys, uids in ((tk.row_keys(ids, padding_mask_BS=pad), [0, 1, 2]), (packed(data, slot=9), [0, 1, 2])):
        for t in range(keys.tokens):
            if not bool(keys.pad_T[t]):
                seq, _ = keys.locate(t)
                assert tuple(keys.last_2T[:, t].tolist()) == last[uids[seq]]
    keys = tk.row_keys(ids, padding_mask_BS=pad)
    half = tk.sequence_slice(keys, rank=1, size=2)
    assert torch.equal(half.last_2T, keys.last_2T[:, keys.tokens // 2 :])
    taken = tk.take(keys, torch.tensor([4, 0, 7]))
    assert torch.equal(taken.last_2T, keys.last_2T[:, [4, 0, 7]])


@pytest.mark.parametrize(
    "cu, cu_pad, message",
    [
        # real [3, 2, 2, 4] in slots [4, 1, 2, 4]: sequence 1 claims 2 real tokens in a slot of 1 (it was accepted:
        # sequence 0's last real token read as padding, sequence 1 took sequence 2's first token)
        ([0, 3, 5, 7, 11], [0, 4, 5, 7, 11], r"sequence 1 holds 2 real tokens .* in a slot of 1"),
        ([0, 3, 2, 7], [0, 3, 4, 7], r"sequence 1 holds -1 real tokens"),
        ([1, 3, 5], [1, 3, 5], r"sequence 0 holds 2 real tokens .*must start at 0"),
    ],
)
def test_packed_boundaries_that_contradict_each_other_are_refused(cu, cu_pad, message):
    ids = torch.arange(12)[None]
    for keyed in (tk.packed_keys, tk.packed_fingerprints):
        with pytest.raises(RouteError, match=message):
            keyed(ids, cu_seqlens=torch.tensor(cu), cu_seqlens_padded=torch.tensor(cu_pad))
