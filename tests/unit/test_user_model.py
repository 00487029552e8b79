"""The user's own model (--model PATH, --model-set, model: in scenario files): reading, overrides, refusals."""

from __future__ import annotations

import json
import textwrap

import pytest
import torch

from moeverify import cli
from moeverify.errors import UsageError
from moeverify.models import families, seeded
from moeverify.models.builder import _moe_pattern
from moeverify.spec.models import user
from moeverify.spec.scenario import load, scenario_from_dict, scenario_to_dict

CHECKS = ("roundtrip", "export", "replay")

# A production-sized Qwen3-MoE config (transformers' defaults: 128 experts, 24 layers, hidden 2048) and the
# overrides that make a CPU-sized model of the same architecture from it.
SHRINK = dict(
    num_hidden_layers=4,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_experts=8,
    num_experts_per_tok=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=256,
    max_position_embeddings=256,
)


@pytest.fixture
def prod_dir(tmp_path):
    import transformers

    config = transformers.Qwen3MoeConfig()
    config.architectures = ["Qwen3MoeForCausalLM"]
    config.save_pretrained(tmp_path / "Qwen3-Prod")
    return tmp_path / "Qwen3-Prod"


def _sets(overrides: dict) -> list[str]:
    return [f"{k}={json.dumps(v)}" for k, v in overrides.items()]


def test_shrunk_production_config_reads_as_the_small_model(prod_dir):
    model = user.read(prod_dir, user.parse_sets(_sets(SHRINK)))
    assert model.key.startswith("model:Qwen3-Prod+") and model.weights_dir is None
    # transformers 5 stores the expert count as num_local_experts: the override under its alias must win
    assert model.config["num_local_experts"] == 8 and "num_experts" not in model.config
    shape = families.family_shape(model.ref)
    assert (shape.num_layers, shape.num_heads, shape.num_query_groups, shape.num_experts) == (4, 4, 2, 8)
    assert shape.moe_layers == (0, 1, 2, 3)
    assert "random weights per seed" in model.describe() and "num_experts=8" in model.describe()


