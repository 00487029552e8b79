"""The recorder's plain-tensor parts: top-k ids from a routing map, model shape from a config (no Megatron)."""

import types

import pytest
import torch

from moeverify.errors import RouteError
from moeverify.patches.recorder import _topk_ids, model_info


def test_topk_ids_from_routing_map_are_set_columns():
    map_TE = torch.tensor([[0, 1, 0, 1], [1, 1, 0, 0], [0, 0, 1, 1]], dtype=torch.bool)
    assert _topk_ids(map_TE, topk=2, layer=0, mb=0).tolist() == [[1, 3], [0, 1], [2, 3]]


def test_topk_ids_matches_torch_topk_as_sets():
    scores_TE = torch.rand(64, 16, generator=torch.Generator().manual_seed(0))
    top_TK = scores_TE.topk(4, dim=1).indices
    map_TE = torch.zeros(64, 16, dtype=torch.bool).scatter_(1, top_TK, True)
    assert torch.equal(_topk_ids(map_TE, topk=4, layer=0, mb=0), top_TK.sort(dim=1).values)


def test_topk_ids_dropped_token_raises():
    map_TE = torch.tensor([[0, 1, 0, 1], [1, 0, 0, 0]], dtype=torch.bool)
    with pytest.raises(RouteError, match=r"layer 3 mb 1: token 1 routed to 1 experts != topk 2"):
        _topk_ids(map_TE, topk=2, layer=3, mb=1)


def test_model_info_from_int_and_list_moe_layer_freq():
    config = types.SimpleNamespace(num_layers=4, moe_layer_freq=2, num_moe_experts=8, moe_router_topk=2)
    assert model_info(config).moe_layers == (0, 2)
    config.moe_layer_freq = [0, 1, 1, 1]
    info = model_info(config)
    assert (info.moe_layers, info.num_experts, info.topk, info.num_layers) == ((1, 2, 3), 8, 2, 4)
