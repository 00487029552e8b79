"""Kimi-K2 as a built-in family: an in-code config registered in-process (no remote code), DeepSeek-V3's
weights and per-expert names, and Megatron-Bridge 0.6.2's KimiK2Bridge picked from it."""

import json

import pytest
from safetensors import safe_open

from moeverify.errors import UsageError
from moeverify.models import FAMILIES, family_shape, hf_checkpoint
from moeverify.spec.models import kimi


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MOEVERIFY_CACHE_DIR", str(tmp_path))
    return tmp_path


def test_kimi_k2_is_a_built_in_family_no_longer_refused():
    assert "kimi_k2" in FAMILIES
    assert family_shape("kimi_k2").moe_layers == (1, 2, 3) and family_shape("kimi_k2").num_experts == 8


def test_config_class_is_deepseek_v3_under_kimi_model_type_with_kimi_fields():
    import transformers

    config_cls, model_cls = kimi.classes()
    config = config_cls(n_group=1, topk_group=1)
    assert issubclass(config_cls, transformers.DeepseekV3Config) and config.model_type == "kimi_k2"
    assert {k: getattr(config, k) for k in kimi.KIMI_FIELDS} == kimi.KIMI_FIELDS
    assert config.scoring_func == "sigmoid" and config.topk_method == "noaux_tc"
    assert issubclass(model_cls, transformers.DeepseekV3ForCausalLM) and model_cls.__name__ == kimi.ARCHITECTURE
    assert model_cls.config_class is config_cls


def test_registration_loads_the_config_without_remote_code(tmp_path):
    import transformers

    kimi.ensure_registered()
    kimi.ensure_registered()  # idempotent
    cfg = {
        "model_type": "kimi_k2",
        "architectures": [kimi.ARCHITECTURE],
        "scoring_func": "sigmoid",
        "n_group": 1,
        "topk_group": 1,
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    loaded = transformers.AutoConfig.from_pretrained(str(tmp_path))  # trust_remote_code left at False
    assert type(loaded) is kimi.classes()[0] and loaded.scoring_func == "sigmoid"
    assert kimi.model_class(kimi.ARCHITECTURE) is kimi.classes()[1]
    assert kimi.model_class("DeepseekV3ForCausalLM") is transformers.DeepseekV3ForCausalLM


def test_registration_fails_loudly_if_transformers_knows_kimi_k2(monkeypatch):
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    class Other:
        __name__ = "Other"

    monkeypatch.setitem(CONFIG_MAPPING._extra_content, "kimi_k2", Other)
    with pytest.raises(UsageError, match="already knows model_type 'kimi_k2'"):
        kimi.ensure_registered()


def test_hf_checkpoint_kimi_k2_has_deepseek_per_expert_names_and_fp32_bias(cache):
    path = hf_checkpoint("kimi_k2")
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        dtypes = {name: f.get_slice(name).get_dtype() for name in f.keys()}
    assert "model.layers.1.mlp.experts.7.gate_proj.weight" in dtypes  # not transformers 5's fused gate_up_proj
    assert not any(n.endswith(("experts.gate_up_proj", "experts.down_proj")) for n in dtypes)
    assert "model.layers.0.mlp.gate_proj.weight" in dtypes
    assert "model.layers.1.mlp.shared_experts.up_proj.weight" in dtypes
    biases = [n for n in dtypes if n.endswith("e_score_correction_bias")]
    assert biases and all(dtypes[n] == "F32" for n in biases)
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "kimi_k2" and config["architectures"] == ["KimiK2ForCausalLM"]
    assert "auto_map" not in config and not list(path.glob("*.py"))  # no remote code written
    assert config["scoring_func"] == "sigmoid" and config["routed_scaling_factor"] == 2.827


def test_bridge_is_kimi_k2_with_its_own_router_settings(tmp_path):
    from moeverify import runtime
    from moeverify.models.builder import _bridge_for, _provider, preflight
    from moeverify.models.families import hf_config_dict

    runtime.import_bridge()
    (tmp_path / "config.json").write_text(json.dumps(hf_config_dict("kimi_k2")))
    bridge = _bridge_for("kimi_k2", tmp_path)
    assert type(bridge._model_bridge).__name__ == "KimiK2Bridge"
    p = _provider(bridge, "kimi_k2", load_weights=False)
    assert (
        p.moe_router_score_function,
        p.moe_router_pre_softmax,
        p.moe_router_enable_expert_bias,
        p.moe_router_dtype,
        p.moe_router_load_balancing_type,
    ) == ("sigmoid", True, True, "fp32", "seq_aux_loss")
    assert p.multi_latent_attention and p.moe_layer_freq == [0, 1, 1, 1] and p.moe_shared_expert_intermediate_size == 32
    assert p.moe_router_topk_scaling_factor == 2.827 and p.moe_shared_expert_overlap  # CPU path turns TE settings off
    preflight("kimi_k2", te_real=False)  # the CPU spec rebuilds it: not refused