def test_random_weights_checkpoint_holds_the_overridden_config_and_is_deterministic(prod_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("MOEVERIFY_CACHE_DIR", str(tmp_path / "cache"))
    ref = user.read(prod_dir, dict(SHRINK)).ref
    path = families.hf_checkpoint(ref, seed=1)
    written = json.loads((path / "config.json").read_text())
    assert written["num_local_experts"] == 8 and written["num_hidden_layers"] == 4
    assert not list(path.glob("*.safetensors"))  # a config alone: weights made per tensor when read
    weights = seeded.SeededWeights(path)
    names = weights.names()
    assert any(".mlp.experts.7." in n for n in names) and len(names) > 40
    blob = b"".join(weights.get_tensor(n).view(-1).view(torch.uint8).numpy().tobytes() for n in names)
    import shutil

    shutil.rmtree(path)
    again = families.hf_checkpoint(ref, seed=1)
    assert again == path and (again / seeded.MARKER).read_text() == (path / seeded.MARKER).read_text()
    redo = seeded.SeededWeights(again)
    assert b"".join(redo.get_tensor(n).view(-1).view(torch.uint8).numpy().tobytes() for n in names) == blob
    other = seeded.SeededWeights(families.hf_checkpoint(ref, seed=2))
    assert other.names() == names
    assert [n for n in names[:10] if torch.equal(other.get_tensor(n), redo.get_tensor(n))] == []


def test_real_weights_directory_is_used_as_it_is(tmp_path, monkeypatch):
    monkeypatch.setenv("MOEVERIFY_CACHE_DIR", str(tmp_path / "cache"))
    src = families.hf_checkpoint("qwen3_moe", seed=0)
    import shutil

    shutil.copytree(src, tmp_path / "mine")
    model = user.read(tmp_path / "mine")
    assert model.weights_dir == (tmp_path / "mine").resolve()
    assert families.hf_checkpoint(model.ref, seed=5) == model.weights_dir
    assert families.family_shape(model.ref) == families.family_shape("qwen3_moe")
    with pytest.raises(UsageError, match="holds real weights.*num_hidden_layers.*config.json"):
        user.read(tmp_path / "mine", {"num_hidden_layers": 2})
    # the config alone (the file) is accepted with overrides: random weights
    assert user.read(tmp_path / "mine" / "config.json", {"num_hidden_layers": 2}).weights_dir is None


@pytest.mark.parametrize(
    "setup, overrides, message",
    [
        (lambda d: None, {}, "does not exist"),
        (lambda d: d.mkdir(), {}, "has no config.json"),
        (lambda d: (d.mkdir(), (d / "config.json").write_text("{nope")), {}, "not valid JSON"),
        (lambda d: (d.mkdir(), (d / "config.json").write_text("[1]")), {}, "expected a JSON object, got list"),
        (lambda d: (d.mkdir(), (d / "config.json").write_bytes(b"\xff\xfe")), {}, "cannot read"),
        (lambda d: (d.mkdir(), (d / "config.json").write_text('{"model_type": "qwen3_moe"}')), {}, "architectures"),
        (
            lambda d: (
                d.mkdir(),
                (d / "config.json").write_text('{"model_type": "qwen3_moe", "architectures": ["NoSuchForCausalLM"]}'),
            ),
            {},
            "has no class NoSuch",
        ),
        (
            lambda d: (
                d.mkdir(),
                (d / "config.json").write_text('{"model_type": "nonesuch", "architectures": ["Qwen3MoeForCausalLM"]}'),
            ),
            {},
            "does not know model_type",
        ),
    ],
)
def test_bad_model_paths_are_refused_with_the_reason(tmp_path, setup, overrides, message):
    setup(tmp_path / "m")
    with pytest.raises(UsageError, match=message):
        user.read(tmp_path / "m", overrides)


def test_pickled_weights_are_never_loaded(prod_dir):
    (prod_dir / "pytorch_model.bin").write_bytes(b"\x80\x04not really")
    with pytest.raises(UsageError, match="never unpickles"):
        user.read(prod_dir)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"num_expert": 8}, r"num_expert: qwen3_moe's config has no such key \(did you mean num_experts"),
        ({"num_hidden_layers": "four"}, "expected an int like the config's 24"),
        ({"num_hidden_layers": 2.5}, "expected an int"),
        ({"norm_topk_prob": 1}, "expected a bool"),
        ({"num_experts": "8"}, "expected an int like the config's 128"),  # an alias is type-checked as its target
    ],
)
def test_bad_overrides_are_refused(prod_dir, overrides, message):
    with pytest.raises(UsageError, match=message):
        user.read(prod_dir, overrides)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"architectures": ["LlamaForCausalLM"]}, r"architectures: names the model's class, not a setting"),
        ({"model_type": "llama"}, r"model_type: names the model's class"),
    ],
)
def test_overrides_of_the_models_class_are_refused(prod_dir, overrides, message):
    # an architectures override read back unchanged from the config class, yet the model built was the file's
    with pytest.raises(UsageError, match=message):
        user.read(prod_dir, overrides)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"num_hidden_layers": 10**12}, r"num_hidden_layers=1000000000000: more than 10000 decoder layers"),
        ({"num_hidden_layers": 0}, r"num_hidden_layers=0: expected a positive integer"),
        ({"num_hidden_layers": -1}, r"num_hidden_layers=-1: expected a positive integer"),
        ({"vocab_size": -5}, r"vocab_size=-5: expected a positive integer"),
        ({"hidden_size": 0}, r"hidden_size=0: expected a positive integer"),
        ({"num_experts": -2}, r"num_local_experts=-2: expected 0 or more experts"),
        ({"num_experts_per_tok": 9, "num_experts": 4}, r"top-k 9 of 4 experts: expected 1 \.\. 4"),
    ],
)
def test_impossible_sizes_are_refused_before_any_rank_starts(prod_dir, overrides, message):
    # each reached a rank before (math domain error, negative dimension, ZeroDivisionError), or filled the memory
    # (a layer pattern of 10**12 entries), or passed (top-k past the experts)
    with pytest.raises(UsageError, match=message):
        families.family_shape(user.read(prod_dir, {**SHRINK, **overrides}).ref)


def test_override_read_by_the_modeling_code_only_is_accepted(prod_dir):
    # head_dim is no attribute of Qwen3MoeConfig in transformers 5, but the attention reads it
    assert user.read(prod_dir, {"head_dim": 16}).config["head_dim"] == 16


