"""Linear attention (Qwen3-Next, Qwen3.5-MoE) without flash-linear-attention: megatron-core's own
``GatedDeltaNet`` with its CUDA-only kernels replaced by torch ones, and the fused norm + in_proj it expects.

megatron-core 0.19.2's ``GatedDeltaNet`` (``megatron/core/ssm/gated_delta_net``) refuses to build without
flash-linear-attention (FLA, Triton: CUDA only), and its forward calls three FLA functions: ``causal_conv1d``
(depthwise causal conv + SiLU on ``[b, s, d]``), ``l2norm`` (q/k over the head dim, eps 1e-6) and
``chunk_gated_delta_rule``. ``CpuGatedDeltaNet`` is the same module (its parameters, TP split, CP all-to-alls
and every other line of its forward are megatron-core's) with torch versions of the three, each as
megatron-core itself writes it for ``deterministic_mode``: ``F.conv1d`` with ``padding = kernel - 1`` cut to
the sequence, and ``torch_chunk_gated_delta_rule`` (from transformers' Qwen3-Next). ``hf_parity`` compares the
result with transformers' own Qwen3-Next/Qwen3.5 layers, which use the same torch fallbacks without FLA.

The GDN layer's input norm is fused into ``in_proj`` (Transformer Engine's ``LayerNormColumnParallelLinear``;
the bridges map ``self_attention.in_proj.layer_norm_weight``): ``CpuLayerNormColumnParallelLinear`` is the
local norm followed by megatron-core's ``ColumnParallelLinear``. Its class name carries
``LayerNormColumnParallelLinear``, which is how Megatron-Bridge 0.6.2 tells the replicated norm weight from the
column-split weight. Packed sequences (THD, ``cu_seqlens``) are refused: the torch kernel does not take them.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from megatron.core.models.gpt.experimental_attention_variant_module_specs import get_linear_attention_pattern
from megatron.core.ssm.gated_delta_net import common as gdn_common
from megatron.core.ssm.gated_delta_net import gdn as gdn_module
from megatron.core.ssm.gated_delta_net.common import GatedDeltaNetSubmodules, torch_chunk_gated_delta_rule
from megatron.core.ssm.gated_delta_net.gdn import GatedDeltaNet
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.enums import LayerType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import get_num_layers_to_build
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from moeverify.errors import UsageError
from moeverify.models.norms import LocalNorm, local_norm_forward


def l2norm(x: torch.Tensor, dim: int = -1, eps: float = 1e-6) -> torch.Tensor:
    """FLA's ``l2norm``: ``x / sqrt(sum(x^2) + eps)`` in fp32, returned in ``x``'s dtype."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).sum(dim=dim, keepdim=True) + eps)).to(x.dtype)


def causal_conv1d(x, weight, bias=None, activation=None, initial_state=None, output_final_state=False, cu_seqlens=None):
    """FLA's ``causal_conv1d`` on ``x [b, s, d]`` with a depthwise ``weight [d, w]``: the output at ``t`` sees
    ``x[t-w+1 .. t]`` (zeros before the start), then SiLU; ``(y, None)`` as FLA returns without a final state."""
    if cu_seqlens is not None or initial_state is not None or output_final_state:
        raise UsageError(
            "the CPU gated delta net takes no packed sequences (cu_seqlens) and no "
            "recurrent state: run THD packing where flash-linear-attention is installed"
        )
    if activation not in ("silu", "swish"):
        raise ValueError(f"causal_conv1d: activation {activation!r}; megatron-core's GDN asserts silu/swish")
    seq_len, width = x.shape[1], weight.shape[-1]
    out = F.conv1d(x.transpose(1, 2), weight.unsqueeze(1), bias, padding=width - 1, groups=weight.shape[0])
    return F.silu(out[..., :seq_len]).transpose(1, 2), None


def _torch_rule(
    q, k, v, g, beta, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False, cu_seqlens=None
):
    if cu_seqlens is not None:
        raise UsageError(
            "the CPU gated delta net takes no packed sequences (cu_seqlens): run THD "
            "packing where flash-linear-attention is installed"
        )
    return torch_chunk_gated_delta_rule(
        q,
        k,
        v,
        g=g,
        beta=beta,
        initial_state=initial_state,
        output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
    )


