"""Write tiny HF configs of the MoE families Megatron-Bridge 0.6.2 converts, for ``moeverify run --model DIR``.

    .venv/bin/python tools/family_configs.py OUT_DIR [NAME ...]      # every family, or the names given

Each OUT_DIR/NAME/config.json is made in code from the family's transformers config class (no download):
4 layers, hidden 64, 4 heads (2 kv heads), 8 routed experts, top-2, vocab 256, keeping what makes the family
hard (sinks and alternating sliding windows, shared experts, dense prefix layers, linear attention). No
weights are written: moeverify seeds them per scenario seed. docs/families.md has the results.
"""

from __future__ import annotations

import sys
from pathlib import Path

COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    bos_token_id=0,
    eos_token_id=1,
    num_hidden_layers=4,
)
_LINEAR_ATTENTION = dict(
    layer_types=["linear_attention"] * 3 + ["full_attention"],
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
)

# name -> (transformers config class, architecture, family keys)
FAMILIES = {
    # multi-head, as real OLMoE checkpoints are: the bridge's k_layernorm does not fit GQA (docs/families.md F1)
    "olmoe": (
        "OlmoeConfig",
        "OlmoeForCausalLM",
        dict(intermediate_size=32, num_experts=8, num_experts_per_tok=2, num_key_value_heads=4),
    ),
    "gpt_oss": (
        "GptOssConfig",
        "GptOssForCausalLM",
        dict(
            intermediate_size=48,
            head_dim=16,
            num_local_experts=8,
            num_experts_per_tok=2,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention"] * 2,
        ),
    ),
    "deepseek_v2": (
        "DeepseekV2Config",
        "DeepseekV2ForCausalLM",
        dict(
            intermediate_size=64,
            moe_intermediate_size=32,
            n_routed_experts=8,
            n_shared_experts=1,
            num_experts_per_tok=2,
            first_k_dense_replace=1,
            kv_lora_rank=16,
            q_lora_rank=32,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=16,
            head_dim=8,
        ),
    ),
    "glm4_moe": (
        "Glm4MoeConfig",
        "Glm4MoeForCausalLM",
        dict(
            intermediate_size=64,
            moe_intermediate_size=32,
            head_dim=16,
            n_routed_experts=8,
            n_shared_experts=1,
            num_experts_per_tok=2,
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
            use_qk_norm=True,
        ),
    ),
    "qwen3_next": (
        "Qwen3NextConfig",
        "Qwen3NextForCausalLM",
        dict(
            intermediate_size=64,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
            head_dim=16,
            num_experts=8,
            num_experts_per_tok=2,
            **_LINEAR_ATTENTION,
        ),
    ),
    "ernie45_moe": (
        "Ernie4_5_MoeConfig",
        "Ernie4_5_MoeForCausalLM",
        dict(
            intermediate_size=64,
            moe_intermediate_size=32,
            moe_num_experts=8,
            moe_k=2,
            moe_num_shared_experts=1,
            moe_layer_start_index=1,
            moe_layer_interval=1,
        ),
    ),
    "minimax_m2": (
        "MiniMaxM2Config",
        "MiniMaxM2ForCausalLM",
        dict(intermediate_size=32, head_dim=16, num_local_experts=8, num_experts_per_tok=2),
    ),
    "qwen35_moe": (
        "Qwen3_5MoeTextConfig",
        "Qwen3_5MoeForCausalLM",
        dict(
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
            head_dim=16,
            num_experts=8,
            num_experts_per_tok=2,
            **_LINEAR_ATTENTION,
        ),
    ),
    # GLM-5: MLA with DeepSeek sparse attention (DSA); its bridge builds megatron-core's DSA variant, which the CPU
    # path refuses (docs/families.md)
    "glm_moe_dsa": (
        "GlmMoeDsaConfig",
        "GlmMoeDsaForCausalLM",
        dict(
            intermediate_size=64,
            moe_intermediate_size=32,
            num_key_value_heads=4,
            n_routed_experts=8,
            num_experts=8,
            n_shared_experts=1,
            num_experts_per_tok=2,
            first_k_dense_replace=1,
            kv_lora_rank=16,
            q_lora_rank=32,
            qk_rope_head_dim=8,
            qk_nope_head_dim=16,
            v_head_dim=16,
            head_dim=8,
            index_topk=8,
            index_head_dim=16,
            index_n_heads=2,
            indexer_rope_interleave=True,
        ),
    ),  # read by the bridge, not in the class
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        dict(intermediate_size=32, num_local_experts=8, num_experts_per_tok=2),
    ),
}


def write(out: Path, name: str) -> Path:
    import transformers

    cls_name, arch, keys = FAMILIES[name]
    config = getattr(transformers, cls_name)(**{**COMMON, **keys}, architectures=[arch])
    stored = config.to_dict()
    lost = [k for k, v in keys.items() if stored.get(k, getattr(config, k, None)) != v]
    if lost:
        raise SystemExit(f"{name}: {cls_name} did not keep {lost}")
    config.save_pretrained(out / name)
    return out / name


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    out, names = Path(argv[0]), argv[1:] or list(FAMILIES)
    unknown = [n for n in names if n not in FAMILIES]
    if unknown:
        print(f"unknown family {unknown}; known: {', '.join(FAMILIES)}", file=sys.stderr)
        return 2
    for name in names:
        print(write(out, name))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