@pytest.mark.parametrize(
    "items, message",
    [
        (["num_hidden_layers"], "expected key=value"),
        (["=4"], "expected key=value"),
        (["a=1", "a=2"], "a given twice"),
        (["a=[1"], "not a plain value"),
    ],
)
def test_parse_sets_refuses_malformed_items(items, message):
    with pytest.raises(UsageError, match=message):
        user.parse_sets(items)


def test_parse_sets_reads_yaml_scalars():
    assert user.parse_sets(["a=4", "b=0.5", "c=true", "d=[1, 2]", "e=null", "f=silu"]) == dict(
        a=4, b=0.5, c=True, d=[1, 2], e=None, f="silu"
    )


@pytest.mark.parametrize(
    "config, layers",
    [
        (dict(first_k_dense_replace=1), (1, 2, 3, 4, 5)),  # DeepSeek-V3, GLM-4.5, Kimi-K2
        (dict(first_k_dense_replace=1, moe_layer_freq=2), (2, 4)),  # DeepSeek-V2 style
        (dict(mlp_only_layers=[0, 3], decoder_sparse_step=1), (1, 2, 4, 5)),  # Qwen2/3-MoE
        (dict(decoder_sparse_step=2), (1, 3, 5)),
        (dict(moe_layer_start_index=1, moe_layer_end_index=4, moe_layer_interval=1), (1, 2, 3, 4)),  # Ernie-4.5
        (dict(moe_layer_start_index=0, moe_layer_end_index=5, moe_layer_interval=2), (1, 3, 5)),  # (i + 1) % interval
        (dict(mlp_layer_types=["dense", "sparse", "sparse", "dense", "sparse", "sparse"]), (1, 2, 4, 5)),
        (dict(), (0, 1, 2, 3, 4, 5)),  # Mixtral, OLMoE, GPT-OSS: every layer
    ],
)
def test_moe_layer_rules(config, layers):
    shape = user.shape_of(dict(config, num_hidden_layers=6, num_attention_heads=4, num_local_experts=8))
    assert shape.moe_layers == layers


def test_built_moe_pattern_forms():
    from types import SimpleNamespace as NS

    assert _moe_pattern(NS(num_moe_experts=None, moe_layer_freq=1, num_layers=4)) == ()
    assert _moe_pattern(NS(num_moe_experts=8, moe_layer_freq=2, num_layers=4)) == (0, 2)
    assert _moe_pattern(NS(num_moe_experts=8, moe_layer_freq=[0, 1, 1, 0], num_layers=4)) == (1, 2)
    with pytest.raises(UsageError, match="moe_layer_freq"):
        _moe_pattern(NS(num_moe_experts=8, moe_layer_freq=[1, 1], num_layers=4))


# ----------------------------------------------------------------------------------- scenario files
def _write(tmp_path, text: str) -> str:
    path = tmp_path / "s.yaml"
    path.write_text(textwrap.dedent(text))
    return str(path)


def test_scenario_file_model_relative_to_the_file_and_round_trip(tmp_path, prod_dir):
    sets = ", ".join(f"{k}: {json.dumps(v)}" for k, v in SHRINK.items())
    path = _write(
        tmp_path,
        f"""
        scenarios:
          - {{model: Qwen3-Prod, model_set: {{{sets}}}, world_size: 2, layout: {{ep: 2}}, checks: [export]}}
        matrix:
          - models: [{{path: Qwen3-Prod, set: {{{sets}}}}}]
            layouts: [{{pp: 2}}]
            world_size: 2
            checks: [roundtrip]
    """,
    )
    first, second = load([path], checks=CHECKS)
    assert first.name.startswith("model:Qwen3-Prod+") and first.name.endswith("/ep2-dp2")
    assert (
        first.family == second.family
        and first.model == second.model
        and first.model.to_dict() == {"path": str(prod_dir.resolve()), "set": SHRINK}
    )
    back = scenario_from_dict(json.loads(json.dumps(scenario_to_dict(first))))
    assert back == first


