"""``Routes``: validation of every bad route, rollout import, layer selection, views delegation.

Legend: T = tokens, L = MoE layers, K = top-k, E = experts.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from moeverify.errors import RouteError
from moeverify.layout import Layout
from moeverify.routes import Routes, safe_routes, validate_topk_ids

E, K = 8, 2


def ids(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.int64)


def test_validate_topk_ids_wrong_shape_raises():
    with pytest.raises(RouteError, match=r"layer 3 rank 1 mb 2: route shape \(4, 3\) != expected \(T=4, K=2\)"):
        validate_topk_ids(torch.zeros(4, 3, dtype=torch.int64), layer=3, microbatch=2, num_experts=E, topk=K,
                          tokens=4, rank=1)


def test_validate_topk_ids_float_dtype_raises():
    with pytest.raises(RouteError, match="layer 0 rank 0 mb 0: route dtype torch.float32 is not an integer"):
        validate_topk_ids(torch.zeros(4, 2), layer=0, microbatch=0, num_experts=E, topk=K, rank=0)


@pytest.mark.parametrize("bad", [-1, E])
def test_validate_topk_ids_out_of_range_raises(bad):
    with pytest.raises(RouteError, match=rf"layer 1 rank 0 mb 0: expert id {bad} out of range \[0, {E}\)"):
        validate_topk_ids(ids([[0, 1], [2, bad]]), layer=1, microbatch=0, num_experts=E, topk=K, rank=0)


def test_validate_topk_ids_duplicate_expert_raises():
    with pytest.raises(RouteError, match=r"layer 1 rank 0 mb 0: token 1 routes to expert\(s\) twice: \[5, 5\]"):
        validate_topk_ids(ids([[0, 1], [5, 5]]), layer=1, microbatch=0, num_experts=E, topk=K, rank=0)


@pytest.mark.parametrize("tokens", [100, 2_000])  # below and above the size where columns are compared
@pytest.mark.parametrize("dtype", [torch.uint8, torch.int16, torch.int64])
def test_validate_topk_ids_duplicates_found_alike_on_small_and_large_tensors(tokens, dtype):
    gen = torch.Generator().manual_seed(tokens)
    good = torch.rand(tokens, 128, generator=gen).topk(8, dim=1).indices.to(dtype)
    validate_topk_ids(good, layer=0, microbatch=0, num_experts=128, topk=8, rank=0)
    bad = good.clone()
    for row, (i, j) in ((tokens - 1, (7, 0)), (tokens // 2, (3, 4)), (tokens // 3, (1, 6))):
        bad[row, i] = bad[row, j]
    with pytest.raises(RouteError, match=rf"token {tokens // 3} routes to expert\(s\) twice: .* \(3 such row\(s\)\)"):
        validate_topk_ids(bad, layer=0, microbatch=0, num_experts=128, topk=8, rank=0)


def test_routes_microbatch_count_differs_raises():
    with pytest.raises(RouteError, match=r"micro-batch count differs between layers: \{0: 1, 1: 2\}"):
        Routes({0: [ids([[0, 1]])], 1: [ids([[0, 1]]), ids([[2, 3]])]}, num_experts=E, topk=K)


def test_routes_select_keeps_only_named_layers():
    routes = Routes({0: [ids([[0, 1]])], 2: [ids([[2, 3]])], 5: [ids([[4, 5]])]}, num_experts=E, topk=K)
    picked = routes.select((2, 5))
    assert picked.layers == (2, 5) and torch.equal(picked.get(5, 0), ids([[4, 5]]))


def test_routes_select_missing_layer_raises():
    routes = Routes({0: [ids([[0, 1]])]}, num_experts=E, topk=K)
    with pytest.raises(RouteError, match=r"select: layer\(s\) \[3\] not held; layers held: \[0\]"):
        routes.select((0, 3))


def test_safe_routes_distinct_and_spread_over_experts():
    safe_TK = safe_routes(12, topk=3, num_experts=E)
    assert all(len(set(row)) == 3 for row in safe_TK.tolist())
    counts_E = torch.bincount(safe_TK.flatten(), minlength=E)
    assert int(counts_E.max() - counts_E.min()) <= 1  # round-robin: every expert within one of the others


def test_from_rollout_numpy_fills_engine_missing_last_row():
    rollout_TLK = np.array([[[0, 1], [2, 3]], [[4, 5], [6, 7]], [[1, 2], [3, 4]]], dtype=np.int32)
    routes = Routes.from_rollout(rollout_TLK, layers=(1, 3), num_experts=E, tokens=4)
    assert routes.layers == (1, 3) and routes.microbatches == 1
    layer1_TK = routes.get(1, 0)
    assert layer1_TK.shape == (4, K)
    assert torch.equal(layer1_TK[:3], ids([[0, 1], [4, 5], [1, 2]]))
    assert torch.equal(layer1_TK[3], safe_routes(1, topk=K, num_experts=E, start=3)[0])
    assert torch.equal(routes.get(3, 0)[:3], ids([[2, 3], [6, 7], [3, 4]]))


def test_from_rollout_pad_rows_get_safe_distinct_routes():
    rollout_TLK = torch.full((6, 1, K), -1, dtype=torch.int64)
    rollout_TLK[:2, 0] = ids([[3, 4], [5, 6]])
    pad_T = torch.tensor([False, False, True, True, True, True])
    routes = Routes.from_rollout(rollout_TLK, layers=(0,), num_experts=E, pad_T=pad_T)
    pads_TK = routes.get(0, 0)[2:]
    assert torch.equal(routes.get(0, 0)[:2], ids([[3, 4], [5, 6]]))
    assert len(set(pads_TK.flatten().tolist())) == 4 * K  # 4 pad rows over 8 distinct experts, none piled on 0


def test_from_rollout_split_into_microbatches():
    rollout_TLK = safe_routes(10, topk=K, num_experts=E).unsqueeze(1)
    routes = Routes.from_rollout(rollout_TLK, layers=(0,), num_experts=E, split=(4, 6))
    assert routes.microbatches == 2 and routes.get(0, 1).shape == (6, K)
    assert torch.equal(routes.get(0, 1), rollout_TLK[4:, 0])


def test_from_rollout_wrong_token_count_raises():
    with pytest.raises(RouteError, match=r"rollout routes hold 3 tokens != expected 5 \(or 4, the engine's"):
        Routes.from_rollout(np.zeros((3, 1, K), dtype=np.int64) + [0, 1], layers=(0,), num_experts=E, tokens=5)


def test_from_rollout_wrong_layer_count_raises():
    with pytest.raises(RouteError, match=r"rollout routes hold 2 layer columns, which fits neither numbering: "
                                         r"expected 1 MoE layers \(pass num_layers="):
        Routes.from_rollout(np.zeros((3, 2, K), dtype=np.int64), layers=(0,), num_experts=E)


def test_from_rollout_float_dtype_raises():
    with pytest.raises(RouteError, match="rollout routes dtype torch.float64 is not an integer dtype"):
        Routes.from_rollout(np.zeros((3, 1, K)), layers=(0,), num_experts=E)


@pytest.mark.parametrize("gap", [[-1, -1], [0, 0]])
def test_from_rollout_capture_gap_on_real_token_raises(gap):
    bad_TLK = np.array([[[0, 1]], [gap]])
    with pytest.raises(RouteError, match=r"rollout routes: token 1 MoE column 0: capture gap .*" + re.escape(str(gap))):
        Routes.from_rollout(bad_TLK, layers=(0,), num_experts=E)


def test_from_rollout_capture_gap_on_pad_token_gets_safe_route():
    routes = Routes.from_rollout(np.array([[[0, 1]], [[-1, -1]]]), layers=(0,), num_experts=E, pad_T=[False, True])
    assert routes.get(0, 0)[1].tolist() == safe_routes(2, topk=K, num_experts=E)[1].tolist()


def test_from_rollout_out_of_range_id_raises():
    with pytest.raises(RouteError, match=r"layer 0 rank \? mb 0: expert id -3 out of range"):
        Routes.from_rollout(np.array([[[0, 1]], [[-3, 2]]]), layers=(0,), num_experts=E)


def test_routes_copy_caller_buffer():
    buffer_TLK = np.array([[[0, 1]], [[2, 3]]])
    routes = Routes.from_rollout(buffer_TLK, layers=(0,), num_experts=E)
    buffer_TLK[:] = 5  # a reused rollout buffer: the validated routes must not change
    assert routes.get(0, 0).tolist() == [[0, 1], [2, 3]]
    source = ids([[0, 1]])
    held = Routes({0: [source]}, num_experts=E, topk=K)
    source.fill_(50)
    assert held.get(0, 0).tolist() == [[0, 1]]


def test_replay_ids_private_int64_copy_made_once_per_device():
    routes = Routes({0: [ids([[0, 1], [2, 3]])]}, num_experts=E, topk=K)
    first = routes.replay_ids(0, 0, "cpu")
    assert first.dtype == torch.int64 and routes.replay_ids(0, 0, torch.device("cpu")) is first
    routes.get(0, 0).fill_(7)  # writing into what get() returned does not reach what replay uses
    assert routes.replay_ids(0, 0, "cpu").tolist() == [[0, 1], [2, 3]]
    with pytest.raises(RouteError, match="mb 1"):
        routes.replay_ids(0, 1, "cpu")


def requests(lengths, *, short: bool, layers: int = 1, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [torch.rand(n - short, layers, E, generator=g).argsort(dim=-1)[..., :K] for n in lengths]


def test_from_rollout_requests_missing_last_rows_sequence_major():
    lengths, seq_len = [3, 5], 6
    arrays = requests(lengths, short=True)
    routes = Routes.from_rollout([a.numpy() for a in arrays], layers=(2,), num_experts=E, lengths=lengths,
                                 seq_len=seq_len)
    got_TK = routes.get(2, 0)
    assert got_TK.shape == (2 * seq_len, K)
    for b, (a, n) in enumerate(zip(arrays, lengths)):
        assert torch.equal(got_TK[b * seq_len: b * seq_len + n - 1], a[:, 0])
        filler_TK = got_TK[b * seq_len + n - 1: (b + 1) * seq_len]  # the missing row and padding: safe routes
        assert (filler_TK.sort(dim=1).values[:, 1:] != filler_TK.sort(dim=1).values[:, :-1]).all()


def test_from_rollout_padded_batch_equals_request_list():
    lengths = [4, 2]
    arrays = requests(lengths, short=False, layers=2, seed=1)
    padded_BSLK = torch.full((2, 4, 2, K), -1, dtype=torch.int64)
    for b, a in enumerate(arrays):
        padded_BSLK[b, : a.shape[0]] = a
    from_list = Routes.from_rollout(arrays, layers=(1, 3), num_experts=E, lengths=lengths)
    from_padded = Routes.from_rollout(padded_BSLK, layers=(1, 3), num_experts=E, lengths=lengths)
    assert from_list == from_padded


def test_from_rollout_requests_need_lengths():
    with pytest.raises(RouteError, match="several rollout requests need lengths="):
        Routes.from_rollout(requests([3, 3], short=False), layers=(0,), num_experts=E)


def test_from_rollout_request_wrong_length_raises():
    with pytest.raises(RouteError, match=r"rollout request 1 hold 2 tokens != expected 5 \(or 4"):
        Routes.from_rollout(requests([3, 2], short=False), layers=(0,), num_experts=E, lengths=[3, 5])


def test_from_rollout_all_layer_numbering_takes_moe_columns():
    all_TLK = torch.stack([safe_routes(3, topk=K, num_experts=E, start=10 * layer) for layer in range(3)], dim=1)
    all_TLK[:, 0] = -1  # the dense first layer: the engine captured nothing there
    routes = Routes.from_rollout(all_TLK, layers=(1, 2), num_experts=E, num_layers=3)
    assert routes.get(2, 0).tolist() == safe_routes(3, topk=K, num_experts=E, start=20).tolist()


def test_from_rollout_layer_count_fitting_neither_refused():
    with pytest.raises(RouteError, match=r"hold 4 layer columns, which fits neither numbering: expected 2 MoE "
                                         r"layers or 3 decoder layers"):
        Routes.from_rollout(np.zeros((3, 4, K), dtype=np.int64), layers=(1, 2), num_experts=E, num_layers=3)


def test_from_rollout_string_refused():
    with pytest.raises(RouteError, match="rollout routes must be an integer array, got str"):
        Routes.from_rollout("routes", layers=(0,), num_experts=E)


def test_from_rollout_split_not_partition_raises():
    with pytest.raises(RouteError, match=r"split \[2, 2\] does not partition 5 tokens"):
        Routes.from_rollout(safe_routes(5, topk=K, num_experts=E).unsqueeze(1), layers=(0,), num_experts=E,
                            split=(2, 2))


def test_routes_to_local_to_global_roundtrip_pp2_sp():
    from moeverify import views

    layout, world = Layout(tp=2, pp=2, sp=True), 4
    seq_len, batch, num_layers = 4, 2, 4
    tokens = seq_len * batch
    global_routes = Routes({layer: [safe_routes(tokens, topk=K, num_experts=E, start=layer)]
                            for layer in (1, 3)}, num_experts=E, topk=K)
    local = {c: global_routes.to_local(layout, coords=c, seq_len=seq_len, batch=batch, num_layers=num_layers)
             for c in views.all_rank_coords(layout, world_size=world)}
    assert {c.rank: r.layers for c, r in local.items()} == {0: (1,), 1: (1,), 2: (3,), 3: (3,)}
    assert all(r.get(r.layers[0], 0).shape == (tokens // 2, K) for r in local.values())
    merged = Routes.to_global(local, layout, world_size=world, seq_len=seq_len, batch=batch,
                              num_layers=num_layers, moe_layers=(1, 3))
    assert merged == global_routes


@pytest.mark.parametrize(("kwargs", "match"), [
    (dict(per_layer={0: "ids"}, num_experts=4, topk=2), r"layer 0: expected a list of \[T, K\] tensors"),
    (dict(per_layer="abc", num_experts=4, topk=2), r"routes must be a mapping"),
    (dict(per_layer={-1: []}, num_experts=4, topk=2), r"layer key -1 must be a global layer number"),
    (dict(per_layer={0: [], "1": []}, num_experts=4, topk=2), r"layer key '1' must be a global layer number"),
    (dict(per_layer={0: [[[0, 1], [1]]]}, num_experts=4, topk=2), r"route must be a torch.Tensor, got list"),
    (dict(per_layer={}, num_experts=4.0, topk=2), r"num_experts and topk must be integers"),
    (dict(per_layer={}, num_experts=4, topk=True), r"num_experts and topk must be integers"),
])
def test_routes_refuse_malformed_containers_by_name(kwargs, match):
    with pytest.raises(RouteError, match=match):
        Routes(**kwargs)


def test_routes_accept_numpy_integer_layers_and_counts():
    import numpy as np

    r = Routes({np.int64(3): [torch.tensor([[0, 1]])]}, num_experts=np.int64(4), topk=2)
    assert r.layers == (3,) and r.num_experts == 4 and type(r.num_experts) is int
