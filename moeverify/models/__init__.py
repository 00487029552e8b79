"""Tiny HF model families made in code and built into Megatron through Megatron-Bridge under a Layout."""

from moeverify.layout import Layout, ModelShape
from moeverify.models.families import FAMILIES, family_shape, hf_checkpoint, hf_config_dict

__all__ = ["FAMILIES", "Layout", "ModelShape", "Built", "build", "family_shape", "hf_checkpoint", "hf_config_dict"]


def __getattr__(name):  # megatron is imported only when a model is built
    if name in ("build", "Built"):
        from moeverify.models import builder as _build_module

        return getattr(_build_module, name)
    raise AttributeError(name)