@pytest.mark.parametrize(
    "entry, message",
    [
        ("{family: qwen3_moe, model: Qwen3-Prod, world_size: 1, checks: [export]}", "family or model, not both"),
        ("{family: qwen3_moe, model_set: {a: 1}, world_size: 1, checks: [export]}", "model_set needs model"),
        ("{model: 7, world_size: 1, checks: [export]}", "model must be a path"),
        ("{model: Qwen3-Prod, model_set: [1], world_size: 1, checks: [export]}", "model_set must be a mapping"),
        ("{model: {path: Qwen3-Prod, sett: {}}, world_size: 1, checks: [export]}", "unknown model key"),
        ("{model: Qwen3-Prod, model_set: {num_expert: 8}, world_size: 1, checks: [export]}", "no such key"),
        ("{model: Missing, world_size: 1, checks: [export]}", "s.yaml:2: .*Missing does not exist"),
    ],
)
def test_bad_model_entries_are_refused(tmp_path, prod_dir, entry, message):
    with pytest.raises(UsageError, match=message):
        load([_write(tmp_path, f"scenarios:\n  - {entry}\n")], checks=CHECKS)


def test_cli_model_replaces_families_and_skips_layouts_it_does_not_admit(tmp_path, prod_dir, capsys):
    path = _write(
        tmp_path,
        """
        scenarios:
          - {family: qwen2, world_size: 2, layout: {tp: 2}, checks: [roundtrip]}
          - {family: qwen3_moe, world_size: 2, layout: {tp: 2, sp: true}, checks: [export]}
          - {family: qwen3_moe, world_size: 2, layout: {ep: 2}, checks: [export]}
    """,
    )
    # 3 query groups: tp2 does not divide them; ep2 still fits
    sets = _sets(dict(SHRINK, num_attention_heads=6, num_key_value_heads=3))
    argv = ["run", path, "--model", str(prod_dir), *[a for s in sets for a in ("--model-set", s)], "--list"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if not line.startswith("#")]
    assert out.startswith("# model:Qwen3-Prod+") and "random weights per seed" in out
    assert len(lines) == 3, out  # qwen2/tp2 and qwen3_moe/tp2 merge: tp2 (a dense layout for MoE) differs by sp
    unfit = [line for line in lines if "not run:" in line]
    assert len(unfit) == 2 and all("query groups" in line or "divisible" in line for line in unfit), out
    assert any(line.split()[0].endswith("/ep2-dp2") and "not run" not in line for line in lines), out


def test_two_models_of_one_name_are_refused(tmp_path, prod_dir):
    import shutil

    shutil.copytree(prod_dir, tmp_path / "other" / "Qwen3-Prod")
    assert user.read(prod_dir).key == user.read(tmp_path / "other" / "Qwen3-Prod").key  # read alone: no clash
    first = _write(tmp_path, f"scenarios:\n  - {{model: {prod_dir}, world_size: 1, checks: [export]}}\n")
    second = tmp_path / "t.yaml"
    second.write_text("scenarios:\n  - {model: other/Qwen3-Prod, world_size: 2, layout: {ep: 2}, checks: [export]}\n")
    with pytest.raises(UsageError, match=r"t.yaml:2: two user models share the key 'model:Qwen3-Prod'.*rename one"):
        load([first, str(second)], checks=CHECKS)


def test_cli_model_set_needs_model(capsys):
    assert cli.main(["run", "--model-set", "a=1", "--list"]) == 2
    assert "give --model" in capsys.readouterr().err


