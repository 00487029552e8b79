"""Seeded multi-token-prediction (MTP) tensors for tiny checkpoints whose config asks for MTP layers.

transformers' DeepSeek-V3 and Qwen3-Next models hold no MTP module (transformers 5.12.1), so a checkpoint
written from them has no MTP tensors, while Megatron-Bridge builds an MTP block from the config's
``num_nextn_predict_layers`` / ``mtp_num_hidden_layers`` and loads it from the checkpoint. This module adds
the tensors production checkpoints carry under the names Megatron-Bridge 0.6.2 maps:

- DeepSeek-V3 (``deepseek/common.py``'s ``get_common_mapping_list``): MTP depth ``i`` is HF layer
  ``model.layers.{N + i}``: a decoder layer's tensors (the MoE layer: attention, norms, router, experts, shared
  expert) plus ``enorm``, ``hnorm``, ``eh_proj`` ``[H, 2H]`` and ``shared_head.norm``. Real checkpoints also
  carry ``embed_tokens`` and ``shared_head.head`` in that layer (copies of the shared embedding and head); the
  bridge maps neither, so they are not written here (docs/families.md F8).
- Qwen3-Next (``qwen/qwen3_next_bridge.py``): ``mtp.layers.{i}.*`` (a full-attention MoE layer),
  ``mtp.fc`` ``[H, 2H]``, ``mtp.pre_fc_norm_embedding``, ``mtp.pre_fc_norm_hidden``, ``mtp.norm``.

The layer's tensors take the names (renumbered), shapes and dtypes of the checkpoint's last decoder layer as
transformers saved it (the fp32 expert bias stays fp32), which is the layer Megatron-Core 0.19.2 builds the
MTP layer from (``get_gpt_mtp_block_spec_for_backend``: the decoder block's last layer spec). Values follow
``families.seeded_value``'s recipe from their own generator, seeded by ``seed``: deterministic per seed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import torch

from moeverify.errors import UsageError


@dataclasses.dataclass(frozen=True, kw_only=True)
class MtpNames:
    """Where one architecture keeps its MTP tensors in an HF checkpoint."""

    layer_prefix: str  # of the MTP layer's decoder-layer tensors; formatted with i (depth), n_plus_i
    extras: tuple[tuple[str, str], ...]  # (name after extras_prefix, "norm" [H] | "proj" [H, 2H])
    extras_prefix: str  # formatted as layer_prefix


_DEEPSEEK = MtpNames(
    layer_prefix="model.layers.{n_plus_i}.",
    extras_prefix="model.layers.{n_plus_i}.",
    extras=(
        ("enorm.weight", "norm"),
        ("hnorm.weight", "norm"),
        ("eh_proj.weight", "proj"),
        ("shared_head.norm.weight", "norm"),
    ),
)
_QWEN3_NEXT = MtpNames(
    layer_prefix="mtp.layers.{i}.",
    extras_prefix="mtp.",
    extras=(
        ("pre_fc_norm_embedding.weight", "norm"),
        ("pre_fc_norm_hidden.weight", "norm"),
        ("fc.weight", "proj"),
        ("norm.weight", "norm"),
    ),
)

# HF architecture -> (config key of the MTP depth count, names)
_ARCHITECTURES = {
    "DeepseekV3ForCausalLM": ("num_nextn_predict_layers", _DEEPSEEK),
    "Qwen3NextForCausalLM": ("mtp_num_hidden_layers", _QWEN3_NEXT),
}
RECIPE_VERSION = 1  # part of a checkpoint's cache fingerprint where MTP tensors are added; bump on change
_SEED_SALT = 0x4D5450  # MTP noise is drawn apart from the decoder's (same seed): no MTP tensor copies another


def mtp_depth(cfg: dict) -> int:
    """MTP layers ``cfg`` asks for that this module writes (0 for none, and for architectures it does not know:
    their checkpoints stay as transformers writes them)."""
    arch = (cfg.get("architectures") or [""])[0]
    if arch not in _ARCHITECTURES:
        return 0
    depth = cfg.get(_ARCHITECTURES[arch][0]) or 0
    if not isinstance(depth, int) or depth < 0:
        raise UsageError(f"{arch}: {_ARCHITECTURES[arch][0]} must be a non-negative int, got {depth!r}")
    return depth


def mtp_specs(cfg: dict, saved: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> dict[str, tuple]:
    """``{hf_name: (shape, dtype)}`` of the MTP tensors ``cfg`` asks for, from ``saved`` (the names, shapes and
    dtypes of the checkpoint transformers wrote)."""
    depth = mtp_depth(cfg)
    if not depth:
        return {}
    names = _ARCHITECTURES[cfg["architectures"][0]][1]
    n, hidden = int(cfg["num_hidden_layers"]), int(cfg["hidden_size"])
    template = f"model.layers.{n - 1}."
    layer = {name[len(template) :]: spec for name, spec in saved.items() if name.startswith(template)}
    if not any(k.startswith("self_attn.") for k in layer) or not any(".gate.weight" in k for k in layer):
        raise UsageError(
            f"MTP weights are written from the last decoder layer ({template}*), which must be a "
            f"full-attention MoE layer; got {sorted(layer)[:6]}"
        )
    dtype = saved[f"{template}input_layernorm.weight"][1]
    specs: dict[str, tuple] = {}
    for i in range(depth):
        fmt = dict(i=i, n_plus_i=n + i)
        prefix = names.layer_prefix.format(**fmt)
        specs.update({prefix + suffix: spec for suffix, spec in layer.items()})
        for suffix, kind in names.extras:
            shape = (hidden,) if kind == "norm" else (hidden, 2 * hidden)
            specs[names.extras_prefix.format(**fmt) + suffix] = (shape, dtype)
    clash = sorted(set(specs) & set(saved))
    if clash:
        raise UsageError(f"MTP tensor names already in the checkpoint transformers wrote: {clash[:5]}")
    return specs


def add_mtp_tensors(cfg: dict, seed: int, dst: Path, *, value: Callable[[str, torch.Tensor], torch.Tensor]) -> int:
    """Add the seeded MTP tensors ``cfg`` asks for to ``dst/model.safetensors`` (one file, as transformers writes
    tiny models); ``value(name, noise)`` is the families' recipe. Returns how many tensors were added."""
    from safetensors import safe_open  # lazy: safetensors
    from safetensors.torch import save_file  # lazy: safetensors

    if not mtp_depth(cfg):
        return 0
    path = dst / "model.safetensors"
    if not path.exists() or any(dst.glob("*.safetensors.index.json")):
        raise UsageError(
            f"{dst}: MTP tensors are added to a single model.safetensors; transformers wrote another layout"
        )
    with safe_open(str(path), "pt") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}
        metadata = f.metadata()
    specs = mtp_specs(cfg, {name: (tuple(t.shape), t.dtype) for name, t in tensors.items()})
    gen = torch.Generator().manual_seed(seed + _SEED_SALT)
    for name in sorted(specs):
        shape, dtype = specs[name]
        noise = torch.randn(shape, generator=gen, dtype=torch.float32)
        tensors[name] = value(name, noise).to(dtype)
    save_file(tensors, str(path), metadata=metadata)
    return len(specs)
