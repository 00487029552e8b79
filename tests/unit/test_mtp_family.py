"""The ``deepseek_v3_mtp`` and ``qwen3_next_mtp`` families: seeded MTP tensors (``models.mtp_weights``) and the CPU MTP
block (``models.mtp_spec``).

The reference for names and shapes is Megatron-Bridge's own mapping registry on the model it built: every MTP
parameter of the built model maps to checkpoint tensors the writer made, with the parameter's shape, and every
MTP tensor the writer made is mapped.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from moeverify.errors import UsageError
from moeverify.models import hf_checkpoint, hf_config_dict
from moeverify.models import mtp_weights as mw
from moeverify.spec.layout import Layout

MTP_LAYER = "model.layers.4."  # num_hidden_layers 4: DeepSeek-V3's MTP depth 0 is HF layer 4
VARIANTS = {"deepseek_v3_mtp": "deepseek_v3", "qwen3_next_mtp": "qwen3_next"}  # MTP variant -> its family


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def built(request, patched_megatron_world):
    from moeverify import models

    return models.build(request.param, Layout(), seed=0)


def _checkpoint(path) -> dict[str, torch.Tensor]:
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}


def _hf_names(mapping) -> list[str]:
    hf = mapping.hf_param
    return list(hf.values()) if isinstance(hf, dict) else [hf]


def test_mtp_weights_every_mtp_parameter_maps_to_written_tensors_of_its_shape(built):
    registry = built.bridge._model_bridge.mapping_registry()
    tensors = _checkpoint(built.hf_path)
    base = _checkpoint(hf_checkpoint(VARIANTS[built.family]))
    written = set(tensors) - set(base)
    assert base and [n for n, t in base.items() if not torch.equal(tensors[n], t)] == []  # the family's tensors
    chunk = built.model_chunks[0]
    params = {
        n.removeprefix("module."): p
        for n, p in [*chunk.named_parameters(), *chunk.named_buffers()]
        if ".mtp." in f".{n}" and (p.is_floating_point() and "expert_bias" in n or p.requires_grad)
    }
    assert len(params) > 20 and any("mtp_model_layer.mlp.router.weight" in n for n in params)
    reached = set()
    for name, param in params.items():
        mapping = registry.megatron_to_hf_lookup(name)
        assert mapping is not None, f"no bridge mapping for {name}"
        hf = _hf_names(mapping)
        assert set(hf) <= written, f"{name} -> {hf}: not written"
        reached.update(hf)
        rows = sum(tensors[n].shape[0] for n in hf)  # fused fc1 / qkv: stacked on rows
        assert (rows, *tensors[hf[0]].shape[1:]) == tuple(param.shape), name
        assert {n: tensors[n].dtype for n in hf} == dict.fromkeys(hf, param.dtype), name
    assert reached == written  # nothing written that the bridge does not load
    proj = "model.layers.4.eh_proj.weight" if built.family == "deepseek_v3_mtp" else "mtp.fc.weight"
    assert tensors[proj].shape == (64, 128)


def test_mtp_weights_are_seeded_deterministic_and_copy_no_other_tensor(tmp_path, monkeypatch):
    monkeypatch.setenv("MOEVERIFY_CACHE_DIR", str(tmp_path / "a"))
    first = _checkpoint(hf_checkpoint("deepseek_v3_mtp", seed=5))
    monkeypatch.setenv("MOEVERIFY_CACHE_DIR", str(tmp_path / "b"))
    again = _checkpoint(hf_checkpoint("deepseek_v3_mtp", seed=5))
    other = _checkpoint(hf_checkpoint("deepseek_v3_mtp", seed=6))
    mtp = sorted(n for n in first if n.startswith(MTP_LAYER))
    assert len(mtp) == 4 + 2 + 7 + 2 + 3 * 8 + 3  # extras, 2 norms, 7 MLA tensors, router + bias, experts, shared
    assert first and [n for n in first if not torch.equal(first[n], again[n])] == []
    assert not any(torch.equal(first[n], other[n]) for n in mtp)
    decoder = {n: t for n, t in first.items() if n not in mtp}
    for name in mtp:  # an MTP tensor equal to another one would hide a swapped mapping
        assert not any(t.shape == first[name].shape and torch.equal(t, first[name]) for t in decoder.values())
    assert first["model.layers.4.enorm.weight"].float().sub(1).abs().max() < 0.6  # a norm: 1 + 0.1 x noise


def test_mtp_weights_leave_checkpoints_without_mtp_as_they_were(tmp_path, monkeypatch):
    monkeypatch.setenv("MOEVERIFY_CACHE_DIR", str(tmp_path))
    base = _checkpoint(hf_checkpoint("deepseek_v3"))
    assert not any(n.startswith(MTP_LAYER) for n in base)
    assert hf_config_dict("deepseek_v3")["num_nextn_predict_layers"] == 0
    variant = hf_config_dict("deepseek_v3_mtp")
    assert {k: v for k, v in variant.items() if k != "num_nextn_predict_layers"} == {
        k: v for k, v in hf_config_dict("deepseek_v3").items() if k != "num_nextn_predict_layers"
    }
    mtp = _checkpoint(hf_checkpoint("deepseek_v3_mtp"))
    assert base and [n for n, t in base.items() if not torch.equal(mtp[n], t)] == []  # deepseek_v3's tensors


def test_mtp_depth_reads_the_architecture_key_and_refuses_bad_counts():
    assert mw.mtp_depth(hf_config_dict("deepseek_v3_mtp")) == 1
    assert mw.mtp_depth(hf_config_dict("deepseek_v3")) == 0
    assert mw.mtp_depth(hf_config_dict("qwen3_next_mtp")) == 1 and mw.mtp_depth(hf_config_dict("qwen3_next")) == 0
    assert mw.mtp_depth(dict(architectures=["Glm4MoeLiteForCausalLM"], num_nextn_predict_layers=1)) == 0
    with pytest.raises(UsageError, match=r"num_nextn_predict_layers must be a non-negative int, got -1"):
        mw.mtp_depth(dict(architectures=["DeepseekV3ForCausalLM"], num_nextn_predict_layers=-1))


def test_mtp_specs_refuses_a_last_layer_without_attention_and_router():
    cfg = dict(json.loads(json.dumps(hf_config_dict("deepseek_v3_mtp"))))
    saved = {
        "model.layers.3.input_layernorm.weight": ((64,), torch.bfloat16),
        "model.layers.3.mlp.down_proj.weight": ((64, 128), torch.bfloat16),
    }
    with pytest.raises(UsageError, match=r"must be a full-attention MoE layer"):
        mw.mtp_specs(cfg, saved)


def test_mtp_spec_builds_cpu_modules_and_restores_the_bridge_function(built):
    from megatron.bridge.models import gpt_provider
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear
    from megatron.core.transformer.identity_op import IdentityOp

    from moeverify.models.linear_attention import CpuLayerNormColumnParallelLinear
    from moeverify.models.local_spec import LocalCoreAttention
    from moeverify.models.mtp_spec import cpu_mtp_block_spec
    from moeverify.models.norms import ZeroCenteredRMSNorm

    layer = built.model_chunks[0].module.mtp.layers[0]
    norm = ZeroCenteredRMSNorm if built.family == "qwen3_next_mtp" else torch.nn.RMSNorm
    assert [type(m) for m in (layer.enorm, layer.hnorm, layer.final_layernorm)] == [norm] * 3
    assert type(layer.eh_proj) is ColumnParallelLinear
    inner = layer.mtp_model_layer
    assert isinstance(inner.self_attention.core_attention, LocalCoreAttention)
    if built.family == "qwen3_next_mtp":  # the input norm where the bridge maps it: in linear_qkv, as TE holds it
        assert type(inner.self_attention.linear_qkv) is CpuLayerNormColumnParallelLinear
        assert isinstance(inner.input_layernorm, IdentityOp)
    else:
        assert type(inner.input_layernorm) is norm
    original = gpt_provider.mtp_block_spec
    with cpu_mtp_block_spec(built.bridge._model_bridge.mapping_registry()):
        assert gpt_provider.mtp_block_spec is not original
    assert gpt_provider.mtp_block_spec is original


def test_mtp_router_runs_in_the_forward_as_the_layer_after_the_decoder(built):
    from moeverify.patches import router_replay as rr

    chunks = built.model_chunks
    session = rr.ReplaySession(chunks)
    assert session.layers[-2:] == (3, 4)  # decoder layers 0-3, MTP depth 0 is global layer 4
    tokens = torch.randint(3, 256, (1, 16), generator=torch.Generator().manual_seed(0))
    with session.record(), torch.no_grad():
        chunks[0](tokens, torch.arange(16)[None], None)
    assert session.routes().layers == session.layers


@pytest.mark.parametrize("built", ["deepseek_v3_mtp"], indirect=True)
def test_bridge_finding_mtp_embed_and_head_copies_are_not_mapped(built):
    """Finding F8: real DeepSeek-V3 checkpoints hold ``model.layers.61.embed_tokens.weight`` and
    ``model.layers.61.shared_head.head.weight`` (copies of the shared embedding and head). Megatron-Bridge 0.6.2
    maps neither: they are not loaded (Megatron's MTP shares the main ones) and never exported, so an export of a
    DeepSeek-V3 with MTP lacks two tensors of the checkpoint it came from."""
    registry = built.bridge._model_bridge.mapping_registry()
    for name in ("embed_tokens.weight", "shared_head.head.weight"):
        assert registry.hf_to_megatron_lookup(f"{MTP_LAYER}{name}") is None
    assert registry.hf_to_megatron_lookup(f"{MTP_LAYER}shared_head.norm.weight") is not None
    exported = [name for name, _ in built.bridge.export_hf_weights(built.model_chunks, cpu=True, show_progress=False)]
    assert f"{MTP_LAYER}eh_proj.weight" in exported
    assert not any(n.startswith(MTP_LAYER) and n.endswith(("embed_tokens.weight", "head.weight")) for n in exported)


def test_mtp_spec_asks_the_registry_only_for_models_with_mtp():
    import types

    from moeverify.models.mtp_spec import local_mtp_block_spec, mtp_input_norm_fused

    class Unmapped:
        def megatron_to_hf_lookup(self, name):
            return None

    assert local_mtp_block_spec(types.SimpleNamespace(mtp_num_layers=None), registry=Unmapped()) is None
    with pytest.raises(UsageError, match=r"the bridge maps neither mtp\.layers\.0\.mtp_model_layer\.input_layernorm"):
        mtp_input_norm_fused(Unmapped())
