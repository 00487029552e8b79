"""The local block spec (no Transformer Engine: every CPU rank, GPU nodes without TE): megatron-core's
local spec with the two modules that keep it from running our matrix replaced.

megatron-core 0.19.2's local spec refuses two things every matrix needs (docs/families.md, "How the CPU path
builds them"):
- its torch norm asserts "sequence parallel not supported by torch LayerNorm", and MoE with tp > 1 needs
  sequence parallelism: ``LocalNorm`` (``norms.py``) is the same per-token norm, marked ``sequence_parallel`` so that
  Megatron all-reduces its gradients across TP exactly as it does for TE's norms;
- its ``DotProductAttention`` takes no ``k_channels``/``v_channels`` (MLA) and refuses context parallelism:
  ``LocalCoreAttention`` is a plain causal attention on ``[s, b, heads, dim]`` that takes MLA's arguments and,
  under CP, all-gathers K/V from the CP group and masks with the global positions of Megatron's
  load-balanced split (chunks ``r`` and ``2*cp-1-r``). CP replicates weights and splits activations, so
  this is functionally faithful. Like megatron-core 0.19.2's ``DotProductAttention`` it also takes
  attention sinks (``softmax_type`` ``learnable``: a per-head ``softmax_offset`` parameter, one extra logit in
  each softmax row; ``off-by-one``: a zero logit) and sliding windows (``window_size`` ``(left, right)`` on the
  layers ``is_layer_window_attention`` selects; ``-1`` unbounded, as Transformer Engine reads it), so GPT-OSS
  builds as its bridge means it.
Legend: S = local sequence, B = micro-batch, H = heads, D = head dim, G = query groups.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math

import torch
from megatron.core import parallel_state
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.utils import is_layer_window_attention

from moeverify import runtime
from moeverify.errors import UsageError
from moeverify.models.grouped_linear import (
    CpuColumnParallelGroupedLinear,
    CpuRowParallelGroupedLinear,
    grouped_experts_spec,
)
from moeverify.models.linear_attention import CpuGatedDeltaNet, use_linear_attention
from moeverify.models.norms import LocalNorm


class _GatherFromCP(torch.autograd.Function):
    """All-gather along dim 0 over the CP group; backward all-reduces and keeps this rank's slice."""

    @staticmethod
    def forward(ctx, tensor_SBHD, group):
        ctx.group = group
        world = torch.distributed.get_world_size(group)
        parts = [torch.empty_like(tensor_SBHD) for _ in range(world)]
        torch.distributed.all_gather(parts, tensor_SBHD.contiguous(), group=group)
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        torch.distributed.all_reduce(grad, group=ctx.group)
        rank = torch.distributed.get_rank(ctx.group)
        size = grad.shape[0] // torch.distributed.get_world_size(ctx.group)
        return grad[rank * size : (rank + 1) * size], None


def cp_positions(local_len: int, cp_rank: int, cp_size: int) -> torch.Tensor:
    """Global sequence positions of the tokens a CP rank holds under Megatron's load-balanced split."""
    if cp_size == 1:
        return torch.arange(local_len)
    chunk = local_len // 2
    first, second = cp_rank, 2 * cp_size - 1 - cp_rank
    return torch.cat(
        [torch.arange(first * chunk, (first + 1) * chunk), torch.arange(second * chunk, (second + 1) * chunk)]
    )


