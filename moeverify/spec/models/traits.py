"""What checks need to know about a model, read from its HF config (never from its name).

Oracles and mutants decide what applies to a model from these traits, so a user model (``--model PATH``)
gets the same checks as the built-in family it resembles. Pure Python: no torch, no transformers.

- ``expert_bias``: the HF checkpoint holds an expert-bias tensor (``e_score_correction_bias``, fp32) per
  MoE layer. Whether it does is decided by the architecture's modeling code in transformers 5.12.1, not by
  a config key (DeepSeek-V3's, GLM-4.5's, MiniMax-M2's register it unconditionally), so it is read from
  the config's ``architectures``.
- ``mtp_layers``: multi-token-prediction depth (``num_nextn_predict_layers`` / ``mtp_num_hidden_layers``).
- ``linear_attention``: the stack has gated-delta-net (linear attention) layers; ``gdn_in_proj`` says how
  the HF checkpoint lays out their input projection: ``"grouped"`` (Qwen3-Next's ``in_proj_qkvz`` /
  ``in_proj_ba``, interleaved per key head) or ``"flat"`` (separate projections), None without them.
- ``tied_embeddings``: the output layer shares the input embedding (``tie_word_embeddings``).
- ``dense_prefix``: decoder layers before the first MoE layer.
- ``mla``: multi-latent attention (``kv_lora_rank``): no fused ``linear_qkv``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from moeverify.errors import UsageError
from moeverify.spec.models.user import shape_of

# HF architectures whose modeling code (transformers 5.12.1) keeps an expert-bias tensor in every MoE layer,
# and whose Megatron-Bridge 0.6.2 bridge maps it onto the router's expert_bias.
_EXPERT_BIAS_ARCHITECTURES = frozenset(
    {
        "DeepseekV3ForCausalLM",
        "KimiK2ForCausalLM",
        "Glm4MoeForCausalLM",
        "Glm4MoeLiteForCausalLM",
        "MiniMaxM2ForCausalLM",
        "Ernie4_5_MoeForCausalLM",
    }
)
# Architectures whose gated-delta-net in_proj is stored head-grouped (in_proj_qkvz, in_proj_ba).
_GROUPED_GDN_ARCHITECTURES = frozenset({"Qwen3NextForCausalLM"})
_MTP_KEYS = ("num_nextn_predict_layers", "mtp_num_hidden_layers")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ModelTraits:
    """Facts about a model's architecture that decide which checks and mutants apply (module docstring)."""

    expert_bias: bool
    mtp_layers: int
    linear_attention: bool
    gdn_in_proj: str | None
    tied_embeddings: bool
    dense_prefix: int
    mla: bool


def traits_of(config, *, where: str = "model") -> ModelTraits:
    """The traits of an HF config (a ``config.json`` dict, or a transformers config object).

    Raises:
        UsageError: the config names no architecture, or does not say whether embeddings are tied.
    """
    if not isinstance(config, dict):
        config = config.to_dict()
    archs: Any = config.get("architectures") or ()
    if len(archs) != 1:
        raise UsageError(f"{where}: config 'architectures' must name exactly one model class, got {archs!r}")
    arch = archs[0]
    if not isinstance(config.get("tie_word_embeddings"), bool):
        raise UsageError(
            f"{where}: config needs a boolean tie_word_embeddings (got "
            f"{config.get('tie_word_embeddings')!r}); its default differs per architecture"
        )
    mtp = max(int(config.get(k) or 0) for k in _MTP_KEYS)
    shape = shape_of(config, where=where)
    linear = bool(shape.linear_heads)
    return ModelTraits(
        expert_bias=arch in _EXPERT_BIAS_ARCHITECTURES and shape.is_moe,
        mtp_layers=mtp,
        linear_attention=linear,
        gdn_in_proj=("grouped" if arch in _GROUPED_GDN_ARCHITECTURES else "flat") if linear else None,
        tied_embeddings=config["tie_word_embeddings"],
        dense_prefix=min(shape.moe_layers) if shape.moe_layers else shape.num_layers,
        mla=config.get("kv_lora_rank") is not None,
    )
