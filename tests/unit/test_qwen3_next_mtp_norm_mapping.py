"""Finding F9 (docs/families.md): Megatron-Bridge 0.6.2's Qwen3-Next bridge maps the MTP layer's input norm under
Transformer Engine's fused name only (``mtp.layers.0.mtp_model_layer.self_attention.linear_qkv.layer_norm_weight``).
``MegatronMappingRegistry._add_separate_layernorm_mappings`` adds the separate-norm alias (``input_layernorm.weight``,
what a model built without TE's fused ``LayerNormColumnParallelLinear`` holds: a local spec) only for
patterns ending ``*.<name>``, and the bridge writes the MTP entries with a literal ``0``: the decoder's full-attention
layers get the alias, the MTP layer does not. A Qwen3-Next with MTP built without TE fails to load: "No mapping found
for megatron_param: mtp.layers.0.mtp_model_layer.input_layernorm.weight", then ``AttributeError: 'NoneType' object
has no attribute 'megatron_module'``. moeverify's CPU spec holds that norm in ``linear_qkv`` as TE does
(``mtp_spec.mtp_input_norm_fused``). The registry alone shows it, from the config: no weights, no model."""

import json

from moeverify.models import hf_config_dict


def _registry(tmp_path):
    from moeverify import runtime

    runtime.import_bridge()
    from megatron.bridge import AutoBridge

    (tmp_path / "config.json").write_text(json.dumps(hf_config_dict("qwen3_next_mtp")))
    return AutoBridge.from_hf_pretrained(str(tmp_path))._model_bridge.mapping_registry()


def test_qwen3_next_bridge_maps_the_mtp_input_norm_under_the_fused_te_name_only(tmp_path):
    registry = _registry(tmp_path)
    decoder = registry.megatron_to_hf_lookup("decoder.layers.3.input_layernorm.weight")  # the alias, for layers.*
    assert decoder is not None and decoder.hf_param == "model.layers.3.input_layernorm.weight"
    fused = registry.megatron_to_hf_lookup("mtp.layers.0.mtp_model_layer.self_attention.linear_qkv.layer_norm_weight")
    assert fused is not None and fused.hf_param == "mtp.layers.0.input_layernorm.weight"
    assert registry.megatron_to_hf_lookup("mtp.layers.0.mtp_model_layer.input_layernorm.weight") is None
    # DeepSeek-V3's MTP entries are made from its decoder's by string replacement: the separate name is there.
    deepseek = tmp_path / "deepseek"
    deepseek.mkdir()
    from megatron.bridge import AutoBridge

    (deepseek / "config.json").write_text(json.dumps(hf_config_dict("deepseek_v3_mtp")))
    ds = AutoBridge.from_hf_pretrained(str(deepseek))._model_bridge.mapping_registry()
    assert (
        ds.megatron_to_hf_lookup("mtp.layers.0.mtp_model_layer.input_layernorm.weight").hf_param
        == "model.layers.4.input_layernorm.weight"
    )
