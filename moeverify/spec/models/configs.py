"""Tiny HF model families made in code: their ``config.json`` content, read without torch.

``families.py`` writes their seeded checkpoints; this table is what scenario files, the layout rules and
the checks' traits read (``moeverify run --list`` and scenario validation import no torch). A model is named by
a ``ModelRef`` (``ref.py``: a family here, or a user model's path and overrides) and read, here, into a
``ModelSpec``: config, shape, traits and an optional prepare hook. A new family is one entry in ``_FAMILIES``.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable

from moeverify.errors import UsageError
from moeverify.spec.layout import ModelShape
from moeverify.spec.models import kimi, user
from moeverify.spec.models.ref import ModelRef, as_ref
from moeverify.spec.models.traits import ModelTraits, traits_of

_COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    attention_dropout=0.0,
    bos_token_id=0,
    eos_token_id=1,
    pad_token_id=2,
)

_QWEN_HYBRID = dict(
    _COMMON,
    head_dim=16,
    intermediate_size=64,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=32,
    num_experts=8,
    num_experts_per_tok=2,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    tie_word_embeddings=False,
)

_DEEPSEEK_V3 = dict(
    _COMMON,
    model_type="deepseek_v3",
    num_key_value_heads=4,
    intermediate_size=128,
    moe_intermediate_size=32,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    n_shared_experts=1,
    first_k_dense_replace=1,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    q_lora_rank=32,
    kv_lora_rank=16,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    rope_interleave=True,
    tie_word_embeddings=False,
)

# family -> (HF architecture, config class module/name, config kwargs)
_FAMILIES: dict[str, tuple[str, dict]] = {
    "qwen2": ("Qwen2ForCausalLM", dict(_COMMON, model_type="qwen2", intermediate_size=128, tie_word_embeddings=False)),
    "qwen2_tied": (
        "Qwen2ForCausalLM",
        dict(_COMMON, model_type="qwen2", intermediate_size=128, tie_word_embeddings=True),
    ),
    "qwen3_moe": (
        "Qwen3MoeForCausalLM",
        dict(
            _COMMON,
            model_type="qwen3_moe",
            head_dim=16,
            intermediate_size=128,
            moe_intermediate_size=32,
            num_experts=8,
            num_experts_per_tok=2,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            norm_topk_prob=True,
            tie_word_embeddings=False,
        ),
    ),
    "deepseek_v3": ("DeepseekV3ForCausalLM", dict(_DEEPSEEK_V3, num_nextn_predict_layers=0)),
    # DeepSeek-V3 with one multi-token-prediction layer (HF layer 4: an MoE layer with enorm, hnorm, eh_proj and
    # shared_head.norm), seeded by mtp_weights.py since transformers' model has no MTP; built on CPU by mtp_spec.py.
    "deepseek_v3_mtp": ("DeepseekV3ForCausalLM", dict(_DEEPSEEK_V3, num_nextn_predict_layers=1)),
    # DeepSeek-V3 at its routing shape: 64 experts in 8 groups, 4 groups then top-8 per token, an fp32 expert bias:
    # the shape where top-k slot order (an ulp at top-k >= 3), group-limited ties and T == E live. Two layers (the
    # dense first one and one MoE layer) and narrow experts: 64 experts cost CPU time per expert, so CI stays cheap.
    "deepseek_v3_wide": (
        "DeepseekV3ForCausalLM",
        dict(
            _DEEPSEEK_V3,
            num_nextn_predict_layers=0,
            num_hidden_layers=2,
            n_routed_experts=64,
            num_experts_per_tok=8,
            n_group=8,
            topk_group=4,
            moe_intermediate_size=16,
        ),
    ),
    # Kimi-K2: DeepSeek-V3's architecture under its own model type and bridge (KimiK2Bridge: pre-softmax
    # sigmoid routing with an fp32 expert bias from the config's scoring_func, seq_aux_loss, a shared expert, a
    # dense first layer, MLA). transformers 5.12.1 has no class: kimi.py makes the config (DeepSeek-V3's plus
    # Kimi-K2's scoring_func, topk_method, ...) and registers it in-process; weights are DeepseekV3ForCausalLM's.
    # One expert group as Kimi-K2 (n_group=1), its routed scaling factor, MHA-sized kv heads.
    "kimi_k2": (
        kimi.ARCHITECTURE,
        dict(_DEEPSEEK_V3, model_type=kimi.MODEL_TYPE, n_group=1, routed_scaling_factor=2.827, **kimi.KIMI_FIELDS),
    ),
    # DeepSeek-V2: MLA, softmax routing without expert bias, a shared expert, a dense first layer.
    # (megatron-bridge 0.6.2 deprecates its DeepSeek-V2 bridge, to be removed in 0.7.)
    "deepseek_v2": (
        "DeepseekV2ForCausalLM",
        dict(
            _COMMON,
            model_type="deepseek_v2",
            num_key_value_heads=4,
            intermediate_size=64,
            moe_intermediate_size=32,
            n_routed_experts=8,
            n_shared_experts=1,
            num_experts_per_tok=2,
            first_k_dense_replace=1,
            routed_scaling_factor=1.0,
            norm_topk_prob=False,
            q_lora_rank=32,
            kv_lora_rank=16,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=16,
            head_dim=8,
            tie_word_embeddings=False,
        ),
    ),
    # GLM-4.5: sigmoid routing with an fp32 expert bias, a shared expert, a dense first layer, per-head q/k
    # norms, qkv biases, partial rotary; its bridge maps experts for grouped GEMM only (grouped_linear.py).
    "glm4_moe": (
        "Glm4MoeForCausalLM",
        dict(
            _COMMON,
            model_type="glm4_moe",
            head_dim=16,
            intermediate_size=64,
            moe_intermediate_size=32,
            n_routed_experts=8,
            n_shared_experts=1,
            num_experts_per_tok=2,
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
            use_qk_norm=True,
            attention_bias=True,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            tie_word_embeddings=False,
        ),
    ),
    # OLMoE: q/k norms over all heads at once (the bridge's OLMoESelfAttention), multi-head as real OLMoE
    # (its k_layernorm does not fit GQA: docs/families.md F1); grouped-GEMM-only expert mapping.
    "olmoe": (
        "OlmoeForCausalLM",
        dict(
            _COMMON,
            model_type="olmoe",
            num_key_value_heads=4,
            intermediate_size=32,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=False,
            tie_word_embeddings=False,
        ),
    ),
    # MiniMax-M2: full-dimension q/k norms (TP all-reduce of the sum of squares), sigmoid routing with an fp32
    # expert bias, partial rotary; grouped-GEMM-only expert mapping.
    "minimax_m2": (
        "MiniMaxM2ForCausalLM",
        dict(
            _COMMON,
            model_type="minimax_m2",
            head_dim=16,
            intermediate_size=32,
            num_local_experts=8,
            num_experts_per_tok=2,
            tie_word_embeddings=False,
        ),
    ),
    # GPT-OSS: learnable attention sinks, sliding windows on every other layer (8 tokens here), YaRN, expert and
    # router biases, clamped quick-GeGLU. intermediate 48, not 32: with hidden == 2 x intermediate the bridge
    # cannot tell gate_up_proj's orientation and loads it transposed (docs/families.md F4).
    "gpt_oss": (
        "GptOssForCausalLM",
        dict(
            _COMMON,
            model_type="gpt_oss",
            head_dim=16,
            intermediate_size=48,
            num_local_experts=8,
            num_experts_per_tok=2,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention"] * 2,
            tie_word_embeddings=False,
        ),
    ),
    # GLM-4.7-Flash: MLA, sigmoid routing with an fp32 expert bias, a shared expert, a dense first layer.
    "glm4_moe_lite": (
        "Glm4MoeLiteForCausalLM",
        dict(
            _COMMON,
            model_type="glm4_moe_lite",
            num_key_value_heads=4,
            intermediate_size=64,
            moe_intermediate_size=32,
            n_routed_experts=8,
            n_shared_experts=1,
            num_experts_per_tok=2,
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
            routed_scaling_factor=1.8,
            norm_topk_prob=True,
            q_lora_rank=32,
            kv_lora_rank=16,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=16,
            tie_word_embeddings=False,
        ),
    ),
    # Ernie-4.5-MoE: a dense first layer (moe_layer_start_index), a shared expert, an fp32 expert-bias
    # *parameter*, tied embeddings.
    "ernie45_moe": (
        "Ernie4_5_MoeForCausalLM",
        dict(
            _COMMON,
            model_type="ernie4_5_moe",
            intermediate_size=64,
            moe_intermediate_size=32,
            moe_num_experts=8,
            moe_k=2,
            moe_num_shared_experts=1,
            moe_layer_start_index=1,
            moe_layer_interval=1,
            tie_word_embeddings=True,
        ),
    ),
    # Qwen3-Next: gated delta net (linear attention) on three layers of four, gated full attention on the fourth,
    # zero-centered norms, a gated shared expert. Built on CPU by linear_attention.py.
    "qwen3_next": (
        "Qwen3NextForCausalLM",
        dict(_QWEN_HYBRID, model_type="qwen3_next", decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True),
    ),
    # Qwen3-Next with one MTP layer (mtp.layers.0: gated full attention and MoE; mtp.fc, its norms), as
    # production configs ask with mtp_num_hidden_layers (transformers' config class has no such field).
    "qwen3_next_mtp": (
        "Qwen3NextForCausalLM",
        dict(
            _QWEN_HYBRID,
            model_type="qwen3_next",
            decoder_sparse_step=1,
            mlp_only_layers=[],
            norm_topk_prob=True,
            mtp_num_hidden_layers=1,
        ),
    ),
    # Qwen3.5-MoE (text): the same hybrid stack with in_proj split four ways in the HF checkpoint.
    "qwen3_5_moe": ("Qwen3_5MoeForCausalLM", dict(_QWEN_HYBRID, model_type="qwen3_5_moe_text")),
}

FAMILIES: tuple[str, ...] = tuple(_FAMILIES)


def check_family(model: str | ModelRef) -> ModelRef:
    """``model`` as a reference; an unknown family's name is a ``UsageError`` listing the known ones."""
    ref = as_ref(model)
    if ref.is_user:
        return ref
    if user.is_user_key(ref.family):
        raise UsageError(
            f"user model {ref.family!r}: a user model is read from its reference (path and "
            "overrides), not looked up by its key"
        )
    if ref.family not in _FAMILIES:
        looks_like_path = any(c in str(ref.family) for c in "/\\.") or os.path.exists(str(ref.family))
        raise UsageError(
            f"unknown model family {ref.family!r}; known families: {', '.join(FAMILIES)}"
            + (
                "; a model of your own (a config.json or a checkpoint directory) is built from its reference: "
                "models.build(models.ModelRef.user(path, {key: value overrides}), layout)"
                if looks_like_path
                else ""
            )
        )
    return ref


