"""The user's own model through the real runner on 2 CPU ranks: a production config shrunk with overrides,
and a directory of real safetensors weights that moeverify did not write."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]

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


def _prod_config():
    import transformers

    config = transformers.Qwen3MoeConfig()  # production-sized: 24 layers, hidden 2048, 128 experts
    config.architectures = ["Qwen3MoeForCausalLM"]
    return config


def _assert_all_passed(run, scenario: str, checks) -> None:
    assert run.code == 0, run.output[-4000:]
    for check in checks:
        record = run.record(scenario, check)
        assert record["passed"], (check, record)
        assert sum(s["checked"] for s in record["subchecks"].values()) > 0, (check, record)


@pytest.mark.release  # make test keeps the real-weights directory run through --model
def test_shrunk_production_config_in_a_scenario_file(run_moeverify, tmp_path, monkeypatch):
    monkeypatch.setenv("MOEVERIFY_CACHE_DIR", str(tmp_path / "cache"))
    _prod_config().save_pretrained(tmp_path / "Qwen3-Prod")
    sets = json.dumps(SHRINK)
    run = run_moeverify(f"""
        scenarios:
          - model: Qwen3-Prod
            model_set: {sets}
            world_size: 2
            layout: {{ep: 2}}
            checks: [roundtrip, export, replay]
    """)
    names = {r["scenario"] for r in run.records}
    assert len(names) == 1, names
    (name,) = names
    assert name.startswith("model:Qwen3-Prod+") and name.endswith("/ep2-dp2")
    _assert_all_passed(run, name, ("roundtrip", "export", "replay"))


def test_real_weights_directory_through_the_model_flag(run_moeverify, tmp_path, monkeypatch):
    import torch
    import transformers

    monkeypatch.setenv("MOEVERIFY_CACHE_DIR", str(tmp_path / "cache"))
    config = _prod_config()
    for key, value in SHRINK.items():
        setattr(config, key, value)
    torch.manual_seed(11)  # transformers' own initialisation: weights moeverify did not make
    model = transformers.Qwen3MoeForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(tmp_path / "mine", safe_serialization=True)
    assert list((tmp_path / "mine").glob("*.safetensors"))
    run = run_moeverify(
        """
        scenarios:
          - {family: qwen3_moe, world_size: 2, layout: {pp: 2}, checks: [roundtrip, export]}
          - {family: qwen2, world_size: 2, layout: {tp: 2}, checks: [roundtrip]}
    """,
        "--model",
        str(tmp_path / "mine"),
    )
    # both entries became the user's model; tp2 without sp does not admit an MoE model: skipped, with the reason
    skipped = run.record("model:mine/tp2", "roundtrip")
    assert not skipped["passed"] and "does not admit" in skipped["skipped"], skipped
    _assert_all_passed(run, "model:mine/pp2", ("roundtrip", "export"))


@pytest.mark.parametrize("override, message", [("num_expert=8", "no such key"), ("num_hidden_layers=x", "an int")])
def test_bad_override_is_refused_before_torchrun(run_moeverify, tmp_path, override, message):
    _prod_config().save_pretrained(tmp_path / "Qwen3-Prod")
    run = run_moeverify(
        "scenarios: [{family: qwen3_moe, world_size: 2, checks: [export]}]",
        "--model",
        str(tmp_path / "Qwen3-Prod"),
        "--model-set",
        override,
        timeout_s=60,
    )
    assert run.code == 2 and message in run.output and "torchrun" not in run.output, run.output


@pytest.mark.release
def test_production_width_directory_written_by_transformers(run_moeverify, tmp_path, monkeypatch):
    """Qwen3-30B-A3B's published width (hidden 2048, 128 experts top-8, vocab 151,936) at one layer, initialised and
    saved by transformers itself in 1 GB safetensors shards with their index (2.49 GB, weights moeverify never made):
    roundtrip and export pass on one rank and under EP2, every element of the export compared."""
    import torch
    import transformers

    monkeypatch.setenv("MOEVERIFY_CACHE_DIR", str(tmp_path / "cache"))
    published = json.loads((REPO_ROOT / "bench" / "qwen3_30b_a3b.json").read_text())
    config = transformers.Qwen3MoeConfig(**{**published, "num_hidden_layers": 1, "max_window_layers": 1})
    torch.manual_seed(5)
    model = transformers.Qwen3MoeForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(tmp_path / "Qwen3-30B-A3B-1layer", max_shard_size="1GB")
    del model
    shards = sorted((tmp_path / "Qwen3-30B-A3B-1layer").glob("*.safetensors"))
    assert len(shards) >= 2 and (tmp_path / "Qwen3-30B-A3B-1layer" / "model.safetensors.index.json").is_file()
    run = run_moeverify(
        """
        scenarios:
          - {model: Qwen3-30B-A3B-1layer, world_size: 1, checks: [roundtrip, export]}
          - {model: Qwen3-30B-A3B-1layer, world_size: 2, layout: {ep: 2}, checks: [roundtrip, export]}
    """,
        timeout_s=900,
    )
    _assert_all_passed(run, "model:Qwen3-30B-A3B-1layer/tp1", ("roundtrip", "export"))
    _assert_all_passed(run, "model:Qwen3-30B-A3B-1layer/ep2-dp2", ("roundtrip", "export"))
    assert run.record("model:Qwen3-30B-A3B-1layer/tp1", "export")["subchecks"]["bitwise"]["checked"] > 1.2e9
