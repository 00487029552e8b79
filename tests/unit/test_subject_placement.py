"""The sharded exporter's placement rules against independent references built by plain slicing."""

import itertools

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
        blocks += [q[(g * per_group + i) * dim : (g * per_group + i + 1) * dim] for i in range(per_group)]
        blocks += [k[g * dim : (g + 1) * dim], v[g * dim : (g + 1) * dim]]
    fused = torch.cat(blocks)
    got = {"q": [], "k": [], "v": []}
    for r, shard in enumerate(torch.chunk(fused, tp)):
        for key, placer in zip(
            "qkv", placement.qkv(shard, heads=heads, groups=groups, head_dim=dim, tp=tp, r=r), strict=True
        ):
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
    shards = [torch.cat([gate[2 * r : 2 * r + 2], up[2 * r : 2 * r + 2]]) for r in range(2)]
    got = [placement.gated(s, tp=2, r=r, hf_rows=4) for r, s in enumerate(shards)]
    assert torch.equal(_scatter((4, 3), [g.full() for g, _ in got]), gate)
    assert torch.equal(_scatter((4, 3), [u.full() for _, u in got]), up)


def test_subject_split_range_covers_everything_once():
    spans = [split_range(10, 4, k) for k in range(4)]
    assert spans[0][0] == 0 and spans[-1][1] == 10 and all(a[1] == b[0] for a, b in itertools.pairwise(spans))


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
    bias_parts = [
        placement.stacked_down(bias[e], expert=e, tp=1, r=0, hf_shape=bias.shape).full() for e in range(experts)
    ]
    assert torch.equal(_scatter(bias.shape, bias_parts), bias)


def _reassemble(shards, place, shapes):
    """Scatter every rank's placed shard (in three ranges, as the exporter cuts rows) into the HF tensors."""
    got = {name: [] for name in shapes}
    for r, shard in enumerate(shards):
        for name, placer in place(shard, r).items():
            for k in range(3):
                a, b = split_range(placer.n, 3, k)
                got[name].append((placer.positions(a, b), placer.values(a, b)))
    return {name: _scatter(shape, got[name]) for name, shape in shapes.items()}


def _bridge_mappings():
    from moeverify import runtime

    runtime.import_bridge()  # megatron-bridge imports through moeverify's shim where Transformer Engine is absent
    from megatron.bridge.models.conversion import param_mapping

    return param_mapping


def _gdn_config(**extra):
    from types import SimpleNamespace as NS

    return NS(
        hidden_size=6,
        linear_key_head_dim=3,
        linear_value_head_dim=2,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        **extra,
    )


def test_subject_gdn_in_proj_grouped_and_flat_against_the_bridges_merge():
    pm = _bridge_mappings()
    _fuse_gdn_separate_to_grouped, merge_gdn_linear_weights = (
        pm._fuse_gdn_separate_to_grouped,
        pm.merge_gdn_linear_weights,
    )
    cfg = _gdn_config()
    dims = placement.GdnDims(dk=3, dv=2, nk=2, nv=4)
    qk, v, hidden = 6, 8, 6
    qkv, z = torch.randn(2 * qk + v, hidden), torch.randn(v, hidden)
    b, a = torch.randn(4, hidden), torch.randn(4, hidden)
    qkvz, ba = _fuse_gdn_separate_to_grouped(cfg, qkv, z, b, a)  # Qwen3-Next's head-grouped HF tensors
    for tp in (1, 2):
        shards = torch.chunk(merge_gdn_linear_weights(cfg, qkvz, ba, tp_size=tp), tp)  # Megatron's in_proj per rank

        def grouped(shard, r):
            sections = placement.gdn_sections(dims, tp=tp, r=r, gates=True)
            return {
                name: placement.row_map(
                    shard,
                    local_rows=torch.cat([sections[s][0] for s in secs]),
                    hf_rows=torch.cat([placement.gdn_grouped_row(dims, s, sections[s][1]) for s in secs]),
                )
                for name, secs in (("qkvz", "qkvz"), ("ba", "ba"))
            }

        def flat(shard, r):
            sections = placement.gdn_sections(dims, tp=tp, r=r, gates=True)
            return {
                name: placement.row_map(
                    shard,
                    local_rows=torch.cat([sections[s][0] for s in secs]),
                    hf_rows=torch.cat([placement.gdn_flat_row(dims, s, sections[s][1]) for s in secs]),
                )
                for name, secs in (("qkv", "qkv"), ("z", "z"), ("b", "b"), ("a", "a"))
            }

        got = _reassemble(shards, grouped, {"qkvz": qkvz.shape, "ba": ba.shape})
        assert torch.equal(got["qkvz"], qkvz) and torch.equal(got["ba"], ba), tp
        got = _reassemble(shards, flat, {"qkv": qkv.shape, "z": z.shape, "b": b.shape, "a": a.shape})
        expected = {"qkv": qkv, "z": z, "b": b, "a": a}
        assert sorted(got) == sorted(expected), tp
        assert [k for k, t in expected.items() if not torch.equal(got[k], t)] == [], tp


