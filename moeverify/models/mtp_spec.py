"""The multi-token-prediction (MTP) block on the CPU spec (no Transformer Engine).

Megatron-Bridge 0.6.2's ``GPTModelProvider.provide`` builds the MTP block from the module function
``megatron.bridge.models.gpt_provider.mtp_block_spec(config, vp_stage)``, which calls megatron-core 0.19.2's
``get_gpt_mtp_block_spec(config, spec, use_transformer_engine=True, ...)`` whatever the layer spec is:
``enorm``/``hnorm``/``layer_norm`` are ``TENorm`` and ``eh_proj`` ``TEColumnParallelLinear``, which need
Transformer Engine. ``local_mtp_block_spec`` is the same function on the CPU spec, as ``local_spec`` does for
the decoder: megatron-core's own MTP layer spec with the local backend (``eh_proj`` ``ColumnParallelLinear``:
the same column split, ``gather_output=False``, sequence-parallel input gather) and ``LocalNorm`` for the three
norms (megatron-core's torch norm refuses sequence parallelism); its inner layer is the last layer of the CPU
decoder block spec, as megatron-core takes the last layer of the block spec it is given.
``cpu_mtp_block_spec(registry)`` puts it in place of the bridge's function while a model is provided, and restores it.
"""

from __future__ import annotations

import contextlib
import copy
import functools

from moeverify.errors import UsageError


def local_mtp_block_spec(config, vp_stage: int | None = None, *, registry=None):
    """``gpt_provider.mtp_block_spec`` (megatron-bridge 0.6.2) on the CPU spec: ``None`` where this stage
    builds no MTP layer, else megatron-core's ``MultiTokenPredictionBlockSubmodules`` with CPU modules.
    ``registry`` (the bridge's mapping registry): where it maps the inner layer's input norm under TE's fused name
    only, ``linear_qkv`` holds it (``layer_norm_weight``) as TE's ``LayerNormColumnParallelLinear`` does
    (``mtp_input_norm_fused``)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec  # lazy: megatron
    from megatron.core.transformer.multi_token_prediction import get_mtp_num_layers_to_build  # lazy: megatron

    if not getattr(config, "mtp_num_layers", None) or not get_mtp_num_layers_to_build(config, vp_stage=vp_stage):
        return None  # a chunk without MTP asks nothing of its decoder spec
    layer_spec = config.transformer_layer_spec
    spec = layer_spec(config, vp_stage=vp_stage) if callable(layer_spec) else layer_spec
    if hasattr(spec, "layer_specs") and not spec.layer_specs:
        # The bridge re-derives the whole decoder's layer specs with TE here; the CPU spec has no such path.
        raise UsageError(
            "MTP on a pipeline stage that holds no decoder layer: Megatron-Bridge 0.6.2 takes the MTP "
            "layer's spec from Transformer Engine's decoder specs there, which the CPU spec cannot "
            "rebuild. Give the last stage at least one decoder layer (pp_last / pp_layout)"
        )
    block = get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False, vp_stage=vp_stage)
    if block is None:
        return None
    block = copy.deepcopy(block)
    block.layer_specs = [_local_norms(layer) for layer in block.layer_specs]
    if registry is not None and mtp_input_norm_fused(registry):
        for layer in block.layer_specs:
            _fuse_input_norm(layer.submodules.mtp_model_layer)
    return block


def _local_norms(layer_spec):
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear  # lazy: megatron

    from moeverify.models.norms import LocalNorm  # lazy: torch

    sub = layer_spec.submodules
    for name in ("enorm", "hnorm", "layer_norm", "eh_proj", "mtp_model_layer"):
        if not hasattr(sub, name):
            raise ValueError(
                f"MTP layer spec without {name!r} ({type(sub).__name__}): megatron-core 0.19.2's "
                "MultiTokenPredictionLayerSubmodules changed"
            )
    if sub.eh_proj is not ColumnParallelLinear:
        raise ValueError(
            f"MTP eh_proj of the local backend is {sub.eh_proj!r}, not ColumnParallelLinear: "
            "megatron-core's LocalSpecProvider changed"
        )
    sub.enorm = sub.hnorm = sub.layer_norm = LocalNorm
    return layer_spec


def _fuse_input_norm(layer_spec) -> None:
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear  # lazy: megatron
    from megatron.core.transformer.identity_op import IdentityOp  # lazy: megatron

    from moeverify.models.linear_attention import CpuLayerNormColumnParallelLinear  # lazy: torch, megatron

    sub = layer_spec.submodules
    attn = getattr(sub.self_attention, "submodules", None)
    if attn is None or getattr(attn, "linear_qkv", None) is not ColumnParallelLinear:
        raise ValueError(
            f"MTP inner layer without a ColumnParallelLinear linear_qkv ({attn!r}): cannot hold its "
            "input norm as Transformer Engine's LayerNormColumnParallelLinear does"
        )
    attn.linear_qkv = CpuLayerNormColumnParallelLinear
    sub.input_layernorm = IdentityOp


_SEPARATE_NORM = "mtp.layers.0.mtp_model_layer.input_layernorm.weight"
_FUSED_NORM = "mtp.layers.0.mtp_model_layer.self_attention.linear_qkv.layer_norm_weight"


def mtp_input_norm_fused(registry) -> bool:
    """Whether the MTP inner layer is built with its input norm in ``linear_qkv``: where the bridge maps that name
    only (megatron-bridge 0.6.2's Qwen3-Next bridge: its separate-norm aliases cover ``*`` patterns only,
    docs/families.md F9), as TE builds it; a separate norm where it is mapped (DeepSeek-V3)."""
    if registry.megatron_to_hf_lookup(_SEPARATE_NORM) is not None:
        return False
    if registry.megatron_to_hf_lookup(_FUSED_NORM) is not None:
        return True
    raise UsageError(
        f"the bridge maps neither {_SEPARATE_NORM} nor {_FUSED_NORM}: the MTP layer's input norm could not be loaded"
    )


@contextlib.contextmanager
def cpu_mtp_block_spec(registry):
    """While active, Megatron-Bridge's providers build MTP blocks from ``local_mtp_block_spec`` (with the input
    norm where ``registry``, the bridge's mapping registry, maps it)."""
    from megatron.bridge.models import gpt_provider  # lazy: megatron

    original = getattr(gpt_provider, "mtp_block_spec", None)
    if original is None:
        raise RuntimeError(
            "megatron.bridge.models.gpt_provider.mtp_block_spec is gone: GPTModelProvider.provide "
            "no longer builds MTP blocks as megatron-bridge 0.6.2 did; moeverify's CPU MTP spec needs "
            "a new hook"
        )
    gpt_provider.mtp_block_spec = functools.partial(local_mtp_block_spec, registry=registry)
    try:
        yield
    finally:
        gpt_provider.mtp_block_spec = original


def cpu_mtp_gaps(provider) -> list[str]:
    """What of ``provider``'s MTP the CPU spec cannot build as the bridge means it (empty where it can)."""
    if not getattr(provider, "mtp_num_layers", None):
        return []
    from megatron.bridge.models.gpt_provider import GPTModelProvider  # lazy: megatron

    if type(provider).provide is not GPTModelProvider.provide:
        return [
            f"MTP layers under {type(provider).__name__}'s own provide() (the CPU MTP spec replaces "
            "GPTModelProvider.provide's mtp_block_spec only)"
        ]
    return []