def test_doctor_model_set_needs_model_and_bad_model_is_refused_first(capsys, tmp_path):
    assert cli.main(["doctor", "--model-set", "a=1"]) == 2
    assert "give --model" in capsys.readouterr().err
    assert cli.main(["doctor", "--model", str(tmp_path / "absent")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_cpu_spec_refuses_what_it_cannot_rebuild():
    import functools
    from types import SimpleNamespace as NS

    from moeverify.models.builder import _refuse_cpu_spec_gaps

    def default_layer_spec(config):  # the names the CPU spec rebuilds
        return None

    def get_gpt_decoder_block_spec(config, use_transformer_engine=False):
        return None

    def olmoe_layer_spec(config):
        return None

    plain = dict(
        softmax_type="vanilla",
        window_size=None,
        experimental_attention_variant=None,
        layernorm_zero_centered_gamma=False,
    )
    rebuilt = {default_layer_spec: "plain", get_gpt_decoder_block_spec: "block"}
    assert (
        _refuse_cpu_spec_gaps(NS(transformer_layer_spec=default_layer_spec, **plain), "f", rebuilt=rebuilt) == "plain"
    )
    assert (
        _refuse_cpu_spec_gaps(
            NS(transformer_layer_spec=functools.partial(get_gpt_decoder_block_spec), **plain), "f", rebuilt=rebuilt
        )
        == "block"
    )
    with pytest.raises(UsageError, match="f: without Transformer Engine.*own layer spec .*olmoe_layer_spec"):
        _refuse_cpu_spec_gaps(NS(transformer_layer_spec=olmoe_layer_spec, **plain), "f", rebuilt=rebuilt)
    with pytest.raises(
        UsageError, match="does not reproduce experimental_attention_variant='gated_delta_net'.*gpu_only"
    ):  # linear attention under a spec that builds none
        _refuse_cpu_spec_gaps(
            NS(
                transformer_layer_spec=default_layer_spec,
                softmax_type="learnable",
                window_size=(127, 0),
                experimental_attention_variant="gated_delta_net",
                layernorm_zero_centered_gamma=False,
            ),
            "f",
            rebuilt=rebuilt,
        )


def test_cpu_spec_builds_gated_delta_net_and_zero_centered_rms_norms_only():
    from types import SimpleNamespace as NS

    from moeverify.models.builder import _refuse_cpu_spec_gaps
    from moeverify.models.local_spec import FamilySpec

    def hybrid_spec(config):
        return None

    hybrid = FamilySpec(linear_attention=True)
    rebuilt = {hybrid_spec: hybrid}
    qwen3_next = dict(
        transformer_layer_spec=hybrid_spec,
        softmax_type="vanilla",
        window_size=None,
        normalization="RMSNorm",
        layernorm_zero_centered_gamma=True,
    )
    assert (
        _refuse_cpu_spec_gaps(NS(**qwen3_next, experimental_attention_variant="gated_delta_net"), "f", rebuilt=rebuilt)
        is hybrid
    )
    with pytest.raises(UsageError, match=r"experimental_attention_variant='dsa'"):
        _refuse_cpu_spec_gaps(NS(**qwen3_next, experimental_attention_variant="dsa"), "f", rebuilt=rebuilt)
    with pytest.raises(UsageError, match=r"layernorm_zero_centered_gamma=True with LayerNorm"):
        _refuse_cpu_spec_gaps(
            NS(**dict(qwen3_next, normalization="LayerNorm"), experimental_attention_variant="gated_delta_net"),
            "f",
            rebuilt=rebuilt,
        )


def test_seeded_weights_keep_an_expert_bias_parameter_in_fp32(tmp_path):
    import torch

    class Gate(torch.nn.Module):  # Ernie-4.5 keeps e_score_correction_bias as a parameter, not a buffer
        def __init__(self):
            super().__init__()
            self.e_score_correction_bias = torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))

    gate = Gate()
    families._fp32_expert_bias(gate)
    assert isinstance(gate.e_score_correction_bias, torch.nn.Parameter)
    assert gate.e_score_correction_bias.dtype == torch.float32


@pytest.mark.parametrize(
    "name, moe_layers",
    [
        ("olmoe", (0, 1, 2, 3)),
        ("gpt_oss", (0, 1, 2, 3)),
        ("deepseek_v2", (1, 2, 3)),
        ("glm4_moe", (1, 2, 3)),
        ("qwen3_next", (0, 1, 2, 3)),
        ("ernie45_moe", (1, 2, 3)),
        ("minimax_m2", (0, 1, 2, 3)),
        ("qwen35_moe", (0, 1, 2, 3)),
        ("mixtral", (0, 1, 2, 3)),
    ],
)
def test_family_configs_register_with_their_moe_layers(tmp_path, repo_root, name, moe_layers):
    shape = families.family_shape(user.read(_family_tool(repo_root).write(tmp_path, name)).ref)
    assert (shape.num_layers, shape.num_experts, shape.moe_layers) == (4, 8, moe_layers)


