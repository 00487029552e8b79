"""The ``hf_parity`` check against transformers' own models: passes on faithful builds, and names the first
divergent layer for the bridge findings and for injected faults in the CPU attention."""

from types import SimpleNamespace as NS

import pytest

from moeverify.spec.layout import Layout
from moeverify.spec.models.ref import as_ref
from moeverify.oracles import hf_parity


def _ctx(family, *, world_size=1, layout=Layout()):
    model = as_ref(family)
    return NS(rank=0, world_size=world_size, options={},
              scenario=NS(family=model.key, model=model, layout=layout, seed=0, name=f"{model.key}/x"))


def _failures(tallies):
    return {name: t.failures for name, t in tallies.items() if not t.passed}


def test_hf_parity_passes_gpt_oss_with_sinks_and_sliding_windows(patched_megatron_world):
    tallies = hf_parity.run(_ctx("gpt_oss"))
    assert _failures(tallies) == {}
    assert (tallies["layers"].checked, tallies["logits"].checked) == (4, 1)


@pytest.mark.parametrize("fault, first", [
    ("window_one_short", 0),  # layer 0 is a sliding-window layer (8 tokens), sequences are 32 long
    ("sinks_ignored", 0),
])
def test_hf_parity_names_the_layer_an_attention_fault_changes(patched_megatron_world, monkeypatch, fault, first):
    from moeverify.models.local_spec import LocalCoreAttention

    if fault == "window_one_short":
        original = LocalCoreAttention._mask

        def mask(self, q_pos, k_pos):
            if self.window_size is not None:
                self.window_size = (self.window_size[0] - 1, self.window_size[1])
            return original(self, q_pos, k_pos)

        monkeypatch.setattr(LocalCoreAttention, "_mask", mask)
    else:
        monkeypatch.setattr(LocalCoreAttention, "_softmax", lambda self, s: s.softmax(-1))
    failures = _failures(hf_parity.run(_ctx("gpt_oss")))
    assert set(failures) == {"layers", "logits"}
    assert failures["layers"][0] == f"first divergent layer: {first} (global layer number, 0-based)"


def test_hf_parity_finds_ernie45_routing_with_another_score_function(patched_megatron_world):
    """Finding: the Ernie-4.5 bridge routes with sigmoid + expert bias; HF Ernie-4.5-MoE with softmax + bias."""
    failures = _failures(hf_parity.run(_ctx("ernie45_moe")))
    assert failures["layers"][0] == "first divergent layer: 1 (global layer number, 0-based)"  # layer 0 is dense
    assert failures["layers"][1].startswith("layer 1: max|Megatron - HF|")


def test_hf_parity_finds_gpt_oss_gate_up_loaded_transposed_when_square(patched_megatron_world, tmp_path):
    """Finding: with hidden == 2 x intermediate the GPT-OSS bridge loads gate_up_proj transposed (roundtrip
    and export still pass bit for bit: it is transposed back on export)."""
    import json

    from moeverify.models import families
    from moeverify.spec.models import user

    config = families.hf_config_dict("gpt_oss") | {"intermediate_size": 32}
    (tmp_path / "config.json").write_text(json.dumps(config))
    ref = user.read(tmp_path).ref
    failures = _failures(hf_parity.run(_ctx(ref)))
    assert failures["layers"][0] == "first divergent layer: 0 (global layer number, 0-based)"


def test_hf_parity_refuses_other_layouts_rather_than_passing_on_nothing():
    tallies = hf_parity.run(_ctx("qwen3_moe", world_size=2, layout=Layout(ep=2)))
    assert tallies and {k: t.passed for k, t in tallies.items()} == dict.fromkeys(tallies, False)
    assert {k: t.failures[0] for k, t in tallies.items() if "hf_parity runs on one rank" not in t.failures[0]} == {}
