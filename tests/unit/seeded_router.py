"""A lone ``TopKRouter`` with seeded weights (and expert bias), for router-level tests: one definition."""

from __future__ import annotations

import torch


def seeded_router(*, hidden: int, experts: int, topk: int, seed: int, layer: int = 1, num_layers: int = 2, **overrides):
    """A megatron-core ``TopKRouter`` of ``experts`` experts, top-``topk``, CPU-initialised, weights (and expert bias,
    when ``overrides`` enable one) drawn from ``seed``, global layer number ``layer`` (1-based)."""
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.transformer_config import TransformerConfig

    settings = dict(
        num_layers=num_layers,
        hidden_size=hidden,
        num_attention_heads=2,
        num_moe_experts=experts,
        moe_router_topk=topk,
        use_cpu_initialization=True,
        moe_aux_loss_coeff=0.0,
        add_bias_linear=False,
    )
    settings.update(overrides)
    router = TopKRouter(TransformerConfig(**settings), pg_collection=get_default_pg_collection())
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        router.weight.normal_(0.0, 1.0, generator=g)
        if router.expert_bias is not None:
            router.expert_bias.normal_(0.0, 0.5, generator=g)
    router.set_layer_number(layer)
    return router
