"""The sharded exporter's placement rules against independent references built by plain slicing."""

import torch

from moeverify.subjects import placement
from moeverify.subjects.placement import split_range


def _scatter(shape, parts):
    out = torch.full((int(torch.tensor(shape).prod()),), float("nan"))
    for pos, val in parts:
        out[pos] = val
    return out.reshape(shape)


def test_subject_column_split_reassembles_full():
    full = torch.randn(8, 3)
    parts = [placement.column(shard, tp=4, r=r, hf_rows=8).full() for r, shard in enumerate(torch.chunk(full, 4))]
    assert torch.equal(_scatter((8, 3), parts), full)


def test_subject_column_drops_vocab_padding_rows():
    full = torch.randn(6, 2)
    padded = torch.cat([full, torch.zeros(2, 2)])
    parts = [placement.column(shard, tp=2, r=r, hf_rows=6).full() for r, shard in enumerate(torch.chunk(padded, 2))]
    assert sum(p.numel() for p, _ in parts) == 12 and torch.equal(_scatter((6, 2), parts), full)


def test_subject_row_split_reassembles_full():
    full = torch.randn(3, 8)
    parts = [placement.row(shard, tp=2, r=r).full() for r, shard in enumerate(torch.chunk(full, 2, dim=1))]
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
    got = {"q": [], "k": [], "v": []}
    for r, shard in enumerate(torch.chunk(fused, tp)):
        for key, placer in zip("qkv", placement.qkv(shard, heads=heads, groups=groups, head_dim=dim, tp=tp, r=r)):
            # in three ranges, as the exporter cuts large tensors into rows
            for part in range(3):
                a, b = split_range(placer.n, 3, part)
                got[key].append((placer.positions(a, b), placer.values(a, b)))
    assert torch.equal(_scatter(q.shape, got["q"]), q)
    assert torch.equal(_scatter(k.shape, got["k"]), k)
    assert torch.equal(_scatter(v.shape, got["v"]), v)


def test_subject_qkv_bias_one_dimensional():
    fused = torch.arange(8, dtype=torch.float32)  # [q0 q0 q1 q1 k k v v]
    (qp, qv), (kp, kv), (vp, vv) = (p.full() for p in placement.qkv(fused, heads=2, groups=1, head_dim=2, tp=1, r=0))
    assert qv.tolist() == [0, 1, 2, 3] and kv.tolist() == [4, 5] and vv.tolist() == [6, 7]
    assert qp.tolist() == [0, 1, 2, 3] and kp.tolist() == [0, 1]


def test_subject_gated_splits_gate_and_up_per_shard():
    gate, up = torch.randn(4, 3), torch.randn(4, 3)
    shards = [torch.cat([gate[2 * r:2 * r + 2], up[2 * r:2 * r + 2]]) for r in range(2)]
    got = [placement.gated(s, tp=2, r=r, hf_rows=4) for r, s in enumerate(shards)]
    assert torch.equal(_scatter((4, 3), [g.full() for g, _ in got]), gate)
    assert torch.equal(_scatter((4, 3), [u.full() for _, u in got]), up)


def test_subject_split_range_covers_everything_once():
    spans = [split_range(10, 4, k) for k in range(4)]
    assert spans[0][0] == 0 and spans[-1][1] == 10 and all(a[1] == b[0] for a, b in zip(spans, spans[1:]))


def test_subject_stacked_gate_up_interleaves_each_expert_into_its_slice():
    """GPT-OSS: HF gate_up_proj [E, I, 2F] holds gate in even and up in odd columns; Megatron's expert fc1 is
    [gate; up] as rows [2F, I]. Reference: the HF tensor built column by column."""
    experts, inner, f = 3, 4, 5
    hf = torch.randn(experts, inner, 2 * f)
    hf_bias = torch.randn(experts, 2 * f)
    parts, bias_parts = [], []
    for e in range(experts):
        fc1 = torch.cat([hf[e][:, 0::2].t(), hf[e][:, 1::2].t()])  # [2F, I]: gate rows, then up rows
        fc1_bias = torch.cat([hf_bias[e][0::2], hf_bias[e][1::2]])
        parts.append(placement.stacked_gate_up(fc1, expert=e, tp=1, r=0, hf_shape=hf.shape).full())
        bias_parts.append(placement.stacked_gate_up(fc1_bias, expert=e, tp=1, r=0, hf_shape=hf_bias.shape).full())
    assert torch.equal(_scatter(hf.shape, parts), hf)
    assert torch.equal(_scatter(hf_bias.shape, bias_parts), hf_bias)


def test_subject_stacked_down_transposes_each_expert_shard_into_its_slice():
    """GPT-OSS: HF down_proj [E, F, O]; Megatron's expert fc2 is [O, F], split by columns over expert TP."""
    experts, f, out = 2, 6, 3
    hf = torch.randn(experts, f, out)
    parts = []
    for e in range(experts):
        for r, shard in enumerate(torch.chunk(hf[e].t(), 2, dim=1)):
            parts.append(placement.stacked_down(shard, expert=e, tp=2, r=r, hf_shape=hf.shape).full())
    assert torch.equal(_scatter(hf.shape, parts), hf)
    bias = torch.randn(experts, out)
    bias_parts = [placement.stacked_down(bias[e], expert=e, tp=1, r=0, hf_shape=bias.shape).full()
                  for e in range(experts)]
    assert torch.equal(_scatter(bias.shape, bias_parts), bias)
