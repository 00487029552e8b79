"""The sharded exporter's placement rules against independent references built by plain slicing."""

from types import SimpleNamespace

import torch

from moeverify.subjects.shard_rows import _column, _qkv, _row_split


def _scatter(shape, parts):
    out = torch.full((int(torch.tensor(shape).prod()),), float("nan"))
    for pos, val in parts:
        out[pos] = val
    return out.reshape(shape)


def test_subject_column_split_reassembles_full():
    full = torch.randn(8, 3)
    parts = [_column(shard, tp=4, r=r, hf_shape=(8, 3)) for r, shard in enumerate(torch.chunk(full, 4))]
    assert torch.equal(_scatter((8, 3), parts), full)


def test_subject_column_drops_vocab_padding_rows():
    full = torch.randn(6, 2)
    padded = torch.cat([full, torch.zeros(2, 2)])
    parts = [_column(shard, tp=2, r=r, hf_shape=(6, 2)) for r, shard in enumerate(torch.chunk(padded, 2))]
    assert sum(p.numel() for p, _ in parts) == 12 and torch.equal(_scatter((6, 2), parts), full)


def test_subject_row_split_reassembles_full():
    full = torch.randn(3, 8)
    parts = [_row_split(shard, tp=2, r=r) for r, shard in enumerate(torch.chunk(full, 2, dim=1))]
    assert torch.equal(_scatter((3, 8), parts), full)


def test_subject_qkv_interleaved_per_group():
    heads, groups, dim, hidden, tp = 4, 2, 3, 5, 2
    q = torch.randn(heads * dim, hidden)
    k = torch.randn(groups * dim, hidden)
    v = torch.randn(groups * dim, hidden)
    # independent reference: Megatron's fused layout built group by group, then split over TP
    per_group = heads // groups
    blocks = []
    for g in range(groups):
        blocks += [q[(g * per_group + i) * dim:(g * per_group + i + 1) * dim] for i in range(per_group)]
        blocks += [k[g * dim:(g + 1) * dim], v[g * dim:(g + 1) * dim]]
    fused = torch.cat(blocks)
    config = SimpleNamespace(num_attention_heads=heads, num_query_groups=groups, kv_channels=dim, hidden_size=hidden)
    got = {"q": [], "k": [], "v": []}
    for r, shard in enumerate(torch.chunk(fused, tp)):
        for key, part in zip("qkv", _qkv(shard, config=config, tp=tp, r=r)):
            got[key].append(part)
    assert torch.equal(_scatter(q.shape, got["q"]), q)
    assert torch.equal(_scatter(k.shape, got["k"]), k)
    assert torch.equal(_scatter(v.shape, got["v"]), v)


def test_subject_qkv_bias_one_dimensional():
    config = SimpleNamespace(num_attention_heads=2, num_query_groups=1, kv_channels=2, hidden_size=4)
    fused = torch.arange(8, dtype=torch.float32)  # [q0 q0 q1 q1 k k v v]
    (qp, qv), (kp, kv), (vp, vv) = _qkv(fused, config=config, tp=1, r=0)
    assert qv.tolist() == [0, 1, 2, 3] and kv.tolist() == [4, 5] and vv.tolist() == [6, 7]
    assert qp.tolist() == [0, 1, 2, 3] and kp.tolist() == [0, 1]
