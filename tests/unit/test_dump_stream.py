"""Per-router and per-sequence figures of a diff, and the streaming engine (one layer at a time) against the
in-memory one, on dumps on disk; checked against plain Python loops over tokens and layers."""

import json

import pytest
import torch

from moeverify import record
from moeverify.cli import main
from moeverify.errors import RouteError
from moeverify.record.diff import sequence_spans
from moeverify.record.stream import DumpSource, RoutesSource
from moeverify.routing.routes import Routes


def _random(tokens, layers, *, experts=16, topk=4, microbatches=1, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return Routes(
        {
            layer: [torch.rand(tokens, experts, generator=gen).topk(topk, dim=1).indices for _ in range(microbatches)]
            for layer in layers
        },
        num_experts=experts,
        topk=topk,
    )


def _perturbed(a, *, fraction, seed=1):
    """B: a share of rows with one expert swapped for an unused one, another share only reordered."""
    gen = torch.Generator().manual_seed(seed)
    data = {}
    for layer in a.layers:
        data[layer] = []
        for mb in range(a.microbatches):
            rows = a.get(layer, mb).clone()
            pick = torch.rand(rows.shape[0], generator=gen)
            for t in (pick < fraction).nonzero().flatten().tolist():
                rows[t, 0] = next(e for e in range(a.num_experts) if e not in rows[t].tolist())
            reorder = (pick > 1 - fraction).nonzero().flatten()
            rows[reorder] = rows[reorder].flip(1)
            data[layer].append(rows)
    return Routes(data, num_experts=a.num_experts, topk=a.topk)


def _reference(a, b):
    """Per token (over micro-batches in order): the layer indices whose sets differ."""
    out = []
    for mb in range(a.microbatches):
        rows = [(a.get(layer, mb).tolist(), b.get(layer, mb).tolist()) for layer in a.layers]
        for t in range(len(rows[0][0])):
            out.append([i for i, (ra, rb) in enumerate(rows) if set(ra[t]) != set(rb[t])])
    return out


def test_routers_differing_per_token_and_share_match_a_token_by_token_count():
    a = _random(200, (1, 3, 4, 7), microbatches=2)
    b = _perturbed(a, fraction=0.2)
    ref = _reference(a, b)
    report = record.diff(a, b)
    n, width = len(ref), len(a.layers)
    differing = sum(len(r) for r in ref)
    assert 0 < differing < n * width
    assert report.routers_differing == differing
    assert report.routers_differing_per_token == pytest.approx(differing / n)
    assert report.routers_differing_share == pytest.approx(differing / (n * width))
    hist = {}
    for r in ref:
        hist[len(r)] = hist.get(len(r), 0) + 1
    assert report.tokens_by_routers_differing() == hist
    result = report.to_json()
    assert result["routers_per_token"] == width
    assert result["routers_differing_per_token"] == pytest.approx(differing / n)
    assert result["routers_differing_share"] == pytest.approx(1 - result["agreement_all_layers"])
    assert result["routers_differing_per_diverging_token"] == pytest.approx(differing / sum(1 for r in ref if r))
    assert result["tokens_by_routers_differing"] == {str(k): v for k, v in hist.items()}
    assert result["sequences"] is None and result["sequences_diverging"] is None


def test_per_sequence_figures_match_a_sequence_by_sequence_count():
    seq_len, batch = 10, 4
    a = _random(seq_len * batch, (0, 2, 5), microbatches=3, seed=2)
    b = _perturbed(a, fraction=0.08, seed=3)
    ref = _reference(a, b)
    report = record.diff(a, b, seq_len=seq_len, batch=batch)
    sequences = report.sequences()
    assert len(sequences) == 3 * batch
    for s, rec in enumerate(sequences):
        rows = ref[s * seq_len : (s + 1) * seq_len]
        diverging = [r for r in rows if r]
        assert (rec["sequence"], rec["microbatch"], rec["sequence_in_microbatch"]) == (s, s // batch, s % batch)
        assert rec["tokens"] == seq_len
        assert rec["tokens_diverging"] == len(diverging)
        assert rec["tokens_diverging_any_layer"] == pytest.approx(len(diverging) / seq_len)
        assert rec["routers_differing_per_token"] == pytest.approx(sum(len(r) for r in rows) / seq_len)
        first = min((r[0] for r in diverging), default=None)
        assert rec["first_divergent_layer"] == (None if first is None else a.layers[first])
    assert any(r["tokens_diverging"] for r in sequences) and not all(r["tokens_diverging"] for r in sequences)
    result = report.to_json()
    assert result["sequences"] == sequences
    assert result["sequences_diverging"] == sum(1 for r in sequences if r["tokens_diverging"])


def test_uneven_sequences_and_a_sequence_without_tokens():
    a = _random(9, (0, 1), experts=8, topk=2)
    b = a.replace(1, 0, torch.cat([a.get(1, 0)[:7], a.get(1, 0)[7:].flip(0)]))  # tokens 7, 8 swapped in layer 1
    report = record.diff(a, b, sequence_tokens=[[3, 0, 6]], sequence_extra=[{"request": r} for r in range(3)])
    seqs = report.sequences()
    assert [s["tokens"] for s in seqs] == [3, 0, 6]
    assert seqs[1]["tokens_diverging_any_layer"] is None and seqs[1]["routers_differing_per_token"] is None
    assert seqs[1]["first_divergent_layer"] is None and seqs[1]["request"] == 1
    differing = sum(1 for t in (7, 8) if set(a.get(1, 0)[t].tolist()) != set(b.get(1, 0)[t].tolist()))
    assert seqs[2]["tokens_diverging"] == differing > 0 and seqs[2]["first_divergent_layer"] == 1


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"seq_len": 5, "batch": 2}, r"micro-batch 0: sequences of \[5, 5\] token\(s\) \(sum 10\) != the 9 tokens"),
        ({"sequence_tokens": [[4, 4]]}, r"sum 8\) != the 9 tokens"),
        ({"sequence_tokens": [[9], [0]]}, r"sequences given for 2 micro-batch\(es\), the routes hold 1"),
        ({"seq_len": 9}, r"seq_len and batch go together"),
        ({"seq_len": 9, "batch": 1, "sequence_tokens": [[9]]}, r"not both"),
        ({"sequence_tokens": [[10, -1]]}, r"sequences of \[10, -1\] token\(s\) \(sum 9\) != the 9 tokens"),
    ],
)
def test_sequences_that_do_not_cover_the_tokens_are_refused(kwargs, match):
    a = _random(9, (0,), experts=8, topk=2)
    with pytest.raises(RouteError, match=match):
        record.diff(a, a, **kwargs)
    with pytest.raises(RouteError, match=match):
        sequence_spans([9], **kwargs)