def test_subject_gdn_conv1d_sections_split_per_tp_rank():
    dims = placement.GdnDims(dk=3, dv=2, nk=2, nv=4)
    qk, v, width = 6, 8, 4
    conv = torch.randn(2 * qk + v, 1, width)  # HF: [Q; K; V] channels
    q, k, vv = torch.split(conv, [qk, qk, v])
    tp = 2
    # independent reference: each rank holds its slice of q, of k and of v, one after the other
    shards = [torch.cat([t.chunk(tp)[r] for t in (q, k, vv)]) for r in range(tp)]

    def place(shard, r):
        sections = placement.gdn_sections(dims, tp=tp, r=r, gates=False)
        return {
            "conv": placement.row_map(
                shard,
                local_rows=torch.cat([sections[s][0] for s in "qkv"]),
                hf_rows=torch.cat([placement.gdn_flat_row(dims, s, sections[s][1]) for s in "qkv"]),
            )
        }

    assert torch.equal(_reassemble(shards, place, {"conv": conv.shape})["conv"], conv)


def test_subject_qkv_with_output_gate_against_the_bridges_merge():
    from types import SimpleNamespace as NS

    merge_qkv_weights = _bridge_mappings().merge_qkv_weights
    heads, groups, dim, hidden = 4, 2, 3, 5
    cfg = NS(
        num_attention_heads=heads,
        num_query_groups=groups,
        kv_channels=dim,
        hidden_size=hidden,
        attention_output_gate=True,
    )
    q = torch.randn(heads * 2 * dim, hidden)  # HF q_proj: each head's query then its gate
    k, v = torch.randn(groups * dim, hidden), torch.randn(groups * dim, hidden)
    fused = merge_qkv_weights(cfg, q, k, v)
    for tp in (1, 2):

        def place(shard, r):
            return dict(
                zip(
                    "qkv",
                    placement.qkv(shard, heads=heads, groups=groups, head_dim=dim, tp=tp, r=r, output_gate=True),
                    strict=True,
                )
            )

        got = _reassemble(torch.chunk(fused, tp), place, {"q": q.shape, "k": k.shape, "v": v.shape})
        assert torch.equal(got["q"], q) and torch.equal(got["k"], k) and torch.equal(got["v"], v), tp


def test_subject_placers_with_an_offset_are_exactly_that_range():
    """A placer that declares ``offset`` is exported as a ``RangeSlot`` (no positions built): the range must be
    the positions it would have built, for every sub-range a row may ask for."""
    w2, bias = torch.randn(6, 4), torch.randn(5)
    placers = [
        placement.replicated(w2),
        placement.column(w2, tp=2, r=1, hf_rows=12),
        placement.column(w2, tp=2, r=1, hf_rows=9),  # vocab padding dropped
        placement.stacked_down(bias, expert=3, tp=1, r=0, hf_shape=(4, 5)),
    ]
    for p in placers:
        assert p.offset is not None
        for a, b in [(0, p.n), (1, p.n - 1), (2, 2)]:
            assert torch.equal(p.positions(a, b), torch.arange(a + p.offset, b + p.offset))
    assert placement.row(w2, tp=2, r=1).offset is None  # strided: positions are built


def test_subject_placers_sub_ranges_are_slices_of_the_whole():
    """Rows cut a large shard into ranges: every placer's positions and values over ``[a, b)`` are exactly that
    slice of its whole-shard ones, ranges that start or end inside a head or a row included."""
    w_qkv = torch.randn(2 * (4 + 2) * 3, 5)  # G=2 local groups, H=2 q heads per group + k + v, D=3, I=5
    placers = [
        placement.row(torch.randn(6, 4), tp=2, r=1),
        *placement.qkv(w_qkv, heads=8, groups=4, head_dim=3, tp=2, r=1),
        *placement.qkv(torch.randn(2 * (2 * 2 + 2) * 3, 5), heads=8, groups=4, head_dim=3, tp=2, r=0, output_gate=True),
        placement.row_map(torch.randn(4, 3, 2), local_rows=torch.tensor([2, 0, 3]), hf_rows=torch.tensor([7, 1, 4])),
    ]
    for p in placers:
        pos, val = p.full()
        assert pos.numel() == val.numel() == p.n
        for a, b in [(0, p.n), (1, p.n - 1), (7, 7), (p.n // 3, 2 * p.n // 3 + 1)]:
            assert torch.equal(p.positions(a, b), pos[a:b]) and torch.equal(p.values(a, b), val[a:b])


def test_subject_placers_runs_are_their_positions():
    """A placer that declares ``runs`` is exported as a ``RunSlot``: expanded, its runs must be exactly the
    positions it would have built, for every sub-range (cut inside a block at either end included)."""
    placers = [
        placement.row(torch.randn(6, 4), tp=2, r=1),
        *placement.qkv(torch.randn(2 * (4 + 2) * 3, 5), heads=8, groups=4, head_dim=3, tp=2, r=1),
        *placement.qkv(torch.randn(2 * (2 * 2 + 2) * 3, 5), heads=8, groups=4, head_dim=3, tp=2, r=0, output_gate=True),
        placement.row_map(torch.randn(4, 3, 2), local_rows=torch.tensor([2, 0, 3]), hf_rows=torch.tensor([7, 1, 4])),
    ]
    for p in placers:
        assert p.runs is not None
        for a, b in [(0, p.n), (1, p.n - 1), (7, 7), (p.n // 3, 2 * p.n // 3 + 1), (5, 6)]:
            starts, lengths = p.runs(a, b)
            assert a == b or int(lengths.min()) >= 1  # no empty runs
            expanded = torch.cat(
                [torch.arange(s, s + n) for s, n in zip(starts.tolist(), lengths.tolist(), strict=True)]
                or [torch.zeros(0, dtype=torch.int64)]
            )
            assert torch.equal(expanded, p.positions(a, b))
