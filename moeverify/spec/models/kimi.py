"""Kimi-K2 without remote code: a config class and a model class made in code, registered in-process.

Kimi-K2's checkpoints carry ``model_type: kimi_k2`` and load through remote code (``auto_map``); Moonshot's
deployment guide says the model reuses DeepSeek-V3's architecture, the model type only telling engines apart.
transformers 5.12.1 has no ``kimi_k2`` class. moeverify never runs remote code and never passes
``trust_remote_code``: it registers, in this process, ``KimiK2Config`` (DeepSeek-V3's config plus the fields
of Kimi-K2's real ``config.json`` that DeepSeek-V3's class lacks) with ``transformers.AutoConfig``, and
``KimiK2ForCausalLM`` (transformers' ``DeepseekV3ForCausalLM``, unchanged but for its config class) with
``AutoModelForCausalLM``, and DeepSeek-V3's checkpoint conversion (per-expert tensor names) for
``kimi_k2``. Nothing is written to a checkpoint but ``config.json`` and the weights.

With the config registered, Megatron-Bridge 0.6.2's ``AutoBridge.from_hf_pretrained`` loads it without
``trust_remote_code`` and dispatches ``architectures: ["KimiK2ForCausalLM"]`` to its ``KimiK2Bridge`` (by
class name: the class is not in ``transformers``). The registration happens the first time moeverify makes,
writes or builds the ``kimi_k2`` family (``ensure_registered``), never on import. It fails loudly where the
version assumptions break: transformers knowing ``kimi_k2`` itself, or ``DeepseekV3Config`` /
``DeepseekV3ForCausalLM`` gone.
"""

from __future__ import annotations

import functools
from typing import Any

from moeverify.errors import UsageError

MODEL_TYPE = "kimi_k2"
ARCHITECTURE = "KimiK2ForCausalLM"

# Fields of Kimi-K2's real config.json that transformers 5.12.1's DeepseekV3Config does not declare, with
# Kimi-K2's values. Megatron-Bridge 0.6.2 reads ``scoring_func`` (-> moe_router_score_function: KimiK2Bridge,
# unlike DeepSeekV3Bridge, does not set sigmoid itself); the others are carried as the real config has them.
KIMI_FIELDS: dict[str, Any] = dict(
    scoring_func="sigmoid",
    topk_method="noaux_tc",
    seq_aux=True,
    aux_loss_alpha=0.001,
    moe_layer_freq=1,
    num_nextn_predict_layers=0,
)


@functools.cache
def classes() -> tuple[type, type]:
    """``(KimiK2Config, KimiK2ForCausalLM)``, made once per process (not registered: ``ensure_registered``)."""
    import transformers  # lazy: transformers
    from huggingface_hub.dataclasses import strict  # lazy: huggingface_hub

    base_config = getattr(transformers, "DeepseekV3Config", None)
    base_model = getattr(transformers, "DeepseekV3ForCausalLM", None)
    if base_config is None or base_model is None:
        raise UsageError(
            f"kimi_k2: transformers {transformers.__version__} has no DeepseekV3Config / "
            "DeepseekV3ForCausalLM, which moeverify's Kimi-K2 stands on (written for 5.12.1)"
        )

    @strict
    class KimiK2Config(base_config):  # type: ignore[valid-type,misc]  # transformers' class, found at run time
        """DeepSeek-V3's config under Kimi-K2's model type, with the Kimi-K2 fields DeepSeek-V3's lacks."""

        model_type = MODEL_TYPE
        scoring_func: str = KIMI_FIELDS["scoring_func"]
        topk_method: str = KIMI_FIELDS["topk_method"]
        seq_aux: bool = KIMI_FIELDS["seq_aux"]
        aux_loss_alpha: float = KIMI_FIELDS["aux_loss_alpha"]
        moe_layer_freq: int = KIMI_FIELDS["moe_layer_freq"]
        num_nextn_predict_layers: int = KIMI_FIELDS["num_nextn_predict_layers"]

    class KimiK2ForCausalLM(base_model):  # type: ignore[valid-type,misc]
        """transformers' DeepSeek-V3 model, unchanged: Kimi-K2's modelling is DeepSeek-V3's."""

        config_class = KimiK2Config

    KimiK2Config.__module__ = KimiK2ForCausalLM.__module__ = __name__
    return KimiK2Config, KimiK2ForCausalLM


def ensure_registered() -> None:
    """Register ``kimi_k2`` with transformers' auto classes in this process (idempotent)."""
    import transformers  # lazy: transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING  # lazy: transformers

    config_cls, model_cls = classes()
    known = CONFIG_MAPPING._extra_content.get(MODEL_TYPE)  # transformers 5.12.1: registered types live here
    if known is config_cls:
        return
    if known is not None or MODEL_TYPE in CONFIG_MAPPING:
        raise UsageError(
            f"kimi_k2: transformers {transformers.__version__} already knows model_type "
            f"{MODEL_TYPE!r} ({CONFIG_MAPPING[MODEL_TYPE].__name__}); moeverify's in-code Kimi-K2 "
            "was written for 5.12.1, which has none: use transformers' class and drop moeverify/"
            "models/kimi.py"
        )
    transformers.AutoConfig.register(MODEL_TYPE, config_cls)
    transformers.AutoModelForCausalLM.register(config_cls, model_cls)
    # transformers 5.x fuses per-expert weights on load and splits them on save by a conversion keyed by model
    # type; without DeepSeek-V3's, kimi_k2 checkpoints would be saved as fused ``mlp.experts.gate_up_proj``,
    # which no bridge mapping names (Kimi-K2's real checkpoints keep DeepSeek-V3's per-expert names).
    from transformers import conversion_mapping  # lazy: transformers

    deepseek = conversion_mapping.get_checkpoint_conversion_mapping("deepseek_v3")
    if deepseek is None:
        raise UsageError(
            f"kimi_k2: transformers {transformers.__version__} has no DeepSeek-V3 checkpoint "
            "conversion to save Kimi-K2's experts with (written for 5.12.1)"
        )
    conversion_mapping.register_checkpoint_conversion_mapping(MODEL_TYPE, deepseek, overwrite=True)


def model_class(architecture: str):
    """The model class for an architecture name: transformers' own, or Kimi-K2's made in code."""
    import transformers  # lazy: transformers

    if architecture == ARCHITECTURE:
        ensure_registered()
        return classes()[1]
    return getattr(transformers, architecture)