def test_sequence_extra_must_match_the_sequences():
    a = _random(9, (0,), experts=8, topk=2)
    with pytest.raises(RouteError, match=r"sequence_extra holds 1 record\(s\) for 3 sequence\(s\)"):
        record.diff(a, a, seq_len=3, batch=3, sequence_extra=[{}])


def _pair(
    tmp_path, *, tokens=24, seq_len=6, batch=4, layers=(0, 1, 3, 6), experts=16, topk=4, microbatches=3, fraction=0.15
):
    a = _random(tokens, layers, experts=experts, topk=topk, microbatches=microbatches, seed=4)
    b = _perturbed(a, fraction=fraction, seed=5)
    record.save(tmp_path / "a", a, order="router", seq_len=seq_len, batch=batch)
    record.save(tmp_path / "b", b, order="router", seq_len=seq_len, batch=batch)
    return a, b


def test_stream_gives_the_in_memory_report_reading_one_layer_at_a_time(tmp_path, monkeypatch):
    _pair(tmp_path)
    da, db = record.load(tmp_path / "a"), record.load(tmp_path / "b")
    full = record.diff(da.routes(), db.routes(), seq_len=6, batch=4)
    reads = []
    original = type(da).layer_rows  # what the stream reads a layer with (layer_routes without moving its rows)

    def counted(self, *, step=0, layer, **kwargs):  # B's read passes like= (A's layer vouches for equal rows)
        reads.append((self.path.name, layer))
        return original(self, step=step, layer=layer, **kwargs)

    monkeypatch.setattr(type(da), "layer_rows", counted)
    monkeypatch.setattr(type(da), "routes", lambda self, step=0: pytest.fail("the stream read a whole dump"))
    streamed = record.diff_stream(DumpSource(da), DumpSource(db), seq_len=6, batch=4)
    assert reads == [(side, layer) for layer in (0, 1, 3, 6) for side in ("a", "b")]
    assert streamed.exact_NL is None and streamed.overlap_NL is None
    assert streamed.to_json(worst=50) == full.to_json(worst=50)
    assert 0 < streamed.tokens_diverging_any_layer < 1
    assert torch.allclose(streamed.bucket_disagreement(64), full.bucket_disagreement(64))
    with pytest.raises(ValueError, match="holds 64 token buckets per layer, not 10"):
        streamed.bucket_disagreement(10)


