"""A config the installed Megatron-Bridge would build as another model is refused before any rank starts (F11)."""

from __future__ import annotations

import importlib.util
import re

import pytest

from moeverify import cli
from moeverify.errors import UsageError
from moeverify.models import builder, families
from moeverify.spec.models import user

SMALL = dict(
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
def qwen3_moe_dir(tmp_path):
    """A small Qwen3-MoE config.json whose first layer is dense, in a directory named ``m`` (key ``model:m``)."""
    import transformers

    config = transformers.Qwen3MoeConfig(**SMALL, mlp_only_layers=[0])
    config.architectures = ["Qwen3MoeForCausalLM"]
    config.save_pretrained(tmp_path / "m")
    return tmp_path / "m"


def _family_dir(repo_root, tmp_path, name):
    spec = importlib.util.spec_from_file_location("family_configs", repo_root / "tools" / "family_configs.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool.write(tmp_path, name)


def test_run_refuses_a_dense_first_layer_the_qwen3_moe_bridge_ignores(
    qwen3_moe_dir, repo_root, tmp_path, monkeypatch, capsys
):
    from moeverify.runner import launch

    def no_rank_may_start(*args, **kwargs):
        raise AssertionError("a torchrun group was started")

    monkeypatch.setattr(launch, "run_group", no_rank_may_start)
    code = cli.main(
        [
            "run",
            str(repo_root / "scenarios" / "families.yaml"),
            "--model",
            str(qwen3_moe_dir),
            "--backend",
            "cpu",
            "--check",
            "roundtrip",
            "--run-dir",
            str(tmp_path / "runs"),
        ]
    )
    captured = capsys.readouterr()
    err = captured.err
    assert code == 2, err
    assert re.search(
        r"model:m: the installed Megatron-Bridge's Qwen3MoEBridge cannot convert this config as it is "
        r"\(finding F11, README\): mlp_only_layers=\[0\]: Qwen3MoEBridge ignores mlp_only_layers: "
        r"transformers builds MoE layers 1, 2, 3, Qwen3MoEBridge builds MoE layers 0-3 \(every layer\)"
        r".*Way out: .*--model-set mlp_only_layers=\[\]",
        err,
    ), err
    assert "Traceback" not in err + captured.out and "\N{CIRCLED LATIN CAPITAL LETTER M}" not in err + captured.out


@pytest.mark.parametrize(
    "sets, message",
    [
        (
            {"mlp_only_layers": [], "decoder_sparse_step": 2},
            r"decoder_sparse_step=2: Qwen3MoEBridge ignores decoder_sparse_step: transformers builds MoE layers 1, 3, "
            r"Qwen3MoEBridge builds MoE layers 0-3 .*--model-set decoder_sparse_step=1",
        ),
        (
            {"mlp_only_layers": [1], "decoder_sparse_step": 2},
            r"decoder_sparse_step=2, mlp_only_layers=\[1\]: "
            r"Qwen3MoEBridge ignores decoder_sparse_step, mlp_only_layers: "
            r"transformers builds MoE layers 3, .*--model-set decoder_sparse_step=1 --model-set mlp_only_layers=\[\]",
        ),
        (
            {"mlp_only_layers": [], "attention_bias": True},
            r"attention_bias=true: Qwen3MoEBridge maps it to add_qkv_bias=True, "
            r"then builds add_qkv_bias=False: another "
            r"model than the checkpoint's. Way out: .*--model-set attention_bias=false",
        ),
    ],
)
def test_preflight_names_each_key_the_bridge_ignores(qwen3_moe_dir, sets, message):
    ref = user.read(qwen3_moe_dir / "config.json", sets).ref
    with pytest.raises(UsageError, match=message):
        builder.preflight(ref, te_real=False)


def test_preflight_passes_the_variant_the_bridge_builds(qwen3_moe_dir):
    """The way out the refusal names is a config the bridge converts as it is (the control)."""
    ref = user.read(qwen3_moe_dir / "config.json", {"mlp_only_layers": []}).ref
    builder.preflight(ref, te_real=False)


def test_preflight_refuses_the_ernie_interval_the_bridge_ignores(repo_root, tmp_path):
    """Megatron-Bridge 0.6.2's Ernie-4.5 bridge reads the first MoE layer only: an interval or an end index is
    lost (transformers reads all three)."""
    model = _family_dir(repo_root, tmp_path, "ernie45_moe")
    builder.preflight(user.read(model).ref, te_real=False)  # the family's own config: converted as it is
    interval = user.read(model / "config.json", {"moe_layer_interval": 2}).ref
    with pytest.raises(
        UsageError,
        match=r"moe_layer_interval=2: Ernie45Bridge ignores moe_layer_interval: "
        r"transformers builds MoE layers 1, 3, Ernie45Bridge builds MoE layers 1, 2, 3",
    ):
        builder.preflight(interval, te_real=False)
    end = user.read(model / "config.json", {"moe_layer_end_index": 2}).ref
    with pytest.raises(UsageError, match=r"moe_layer_end_index=2: Ernie45Bridge ignores moe_layer_end_index"):
        builder.preflight(end, te_real=False)


def test_layer_pattern_keys_transformers_does_not_read_are_no_rule(tmp_path):
    """transformers 5's DeepSeek-V2 and Qwen3-MoE ignore ``moe_layer_freq`` and ``first_k_dense_replace``: a stray
    key is neither a rule for the shape nor a reason to refuse."""
    import transformers

    config = transformers.DeepseekV2Config(num_hidden_layers=6, first_k_dense_replace=1, n_routed_experts=8)
    config.architectures = ["DeepseekV2ForCausalLM"]
    config.moe_layer_freq = 2
    config.save_pretrained(tmp_path / "dsv2")
    assert families.family_shape(user.read(tmp_path / "dsv2").ref).moe_layers == (1, 2, 3, 4, 5)
    qwen = transformers.Qwen3MoeConfig(num_hidden_layers=4, decoder_sparse_step=2)
    qwen.architectures = ["Qwen3MoeForCausalLM"]
    qwen.first_k_dense_replace = 3
    qwen.save_pretrained(tmp_path / "qwen")
    assert families.family_shape(user.read(tmp_path / "qwen").ref).moe_layers == (1, 3)