def _family_tool(repo_root):
    import importlib.util

    spec = importlib.util.spec_from_file_location("family_configs", repo_root / "tools" / "family_configs.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool


@pytest.mark.parametrize(
    "name, message",
    [
        ("glm_moe_dsa", r"model:glm_moe_dsa: without Transformer Engine .*experimental_attention_variant='dsa'"),
        ("mixtral", r"model:mixtral: Megatron-Bridge cannot convert it: .*'MixtralForCausalLM' is not yet supported"),
        (
            "glm_moe_dsa_bare",
            r"model:glm_moe_dsa_bare: GLM5Bridge could not make a Megatron config from its config.json: "
            r"AttributeError: .*indexer_rope_interleave",
        ),
    ],
)
def test_run_refuses_what_every_rank_would_refuse_before_torchrun(
    tmp_path, repo_root, monkeypatch, capsys, name, message
):
    import re

    from moeverify.runner import launch

    def no_rank_may_start(*args, **kwargs):
        raise AssertionError("a torchrun group was started")

    monkeypatch.setattr(launch, "run_group", no_rank_may_start)
    model = _family_tool(repo_root).write(tmp_path, name.removesuffix("_bare"))
    if name.endswith("_bare"):  # the config transformers writes, without the key GLM-5's hub configs add
        config = json.loads((model / "config.json").read_text())
        del config["indexer_rope_interleave"]
        model = model.rename(tmp_path / name)
        (model / "config.json").write_text(json.dumps(config))
    code = cli.main(
        [
            "run",
            str(repo_root / "scenarios" / "families.yaml"),
            "--model",
            str(model),
            "--backend",
            "cpu",
            "--run-dir",
            str(tmp_path / "runs"),
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and re.search(message, err), err


@pytest.mark.parametrize(
    "name", ["deepseek_v2", "glm4_moe", "olmoe", "minimax_m2", "ernie45_moe", "qwen3_next", "qwen35_moe"]
)
def test_preflight_passes_a_model_the_cpu_path_rebuilds(tmp_path, repo_root, name):
    from moeverify.models import builder

    ref = user.read(_family_tool(repo_root).write(tmp_path, name)).ref
    builder.preflight(ref, te_real=False)  # its spec is rebuilt faithfully (family_specs.py, grouped experts)
    assert not any(tmp_path.glob("**/*.safetensors")), "the preflight reads the config only"


def test_model_set_layer_count_carries_the_per_layer_lists(tmp_path, repo_root):
    model = _family_tool(repo_root).write(tmp_path, "qwen35_moe")  # layer_types: 3 linear, then full attention
    shrunk = user.read(model, {"num_hidden_layers": 2})
    assert shrunk.config["layer_types"] == ["linear_attention", "linear_attention"]
    with pytest.raises(
        UsageError,
        match=r"num_hidden_layers=8 is more than the config's 4, whose layer_types has "
        r"one entry per layer: give --model-set layer_types=\[...\] with 8 entries",
    ):
        user.read(model, {"num_hidden_layers": 8})
    grown = user.read(model, {"num_hidden_layers": 8, "layer_types": ["linear_attention"] * 7 + ["full_attention"]})
    assert families.family_shape(grown.ref).num_layers == 8
    with pytest.raises(
        UsageError,
        match=r"(?s)config class refuses this config: StrictDataclassClassValidationError.*"
        r"layer_types",
    ):
        user.read(model, {"num_hidden_layers": 2, "layer_types": ["linear_attention", "nonsense"]})


def test_mla_without_a_query_projection_rank_is_refused_by_moeverify_not_megatron(tmp_path, patched_megatron_world):
    """DeepSeek-V2-Lite's q_lora_rank=None: megatron-core builds its query path only with Transformer Engine; every
    path here lacks it, and the refusal says so (it was a ValueError from inside Megatron's MLA module)."""
    from moeverify import models

    config = models.hf_config_dict("deepseek_v3")
    config["q_lora_rank"] = None
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UsageError, match=r"q_lora_rank=None .* only with Transformer Engine"):
        models.build(models.ModelRef.user(tmp_path / "config.json"), models.Layout(), seed=0)


def test_list_refuses_a_model_the_run_refuses(tmp_path, capsys):
    """``run --list`` is the login node's plan check: a user model Megatron-Bridge cannot convert is refused there as
    the run refuses it (it listed a plan that then failed)."""
    from moeverify import cli

    config = dict(
        architectures=["MixtralForCausalLM"],
        model_type="mixtral",
        hidden_size=64,
        intermediate_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        num_local_experts=8,
        num_experts_per_tok=2,
        vocab_size=256,
        max_position_embeddings=256,
    )
    (tmp_path / "mixtral").mkdir()
    (tmp_path / "mixtral" / "config.json").write_text(json.dumps(config))
    scenarios = tmp_path / "s.yaml"
    scenarios.write_text("version: 1\nscenarios:\n  - {family: qwen3_moe, world_size: 1, checks: [export]}\n")
    assert cli.main(["run", str(scenarios), "--model", str(tmp_path / "mixtral"), "--list"]) == 2
    assert "Megatron-Bridge cannot convert it" in capsys.readouterr().err
