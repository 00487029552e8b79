"""Per-rank dumps merged into the global view under each release layout (synthetic routes, no torchrun)."""

import pytest
import torch

from moeverify import record
from moeverify.errors import DumpError
from moeverify.record import format as fmt
from moeverify.record.writer import RankWriter
from moeverify.routing.routes import Routes
from moeverify.routing.views import all_rank_coords, token_index
from moeverify.spec.layout import Layout
from moeverify.views import to_local  # the public face keeps the function form

NUM_LAYERS, MOE_LAYERS, SEQ_LEN, BATCH = 8, (1, 2, 3, 5, 7), 8, 2


def _global_routes(tokens, *, experts=16, topk=4, microbatches=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return Routes(
        {
            layer: [torch.rand(tokens, experts, generator=gen).topk(topk, dim=1).indices for _ in range(microbatches)]
            for layer in MOE_LAYERS
        },
        num_experts=experts,
        topk=topk,
    )


def write_rank_dumps(
    path, global_routes, layout, world_size, *, positions=True, step=0, background=False, finalize=True
):
    """Every rank writes its local view, as ranks of a real run would; rank 0 finalises."""
    model = fmt.ModelInfo(
        num_layers=NUM_LAYERS, moe_layers=MOE_LAYERS, num_experts=global_routes.num_experts, topk=global_routes.topk
    )
    for coords in all_rank_coords(layout, world_size=world_size):
        local = to_local(global_routes, layout, coords=coords, seq_len=SEQ_LEN, batch=BATCH, num_layers=NUM_LAYERS)
        with RankWriter(
            path, model=model, coords=coords, layout=layout, world_size=world_size, background=background
        ) as writer:
            for mb in range(global_routes.microbatches):
                idx = token_index(
                    layout, tp_rank=coords.tp, cp_rank=coords.cp, dp_rank=coords.dp, seq_len=SEQ_LEN, batch=BATCH
                )
                extra = {"positions_T": idx % SEQ_LEN, "seq_ids_T": idx // SEQ_LEN} if positions else {}
                writer.add_tokens(step=step, mb=mb, seq_len=SEQ_LEN, batch=BATCH, **extra)
                for layer in local.layers:
                    writer.add(step=step, mb=mb, layer=layer, ids_TK=local.get(layer, mb))
    return record.finalize(path, world_size=world_size) if finalize else None


RELEASE_LAYOUTS = [
    ("tp2-sp", Layout(tp=2, sp=True), 2),
    ("pp2", Layout(pp=2), 2),
    ("pp2-vpp2", Layout(pp=2, vpp=2), 2),
    ("ep2", Layout(ep=2), 2),
    ("cp2", Layout(cp=2), 2),
    ("tp2-pp2-ep2-sp", Layout(tp=2, pp=2, ep=2, sp=True), 8),
    ("dp2", Layout(), 2),
]


@pytest.mark.parametrize("name,layout,world", RELEASE_LAYOUTS, ids=[r[0] for r in RELEASE_LAYOUTS])
def test_dump_merge_release_layout_recovers_global_routes(tmp_path, name, layout, world):
    global_routes = _global_routes(layout.dp(world) * BATCH * SEQ_LEN)
    write_rank_dumps(tmp_path / name, global_routes, layout, world, background=True)
    dump = record.load(tmp_path / name)
    assert dump.world_size == world and dump.layout == layout
    assert dump.routes(step=0) == global_routes


def test_dump_merge_pp_rank_without_moe_layers(tmp_path):
    layout = Layout(pp=2)
    global_routes = Routes({5: [torch.tensor([[0, 1]] * 16)]}, num_experts=4, topk=2)
    model = fmt.ModelInfo(num_layers=8, moe_layers=(5,), num_experts=4, topk=2)
    for coords in all_rank_coords(layout, world_size=2):
        local = to_local(global_routes, layout, coords=coords, seq_len=8, batch=2, num_layers=8)
        with RankWriter(tmp_path, model=model, coords=coords, layout=layout, world_size=2, background=False) as w:
            w.add_routes(local, step=0, seq_len=8, batch=2)
    record.finalize(tmp_path)
    assert record.load(tmp_path).routes(step=0) == global_routes


def test_dump_merge_replica_mismatch_names_file_and_ranks(tmp_path):
    layout = Layout(tp=2)  # no SP: both TP ranks route every token and must agree
    global_routes = _global_routes(BATCH * SEQ_LEN, microbatches=1)
    model = fmt.ModelInfo(num_layers=NUM_LAYERS, moe_layers=MOE_LAYERS, num_experts=16, topk=4)
    for coords in all_rank_coords(layout, world_size=2):
        local = to_local(global_routes, layout, coords=coords, seq_len=SEQ_LEN, batch=BATCH, num_layers=NUM_LAYERS)
        if coords.rank == 1:
            ids = local.get(2, 0).clone()
            ids[0] = torch.tensor([12, 13, 14, 15]) if set(ids[0].tolist()) != {12, 13, 14, 15} else torch.arange(4)
            local = local.replace(2, 0, ids)
        with RankWriter(tmp_path, model=model, coords=coords, layout=layout, world_size=2, background=False) as w:
            w.add_routes(local, step=0, seq_len=SEQ_LEN, batch=BATCH)
    record.finalize(tmp_path)
    with pytest.raises(
        DumpError,
        match=r"step 0: cannot merge ranks: layer 2 mb 0: replicas disagree on 1 token\(s\);"
        r" first global token 0: rank 1 \(tp1",
    ):
        record.load(tmp_path).routes(step=0)


def test_dump_merge_wrong_positions_raises(tmp_path):
    layout = Layout(cp=2)
    global_routes = _global_routes(BATCH * SEQ_LEN, microbatches=1)
    write_rank_dumps(tmp_path, global_routes, layout, 2, finalize=False)
    # Re-write rank 1 as if it had used contiguous CP chunks instead of zigzag.
    model = fmt.ModelInfo(num_layers=NUM_LAYERS, moe_layers=MOE_LAYERS, num_experts=16, topk=4)
    coords = all_rank_coords(layout, world_size=2)[1]
    local = to_local(global_routes, layout, coords=coords, seq_len=SEQ_LEN, batch=BATCH, num_layers=NUM_LAYERS)
    idx = token_index(layout, tp_rank=0, cp_rank=1, seq_len=SEQ_LEN, batch=BATCH, zigzag=False)
    for p in tmp_path.glob("rank00001*"):
        p.unlink()
    with RankWriter(tmp_path, model=model, coords=coords, layout=layout, world_size=2, background=False) as w:
        w.add_tokens(step=0, mb=0, seq_len=SEQ_LEN, batch=BATCH, positions_T=idx % SEQ_LEN, seq_ids_T=idx // SEQ_LEN)
        w.add_routes(local, step=0)
    record.finalize(tmp_path)
    with pytest.raises(
        DumpError,
        match=r"rank00001.safetensors: tensor step0/mb0/positions: token 0 is positions 4, "
        r"the layout cp2 puts it at 2",
    ):
        record.load(tmp_path).routes(step=0)


def test_dump_merge_without_geometry_multi_rank_raises(tmp_path):
    layout = Layout(ep=2)
    model = fmt.ModelInfo(num_layers=1, moe_layers=(0,), num_experts=4, topk=1)
    for coords in all_rank_coords(layout, world_size=2):
        with RankWriter(tmp_path, model=model, coords=coords, layout=layout, world_size=2, background=False) as w:
            w.add(step=0, mb=0, layer=0, ids_TK=torch.zeros(4, 1, dtype=torch.int64))
    record.finalize(tmp_path)
    with pytest.raises(DumpError, match="seq_len/batch were not recorded, so 2 ranks cannot be merged"):
        record.load(tmp_path).routes(step=0)


def test_save_per_rank_without_process_group_then_finalize(tmp_path):
    layout = Layout(ep=2)
    global_routes = _global_routes(2 * BATCH * SEQ_LEN, microbatches=1)
    for coords in all_rank_coords(layout, world_size=2):
        local = to_local(global_routes, layout, coords=coords, seq_len=SEQ_LEN, batch=BATCH, num_layers=NUM_LAYERS)
        record.save(
            tmp_path,
            local,
            step=4,
            coords=coords,
            layout=layout,
            world_size=2,
            order="router",
            seq_len=SEQ_LEN,
            batch=BATCH,
            num_layers=NUM_LAYERS,
            moe_layers=MOE_LAYERS,
        )
    assert not (tmp_path / "manifest.json").exists()  # no process group: the caller finalises after all ranks
    record.finalize(tmp_path)
    assert record.load(tmp_path).routes(step=4) == global_routes