@pytest.mark.parametrize("experts,topk", [(8, 2), (128, 8), (300, 6), (64, 63), (512, 22)])
def test_stream_and_in_memory_agree_for_every_id_width(experts, topk):
    a = _random(64, (0, 2), experts=experts, topk=topk, microbatches=2, seed=6)
    b = _perturbed(a, fraction=0.2, seed=7)
    full = record.diff(a, b)
    streamed = record.diff_stream(RoutesSource(a), RoutesSource(b))
    assert streamed.to_json(worst=200) == full.to_json(worst=200)
    assert torch.equal(streamed.differing_N, full.differing_N) and torch.equal(streamed.first_N, full.first_N)


def test_stream_refuses_sides_that_do_not_line_up(tmp_path):
    a = _random(12, (0, 1), experts=8, topk=2)
    with pytest.raises(RouteError, match=r"tokens per micro-batch: A \[12\], B \[13\]"):
        record.diff_stream(RoutesSource(a), RoutesSource(_random(13, (0, 1), experts=8, topk=2)))
    with pytest.raises(RouteError, match=r"cannot diff: layers: A \[0, 1\], B \[0, 2\]"):
        record.diff_stream(RoutesSource(a), RoutesSource(_random(12, (0, 2), experts=8, topk=2)))


def test_512_experts_top22_round_trip_through_save_load_and_diff(tmp_path):
    """More than 256 experts: int16 ids on disk, the largest id intact, diffs agree with a set reference."""
    a = _random(40, (0, 3), experts=512, topk=22, microbatches=2, seed=8)
    a = a.replace(3, 1, torch.cat([torch.arange(511, 511 - 22, -1)[None], a.get(3, 1)[1:]]))  # ids up to 511
    b = _perturbed(a, fraction=0.25, seed=9)
    record.save(tmp_path / "a", a, order="router", seq_len=20, batch=2)
    record.save(tmp_path / "b", b, order="router", seq_len=20, batch=2)
    da, db = record.load(tmp_path / "a"), record.load(tmp_path / "b")
    assert da.manifest["ids_dtype"] == "int16"
    assert da.local_routes(step=0) == a
    assert int(da.local_routes(step=0).get(3, 1).max()) == 511
    ref = _reference(da.routes(), db.routes())
    for report in (record.diff(da.routes(), db.routes()), record.diff_stream(DumpSource(da), DumpSource(db))):
        assert report.num_experts == 512 and report.topk == 22
        assert report.routers_differing == sum(len(r) for r in ref) > 0
        assert report.tokens_diverging_any_layer == pytest.approx(sum(1 for r in ref if r) / len(ref))
    assert main(["dump", "diff", str(tmp_path / "a"), str(tmp_path / "a"), "--fail-on-diff"]) == 0
    assert main(["dump", "diff", str(tmp_path / "a"), str(tmp_path / "b"), "--fail-on-diff"]) == 1


