"""Global <-> local route views for models with multi-token-prediction (MTP) layers (cross_layout).

A router of MTP depth ``i`` is global layer ``num_layers + i`` (``moeverify.patches.routers``), while
``moeverify.routing.views`` places decoder layers only. Megatron-Core 0.19.2 builds every MTP layer on the last
pipeline stage, in its last virtual chunk (``get_mtp_num_layers_to_build`` without a
``pipeline_model_parallel_layout``), after the decoder layers there, and its router sees that stage's tokens in
the decoder's order: the MTP layer's input is the decoder's output hidden states (split as the decoder's over
CP, and over TP under sequence parallelism: ``MultiTokenPredictionLayer._concat_embeddings`` scatters again)
and the shifted tokens' embeddings at the same positions. So MTP routes take the local view of the last
decoder layer: ``views`` is asked for decoder layer ``num_layers - 1`` and the rows are renumbered. A model
whose MTP routers are not where this places them is refused (``check_placement``), never viewed otherwise.
"""

from __future__ import annotations

from moeverify.errors import UsageError
from moeverify.routing import views
from moeverify.routing.routes import Routes


def router_layers(chunks: list) -> int:
    """Layers a model's routers can be numbered in: decoder layers plus MTP depths (the 1-rank reference holds
    them all on its one stage)."""
    config = chunks[0].config
    return int(config.num_layers) + int(getattr(config, "mtp_num_layers", None) or 0)


def to_local(global_routes: Routes, layout, *, coords, seq_len, batch: int, num_layers: int) -> Routes:
    """``Routes.to_local`` for decoder layers ``< num_layers`` and MTP layers ``>= num_layers`` alike."""
    mtp = [layer for layer in global_routes.layers if layer >= num_layers]
    decoder = [layer for layer in global_routes.layers if layer < num_layers]
    local = global_routes.select(decoder).to_local(
        layout, coords=coords, seq_len=seq_len, batch=batch, num_layers=num_layers
    )
    if not mtp:
        return local
    held = {}
    for layer in mtp:  # as the last decoder layer, renumbered
        as_last = Routes(
            {num_layers - 1: [global_routes.get(layer, mb) for mb in range(global_routes.microbatches)]},
            num_experts=global_routes.num_experts,
            topk=global_routes.topk,
        ).in_order(global_routes.order)
        viewed = as_last.to_local(layout, coords=coords, seq_len=seq_len, batch=batch, num_layers=num_layers)
        if viewed.layers:
            held[layer] = [viewed.get(num_layers - 1, mb) for mb in range(viewed.microbatches)]
    per_layer = {layer: [local.get(layer, mb) for mb in range(local.microbatches)] for layer in local.layers}
    return Routes({**per_layer, **held}, num_experts=global_routes.num_experts, topk=global_routes.topk).in_order(
        "router"
    )


def check_placement(chunks: list, layout, *, coords, num_layers: int, routers: dict) -> None:
    """The MTP routers of this rank's chunks (``routers``: ``find_routers``' result) are where ``to_local`` puts
    MTP routes: on the stage holding decoder layer ``num_layers - 1``, and nowhere else."""
    depth = int(getattr(chunks[0].config, "mtp_num_layers", None) or 0)
    if not depth:
        return
    mtp = sorted(layer for layer in routers if layer >= num_layers)
    if layout.pp_layout is not None:
        raise UsageError(
            f"MTP layers with pp_layout {layout.pp_layout!r}: cross_layout places MTP routes on the "
            "stage of the last decoder layer, as megatron-core 0.19.2 does without a layout; use pp, "
            "pp_first or pp_last"
        )
    last = views.layers_of(layout, pp_rank=coords.pp, num_layers=num_layers, moe_layers=[num_layers - 1])
    expected = range(num_layers, num_layers + depth) if last else range(0)
    if any(layer not in expected for layer in mtp):
        raise UsageError(
            f"{coords.label()}: MTP routers at global layers {mtp}, expected within {list(expected)} "
            "(megatron-core 0.19.2 builds MTP on the stage of the last decoder layer): cross_layout "
            "cannot place MTP routes on this model"
        )
