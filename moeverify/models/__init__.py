"""Tiny HF model families made in code and built into Megatron through Megatron-Bridge under a Layout."""

import importlib

from moeverify.spec.layout import Layout, ModelShape
from moeverify.spec.models.configs import FAMILIES, ModelSpec, family_shape, family_traits, hf_config_dict, model_spec
from moeverify.spec.models.ref import ModelRef

__all__ = ["FAMILIES", "Layout", "ModelRef", "ModelShape", "ModelSpec", "Built", "build", "family_shape",
           "family_traits", "hf_checkpoint", "hf_config_dict", "model_spec"]

_LAZY = {"build": "builder", "Built": "builder", "hf_checkpoint": "families"}


def __getattr__(name):  # lazy: torch and megatron are imported only when a checkpoint is written or a model built
    if name in _LAZY:
        return getattr(importlib.import_module(f"moeverify.models.{_LAZY[name]}"), name)
    raise AttributeError(name)
