"""The layer specs of Megatron-Bridge 0.6.2 families that the CPU path rebuilds, and how.

Without Transformer Engine moeverify builds every layer from ``local_spec.local_block_spec``. That is the
same model as a family's own spec only where the family's spec is the GPT default or megatron-core's decoder
block spec, or changes it in ways the local spec can take over with the family's *own* classes. Each entry
below was read from the pinned source:

- ``gpt_provider.default_layer_spec``, megatron-core's ``get_gpt_decoder_block_spec`` (DeepSeek-V2/V3 pass it
  as a partial), Ernie-4.5's ``_ernie45_decoder_block_spec`` (``get_gpt_decoder_block_spec`` with TE): the
  GPT layer, nothing of the family's own;
- OLMoE's ``olmoe_layer_spec``: the default spec with ``self_attention.module = OLMoESelfAttention`` (q/k norms
  over all heads at once), kept as it is;
- MiniMax-M2's ``minimax_m2_layer_spec``: the MoE spec with ``q_layernorm``/``k_layernorm`` set to its
  ``FullDimQNorm``/``FullDimKNorm`` (plain torch, TP all-reduce of the sum of squares), kept as they are;
- megatron-core's ``get_transformer_block_with_experimental_attention_variant_spec`` (Qwen3-Next, Qwen3.5-MoE)
  with ``experimental_attention_variant="gated_delta_net"``: the GPT layers (MoE or dense per
  ``moe_layer_freq``), with megatron-core's ``GatedDeltaNet`` on the layers ``linear_attention_freq`` marks
  (``linear_attention.py``); its other variant (DSA) is refused.

Anything else (another family's spec function, DSA attention, zero-centered LayerNorm) is refused by
``builder``: replacing it would build, and then verify, another model. Attention sinks and sliding windows are
``LocalCoreAttention``'s (``local_spec.py``).
"""

from __future__ import annotations

import functools


def cpu_rebuilds() -> dict:
    """Bridge spec function -> the ``local_spec.FamilySpec`` that rebuilds it without Transformer Engine."""
    from megatron.bridge.models.ernie.ernie_45_bridge import _ernie45_decoder_block_spec  # lazy: megatron
    from megatron.bridge.models.gpt_provider import default_layer_spec  # lazy: megatron
    from megatron.bridge.models.minimax_m2.minimax_m2_provider import (  # lazy: megatron
        FullDimKNorm,
        FullDimQNorm,
        minimax_m2_layer_spec,
    )
    from megatron.bridge.models.olmoe.olmoe_provider import OLMoESelfAttention, olmoe_layer_spec  # lazy: megatron
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import (  # lazy: megatron
        get_transformer_block_with_experimental_attention_variant_spec,
    )
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec  # lazy: megatron

    from moeverify.models.local_spec import FamilySpec  # lazy: torch, megatron

    return {
        default_layer_spec: FamilySpec(),
        get_gpt_decoder_block_spec: FamilySpec(),
        _ernie45_decoder_block_spec: FamilySpec(),
        olmoe_layer_spec: FamilySpec(self_attention=OLMoESelfAttention),
        minimax_m2_layer_spec: FamilySpec(q_layernorm=FullDimQNorm, k_layernorm=FullDimKNorm),
        get_transformer_block_with_experimental_attention_variant_spec: FamilySpec(linear_attention=True),
    }


def cover_cuda_call_sites() -> None:
    """Bridge code that the CPU runtime's redirections do not reach, run under ``cpu.ordinal_current_device``
    (idempotent; a no-op on GPUs). megatron-bridge 0.6.2: MiniMax-M2's ``_FullDimQKNormMapping.hf_to_megatron``
    builds ``torch.device("cuda", torch.cuda.current_device())`` to load its q/k norms under TP > 1."""
    from megatron.bridge.models.minimax_m2.minimax_m2_bridge import _FullDimQKNormMapping  # lazy: megatron

    from moeverify.runtime import cpu  # lazy: torch

    original = _FullDimQKNormMapping.hf_to_megatron
    if getattr(original, "_moeverify_covered", False):
        return

    @functools.wraps(original)
    def hf_to_megatron(self, hf_weights, megatron_module):
        with cpu.ordinal_current_device():
            return original(self, hf_weights, megatron_module)

    # a mark on the function itself (functools.wraps' typed result declares no such attribute)
    setattr(hf_to_megatron, "_moeverify_covered", True)  # noqa: B010
    _FullDimQKNormMapping.hf_to_megatron = hf_to_megatron


def spec_function(provider):
    """The function behind ``provider.transformer_layer_spec`` (a partial is unwrapped)."""
    spec = provider.transformer_layer_spec
    return spec.func if isinstance(spec, functools.partial) else spec


def spec_name(fn) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', type(fn).__name__)}"