@contextlib.contextmanager
def _torch_kernels():
    """megatron-core 0.19.2 looks the FLA functions up as module globals of ``common`` (``HAVE_FLA``, ``l2norm``)
    and ``gdn`` (``causal_conv1d``); they hold the torch versions while a ``CpuGatedDeltaNet`` builds or runs."""
    replaced = [
        (gdn_common, "HAVE_FLA", True),
        (gdn_common, "l2norm", l2norm),
        (gdn_module, "causal_conv1d", causal_conv1d),
    ]
    for module, name, _ in replaced:
        if not hasattr(module, name):
            raise RuntimeError(
                f"megatron-core's gated delta net has no {module.__name__}.{name}: the CPU path "
                "was written against megatron-core 0.19.2; read the new module before using it"
            )
    saved = [(module, name, getattr(module, name)) for module, name, _ in replaced]
    for module, name, value in replaced:
        setattr(module, name, value)
    try:
        yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)


class CpuGatedDeltaNet(GatedDeltaNet):
    """megatron-core's ``GatedDeltaNet`` running the torch kernels above (see the module docstring)."""

    def __init__(self, *args, **kwargs):
        with _torch_kernels():
            super().__init__(*args, **kwargs)

    def _setup_variant_attrs(self):
        super()._setup_variant_attrs()
        self.gated_delta_rule = _torch_rule

    def forward(self, *args, **kwargs):
        with _torch_kernels():
            return super().forward(*args, **kwargs)


class CpuLayerNormColumnParallelLinear(ColumnParallelLinear):
    """The input norm (``layer_norm_weight``) fused before a ``ColumnParallelLinear``, as Transformer Engine's
    ``LayerNormColumnParallelLinear`` holds it; under sequence parallelism the norm runs on the local tokens
    and the linear gathers them, as TE does."""

    def __init__(self, input_size, output_size, *, config, **kwargs):
        super().__init__(input_size, output_size, config=config, **kwargs)
        zero_centered = bool(getattr(config, "layernorm_zero_centered_gamma", False))
        init = torch.zeros if zero_centered else torch.ones
        self.layer_norm_weight = torch.nn.Parameter(init(input_size, dtype=config.params_dtype))
        self.layer_norm_weight.sequence_parallel = bool(config.sequence_parallel)

    def forward(self, input_, weight=None, runtime_gather_output=None):
        normed = local_norm_forward(self.config, input_, self.layer_norm_weight, self.config.layernorm_epsilon)
        return super().forward(normed, weight=weight, runtime_gather_output=runtime_gather_output)


def gdn_attention_spec() -> ModuleSpec:
    """The GDN attention of megatron-core's ``get_gated_delta_net_module_spec`` with the CPU modules; the layer's
    ``input_layernorm`` is fused into ``in_proj`` (``metainfo['fuse_input_layernorm']``, as the TE spec sets)."""
    return ModuleSpec(
        module=CpuGatedDeltaNet,
        submodules=GatedDeltaNetSubmodules(
            in_proj=CpuLayerNormColumnParallelLinear, out_norm=LocalNorm, out_proj=RowParallelLinear
        ),
        metainfo={"fuse_input_layernorm": True},
    )


def local_layer_numbers(config, vp_stage: int | None) -> list[int]:
    """Global (0-based) numbers of the decoder layers this rank builds, as megatron-core 0.19.2's
    ``get_transformer_block_with_experimental_attention_variant_spec`` slices them."""

    if config.pipeline_model_parallel_layout is not None:
        return list(
            config.pipeline_model_parallel_layout.get_layer_id_list(layer_type=LayerType.decoder, vp_stage=vp_stage)
        )
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
    return list(range(offset, offset + get_num_layers_to_build(config, vp_stage=vp_stage)))


def use_linear_attention(config, layer_specs: list, vp_stage: int | None) -> None:
    """Give the layers megatron-core's ``get_linear_attention_pattern`` marks linear the GDN attention."""

    if config.experimental_attention_variant != "gated_delta_net":
        raise ValueError(
            f"the CPU linear attention is gated_delta_net; the config asks for "
            f"{config.experimental_attention_variant!r}"
        )
    pattern = get_linear_attention_pattern(config)
    numbers = local_layer_numbers(config, vp_stage)
    if len(numbers) != len(layer_specs):
        raise ValueError(f"{len(layer_specs)} local layer specs for layers {numbers}: megatron-core's slicing changed")
    for number, spec in zip(numbers, layer_specs, strict=True):
        if pattern[number] == 1:
            spec.submodules.self_attention = gdn_attention_spec()
            spec.submodules.input_layernorm = IdentityOp
