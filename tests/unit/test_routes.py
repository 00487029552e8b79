"""``Routes``: validation of every bad route, rollout import, layer selection, views delegation.

Legend: T = tokens, L = MoE layers, K = top-k, E = experts.
"""

from __future__ import annotations

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
    with pytest.raises(RouteError, match=r"rollout routes shape \(3, 2, 2\) != expected \(T, L=1, K\)"):
        Routes.from_rollout(np.zeros((3, 2, K), dtype=np.int64), layers=(0,), num_experts=E)


def test_from_rollout_float_dtype_raises():
    with pytest.raises(RouteError, match="rollout routes dtype torch.float64 is not an integer dtype"):
        Routes.from_rollout(np.zeros((3, 1, K)), layers=(0,), num_experts=E)


def test_from_rollout_unfilled_pad_value_raises():
    bad_TLK = np.array([[[0, 1]], [[-1, -1]]])
    with pytest.raises(RouteError, match=r"layer 0 rank \? mb 0: expert id -1 out of range"):
        Routes.from_rollout(bad_TLK, layers=(0,), num_experts=E)


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
