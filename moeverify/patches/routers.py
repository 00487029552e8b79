"""The one router finder: every ``TopKRouter`` of a model, keyed by its global layer.

Global layers are 0-based. Megatron-Core 0.19 numbers a decoder router ``layer_number`` = its 1-based
global layer (pipeline and virtual-pipeline offsets included), and an MTP router ``layer_number`` = its
1-based MTP depth with ``is_mtp_layer`` set (``MultiTokenPredictionLayer`` builds its inner layer with
its own number, which ``TransformerLayer`` keeps without the decoder offset; the router's own aux-loss
tracking then adds ``num_layers``). So MTP depth ``i`` (0-based) is global layer ``num_layers + i``:
after the decoder's layers, never colliding with them.

Used by the router-replay patch (``ReplaySession``), the route recorder and the replay oracles, so the
three always agree on which routers a model has and what each one's layer is.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from moeverify.errors import UsageError


def global_layer(router) -> int:
    """0-based global layer number of a router; an MTP router of depth ``i`` is ``num_layers + i``."""
    number = router.layer_number
    if number is None:
        raise UsageError(
            "a TopKRouter has no layer_number (built outside a TransformerLayer); call "
            "router.set_layer_number(n) with its 1-based global layer number"
        )
    if getattr(router, "is_mtp_layer", False):
        return router.config.num_layers + number - 1
    return number - 1


def find_routers(model_chunks: torch.nn.Module | Iterable[torch.nn.Module]) -> dict[int, tuple[int, torch.nn.Module]]:
    """``{global layer: (chunk index, TopKRouter)}`` of every router in ``model_chunks``, MTP included.

    ``model_chunks`` is one module or the list of (virtual-pipeline) chunks of ONE model; a router reached
    twice is counted once, and two routers claiming one global layer are refused (``UsageError``).
    """
    from megatron.core.transformer.moe.router import TopKRouter  # lazy: megatron

    chunks = [model_chunks] if isinstance(model_chunks, torch.nn.Module) else list(model_chunks)
    found: dict[int, tuple[int, torch.nn.Module]] = {}
    seen: set[int] = set()
    for c, chunk in enumerate(chunks):
        for module in chunk.modules():
            if not isinstance(module, TopKRouter) or id(module) in seen:
                continue
            seen.add(id(module))
            layer = global_layer(module)
            if layer in found:
                raise UsageError(f"two routers claim global layer {layer}; pass the chunks of one model only")
            found[layer] = (c, module)
    return found


def moe_stage_config(model_chunks: torch.nn.Module | Iterable[torch.nn.Module]):
    """The model config when ``model_chunks`` are one pipeline stage of an MoE model (a stage may hold only
    dense layers: a dense prefix, an uneven split); else None. Read from the first module carrying a
    megatron-core ``TransformerConfig`` as ``.config`` (GPTModel and its wrappers do)."""
    from megatron.core.transformer.transformer_config import TransformerConfig  # lazy: megatron

    chunks = [model_chunks] if isinstance(model_chunks, torch.nn.Module) else list(model_chunks)
    for chunk in chunks:
        for module in chunk.modules():
            config = getattr(module, "config", None)
            if isinstance(config, TransformerConfig):
                moe = bool(config.num_moe_experts) and (config.pipeline_model_parallel_size or 1) > 1
                return config if moe else None
    return None
