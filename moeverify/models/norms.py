"""Per-token norms built from a Megatron config without Transformer Engine: ``LocalNorm`` (torch's RMSNorm or
LayerNorm, usable under sequence parallelism) and the zero-centered RMSNorm (``1 + weight``). A leaf: the local
block spec, the linear-attention modules and the MTP spec all build their norms here."""

from __future__ import annotations

import torch


class ZeroCenteredRMSNorm(torch.nn.Module):
    """RMSNorm scaled by ``1 + weight`` (``layernorm_zero_centered_gamma``, as Transformer Engine's norms and
    Qwen3-Next's HF norms define it), computed in fp32 and returned in the input's dtype."""

    def __init__(self, hidden_size: int, *, eps: float, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return zero_centered_rms_norm(x, self.weight, self.eps)


def zero_centered_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * (1.0 + weight.float())).to(x.dtype)


def local_norm_forward(config, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """What ``LocalNorm(config, ...)`` computes, on a weight held elsewhere (a fused norm + linear)."""
    if getattr(config, "layernorm_zero_centered_gamma", False):
        return zero_centered_rms_norm(x, weight, eps)
    if config.normalization == "RMSNorm":
        return torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, eps)
    raise ValueError(f"a fused norm + linear is built for RMSNorm only, got {config.normalization!r}")


class LocalNorm:
    """``torch.nn.RMSNorm`` / ``LayerNorm`` built from a Megatron config, usable under sequence parallelism
    (``ZeroCenteredRMSNorm`` where the config sets ``layernorm_zero_centered_gamma``)."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **_unused):
        zero_centered = bool(getattr(config, "layernorm_zero_centered_gamma", False))
        if zero_centered and config.normalization != "RMSNorm":
            raise ValueError(f"zero-centered gamma is built for RMSNorm only, got {config.normalization!r}")
        norm: torch.nn.Module
        if zero_centered:
            norm = ZeroCenteredRMSNorm(hidden_size, eps=eps, dtype=config.params_dtype)
        elif config.normalization == "RMSNorm":
            norm = torch.nn.RMSNorm(hidden_size, eps=eps, dtype=config.params_dtype)
        elif config.normalization == "LayerNorm":
            norm = torch.nn.LayerNorm(hidden_size, eps=eps, dtype=config.params_dtype)
        else:
            raise ValueError(f"LocalNorm supports RMSNorm and LayerNorm, got {config.normalization!r}")
        for param in norm.parameters():
            # Megatron marks its parameters with attributes of its own, which torch's stubs do not declare
            param.sequence_parallel = bool(config.sequence_parallel)  # type: ignore[attr-defined]
        return norm
