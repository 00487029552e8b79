"""A standalone recorder: dump the routing of any Megatron model during ordinary training, no replay.

Forward hooks on megatron-core's ``TopKRouter`` modules read what the router returned: in 0.19.2
``forward`` returns ``(probs [T, E], routing_map [T, E] bool)``; a token's experts are the set
columns of its row (ascending expert id, the order of the map). Routers are keyed by global layer:
``router.layer_number`` is megatron's 1-based global number, ours is 0-based; an MTP router's layer
is ``num_layers + layer_number - 1``. Router calls made during backward (activation recompute) are
skipped, so each micro-batch is recorded once. Legend: T = tokens, K = top-k, E = experts.

Usage, on every rank::

    writer = RankWriter(path, model=model_info(config), coords=coords, layout=layout, world_size=ws)
    with RouteRecorder(model_chunks, writer) as rec:
        for step in ...:
            rec.begin_step(step)
            train_step()          # any schedule; micro-batches are counted per layer
    writer.close(); barrier(); rank 0: finalize(path)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from moeverify.errors import RouteError
from moeverify.patches.routers import find_routers, global_layer, moe_stage_config
from moeverify.record.format import ModelInfo
from moeverify.record.writer import RankWriter


def model_info(config) -> ModelInfo:
    """``ModelInfo`` from a megatron ``TransformerConfig`` (``moe_layer_freq`` int or 0/1 list)."""
    freq = config.moe_layer_freq
    if isinstance(freq, int):
        pattern = [1 if i % freq == 0 else 0 for i in range(config.num_layers)]
    else:
        pattern = list(freq)
    moe = tuple(i for i, p in enumerate(pattern) if p == 1)
    return ModelInfo(
        num_layers=config.num_layers, moe_layers=moe, num_experts=config.num_moe_experts, topk=config.moe_router_topk
    )


def _routers(model_chunks: Sequence[torch.nn.Module]) -> list:
    # the one finder: each router once, two claiming one global layer refused
    return [router for _, router in find_routers(model_chunks).values()]


class RouteRecorder:
    """Hooks every ``TopKRouter`` in ``model_chunks`` and hands each routing to ``writer``.

    Args:
        model_chunks: the model (one module or the list of VPP chunks).
        writer: this rank's ``RankWriter`` (its layout turns local ``[s, b]`` into global seq_len/batch).
        record_probs: also store the router probabilities of the chosen experts.
    """

    def __init__(self, model_chunks, writer: RankWriter, *, record_probs: bool = False):
        chunks = model_chunks if isinstance(model_chunks, (list, tuple)) else [model_chunks]
        self.writer = writer
        self.record_probs = record_probs
        self.step = 0
        self._calls: dict[int, int] = {}
        self._geometry_done: set[int] = set()
        self._handles = []
        routers = _routers(chunks)
        if not routers and moe_stage_config(chunks) is None:  # a dense stage of an MoE pipeline records no layer
            raise RouteError("no megatron TopKRouter found in the model: nothing to record")
        for router in routers:
            self._handles.append(router.register_forward_hook(self._hook))

    @property
    def layers_hooked(self) -> int:
        return len(self._handles)

    def begin_step(self, step: int) -> None:
        """Start counting micro-batches of ``step`` from 0."""
        self.step = step
        self._calls.clear()
        self._geometry_done.clear()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def __enter__(self) -> RouteRecorder:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    def _hook(self, router, inputs, outputs) -> None:
        if torch._C._current_graph_task_id() != -1:  # inside backward: an activation recompute
            return
        probs_TE, routing_map_TE = outputs
        layer = global_layer(router)  # the one global-layer rule (MTP after the decoder layers)
        mb = self._calls.get(layer, 0)
        self._calls[layer] = mb + 1
        ids_TK = _topk_ids(routing_map_TE, topk=router.topk, layer=layer, mb=mb)
        probs_TK = probs_TE.detach().gather(1, ids_TK) if self.record_probs else None
        if mb not in self._geometry_done:
            self._geometry_done.add(mb)
            hidden = inputs[0]
            s_local, batch = int(hidden.shape[0]), int(hidden.shape[1]) if hidden.dim() == 3 else 1
            layout = self.writer.layout
            seq_len = s_local * (layout.tp if layout.sp else 1) * layout.cp
            self.writer.add_tokens(step=self.step, mb=mb, seq_len=seq_len, batch=batch)
        # Columns of a bool [T, E] map: distinct and in range by construction.
        self.writer.add(step=self.step, mb=mb, layer=layer, ids_TK=ids_TK, probs_TK=probs_TK, validated=True)


def _topk_ids(routing_map_TE: torch.Tensor, *, topk: int, layer: int, mb: int) -> torch.Tensor:
    """``[T, K]`` expert ids from a ``[T, E]`` bool routing map (exactly ``topk`` set per row)."""
    per_row_T = routing_map_TE.sum(dim=1)
    if bool((per_row_T != topk).any()):
        row = int((per_row_T != topk).nonzero()[0])
        raise RouteError(
            f"layer {layer} mb {mb}: token {row} routed to {int(per_row_T[row])} experts != topk "
            f"{topk} (token dropping or padding masks are not recordable)"
        )
    return routing_map_TE.nonzero()[:, 1].view(-1, topk)
