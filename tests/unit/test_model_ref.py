"""``ModelRef``: a model is a value read from itself (a family's name, or a user model's path and overrides),
never looked up in a registry; the plan's JSON form reads the same model in a fresh process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from moeverify.errors import UsageError
from moeverify.models import ModelRef, family_shape, family_traits, hf_config_dict, model_spec
from moeverify.spec.layout import Layout
from moeverify.spec.models import kimi, user
from moeverify.spec.scenario import Scenario, scenario_from_dict, scenario_to_dict

SMALL = {
    "num_hidden_layers": 2,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "hidden_size": 64,
    "intermediate_size": 64,
    "moe_intermediate_size": 32,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 256,
}


@pytest.fixture
def config_file(tmp_path):
    """A Qwen3-MoE config.json alone (random weights per seed), in a directory named Mine."""
    (tmp_path / "Mine").mkdir()
    path = tmp_path / "Mine" / "config.json"
    path.write_text(json.dumps(dict(hf_config_dict("qwen3_moe"), architectures=["Qwen3MoeForCausalLM"])))
    return path


def test_keys_keep_the_scenario_name_format():
    assert ModelRef.builtin("qwen3_moe").key == "qwen3_moe"
    assert ModelRef.user("/x/My Model").key == "model:My-Model"
    with_sets = ModelRef.user("/x/Mine", {"num_experts": 4, "mlp_only_layers": [1]})
    assert with_sets.key.startswith("model:Mine+") and len(with_sets.key) == len("model:Mine+") + 6
    assert with_sets.key != ModelRef.user("/x/Mine", {"num_experts": 8, "mlp_only_layers": [1]}).key


def test_a_ref_is_a_hashable_value_even_with_list_overrides():
    a = ModelRef.user("/x/Mine", {"mlp_only_layers": [1], "num_experts": 4})
    b = ModelRef.user("/x/Mine", {"num_experts": 4, "mlp_only_layers": [1]})
    assert a == b and hash(a) == hash(b) and len({a, b, ModelRef.builtin("qwen2")}) == 2
    assert ModelRef.from_dict(a.key, json.loads(json.dumps(a.to_dict()))) == a
    assert (
        ModelRef.from_dict("qwen2", None) == ModelRef.builtin("qwen2") and ModelRef.builtin("qwen2").to_dict() is None
    )
    with pytest.raises(ValueError, match="a family or a path"):
        ModelRef(family="qwen2", path="/x")
    with pytest.raises(ValueError, match="takes no overrides"):
        ModelRef(family="qwen2", overrides=(("a", 1),))


def test_no_registry_a_key_alone_is_refused_and_the_ref_reads_the_model(config_file):
    ref = user.read(config_file, {"num_hidden_layers": 2}).ref
    assert family_shape(ref).num_layers == 2
    with pytest.raises(
        UsageError,
        match=r"user model 'model:Mine\+[0-9a-f]{6}': a user model is read from its "
        r"reference \(path and overrides\), not looked up by its key",
    ):
        family_shape(ref.key)
    with pytest.raises(UsageError, match="unknown model family 'nope'; known families: qwen2, ") as nope:
        hf_config_dict("nope")
    assert "ModelRef.user" not in str(nope.value)
    with pytest.raises(UsageError, match=r"known families: .*; a model of your own .*models\.ModelRef\.user\(path"):
        hf_config_dict(str(config_file))  # a path given where a family name goes
    assert ModelRef.user(os.path.relpath(config_file), {"num_hidden_layers": 2}).path == str(config_file)
    assert not hasattr(user, "_REGISTRY") and not hasattr(user, "register")


def test_plan_form_reads_the_same_model_in_a_fresh_process(config_file):
    """What a worker does: the scenario's JSON form alone, in a process that never parsed a scenario file."""
    ref = user.read(config_file, {"num_hidden_layers": 2}).ref
    scenario = Scenario(family=ref.key, model=ref, layout=Layout(ep=2), world_size=2, checks=("export",))
    plan = json.dumps(scenario_to_dict(scenario))
    code = (
        "import json, sys\nfrom moeverify.spec.scenario import scenario_from_dict\nfrom moeverify.models import "
        "family_shape\ns = scenario_from_dict(json.loads(sys.argv[1]))\n"
        "print(s.name, family_shape(s.model).num_layers, s.model.overrides)"
    )
    out = subprocess.run([sys.executable, "-c", code, plan], capture_output=True, text=True, check=True).stdout
    assert out.split() == [f"{ref.key}/ep2-dp2", "2", "(('num_hidden_layers',", "2),)"]
    assert scenario_from_dict(json.loads(plan)) == scenario


def test_plan_form_whose_key_does_not_match_its_model_is_refused(config_file):
    data = scenario_to_dict(Scenario(family="qwen3_moe", layout=Layout(), world_size=1, checks=("export",)))
    data["model"] = {"path": str(config_file), "set": {}}
    with pytest.raises(UsageError, match="scenario qwen3_moe: its model reference reads as model:Mine"):
        scenario_from_dict(data)


def test_an_edited_config_is_read_again(config_file):
    ref = ModelRef.user(config_file)
    assert family_shape(ref).num_layers == 4
    config_file.write_text(json.dumps(dict(json.loads(config_file.read_text()), num_hidden_layers=8)))
    assert family_shape(ref).num_layers == 8


def test_model_spec_carries_shape_traits_and_the_prepare_hook(config_file):
    assert model_spec("kimi_k2").prepare is kimi.ensure_registered
    spec = model_spec(ModelRef.user(config_file))
    assert (
        spec.prepare is None and spec.shape == family_shape("qwen3_moe") and spec.traits == family_traits("qwen3_moe")
    )
    assert spec.config["model_type"] == "qwen3_moe" and spec.ref.key == "model:Mine"
