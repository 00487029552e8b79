"""views.py: token and layer ownership under layouts, and global <-> local route round trips."""

import pytest
import torch

from moeverify.errors import LayoutError, RouteError
from moeverify.routing.routes import Routes
from moeverify.routing.views import RankCoords, all_rank_coords, chunk_layers, layers_of, rank_coords, token_index
from moeverify.spec.layout import Layout
from moeverify.views import to_global, to_local  # the public face keeps the function form


def _reference_local_ids(layout, *, tp_rank, cp_rank, dp_rank, seq_len, batch, zigzag=True):
    """Slice a [B, S] grid of global ids the way Megatron's data path does, then flatten [s, b]."""
    ids_BS = (dp_rank * batch + torch.arange(batch))[:, None] * seq_len + torch.arange(seq_len)[None, :]
    cp = layout.cp
    if cp > 1:
        if zigzag:
            chunks = ids_BS.view(batch, 2 * cp, seq_len // (2 * cp))
            ids_BS = chunks[:, [cp_rank, 2 * cp - 1 - cp_rank]].reshape(batch, -1)
        else:
            ids_BS = ids_BS.chunk(cp, dim=1)[cp_rank]
    ids_SB = ids_BS.t()
    if layout.sp:
        ids_SB = ids_SB.chunk(layout.tp, dim=0)[tp_rank]
    return ids_SB.reshape(-1)


def _random_routes(*, layers, tokens, microbatches=2, experts=8, topk=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    per_layer = {}
    for layer in layers:
        per_layer[layer] = [
            torch.rand(tokens, experts, generator=gen).topk(topk, dim=1).indices for _ in range(microbatches)
        ]
    return Routes(per_layer, num_experts=experts, topk=topk)


@pytest.mark.parametrize(
    "layout", [Layout(), Layout(tp=2, sp=True), Layout(tp=2), Layout(cp=2), Layout(cp=2, tp=2, sp=True), Layout(cp=3)]
)
@pytest.mark.parametrize("zigzag", [True, False])
def test_token_index_matches_megatron_slicing(layout, zigzag):
    for tp_rank in range(layout.tp):
        for cp_rank in range(layout.cp):
            got = token_index(layout, tp_rank=tp_rank, cp_rank=cp_rank, dp_rank=1, seq_len=24, batch=3, zigzag=zigzag)
            want = _reference_local_ids(
                layout, tp_rank=tp_rank, cp_rank=cp_rank, dp_rank=1, seq_len=24, batch=3, zigzag=zigzag
            )
            assert torch.equal(got, want)


def test_token_index_zigzag_cp2_holds_first_and_last_chunk():
    got = token_index(Layout(cp=2), tp_rank=0, cp_rank=0, seq_len=8, batch=1)
    assert got.tolist() == [0, 1, 6, 7]


def test_token_index_seq_len_not_divisible_raises():
    with pytest.raises(LayoutError, match=r"seq_len 6 is not divisible by 2\*cp \(zigzag\) = 4"):
        token_index(Layout(cp=2), tp_rank=0, cp_rank=0, seq_len=6, batch=1)
    with pytest.raises(LayoutError, match="not divisible by tp 2 under sequence parallel"):
        token_index(Layout(tp=2, sp=True), tp_rank=0, cp_rank=0, seq_len=5, batch=1)


def test_chunk_layers_pp2_vpp2_interleaves():
    layout = Layout(pp=2, vpp=2)
    got = {(p, c): list(chunk_layers(layout, pp_rank=p, vp_stage=c, num_layers=8)) for p in range(2) for c in range(2)}
    assert got == {(0, 0): [0, 1], (1, 0): [2, 3], (0, 1): [4, 5], (1, 1): [6, 7]}


def test_chunk_layers_uneven_split_raises():
    with pytest.raises(LayoutError, match=r"num_layers 6 is not divisible by pp\*vpp = 2\*2 = 4; pp_first/pp_last"):
        chunk_layers(Layout(pp=2, vpp=2), pp_rank=0, vp_stage=0, num_layers=6)


def test_layers_of_mixed_dense_moe_stack():
    layout = Layout(pp=2, vpp=2)
    assert layers_of(layout, pp_rank=0, num_layers=8, moe_layers=(1, 2, 3, 5, 7)) == (1, 5)
    assert layers_of(layout, pp_rank=1, num_layers=8, moe_layers=(1, 2, 3, 5, 7)) == (2, 3, 7)
    assert layers_of(layout, pp_rank=1, num_layers=8, moe_layers=(1, 2, 3, 5, 7), vp_stage=1) == (7,)


def test_layers_of_moe_layer_out_of_range_raises():
    with pytest.raises(
        LayoutError,
        match=r"moe_layers \[9\] outside \[0, num_layers=4\), and not MTP layers numbered "
        r"num_layers \+ i \(4, 5, ...\)",
    ):
        layers_of(Layout(), pp_rank=0, num_layers=4, moe_layers=(1, 9))


def test_rank_coords_follows_megatron_default_order():
    layout = Layout(tp=2, pp=2, ep=2)
    coords = all_rank_coords(layout, world_size=8)
    # decoder grid tp-cp-dp-pp: rank = tp + 2 * (dp + 2 * pp); expert grid etp-ep-edp-pp.
    assert [(c.tp, c.dp, c.pp) for c in coords] == [(r % 2, (r // 2) % 2, r // 4) for r in range(8)]
    assert [c.ep for c in coords] == [(r // 2) % 2 for r in range(8)]
    with pytest.raises(LayoutError, match="rank 8 is outside world_size 8"):
        rank_coords(layout, rank=8, world_size=8)


ROUND_TRIPS = [
    (Layout(tp=2, sp=True), 2, True),
    (Layout(tp=2), 2, True),
    (Layout(cp=2), 2, True),
    (Layout(cp=2), 2, False),
    (Layout(cp=2, tp=2, sp=True), 4, True),
    (Layout(pp=2), 2, True),
    (Layout(pp=2, vpp=2), 2, True),
    (Layout(ep=2), 2, True),
    (Layout(), 2, True),
    (Layout(tp=2, pp=2, ep=2, sp=True), 8, True),
]


@pytest.mark.parametrize("layout,world,zigzag", ROUND_TRIPS, ids=lambda v: str(v))
def test_to_global_round_trips_local_views(layout, world, zigzag):
    seq_len, batch, num_layers, moe = 8, 2, 8, (1, 2, 3, 5, 7)
    dp = layout.dp(world)
    global_routes = _random_routes(layers=moe, tokens=dp * batch * seq_len)
    local = {
        c: to_local(global_routes, layout, coords=c, seq_len=seq_len, batch=batch, num_layers=num_layers, zigzag=zigzag)
        for c in all_rank_coords(layout, world_size=world)
    }
    back = to_global(
        local,
        layout,
        world_size=world,
        seq_len=seq_len,
        batch=batch,
        num_layers=num_layers,
        moe_layers=moe,
        zigzag=zigzag,
    )
    assert back == global_routes


def test_to_local_sp_rank_sees_its_slice():
    layout = Layout(tp=2, sp=True)
    ids = torch.arange(8)[:, None].expand(8, 2) % 8
    global_routes = Routes({0: [torch.stack([ids[:, 0], (ids[:, 0] + 1) % 8], 1)]}, num_experts=8, topk=2)
    local = to_local(global_routes, layout, coords=RankCoords(rank=1, tp=1), seq_len=4, batch=2, num_layers=1)
    # tp1 holds positions 2, 3 of both sequences, in (s, b) order: tokens 2, 6, 3, 7.
    assert local.get(0, 0)[:, 0].tolist() == [2, 6, 3, 7]


def test_to_local_variable_seq_len_per_microbatch():
    routes = Routes(
        {0: [torch.zeros(8, 1, dtype=torch.int64), torch.zeros(12, 1, dtype=torch.int64)]}, num_experts=2, topk=1
    )
    local = to_local(
        routes, Layout(cp=2), coords=RankCoords(rank=0), seq_len=[4, 6], batch=2, num_layers=1, zigzag=False
    )
    assert [local.get(0, m).shape[0] for m in range(2)] == [4, 6]


def test_to_global_replica_mismatch_names_ranks():
    layout = Layout(tp=2)
    global_routes = _random_routes(layers=(0,), tokens=8, microbatches=1)
    local = {
        c: to_local(global_routes, layout, coords=c, seq_len=4, batch=2, num_layers=1)
        for c in all_rank_coords(layout, world_size=2)
    }
    c1 = next(c for c in local if c.rank == 1)
    bad = local[c1].get(0, 0).clone()
    bad[3] = (bad[3] + 1) % 8
    bad[3, 1] = (bad[3, 0] + 1) % 8
    local[c1] = local[c1].replace(0, 0, bad)
    with pytest.raises(
        RouteError,
        match=r"layer 0 mb 0: replicas disagree on 1 token\(s\); first global token 5: "
        r"rank 1 \(tp1 .*rank 0 \(tp0",
    ):
        to_global(local, layout, world_size=2, seq_len=4, batch=2, num_layers=1, moe_layers=(0,))


def test_to_global_missing_sp_rank_raises():
    layout = Layout(tp=2, sp=True)
    global_routes = _random_routes(layers=(0,), tokens=8, microbatches=1)
    coords = all_rank_coords(layout, world_size=2)
    local = {coords[0]: to_local(global_routes, layout, coords=coords[0], seq_len=4, batch=2, num_layers=1)}
    with pytest.raises(RouteError, match="no routes from any rank with pp0 dp0 cp0 tp1"):
        to_global(local, layout, world_size=2, seq_len=4, batch=2, num_layers=1, moe_layers=(0,))


def test_to_global_wrong_local_token_count_raises():
    layout = Layout(tp=2, sp=True)
    coords = all_rank_coords(layout, world_size=2)
    local = {c: Routes({0: [torch.zeros(3, 1, dtype=torch.int64)]}, num_experts=2, topk=1) for c in coords}
    with pytest.raises(RouteError, match=r"layer 0 rank 0 \(tp0.*mb 0: local routes hold 3 tokens != expected T=4"):
        to_global(local, layout, world_size=2, seq_len=4, batch=2, num_layers=1, moe_layers=(0,))


def test_to_global_wrong_layers_raises():
    layout = Layout(pp=2)
    coords = all_rank_coords(layout, world_size=2)
    local = {c: Routes({0: [torch.zeros(4, 1, dtype=torch.int64)]}, num_experts=2, topk=1) for c in coords}
    with pytest.raises(RouteError, match=r"rank 1 \(tp0 pp1.*\(2, 1, \(0,\), 1\) != expected \(2, 1, \(1,\), 1\)"):
        to_global(local, layout, world_size=2, seq_len=4, batch=1, num_layers=2, moe_layers=(0, 1))


@pytest.mark.parametrize("layout,world", [(Layout(), 1), (Layout(pp=2), 2), (Layout(pp=2, vpp=2), 2)])
def test_views_mtp_layer_numbered_after_the_decoder_goes_with_the_last_stage(layout, world):
    from moeverify.routing import views

    # the docs' R3 example on a DeepSeek-V3 with MTP: Routes.from_rollout(num_layers=N) numbers the MTP layer N, and
    # to_local(num_layers=N) must place it where Megatron builds it (the last stage's last chunk), rows in the same
    # token order as every layer of that rank
    from moeverify.routing.routes import Routes

    n, seq, batch = 4, 6, 2
    engine = torch.stack(
        [torch.stack([torch.tensor([(t + c) % 8, (t + c + 3) % 8]) for c in range(5)]) for t in range(seq * batch)]
    )  # [T, 5 columns: 4 decoder layers + 1 MTP, K]
    routes = Routes.from_rollout(
        engine[:, [1, 2, 3, 4]], layers=[1, 2, 3, n], num_experts=8, num_layers=n, numbering="routers"
    )
    for rank in range(world):
        coords = views.rank_coords(layout, rank=rank, world_size=world)
        local = routes.to_local(layout, coords=coords, seq_len=seq, batch=batch, num_layers=n)
        last = coords.pp == layout.pp - 1
        assert (n in local.layers) == last
        if last:
            decoder = routes.select([3]).to_local(layout, coords=coords, seq_len=seq, batch=batch, num_layers=n)
            assert torch.equal((local.get(n, 0) - 4) % 8, (decoder.get(3, 0) - 3) % 8)  # the same tokens' rows


def test_to_local_refuses_routes_already_in_router_order():
    # to_local of one rank's view (a session's recording, or to_local's own output) permutes its rows again: every
    # token would replay another token's experts. Refused, whatever the layout.
    global_routes = _random_routes(layers=(0,), tokens=8, microbatches=1).in_order("sequence")
    local = to_local(global_routes, Layout(), coords=RankCoords(rank=0), seq_len=4, batch=2, num_layers=1)
    assert local.order == "router"
    with pytest.raises(RouteError, match=r"to_local: these routes are already one rank's view, in router order"):
        to_local(local, Layout(), coords=RankCoords(rank=0), seq_len=4, batch=2, num_layers=1)


@pytest.mark.parametrize(("seq_len", "batch"), [(4, 4), (2, 8), (16, 1), (4, 2)])
def test_to_local_refuses_a_seq_len_the_rollout_routes_were_not_built_with(seq_len, batch):
    # Two requests of 8 tokens: [4 x 4], [2 x 8] and [16 x 1] hold as many tokens and would pass a count check,
    # [4 x 2] is a data-parallel slice of a misread batch; every one reads tokens of other positions.
    gen = torch.Generator().manual_seed(3)
    arrays = [torch.rand(8, 8, generator=gen).topk(2, dim=1).indices.unsqueeze(1) for _ in range(2)]  # [S, L, K]
    rollout = Routes.from_rollout(arrays, layers=[0], num_experts=8, lengths=[8, 8])
    assert rollout._seq_lens == (8,)
    held = rf"to_local mb 0: these routes hold sequences of 8 tokens .* seq_len {seq_len}"
    with pytest.raises(RouteError, match=held):
        to_local(rollout, Layout(), coords=RankCoords(rank=0), seq_len=seq_len, batch=batch, num_layers=1)
    mine = to_local(rollout, Layout(), coords=RankCoords(rank=0), seq_len=8, batch=2, num_layers=1)
    assert mine.get(0, 0)[0::2].tolist() == rollout.get(0, 0)[:8].tolist()  # request 0's tokens, in router order


def test_to_local_refuses_a_batch_that_does_not_tile_the_global_routes():
    # Routes of unknown geometry (built by hand, sequence order): 12 rows are no whole number of 2 x 4 batches.
    routes = Routes({0: [torch.stack([torch.arange(12) % 8, (torch.arange(12) + 1) % 8], 1)]}, num_experts=8, topk=2)
    routes.in_order("sequence")
    with pytest.raises(RouteError, match=r"to_local mb 0: the global routes hold 12 tokens, not a whole number"):
        to_local(routes, Layout(), coords=RankCoords(rank=0), seq_len=4, batch=2, num_layers=1)


def test_to_global_refuses_a_rank_view_in_sequence_order():
    # A global view (from_rollout, to_global's own output) handed back as one rank's routes would be permuted.
    global_routes = _random_routes(layers=(0,), tokens=8, microbatches=1).in_order("sequence")
    with pytest.raises(RouteError, match=r"rank 0.*: to_global takes each rank's view in router order"):
        to_global(
            {RankCoords(rank=0): global_routes},
            Layout(),
            world_size=1,
            seq_len=4,
            batch=2,
            num_layers=1,
            moe_layers=[0],
        )


def test_to_global_refuses_keys_other_than_rank_coords():
    local = _random_routes(layers=(0,), tokens=8, microbatches=1).in_order("router")
    with pytest.raises(RouteError, match=r"to_global keys each rank's routes by its RankCoords .* got int 0"):
        to_global({0: local}, Layout(), world_size=1, seq_len=4, batch=2, num_layers=1, moe_layers=[0])
