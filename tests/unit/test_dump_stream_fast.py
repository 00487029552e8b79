"""The fast paths of the streaming diff from disk: id checks (range by one max, duplicates by column compares),
rows adopted without a copy, B's rows vouched for by A's equal rows, positioned reads, a layer held by one rank
compared in that rank's order. Each is checked against an independent reference (Python sets, plain indexing,
the general merge) and for its edge cases: K = 1, K = 22 of 512 experts (int16), empty layers, a duplicate in
the last row, an id equal to the expert count."""

import json
import re

import pytest
import torch

from moeverify import record
from moeverify.errors import DumpError, RouteError
from moeverify.record.layer_read import gather_rows, sequence_order
from moeverify.record.stream import DumpSource, LayerPairs
from moeverify.routing.route_ids import _duplicate_rows, validate_topk_ids
from moeverify.routing.routes import Routes
from moeverify.routing.views import RankCoords, token_index
from moeverify.spec.layout import Layout


def _distinct(tokens, *, experts, topk, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(tokens, experts, generator=gen).topk(topk, dim=1).indices


def _reference_dups(ids_TK):
    return torch.tensor([len(set(row)) < len(row) for row in ids_TK.tolist()], dtype=torch.bool)


@pytest.mark.parametrize("tokens", [0, 1, 7, 1023, 1024, 3000])
@pytest.mark.parametrize(
    "experts,topk,dtype",
    [
        (128, 8, torch.uint8),
        (256, 8, torch.uint8),
        (512, 22, torch.int16),
        (16, 1, torch.uint8),
        (300, 6, torch.int16),
        (64, 3, torch.int64),
    ],
)
def test_duplicate_rows_matches_python_sets(tokens, experts, topk, dtype):
    ids = _distinct(tokens, experts=experts, topk=topk).to(dtype)
    if tokens and topk > 1:
        ids[tokens - 1, topk - 1] = ids[tokens - 1, 0]  # the last row, last column
        ids[tokens // 2, 1] = ids[tokens // 2, 0]
    assert torch.equal(_duplicate_rows(ids), _reference_dups(ids))


def test_validate_names_a_duplicate_in_the_last_row_of_a_column_compared_tensor():
    ids = _distinct(2048, experts=512, topk=22).to(torch.int16)
    ids[2047, 21] = ids[2047, 3]
    with pytest.raises(
        RouteError,
        match=r"layer 4 mb 1: token 2047 routes to expert\(s\) twice: .* \(1 such "
        r"row\(s\)\)",
    ):
        validate_topk_ids(ids, layer=4, microbatch=1, num_experts=512, topk=22)


@pytest.mark.parametrize("dtype,experts", [(torch.uint8, 128), (torch.uint8, 255), (torch.int16, 512)])
def test_validate_refuses_an_id_equal_to_the_expert_count(dtype, experts):
    ids = _distinct(1500, experts=experts, topk=4).to(dtype)
    ids[1499, 2] = experts
    with pytest.raises(RouteError, match=rf"expert id {experts} out of range \[0, {experts}\) \(token 1499\)"):
        validate_topk_ids(ids, layer=0, microbatch=0, num_experts=experts, topk=4)
    validate_topk_ids(ids, layer=0, microbatch=0, num_experts=experts + 1, topk=4)  # in range one expert later


def test_validate_names_a_negative_id_before_a_too_large_one():
    ids = _distinct(10, experts=512, topk=4).to(torch.int16)
    ids[3, 0], ids[5, 1] = -2, 600
    with pytest.raises(RouteError, match=r"expert id -2 out of range \[0, 512\) \(token 3\)"):
        validate_topk_ids(ids, layer=0, microbatch=0, num_experts=512, topk=4)


def test_adopt_keeps_the_tensors_and_validates_them():
    ids = _distinct(64, experts=16, topk=4).to(torch.uint8)
    routes = Routes.adopt({2: [ids]}, num_experts=16, topk=4)
    assert routes.get(2, 0).data_ptr() == ids.data_ptr() and routes.validated
    bad = ids.clone()
    bad[63, 3] = bad[63, 0]
    with pytest.raises(RouteError, match=r"layer 2 mb 0: token 63 routes to expert\(s\) twice"):
        Routes.adopt({2: [bad]}, num_experts=16, topk=4)


def _full_check_message(ids, **where):
    with pytest.raises(RouteError) as info:
        validate_topk_ids(ids, **where)
    return str(info.value)


@pytest.mark.parametrize("experts,topk,dtype", [(128, 8, torch.uint8), (512, 22, torch.int16), (16, 1, torch.uint8)])
def test_like_checks_only_other_rows_and_reports_as_the_whole_check(experts, topk, dtype):
    a = Routes({0: [_distinct(2000, experts=experts, topk=topk).to(dtype)]}, num_experts=experts, topk=topk)
    b = a.get(0, 0).clone()
    b[5] = _distinct(1, experts=experts, topk=topk, seed=3).to(dtype)[0]  # a valid row that differs
    assert torch.equal(Routes.adopt({0: [b]}, num_experts=experts, topk=topk, like=a).get(0, 0), b)
    if topk > 1:
        dup = b.clone()
        dup[1999, topk - 1] = dup[1999, 0]
        dup[7, 1] = dup[7, 0]
        want = _full_check_message(dup, layer=0, microbatch=0, num_experts=experts, topk=topk)
        assert "token 7 routes to expert(s) twice" in want and "(2 such row(s))" in want
        with pytest.raises(RouteError, match=re.escape(want)):
            Routes.adopt({0: [dup]}, num_experts=experts, topk=topk, like=a)
    wide = b.clone()
    wide[1999, 0] = experts
    with pytest.raises(RouteError, match=rf"expert id {experts} out of range \[0, {experts}\) \(token 1999\)"):
        Routes.adopt({0: [wide]}, num_experts=experts, topk=topk, like=a)


def test_like_written_into_after_its_check_vouches_for_nothing():
    a = Routes({0: [_distinct(50, experts=16, topk=4).to(torch.uint8)]}, num_experts=16, topk=4)
    a.get(0, 0)[9, 1] = a.get(0, 0)[9, 0]  # in place: torch's counter moves
    with pytest.raises(RouteError, match=r"token 9 routes to expert\(s\) twice"):
        Routes.adopt({0: [a.get(0, 0).clone()]}, num_experts=16, topk=4, like=a)


@pytest.mark.parametrize("change", ["dtype", "shape", "experts", "unchecked"])
def test_like_that_does_not_match_is_not_used(change):
    ids = _distinct(40, experts=16, topk=4)
    like = {
        "dtype": Routes({0: [ids.to(torch.int64)]}, num_experts=16, topk=4),
        "shape": Routes({0: [ids[:39].to(torch.uint8)]}, num_experts=16, topk=4),
        "experts": Routes({0: [ids.to(torch.uint8)]}, num_experts=17, topk=4),
        "unchecked": Routes.unchecked({0: [ids.to(torch.uint8)]}, num_experts=16, topk=4),
    }[change]
    bad = ids.to(torch.uint8)
    bad[0, 1] = bad[0, 0]
    if change != "dtype":
        like.get(0, 0)[0] = bad[0] if change != "shape" else like.get(0, 0)[0]
    with pytest.raises(RouteError, match=r"token 0 routes to expert\(s\) twice"):
        Routes.adopt({0: [bad]}, num_experts=16, topk=4, like=like)


@pytest.mark.parametrize(
    "topk,dtype", [(8, torch.uint8), (3, torch.uint8), (22, torch.int16), (1, torch.uint8), (2, torch.int32)]
)
def test_gather_rows_moves_whole_rows(topk, dtype):
    ids = _distinct(33, experts=64, topk=topk).to(dtype)
    order = torch.randperm(33, generator=torch.Generator().manual_seed(2))
    assert torch.equal(gather_rows(ids, order), ids[order])
    assert gather_rows(ids[:0], order[:0]).shape == (0, topk)


@pytest.mark.parametrize("seq_len,batch", [(6, 4), (5, 1), (1, 3)])
def test_sequence_order_is_token_index_and_its_inverse(seq_len, batch):
    layout = Layout()
    coords = RankCoords(rank=0, tp=0, pp=0, cp=0, dp=0, ep=0)
    order = sequence_order(layout, coords, seq_len=seq_len, batch=batch, tokens=seq_len * batch, zigzag=True)
    token_T = token_index(layout, tp_rank=0, cp_rank=0, seq_len=seq_len, batch=batch)
    if batch == 1 or seq_len == 1:
        assert order == (None, None)
        return
    gather_T, tokens_T = order
    assert torch.equal(tokens_T, token_T) and torch.equal(tokens_T[gather_T], torch.arange(seq_len * batch))
    assert (
        sequence_order(layout, coords, seq_len=seq_len, batch=batch, tokens=seq_len * batch + 1, zigzag=True) is None
    )  # not a permutation of the tokens: the general merge decides


def _save_pair(
    tmp_path, *, tokens=24, seq_len=6, batch=4, layers=(0, 2, 3), experts=16, topk=4, microbatches=2, seed=0
):
    gen = torch.Generator().manual_seed(seed)
    a = Routes(
        {
            layer: [torch.rand(tokens, experts, generator=gen).topk(topk, dim=1).indices for _ in range(microbatches)]
            for layer in layers
        },
        num_experts=experts,
        topk=topk,
    )
    data = {}
    for layer in layers:
        data[layer] = []
        for mb in range(microbatches):
            rows = a.get(layer, mb).clone()
            rows[3] = rows[3].flip(0)
            rows[5, 0] = next(e for e in range(experts) if e not in rows[5].tolist())
            data[layer].append(rows)
    b = Routes(data, num_experts=experts, topk=topk)
    record.save(tmp_path / "a", a, order="router", seq_len=seq_len, batch=batch)
    record.save(tmp_path / "b", b, order="router", seq_len=seq_len, batch=batch)
    return a, b


def test_layer_rows_are_the_layer_in_the_ranks_order_with_their_tokens(tmp_path):
    _save_pair(tmp_path)
    dump = record.load(tmp_path / "a")
    for layer in (0, 2, 3):
        rows, tokens = dump.layer_rows(step=0, layer=layer)
        merged = dump.layer_routes(step=0, layer=layer)
        assert rows.order == "router" and merged.order == "sequence"
        for mb in range(2):
            placed = torch.empty_like(merged.get(layer, mb))
            placed[tokens[mb]] = rows.get(layer, mb)
            assert torch.equal(placed, merged.get(layer, mb))


@pytest.mark.parametrize("experts,topk,batch", [(16, 4, 4), (512, 22, 4), (16, 1, 4), (128, 8, 1)])
def test_stream_of_one_rank_dumps_gives_the_in_memory_record(tmp_path, experts, topk, batch):
    _save_pair(tmp_path, experts=experts, topk=topk, batch=batch, tokens=6 * batch)
    da, db = record.load(tmp_path / "a"), record.load(tmp_path / "b")
    geometry = {"seq_len": 6, "batch": batch}
    streamed = record.diff_stream(DumpSource(da), DumpSource(db), **geometry).to_json(worst=50)
    full = record.diff(da.routes(), db.routes(), **geometry).to_json(worst=50)
    assert json.dumps(streamed, sort_keys=True) == json.dumps(full, sort_keys=True)


def test_pairs_of_dumps_in_different_orders_are_compared_in_global_order(tmp_path):
    _save_pair(tmp_path)
    record.save(tmp_path / "b12", record.load(tmp_path / "b").routes(), order="sequence", seq_len=12, batch=2)
    da, db = record.load(tmp_path / "a"), record.load(tmp_path / "b12")  # 24 tokens each, rows in other orders
    mbs_a, mbs_b, tokens = LayerPairs(DumpSource(da), DumpSource(db))(2)
    assert tokens == [None, None]
    assert len(mbs_a) == len(mbs_b) == 2
    assert [mb for mb, x in enumerate(mbs_a) if not torch.equal(x, da.layer_routes(step=0, layer=2).get(2, mb))] == []
    assert [mb for mb, y in enumerate(mbs_b) if not torch.equal(y, db.layer_routes(step=0, layer=2).get(2, mb))] == []


def _rewrite_row(path, *, layer_index, row, values):
    """Overwrite one row of layer ``layer_index`` of mb 0 in the one rank file, in place (same size)."""
    from moeverify.record.layer_read import data_spans

    file = path / "rank00000.safetensors"
    begin, end = data_spans(file)["step0/mb0/ids"]
    layer_bytes = (end - begin) // 3
    row_bytes = len(values)
    with open(file, "r+b") as f:
        f.seek(begin + layer_index * layer_bytes + row * row_bytes)
        f.write(bytes(values))


@pytest.mark.parametrize(
    "what,values,match",
    [("duplicate", None, r"routes to expert\(s\) twice"), ("range", None, r"expert id 16 out of range \[0, 16\)")],
)
def test_a_bad_row_of_b_is_refused_as_reading_b_alone_refuses_it(tmp_path, what, values, match):
    _save_pair(tmp_path)
    row = 23  # the last row of the rank's own order
    db = record.load(tmp_path / "b")
    good = db.layer_rows(step=0, layer=3)[0].get(3, 0)[row].tolist()
    values = [good[0], good[0], good[2], good[3]] if what == "duplicate" else [16, good[1], good[2], good[3]]
    _rewrite_row(tmp_path / "b", layer_index=2, row=row, values=values)
    db = record.load(tmp_path / "b")
    with pytest.raises(DumpError) as alone:
        db.layer_routes(step=0, layer=3)
    assert "rank00000.safetensors: step 0: layer 3 rank 0 mb 0: " in str(alone.value)
    with pytest.raises(DumpError, match=match) as streamed:
        record.diff_stream(DumpSource(record.load(tmp_path / "a")), DumpSource(db), seq_len=6, batch=4)
    assert str(streamed.value) == str(alone.value)


def test_a_file_truncated_after_load_is_refused_naming_file_and_tensor(tmp_path):
    _save_pair(tmp_path)
    dump = record.load(tmp_path / "a")
    file = tmp_path / "a" / "rank00000.safetensors"
    file.write_bytes(file.read_bytes()[:-200])
    with pytest.raises(
        DumpError,
        match=r"rank00000.safetensors: tensor step0/mb1/ids\[layer 3\]: unreadable: the "
        r"file ends \d+ byte\(s\) short of the tensor \(truncated since it was loaded\)",
    ):
        dump.layer_routes(step=0, layer=3)


def test_an_empty_layer_streams(tmp_path):
    empty = Routes({1: [torch.zeros(0, 4, dtype=torch.int64)]}, num_experts=16, topk=4)
    record.save(tmp_path / "a", empty)
    record.save(tmp_path / "b", empty)
    da, db = record.load(tmp_path / "a"), record.load(tmp_path / "b")
    rows, tokens = db.layer_rows(step=0, layer=1, like=da.layer_routes(step=0, layer=1))
    assert rows.get(1, 0).shape == (0, 4) and tokens == [None]
    assert record.diff_stream(DumpSource(da), DumpSource(db)).tokens == 0
