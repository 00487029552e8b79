"""Tiny HF model families made in code: configs, seeded weights, safetensors checkpoints in a cache dir.

No hub access. For a given (family, seed) the checkpoint bytes are deterministic. Weights are stored
in bf16 like real checkpoints, except DeepSeek-V3's ``e_score_correction_bias``, which real checkpoints
keep in fp32 (a tiny model stored all-bf16 would hide fp32 bugs).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from moeverify.errors import UsageError
from moeverify.layout import ModelShape
from moeverify.models import kimi, mtp_weights, user

_COMMON = dict(vocab_size=256, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6,
               attention_dropout=0.0, bos_token_id=0, eos_token_id=1, pad_token_id=2)

_QWEN_HYBRID = dict(_COMMON, head_dim=16, intermediate_size=64, moe_intermediate_size=32,
                    shared_expert_intermediate_size=32, num_experts=8, num_experts_per_tok=2, linear_conv_kernel_dim=4,
                    linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
                    linear_num_value_heads=4, tie_word_embeddings=False)

_DEEPSEEK_V3 = dict(_COMMON, model_type="deepseek_v3", num_key_value_heads=4, intermediate_size=128,
                    moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
                    n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                    q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                    rope_interleave=True, tie_word_embeddings=False)

# family -> (HF architecture, config class module/name, config kwargs)
_FAMILIES: dict[str, tuple[str, dict]] = {
    "qwen2": ("Qwen2ForCausalLM", dict(_COMMON, model_type="qwen2", intermediate_size=128,
                                       tie_word_embeddings=False)),
    "qwen2_tied": ("Qwen2ForCausalLM", dict(_COMMON, model_type="qwen2", intermediate_size=128,
                                            tie_word_embeddings=True)),
    "qwen3_moe": ("Qwen3MoeForCausalLM", dict(_COMMON, model_type="qwen3_moe", head_dim=16, intermediate_size=128,
                                              moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                                              decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
                                              tie_word_embeddings=False)),
    "deepseek_v3": ("DeepseekV3ForCausalLM", dict(_DEEPSEEK_V3, num_nextn_predict_layers=0)),
    # DeepSeek-V3 with one multi-token-prediction layer (HF layer 4: an MoE layer with enorm, hnorm, eh_proj and
    # shared_head.norm), seeded by mtp_weights.py since transformers' model has no MTP; built on CPU by mtp_spec.py.
    "deepseek_v3_mtp": ("DeepseekV3ForCausalLM", dict(_DEEPSEEK_V3, num_nextn_predict_layers=1)),
    # DeepSeek-V3 at its routing shape: 64 experts in 8 groups, 4 groups then top-8 per token, an fp32 expert bias:
    # the shape where top-k slot order (an ulp at top-k >= 3), group-limited ties and T == E live. Two layers (the
    # dense first one and one MoE layer) and narrow experts: 64 experts cost CPU time per expert, so CI stays cheap.
    "deepseek_v3_wide": ("DeepseekV3ForCausalLM", dict(_DEEPSEEK_V3, num_nextn_predict_layers=0, num_hidden_layers=2,
                                                       n_routed_experts=64, num_experts_per_tok=8, n_group=8,
                                                       topk_group=4, moe_intermediate_size=16)),
    # Kimi-K2: DeepSeek-V3's architecture under its own model type and bridge (KimiK2Bridge: pre-softmax
    # sigmoid routing with an fp32 expert bias from the config's scoring_func, seq_aux_loss, a shared expert, a
    # dense first layer, MLA). transformers 5.12.1 has no class: kimi.py makes the config (DeepSeek-V3's plus
    # Kimi-K2's scoring_func, topk_method, ...) and registers it in-process; weights are DeepseekV3ForCausalLM's.
    # One expert group as Kimi-K2 (n_group=1), its routed scaling factor, MHA-sized kv heads.
    "kimi_k2": (kimi.ARCHITECTURE, dict(_DEEPSEEK_V3, model_type=kimi.MODEL_TYPE, n_group=1,
                                        routed_scaling_factor=2.827, **kimi.KIMI_FIELDS)),
    # DeepSeek-V2: MLA, softmax routing without expert bias, a shared expert, a dense first layer.
    # (megatron-bridge 0.6.2 deprecates its DeepSeek-V2 bridge, to be removed in 0.7.)
    "deepseek_v2": ("DeepseekV2ForCausalLM", dict(
        _COMMON, model_type="deepseek_v2", num_key_value_heads=4, intermediate_size=64, moe_intermediate_size=32,
        n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1,
        routed_scaling_factor=1.0, norm_topk_prob=False, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, head_dim=8, tie_word_embeddings=False)),
    # GLM-4.5: sigmoid routing with an fp32 expert bias, a shared expert, a dense first layer, per-head q/k
    # norms, qkv biases, partial rotary; its bridge maps experts for grouped GEMM only (grouped_linear.py).
    "glm4_moe": ("Glm4MoeForCausalLM", dict(
        _COMMON, model_type="glm4_moe", head_dim=16, intermediate_size=64, moe_intermediate_size=32,
        n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1, n_group=1,
        topk_group=1, use_qk_norm=True, attention_bias=True, routed_scaling_factor=2.5, norm_topk_prob=True,
        tie_word_embeddings=False)),
    # OLMoE: q/k norms over all heads at once (the bridge's OLMoESelfAttention), multi-head as real OLMoE
    # (its k_layernorm does not fit GQA: docs/families.md F1); grouped-GEMM-only expert mapping.
    "olmoe": ("OlmoeForCausalLM", dict(
        _COMMON, model_type="olmoe", num_key_value_heads=4, intermediate_size=32, num_experts=8,
        num_experts_per_tok=2, norm_topk_prob=False, tie_word_embeddings=False)),
    # MiniMax-M2: full-dimension q/k norms (TP all-reduce of the sum of squares), sigmoid routing with an fp32
    # expert bias, partial rotary; grouped-GEMM-only expert mapping.
    "minimax_m2": ("MiniMaxM2ForCausalLM", dict(
        _COMMON, model_type="minimax_m2", head_dim=16, intermediate_size=32, num_local_experts=8,
        num_experts_per_tok=2, tie_word_embeddings=False)),
    # GPT-OSS: learnable attention sinks, sliding windows on every other layer (8 tokens here), YaRN, expert and
    # router biases, clamped quick-GeGLU. intermediate 48, not 32: with hidden == 2 x intermediate the bridge
    # cannot tell gate_up_proj's orientation and loads it transposed (docs/families.md F4).
    "gpt_oss": ("GptOssForCausalLM", dict(
        _COMMON, model_type="gpt_oss", head_dim=16, intermediate_size=48, num_local_experts=8,
        num_experts_per_tok=2, sliding_window=8, layer_types=["sliding_attention", "full_attention"] * 2,
        tie_word_embeddings=False)),
    # GLM-4.7-Flash: MLA, sigmoid routing with an fp32 expert bias, a shared expert, a dense first layer.
    "glm4_moe_lite": ("Glm4MoeLiteForCausalLM", dict(
        _COMMON, model_type="glm4_moe_lite", num_key_value_heads=4, intermediate_size=64, moe_intermediate_size=32,
        n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1, n_group=1,
        topk_group=1, routed_scaling_factor=1.8, norm_topk_prob=True, q_lora_rank=32, kv_lora_rank=16,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, tie_word_embeddings=False)),
    # Ernie-4.5-MoE: a dense first layer (moe_layer_start_index), a shared expert, an fp32 expert-bias
    # *parameter*, tied embeddings.
    "ernie45_moe": ("Ernie4_5_MoeForCausalLM", dict(
        _COMMON, model_type="ernie4_5_moe", intermediate_size=64, moe_intermediate_size=32, moe_num_experts=8,
        moe_k=2, moe_num_shared_experts=1, moe_layer_start_index=1, moe_layer_interval=1)),
    # Qwen3-Next: gated delta net (linear attention) on three layers of four, gated full attention on the fourth,
    # zero-centered norms, a gated shared expert. Built on CPU by linear_attention.py.
    "qwen3_next": ("Qwen3NextForCausalLM", dict(_QWEN_HYBRID, model_type="qwen3_next", decoder_sparse_step=1,
                                                mlp_only_layers=[], norm_topk_prob=True)),
    # Qwen3-Next with one MTP layer (mtp.layers.0: gated full attention and MoE; mtp.fc, its norms), as
    # production configs ask with mtp_num_hidden_layers (transformers' config class has no such field).
    "qwen3_next_mtp": ("Qwen3NextForCausalLM", dict(_QWEN_HYBRID, model_type="qwen3_next", decoder_sparse_step=1,
                                                    mlp_only_layers=[], norm_topk_prob=True,
                                                    mtp_num_hidden_layers=1)),
    # Qwen3.5-MoE (text): the same hybrid stack with in_proj split four ways in the HF checkpoint.
    "qwen3_5_moe": ("Qwen3_5MoeForCausalLM", dict(_QWEN_HYBRID, model_type="qwen3_5_moe_text")),
}

FAMILIES: tuple[str, ...] = tuple(_FAMILIES)


def _check_family(family: str) -> None:
    if family not in _FAMILIES and not user.is_user_key(family):
        raise UsageError(f"unknown model family {family!r}; known families: {', '.join(FAMILIES)}")


def hf_config_dict(family: str) -> dict:
    """The HF ``config.json`` content of a family or a registered user model (plain dict)."""
    _check_family(family)
    if user.is_user_key(family):
        return dict(user.registered(family).config)
    arch, kwargs = _FAMILIES[family]
    return dict(kwargs, architectures=[arch], dtype="bfloat16")


def family_shape(family: str) -> ModelShape:
    """Layer, head and expert counts the layout rules check against (one reading of HF configs for built-in
    families and user models alike: ``user.shape_of``)."""
    return user.shape_of(hf_config_dict(family), where=family)


def cache_dir() -> Path:
    root = os.environ.get("MOEVERIFY_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "moeverify")
    return Path(root) / "models"


def _fingerprint(cfg: dict, seed: int) -> str:
    import transformers

    versions = [_WEIGHTS_VERSION] + ([mtp_weights.RECIPE_VERSION] if mtp_weights.mtp_depth(cfg) else [])
    blob = json.dumps([cfg, seed, transformers.__version__, *versions], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


_WEIGHTS_VERSION = 1  # bump when the weight recipe below changes


def _seeded_weights(model: torch.nn.Module, seed: int) -> None:
    """Overwrite every parameter and float buffer with seeded values (independent of HF's init order)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in sorted(list(model.named_parameters()) + list(model.named_buffers())):
            if not tensor.is_floating_point() or "rotary" in name or "inv_freq" in name:
                continue
            noise = torch.randn(tensor.shape, generator=gen, dtype=torch.float32)
            value = seeded_value(name, noise)
            tensor.copy_(value.to(tensor.dtype))


def seeded_value(name: str, noise: torch.Tensor) -> torch.Tensor:
    """The recipe: seeded fp32 values for the HF tensor ``name`` from standard-normal ``noise``."""
    if name.endswith("norm.weight") or "layernorm" in name:
        return 1.0 + 0.1 * noise
    if "e_score_correction_bias" in name:
        return 0.05 * noise  # non-zero so that bias-aware routing differs from bias-free
    if name.endswith(".bias"):
        return 0.02 * noise
    if ".gate.weight" in name or name.endswith("gate.weight"):
        return 0.5 * noise  # router: spread logits so that top-k choices are well separated
    return 0.05 * noise


def _fp32_expert_bias(model: torch.nn.Module) -> None:
    """Real DeepSeek-V3 checkpoints keep the router's correction bias in fp32 (a buffer; Ernie-4.5's is a parameter)."""
    for module in model.modules():
        bias = getattr(module, "e_score_correction_bias", None)
        if isinstance(bias, torch.nn.Parameter):
            module.e_score_correction_bias = torch.nn.Parameter(bias.detach().to(torch.float32),
                                                                requires_grad=bias.requires_grad)
        elif isinstance(bias, torch.Tensor):
            module.e_score_correction_bias = bias.to(torch.float32)


def _write_checkpoint(cfg: dict, seed: int, dst: Path) -> None:
    import transformers

    if cfg.get("model_type") == kimi.MODEL_TYPE:
        kimi.ensure_registered()  # transformers 5.12.1 has no kimi_k2: the in-code config (kimi.py)
    config = transformers.AutoConfig.for_model(**{k: v for k, v in cfg.items() if k != "architectures"})
    config.architectures = cfg["architectures"]
    model_cls = kimi.model_class(cfg["architectures"][0])
    torch.manual_seed(seed)
    model = model_cls(config).to(_STORED_DTYPES.get(cfg.get("dtype") or cfg.get("torch_dtype"), torch.bfloat16))
    _fp32_expert_bias(model)
    _seeded_weights(model, seed)
    model.save_pretrained(dst, safe_serialization=True)
    mtp_weights.add_mtp_tensors(cfg, seed, dst, value=seeded_value)  # transformers' models hold no MTP layers


_STORED_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def hf_checkpoint(family: str, seed: int = 0) -> Path:
    """Path of the HF checkpoint of ``family`` (created once, atomically, in the cache dir).

    A user model with real weights is its own directory; one without gets seeded weights like a family.
    """
    _check_family(family)
    cfg = hf_config_dict(family)
    if user.is_user_key(family):
        real = user.registered(family).weights_dir
        if real is not None:
            return real
    label = family.removeprefix(user.PREFIX).replace("+", "-") if user.is_user_key(family) else family
    dst = cache_dir() / f"{label}-seed{seed}-{_fingerprint(cfg, seed)}"
    if (dst / "config.json").exists():
        return dst
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", dir=dst.parent))
    try:
        _write_checkpoint(cfg, seed, tmp)
        try:
            os.rename(tmp, dst)  # atomic; another rank may have won the race, which is fine
        except OSError:
            if not (dst / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dst
