"""MTP routes in the replay oracle's cross_layout views (``oracles.replay.mtp_views``).

The reference is ``moeverify.routing.views`` itself: an MTP router sees the tokens of the last decoder layer's stage in
that layer's order, so its local rows must be exactly what ``Routes.to_local`` gives for the last decoder layer.
"""

from __future__ import annotations

import types

import pytest
import torch

from moeverify.errors import UsageError
from moeverify.oracles.replay import mtp_views
from moeverify.routing import views
from moeverify.routing.routes import Routes
from moeverify.spec.layout import Layout

N, SEQ, BATCH, MBS = 4, 8, 2, 2  # decoder layers, sequence, batch, micro-batches


def _global_routes(layers=(1, 2, 3, 4)) -> Routes:
    """Rows that differ per token, layer and micro-batch, so that a wrong token order or layer shows."""
    per_layer = {
        layer: [
            torch.stack([torch.tensor([(t + layer + mb) % 8, (t + layer + mb + 1) % 8]) for t in range(SEQ * BATCH)])
            for mb in range(MBS)
        ]
        for layer in layers
    }
    return Routes(per_layer, num_experts=8, topk=2).in_order("sequence")


@pytest.mark.parametrize(
    "layout,world",
    [
        (Layout(pp=2), 2),
        (Layout(pp=2, vpp=2), 2),
        (Layout(tp=2, sp=True), 2),
        (Layout(cp=2), 2),
        (Layout(pp=2, pp_first=1), 2),
    ],
)
def test_mtp_views_to_local_gives_mtp_rows_of_the_last_decoder_layer(layout, world):
    routes = _global_routes()
    as_last = Routes({N - 1: [routes.get(4, mb) for mb in range(MBS)]}, num_experts=8, topk=2).in_order("sequence")
    for rank in range(world):
        coords = views.rank_coords(layout, rank=rank, world_size=world)
        local = mtp_views.to_local(routes, layout, coords=coords, seq_len=SEQ, batch=BATCH, num_layers=N)
        decoder = routes.select([1, 2, 3]).to_local(layout, coords=coords, seq_len=SEQ, batch=BATCH, num_layers=N)
        expect_mtp = as_last.to_local(layout, coords=coords, seq_len=SEQ, batch=BATCH, num_layers=N)
        holds_last = bool(expect_mtp.layers)
        assert local.layers == decoder.layers + ((4,) if holds_last else ())
        assert holds_last == (coords.pp == layout.pp - 1)
        for mb in range(MBS):
            for layer in decoder.layers:
                assert torch.equal(local.get(layer, mb), decoder.get(layer, mb))
            if holds_last:
                assert torch.equal(local.get(4, mb), expect_mtp.get(N - 1, mb))


def _chunks(mtp_num_layers=1):
    return [types.SimpleNamespace(config=types.SimpleNamespace(num_layers=N, mtp_num_layers=mtp_num_layers))]


def test_mtp_views_check_placement_refuses_mtp_routers_off_the_last_stage():
    layout = Layout(pp=2)
    first = views.rank_coords(layout, rank=0, world_size=2)
    last = views.rank_coords(layout, rank=1, world_size=2)
    mtp_views.check_placement(_chunks(), layout, coords=last, num_layers=N, routers={2: None, 3: None, 4: None})
    mtp_views.check_placement(_chunks(), layout, coords=first, num_layers=N, routers={1: None})
    with pytest.raises(UsageError, match=r"MTP routers at global layers \[4\], expected within \[\]"):
        mtp_views.check_placement(_chunks(), layout, coords=first, num_layers=N, routers={1: None, 4: None})
    with pytest.raises(UsageError, match=r"pp_layout 'Et\|tttL'"):
        mtp_views.check_placement(
            _chunks(), Layout(pp=2, pp_layout="Et|tttL"), coords=last, num_layers=N, routers={4: None}
        )
    mtp_views.check_placement(_chunks(None), layout, coords=first, num_layers=N, routers={1: None})


def test_mtp_views_router_layers_counts_mtp_depths():
    assert mtp_views.router_layers(_chunks()) == N + 1
    assert mtp_views.router_layers(_chunks(None)) == N
