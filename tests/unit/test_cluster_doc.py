"""docs/cluster.md: its production scenario file and plan command, run as written on a 235B-shaped config."""

from __future__ import annotations

import re

from moeverify import cli

# Qwen3-235B-A22B's shape (its published config.json): what the layout rules check against.
SHAPE = dict(
    num_hidden_layers=94,
    hidden_size=4096,
    num_attention_heads=64,
    num_key_value_heads=4,
    head_dim=128,
    num_experts=128,
    num_experts_per_tok=8,
    moe_intermediate_size=1536,
    intermediate_size=12288,
    vocab_size=151936,
    decoder_sparse_step=1,
    mlp_only_layers=[],
)


def _blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, flags=re.S)


def test_cluster_doc_plan_command_lists_the_production_scenario(tmp_path, repo_root, capsys):
    import transformers

    doc = (repo_root / "docs" / "cluster.md").read_text()
    (yaml_text,) = _blocks(doc, "yaml")
    (tmp_path / "production.yaml").write_text(yaml_text)
    ckpt = tmp_path / "Qwen3-235B-A22B"
    config = transformers.Qwen3MoeConfig(**SHAPE)
    config.architectures = ["Qwen3MoeForCausalLM"]
    config.save_pretrained(ckpt)

    plan = next(line for block in _blocks(doc, "bash") for line in block.splitlines() if "--list" in line)
    argv = plan.split()[1:]
    assert argv[:2] == ["run", "production.yaml"] and argv[argv.index("--model") + 1] == "/ckpt/Qwen3-235B-A22B"
    argv[1], argv[argv.index("--model") + 1] = str(tmp_path / "production.yaml"), str(ckpt)
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    expected = re.search(r"It prints `(.*?)`", doc).group(1)
    assert re.sub(r"\s+", " ", expected) in re.sub(r"\s+", " ", out), out


def test_cluster_doc_layout_without_the_uneven_split_is_not_run_with_the_rule(tmp_path, repo_root, capsys):
    import transformers

    doc = (repo_root / "docs" / "cluster.md").read_text()
    (yaml_text,) = _blocks(doc, "yaml")
    (tmp_path / "even.yaml").write_text(yaml_text.replace("pp_first: 11, pp_last: 11, ", ""))
    config = transformers.Qwen3MoeConfig(**SHAPE)
    config.architectures = ["Qwen3MoeForCausalLM"]
    config.save_pretrained(tmp_path / "m")
    assert (
        cli.main(
            [
                "run",
                str(tmp_path / "even.yaml"),
                "--model",
                str(tmp_path / "m"),
                "--nnodes",
                "4",
                "--node-rank",
                "0",
                "--rdzv-endpoint",
                "localhost:29500",
                "--list",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "(not run: model:m does not admit this layout: num_layers 94 is not divisible by pp*vpp = 8*1 = 8" in out