def hf_config_dict(model: str | ModelRef) -> dict:
    """The HF ``config.json`` content of a family (by name or reference) or a user model (plain dict)."""
    ref = check_family(model)
    if ref.is_user:
        return dict(user.load(ref).config)
    arch, kwargs = _FAMILIES[str(ref.family)]  # a known family: check_family
    return dict(kwargs, architectures=[arch], dtype="bfloat16")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """What a model reference reads as: its HF config, shape and traits, and the hook to run before transformers
    or Megatron-Bridge reads that config (None for most; Kimi-K2's registers its in-code classes)."""

    ref: ModelRef
    config: dict = dataclasses.field(compare=False, repr=False)
    shape: ModelShape
    traits: ModelTraits
    prepare: Callable[[], None] | None = None


def prepare_hook(config: dict) -> Callable[[], None] | None:
    """The hook a config needs before transformers or Megatron-Bridge reads it (by its ``model_type``)."""
    # transformers 5.12.1 has no kimi_k2: its in-code config stands in for the remote code (never trusted)
    return kimi.ensure_registered if config.get("model_type") == kimi.MODEL_TYPE else None


def model_spec(model: str | ModelRef) -> ModelSpec:
    """The ``ModelSpec`` of a family (by name or reference) or a user model's reference."""
    ref = check_family(model)
    config = hf_config_dict(ref)
    return ModelSpec(
        ref=ref,
        config=config,
        shape=user.shape_of(config, where=ref.key),
        traits=traits_of(config, where=ref.key),
        prepare=prepare_hook(config),
    )


def family_shape(model: str | ModelRef) -> ModelShape:
    """Layer, head and expert counts the layout rules check against (one reading of HF configs for built-in
    families and user models alike: ``user.shape_of``)."""
    return user.shape_of(hf_config_dict(model), where=as_ref(model).key)


def family_traits(model: str | ModelRef) -> ModelTraits:
    """What checks need to know about a family or a user model, read from its HF config."""
    return traits_of(hf_config_dict(model), where=as_ref(model).key)
