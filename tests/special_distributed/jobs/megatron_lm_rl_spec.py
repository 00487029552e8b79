"""``--spec megatron_lm_rl_spec layer_spec`` for Megatron-LM's RL loop on ranks without Transformer Engine.

Megatron-LM's RL loop runs every log-prob and training forward with THD ``packed_seq_params`` (``rl_utils.py``
``get_logprobs`` builds ``cu_seqlens = [0, S]`` when it does not pack, for one CUDA-graph signature), and
megatron-core 0.19.2's local ``DotProductAttention`` refuses packed sequences (``dot_product_attention.py:153``):
only Transformer Engine's attention takes them. This spec is megatron-core's local layer spec for the job's
arguments (every layer MoE; read when Megatron-LM imports it, after parsing) with the core attention swapped for
``PackedCausalAttention``: causal attention per packed sequence, in torch. Nothing else changes.

Legend: T = packed tokens, S = sequence, B = micro-batch, H = heads, G = query groups, D = head dim.
"""

from __future__ import annotations

import math

import torch
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.module import MegatronModule
from megatron.training import get_args


def _causal(q_THD: torch.Tensor, k_TGD: torch.Tensor, v_TGD: torch.Tensor, scale: float) -> torch.Tensor:
    heads, groups = q_THD.shape[1], k_TGD.shape[1]
    if heads != groups:
        k_TGD, v_TGD = (x.repeat_interleave(heads // groups, dim=1) for x in (k_TGD, v_TGD))
    scores_HTT = torch.einsum("qhd,khd->hqk", q_THD.float(), k_TGD.float()) * scale
    t = q_THD.shape[0]
    later_TT = torch.ones(t, t, dtype=torch.bool, device=q_THD.device).triu(1)
    probs_HTT = scores_HTT.masked_fill(later_TT, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs_HTT, v_TGD.float()).to(q_THD.dtype)


class PackedCausalAttention(MegatronModule):
    """Causal core attention on ``[S, B, H, D]`` or, with THD ``packed_seq_params``, ``[T, H, D]`` cut at
    ``cu_seqlens_q_padded`` (else ``cu_seqlens_q``). No dropout (the job runs with attention dropout 0)."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, cp_comm_type=None, pg_collection=None, **kwargs):  # fmt: skip
        super().__init__(config=config)
        if (attention_dropout if attention_dropout is not None else config.attention_dropout) > 0:
            raise ValueError("PackedCausalAttention has no dropout: run with --attention-dropout 0")
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):  # fmt: skip
        if packed_seq_params is None:
            out_BSHD = torch.stack(
                [_causal(query[:, b], key[:, b], value[:, b], self.softmax_scale) for b in range(query.shape[1])]
            )
            return out_BSHD.transpose(0, 1).reshape(query.shape[0], query.shape[1], -1)
        if packed_seq_params.qkv_format != "thd":
            raise ValueError(f"PackedCausalAttention: qkv_format {packed_seq_params.qkv_format!r} (thd or none)")
        cu = packed_seq_params.cu_seqlens_q_padded
        cu = (cu if cu is not None else packed_seq_params.cu_seqlens_q).tolist()
        out_THD = torch.zeros_like(query)
        for start, end in zip(cu[:-1], cu[1:], strict=True):
            if end > start:
                out_THD[start:end] = _causal(query[start:end], key[start:end], value[start:end], self.softmax_scale)
        return out_THD


def _layer_spec():
    # Imported by Megatron-LM before the model-parallel groups exist (argument_utils.py:457), so a layer spec (every
    # layer MoE, the job's model), not gpt_builder's block spec, which counts the layers of a pipeline stage.
    args = get_args()
    spec = get_gpt_layer_local_spec(
        num_experts=args.num_experts, moe_grouped_gemm=args.moe_grouped_gemm, qk_layernorm=args.qk_layernorm,
        normalization=args.normalization,
    )  # fmt: skip
    spec.submodules.self_attention.submodules.core_attention = PackedCausalAttention
    return spec


layer_spec = _layer_spec()