class LocalCoreAttention(MegatronModule):
    """Causal scaled-dot-product core attention for CPU ranks (GQA, MLA channel sizes, CP)."""

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        k_channels: int | None = None,
        v_channels: int | None = None,
        cp_comm_type=None,
        pg_collection=None,
        **_unused,
    ):
        super().__init__(config=config)
        self.layer_number = layer_number
        self.attn_mask_type = attn_mask_type
        k_dim = k_channels if k_channels is not None else config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(k_dim)
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        self.cp_group = pg_collection.cp if pg_collection is not None and hasattr(pg_collection, "cp") else None

        self.window_size = (
            tuple(config.window_size)
            if is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number)
            else None
        )
        self.softmax_type = config.softmax_type
        if self.softmax_type not in ("vanilla", "off-by-one", "learnable"):
            raise ValueError(
                f"LocalCoreAttention: softmax_type {self.softmax_type!r} is not one of megatron-core "
                "0.19's vanilla, off-by-one, learnable"
            )
        if self.softmax_type == "learnable":
            tp_size = (
                pg_collection.tp.size()
                if pg_collection is not None and hasattr(pg_collection, "tp")
                else parallel_state.get_tensor_model_parallel_world_size()
            )
            self.softmax_offset = torch.nn.Parameter(
                torch.zeros(config.num_attention_heads // tp_size, dtype=config.params_dtype)
            )
            if config.perform_initialization:
                config.init_method(self.softmax_offset)

    def _cp_group(self):
        if self.cp_group is not None:
            return self.cp_group
        return parallel_state.get_context_parallel_group()

    def forward(
        self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None, packed_seq_params=None
    ):
        if packed_seq_params is not None:
            raise ValueError("LocalCoreAttention does not support packed sequences")
        q_SBHD, k_SBGD, v_SBGD = query, key, value
        group = self._cp_group()
        cp_size = torch.distributed.get_world_size(group) if group is not None else 1
        if cp_size > 1:
            cp_rank = torch.distributed.get_rank(group)
            k_SBGD = _GatherFromCP.apply(k_SBGD, group)
            v_SBGD = _GatherFromCP.apply(v_SBGD, group)
            q_pos = cp_positions(q_SBHD.shape[0], cp_rank, cp_size)
            k_pos = torch.cat([cp_positions(q_SBHD.shape[0], r, cp_size) for r in range(cp_size)])
        else:
            q_pos = torch.arange(q_SBHD.shape[0])
            k_pos = torch.arange(k_SBGD.shape[0])
        heads, groups = q_SBHD.shape[2], k_SBGD.shape[2]
        if heads != groups:
            k_SBGD = k_SBGD.repeat_interleave(heads // groups, dim=2)
            v_SBGD = v_SBGD.repeat_interleave(heads // groups, dim=2)
        q_BHSD, k_BHSD, v_BHSD = (t.permute(1, 2, 0, 3) for t in (q_SBHD, k_SBGD, v_SBGD))
        scores = torch.matmul(q_BHSD.float(), k_BHSD.float().transpose(-1, -2)) * self.softmax_scale
        if attention_mask is not None and cp_size == 1 and attention_mask.shape[-2:] == scores.shape[-2:]:
            # Megatron's [B or 1, 1, Sq, Sk] mask (True = masked), e.g. a padded batch's padding keys: the lowest
            # finite logit, so a query whose every key is padding (left padding) stays finite
            scores = scores.masked_fill(
                attention_mask.to(device=scores.device, dtype=torch.bool), torch.finfo(scores.dtype).min
            )
        scores = scores.masked_fill(self._mask(q_pos, k_pos).to(scores.device), float("-inf"))
        probs = self._softmax(scores).to(v_BHSD.dtype)
        if self.training and self.dropout_p > 0:
            with get_cuda_rng_tracker().fork():
                probs = torch.nn.functional.dropout(probs, p=self.dropout_p)
        out_BHSD = torch.matmul(probs, v_BHSD)
        s, b = out_BHSD.shape[2], out_BHSD.shape[0]
        return out_BHSD.permute(2, 0, 1, 3).reshape(s, b, -1)

    def _mask(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """[Sq, Sk], True = masked: causal, or outside the layer's sliding window (megatron-core's
        ``get_sliding_window_causal_mask``: key ``j`` is seen by query ``i`` iff ``i - left <= j <= i + right``)."""
        offset = k_pos.unsqueeze(0) - q_pos.unsqueeze(1)  # j - i
        if self.window_size is None:
            return offset > 0
        left, right = self.window_size
        masked = offset > right if right >= 0 else torch.zeros_like(offset, dtype=torch.bool)
        if left >= 0:
            masked = masked | (offset < -left)
        return masked

    def _softmax(self, scores_BHQK: torch.Tensor) -> torch.Tensor:
        """Row softmax, with one extra sink logit per head where ``softmax_type`` asks for it."""
        if self.softmax_type == "vanilla":
            return torch.softmax(scores_BHQK, dim=-1)
        b, h, q, _ = scores_BHQK.shape
        sink = (
            self.softmax_offset.float() if self.softmax_type == "learnable" else scores_BHQK.new_zeros(h)
        )  # off-by-one: a zero logit, i.e. +1 in the denominator
        sink_BHQ1 = sink.reshape(1, h, 1, 1).expand(b, h, q, 1)
        return torch.softmax(torch.cat([scores_BHQK, sink_BHQ1], dim=-1), dim=-1)[..., :-1]


def _patch_layer_spec(layer_spec: ModuleSpec, *, grouped_experts: bool, family: FamilySpec) -> ModuleSpec:
    spec = copy.deepcopy(layer_spec)
    sub = spec.submodules
    if grouped_experts:
        _use_grouped_experts(sub)
    for name in ("input_layernorm", "pre_mlp_layernorm"):
        if getattr(sub, name, None) is not None and not _is_identity(getattr(sub, name)):
            setattr(sub, name, LocalNorm)
    attn = sub.self_attention.submodules
    attn.core_attention = LocalCoreAttention
    for name in ("q_layernorm", "k_layernorm", "kv_layernorm"):
        if hasattr(attn, name) and not _is_identity(getattr(attn, name)):
            setattr(attn, name, LocalNorm)
    if family.self_attention is not None:
        sub.self_attention.module = family.self_attention
    for name in ("q_layernorm", "k_layernorm"):
        if getattr(family, name) is not None:
            setattr(attn, name, getattr(family, name))
    return spec


def _use_grouped_experts(sub) -> None:
    """MoE layers (megatron-core 0.19.2: ``mlp`` is ``partial(MoELayer, submodules=MoESubmodules(...))``) get
    ``TEGroupedMLP`` over the CPU grouped linears in place of ``SequentialMLP``."""

    mlp = sub.mlp
    if not (isinstance(mlp, functools.partial) and mlp.func is MoELayer):
        return
    moe_sub = mlp.keywords.get("submodules")
    if moe_sub is None or not hasattr(moe_sub, "experts"):
        raise ValueError(f"MoE layer spec without experts submodules ({mlp!r}): megatron-core's MoE spec changed")
    moe_sub.experts = grouped_experts_spec()


def _is_identity(module) -> bool:
    return module is IdentityOp or (isinstance(module, ModuleSpec) and module.module is IdentityOp)


@dataclasses.dataclass(frozen=True, kw_only=True)
class FamilySpec:
    """What a family's own layer spec changes in the GPT layer (its own classes, used as they are)."""

    self_attention: type | None = None  # the attention module (OLMoE's full-width q/k norms)
    q_layernorm: object = None  # q/k norm builders (MiniMax-M2's full-dimension norms)
    k_layernorm: object = None
    linear_attention: bool = False  # GDN on the layers linear_attention_freq marks (Qwen3-Next, Qwen3.5)


def local_block_spec(config, vp_stage: int | None = None, *, family: FamilySpec = FamilySpec()):
    """Decoder block spec for ``config`` (dense and MoE layers mixed per ``moe_layer_freq``) on CPU.

    Routed experts are ``SequentialMLP`` (per-expert linears), or ``TEGroupedMLP`` over grouped linears laid out
    as Transformer Engine's where ``config.moe_grouped_gemm`` is set (``moeverify.models.grouped_linear``)."""
    if getattr(config, "multi_latent_attention", False) and config.q_lora_rank is None and config.qk_layernorm:
        # megatron-core 0.19.2 (transformer/mla_qk_norm_config.py): MLA with QK norm and no query low-rank projection
        # takes linear_q_proj only as a fused norm + linear, which only Transformer Engine provides.
        raise UsageError(
            "q_lora_rank=None (no query low-rank projection, DeepSeek-V2-Lite style) with multi-latent attention: "
            "megatron-core builds it only with Transformer Engine's fused norm + linear, which this path (CPU ranks, "
            "or a GPU without Transformer Engine) lacks; give the config a q_lora_rank"
        )
    gpt_config = config
    if family.linear_attention:  # megatron-core's GPT specs assert no variant: GPT layers first, GDN swapped in below
        gpt_config = copy.copy(config)
        gpt_config.experimental_attention_variant = None
    block = get_gpt_decoder_block_spec(
        gpt_config, use_transformer_engine=False, normalization=config.normalization, vp_stage=vp_stage
    )
    _register_with_bridge()
    grouped = bool(config.moe_grouped_gemm)
    block.layer_specs = [_patch_layer_spec(s, grouped_experts=grouped, family=family) for s in block.layer_specs]
    if family.linear_attention:
        use_linear_attention(config, block.layer_specs, vp_stage)
    block.layer_norm = LocalNorm
    return block


def _register_with_bridge() -> None:
    """Megatron-Bridge finds how to split a parameter over TP from its module's class name (0.6.2:
    ``AutoMapping._MODULE_TYPE_REGISTRY``, extended through ``register_module_type``): the CPU modules that hold
    TP-split parameters are registered as the TE modules they stand for (``LocalCoreAttention`` holds the sinks'
    ``softmax_offset``, one entry per head, a column split as under ``TEDotProductAttention``; the grouped
    linears as ``TEColumnParallelGroupedLinear``/``TERowParallelGroupedLinear``)."""
    runtime.import_bridge()
    from megatron.bridge.models.conversion.param_mapping import AutoMapping  # lazy: megatron.bridge

    for cls, kind in (
        (LocalCoreAttention, "column"),
        (CpuColumnParallelGroupedLinear, "column"),
        (CpuRowParallelGroupedLinear, "row"),
        (CpuGatedDeltaNet, "column"),
    ):
        AutoMapping.register_module_type(cls.__name__, kind)
