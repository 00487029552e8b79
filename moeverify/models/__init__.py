"""Tiny HF model families built into Megatron through Megatron-Bridge under a Layout (torch side).

What a model *is* (references, configs, traits) is torch-free in ``moeverify.spec.models``; this package makes
and builds them:

- ``builder``: ``build(model, layout)``: Megatron model chunks through the bridge; ``bridge_limits``: what the
  installed bridge builds from a config, against what the config says;
- ``families``: seeded safetensors checkpoints of the tiny families; ``seeded``, ``seeded_state``: weights made
  per tensor on demand, read by the bridge's loader; ``checkpoint``: the one checkpoint-directory reader;
  ``mtp_weights``: seeded MTP tensors;
- without Transformer Engine (every CPU rank): ``local_spec`` (the block spec), ``family_specs`` (families the
  CPU path rebuilds), ``grouped_linear``, ``linear_attention``, ``mtp_spec``, ``norms``.
"""

import importlib

from moeverify.spec.layout import Layout, ModelShape
from moeverify.spec.models.configs import FAMILIES, ModelSpec, family_shape, family_traits, hf_config_dict, model_spec
from moeverify.spec.models.ref import ModelRef

__all__ = [
    "FAMILIES",
    "Layout",
    "ModelRef",
    "ModelShape",
    "ModelSpec",
    "Built",
    "build",
    "family_shape",
    "family_traits",
    "hf_checkpoint",
    "hf_config_dict",
    "model_spec",
]

_LAZY = {"build": "builder", "Built": "builder", "hf_checkpoint": "families"}


def __getattr__(name):  # lazy: torch and megatron are imported only when a checkpoint is written or a model built
    if name in _LAZY:
        return getattr(importlib.import_module(f"moeverify.models.{_LAZY[name]}"), name)
    raise AttributeError(name)