def test_cli_diff_streams_by_default_and_in_memory_on_request_with_the_same_record(tmp_path, capsys):
    _pair(tmp_path)
    stream_json, memory_json = tmp_path / "s.json", tmp_path / "m.json"
    assert (
        main(
            [
                "dump",
                "diff",
                str(tmp_path / "a"),
                str(tmp_path / "b"),
                "--json",
                str(stream_json),
                "--plot",
                str(tmp_path / "s.png"),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "routers differ per token" in out and "per sequence:" in out
    assert (
        main(["dump", "diff", str(tmp_path / "a"), str(tmp_path / "b"), "--json", str(memory_json), "--in-memory"]) == 0
    )
    streamed, in_memory = json.loads(stream_json.read_text()), json.loads(memory_json.read_text())
    assert (streamed.pop("engine"), in_memory.pop("engine")) == ("stream", "in-memory")
    assert streamed == in_memory
    assert streamed["expert_maps"] is None
    assert len(streamed["sequences"]) == 3 * 4 and streamed["sequences"][0]["tokens"] == 6
    assert (tmp_path / "s.png").stat().st_size > 1000


def test_cli_diff_refuses_sides_cut_into_different_sequences(tmp_path, capsys):
    a = _random(24, (0, 1), experts=8, topk=2)
    record.save(tmp_path / "a", a, order="router", seq_len=12, batch=2)
    # the same 24 ids, other sequences: not the same tokens
    record.save(tmp_path / "b", a, order="router", seq_len=6, batch=4)
    assert main(["dump", "diff", str(tmp_path / "a"), str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err
    assert "into sequences of seq_len [12] x batch 2" in err and "seq_len [6] x batch 4" in err


RELEASE = [
    ("tp2-sp", dict(tp=2, sp=True), 2),
    ("pp2-vpp2", dict(pp=2, vpp=2), 2),
    ("cp2", dict(cp=2), 2),
    ("tp2-pp2-ep2-sp", dict(tp=2, pp=2, ep=2, sp=True), 8),
    ("dp2", {}, 2),
]


@pytest.mark.parametrize("name,layout,world", RELEASE, ids=[r[0] for r in RELEASE])
def test_layer_routes_merge_one_layer_as_routes_merges_all(tmp_path, name, layout, world):
    from test_dump_merge import BATCH, SEQ_LEN, _global_routes, write_rank_dumps

    from moeverify.spec.layout import Layout

    layout = Layout(**layout)
    global_routes = _global_routes(layout.dp(world) * BATCH * SEQ_LEN)
    write_rank_dumps(tmp_path / "d", global_routes, layout, world)
    dump = record.load(tmp_path / "d")
    assert dump.microbatch_tokens(step=0) == [layout.dp(world) * BATCH * SEQ_LEN] * 2
    for layer in global_routes.layers:
        one = dump.layer_routes(step=0, layer=layer)
        assert one.layers == (layer,)
        assert [mb for mb in range(2) if not torch.equal(one.get(layer, mb), global_routes.get(layer, mb))] == []
    other = _perturbed(global_routes, fraction=0.1, seed=11)
    write_rank_dumps(tmp_path / "o", other, layout, world)
    streamed = record.diff_stream(DumpSource(dump), DumpSource(record.load(tmp_path / "o")))
    assert streamed.to_json() == record.diff(global_routes, other).to_json()


def test_rollout_against_a_dp2_dump_counts_every_data_parallel_sequence(tmp_path, capsys):
    """A merged DP micro-batch holds dp * batch sequences; the rollout has one request for each of them."""
    import numpy as np
    from test_dump_merge import BATCH, SEQ_LEN, _global_routes, write_rank_dumps

    from moeverify.spec.layout import Layout

    global_routes = _global_routes(2 * BATCH * SEQ_LEN)
    write_rank_dumps(tmp_path / "d", global_routes, Layout(), 2)
    requests = []
    for mb in range(2):
        stacked = global_routes.stacked(mb).numpy()
        requests.extend(stacked[s * SEQ_LEN : (s + 1) * SEQ_LEN - 1] for s in range(2 * BATCH))
    row = requests[3][2, 1].copy()  # request 3 = DP rank 1's second sequence of micro-batch 0
    requests[3][2, 1] = [e for e in range(16) if e not in row][: len(row)]
    np.savez(tmp_path / "r.npz", **{f"r{i}": a for i, a in enumerate(requests)})
    out = tmp_path / "r.json"
    assert main(["dump", "diff", str(tmp_path / "d"), str(tmp_path / "r.npz"), "--rollout", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["rollout"]["requests"] == 8 and result["tokens"] == 8 * (SEQ_LEN - 1)
    assert [s["request"] for s in result["sequences"] if s["tokens_diverging"]] == [3]
    assert result["sequences"][3]["first_divergent_layer"] == global_routes.layers[1]
    np.savez(tmp_path / "half.npz", **{f"r{i}": a for i, a in enumerate(requests[:4])})
    capsys.readouterr()
    assert main(["dump", "diff", str(tmp_path / "d"), str(tmp_path / "half.npz"), "--rollout"]) == 2
    assert "4 rollout request(s) != the training step's 8 sequences" in capsys.readouterr().err


class _Short(RoutesSource):
    """A source whose layer 1 holds fewer tokens than its metadata says (a reader bug the diff must catch)."""

    def layer(self, layer):
        mbs = super().layer(layer)
        return [t[:-1] for t in mbs] if layer == 1 else mbs


def test_stream_refuses_a_layer_whose_token_count_is_not_the_announced_one():
    a = _random(12, (0, 1), experts=8, topk=2)
    with pytest.raises(RouteError, match=r"cannot diff: B layer 1: tokens per micro-batch \[11\] != \[12\]"):
        record.diff_stream(RoutesSource(a), _Short(a))


def test_layer_routes_refuses_a_layer_that_is_not_an_moe_layer(tmp_path):
    from moeverify.errors import DumpError

    record.save(tmp_path / "d", _random(6, (0, 2), experts=8, topk=2), seq_len=6, batch=1)
    with pytest.raises(DumpError, match=r"layer 1 is not an MoE layer of the dump \[0, 2\]"):
        record.load(tmp_path / "d").layer_routes(step=0, layer=1)
