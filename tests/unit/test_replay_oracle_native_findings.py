"""Megatron-Core 0.19.2's native ``RouterReplay``: the unchecked-input behaviours docs/replay_matrix.md
reports, pinned so that an upstream fix shows up here (then update the document and these tests).

Runs megatron-core's routing function on tiny CPU tensors; no model, no process group.
"""

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function  # noqa: E402
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction  # noqa: E402

from moeverify.errors import RouteError  # noqa: E402
from moeverify.routing.routes import validate_topk_ids  # noqa: E402


@pytest.fixture
def replay():
    RouterReplay.global_router_replay_instances.clear()
    rr = RouterReplay()
    rr.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    yield rr
    RouterReplay.global_router_replay_instances.clear()


def _route(rr, ids_TK, tokens=2, experts=4):
    rr.set_target_indices(torch.tensor(ids_TK))
    logits_TE = torch.randn(tokens, experts, generator=torch.Generator().manual_seed(0))
    return topk_routing_with_score_function(logits_TE, 2, router_replay=rr)


def test_native_replay_duplicate_expert_silently_routes_to_fewer_experts(replay):
    probs_TE, map_TE = _route(replay, [[0, 0], [1, 2]])
    assert map_TE.sum(dim=1).tolist() == [1, 2]  # token 0 reaches 1 expert, not top-2
    with pytest.raises(RouteError, match="routes to expert"):  # moeverify's validation refuses it
        validate_topk_ids(torch.tensor([[0, 0], [1, 2]]), layer=0, microbatch=0, num_experts=4, topk=2)


def test_native_replay_short_route_table_silently_drops_tokens(replay):
    probs_TE, map_TE = _route(replay, [[0, 1]])  # 1 row for a 2-token router call
    assert map_TE.sum(dim=1).tolist() == [2, 0]  # token 1 is routed to no expert at all
    assert float(probs_TE[1].abs().sum()) == 0.0


def test_native_replay_backward_queue_grows_without_recompute(replay):
    for _ in range(3):
        _route(replay, [[0, 1], [1, 2]])
    assert len(replay.replay_backward_list) == 3  # nothing pops it unless recompute runs


def test_native_replay_global_instances_outlive_their_model(replay):
    RouterReplay()  # a router of a second model (actor + reference, or a rebuilt decoder)
    with pytest.raises(ValueError, match=r"number of replay tensors \(1\) does not match instances \(2\)"):
        RouterReplay.set_replay_data([torch.tensor([[0, 1], [1, 2]])])
