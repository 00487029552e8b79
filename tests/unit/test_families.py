import hashlib
import json

import pytest
from safetensors import safe_open

from moeverify.errors import UsageError
from moeverify.models import FAMILIES, family_shape, hf_checkpoint


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MOEVERIFY_CACHE_DIR", str(tmp_path))
    return tmp_path


def _digest(path):
    return hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()


def test_hf_checkpoint_bytes_are_deterministic_per_seed(cache, tmp_path_factory, monkeypatch):
    first = hf_checkpoint("qwen3_moe", seed=3)
    monkeypatch.setenv("MOEVERIFY_CACHE_DIR", str(tmp_path_factory.mktemp("other")))
    second = hf_checkpoint("qwen3_moe", seed=3)
    third = hf_checkpoint("qwen3_moe", seed=4)
    assert first != second and _digest(first) == _digest(second)
    assert _digest(third) != _digest(first)


def test_hf_checkpoint_deepseek_keeps_correction_bias_fp32(cache):
    path = hf_checkpoint("deepseek_v3")
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        dtypes = {name: f.get_slice(name).get_dtype() for name in f.keys()}
    biases = [n for n in dtypes if n.endswith("e_score_correction_bias")]
    assert biases and all(dtypes[n] == "F32" for n in biases)
    assert {d for n, d in dtypes.items() if n not in biases} == {"BF16"}
    config = json.loads((path / "config.json").read_text())
    assert config["first_k_dense_replace"] == 1 and config["n_group"] == 2


def test_hf_checkpoint_deepseek_v2_is_mla_with_a_dense_first_layer_and_no_expert_bias(cache):
    path = hf_checkpoint("deepseek_v2")
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        dtypes = {f.get_slice(name).get_dtype() for name in names}
    assert dtypes == {"BF16"} and not any("e_score_correction_bias" in n for n in names)
    assert "model.layers.0.mlp.gate_proj.weight" in names and "model.layers.0.mlp.gate.weight" not in names
    assert "model.layers.1.mlp.shared_experts.up_proj.weight" in names
    assert "model.layers.1.self_attn.kv_a_proj_with_mqa.weight" in names
    assert family_shape("deepseek_v2").moe_layers == (1, 2, 3)


def test_family_shape_marks_dense_and_moe_layers():
    assert family_shape("deepseek_v3").moe_layers == (1, 2, 3)
    assert family_shape("qwen3_moe").moe_layers == (0, 1, 2, 3)
    assert family_shape("qwen2").num_experts == 0 and family_shape("qwen2").moe_layers == ()
    for family in FAMILIES:  # enough layers for PP2 x VPP2, but the 64-expert one (kept to one MoE layer for CPU time)
        assert family_shape(family).num_layers % 4 == 0 or family == "deepseek_v3_wide"
    assert family_shape("deepseek_v3_wide").moe_layers == (1,) and family_shape("deepseek_v3_wide").num_experts == 64


def test_hf_checkpoint_unknown_family_names_known_ones():
    with pytest.raises(UsageError, match=r"unknown model family 'llama'; known families: qwen2, qwen2_tied"):
        hf_checkpoint("llama")


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_seeded_checkpoint_built_in_its_dtype_equals_the_fp32_build_cast(family, tmp_path):
    """The model is built in the stored dtype (no fp32 copy of the whole model, docs/memory.md); every saved
    tensor must equal, bit for bit, the former recipe's: built in fp32, cast, then seeded."""
    import torch
    import transformers

    from moeverify.models import families

    cfg = families.hf_config_dict(family)
    families._write_checkpoint(cfg, 0, tmp_path / "new")
    assert torch.get_default_dtype() == torch.float32  # restored
    config = transformers.AutoConfig.for_model(**{k: v for k, v in cfg.items() if k != "architectures"})
    torch.manual_seed(0)
    former = families.kimi.model_class(cfg["architectures"][0])(config).to(torch.bfloat16)
    families._fp32_expert_bias(former)
    families._seeded_weights(former, 0)
    former.save_pretrained(tmp_path / "former", safe_serialization=True)
    families.mtp_weights.add_mtp_tensors(cfg, 0, tmp_path / "former", value=families.seeded_value)
    assert _digest(tmp_path / "new") == _digest(tmp_path / "former")
