"""Model traits read from the HF config decide which replay variants and export mutants apply: built-in families
and user models (--model PATH) alike, never by name."""

from __future__ import annotations

import json

import pytest

from moeverify.errors import UsageError
from moeverify.models import FAMILIES, ModelRef, family_shape, family_traits, hf_config_dict
from moeverify.spec.layout import Layout
from moeverify.spec.models import user
from moeverify.spec.models.traits import traits_of
from moeverify.spec.router_variants import VARIANTS

BIAS_VARIANTS = ("sigmoid_bias", "sqrtsoftplus_bias")


def _user_copy(tmp_path, family: str) -> ModelRef:
    """A user model (a config.json alone) with a built-in family's config; its reference."""
    path = tmp_path / f"my-{family}"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(hf_config_dict(family)))
    return user.read(path).ref


def _hf_holds_expert_bias(family: str) -> bool:
    """Independent reference: transformers' own model of the family, built on the meta device, has an
    expert-bias tensor."""
    import torch
    import transformers

    from moeverify.spec.models import kimi

    cfg = hf_config_dict(family)
    if cfg.get("model_type") == kimi.MODEL_TYPE:
        kimi.ensure_registered()
    config = transformers.AutoConfig.for_model(**{k: v for k, v in cfg.items() if k != "architectures"})
    with torch.device("meta"):
        model = kimi.model_class(cfg["architectures"][0])(config)
    names = [n for n, _ in model.named_parameters()] + [n for n, _ in model.named_buffers()]
    return any(n.endswith("e_score_correction_bias") for n in names)


def test_traits_expert_bias_matches_transformers_models_for_every_family():
    got = {f: family_traits(f).expert_bias for f in FAMILIES}
    expected = {f: _hf_holds_expert_bias(f) for f in FAMILIES}
    assert sum(expected.values()) >= 6, expected  # the reference found the bias somewhere
    assert got == expected


@pytest.mark.parametrize("family", ["glm4_moe", "kimi_k2", "deepseek_v3", "glm4_moe_lite", "minimax_m2"])
def test_bias_variants_apply_to_every_family_that_carries_an_expert_bias(family):
    traits = family_traits(family)
    assert {v: VARIANTS[v].not_applicable(family, traits=traits) for v in BIAS_VARIANTS} == dict.fromkeys(BIAS_VARIANTS)


def test_bias_variants_skip_a_family_without_expert_bias_with_the_reason():
    reason = VARIANTS["sigmoid_bias"].not_applicable("qwen3_moe", traits=family_traits("qwen3_moe"))
    assert reason == (
        "qwen3_moe's HF checkpoint has no expert-bias tensor (e_score_correction_bias) for the bridge to load"
    )
    assert VARIANTS["softmax"].not_applicable("qwen3_moe", traits=family_traits("qwen3_moe")) is None


@pytest.mark.parametrize(
    "family", ["glm4_moe", "deepseek_v3", "qwen3_moe", "qwen2_tied", "qwen3_next", "deepseek_v3_mtp"]
)
def test_user_model_has_the_traits_of_the_family_it_copies(tmp_path, family):
    ref = _user_copy(tmp_path, family)
    assert family_traits(ref) == family_traits(family)


def test_traits_of_each_kind():
    t = {f: family_traits(f) for f in ("deepseek_v3_mtp", "qwen3_next", "qwen3_5_moe", "qwen2_tied", "glm4_moe")}
    assert (t["deepseek_v3_mtp"].mtp_layers, t["deepseek_v3_mtp"].mla, t["deepseek_v3_mtp"].dense_prefix) == (
        1,
        True,
        1,
    )
    assert (t["qwen3_next"].gdn_in_proj, t["qwen3_5_moe"].gdn_in_proj, t["glm4_moe"].gdn_in_proj) == (
        "grouped",
        "flat",
        None,
    )
    assert (t["qwen2_tied"].tied_embeddings, t["qwen2_tied"].dense_prefix) == (True, 4)  # dense: no MoE layer
    assert (t["glm4_moe"].tied_embeddings, t["glm4_moe"].mla, t["glm4_moe"].mtp_layers) == (False, False, 0)


def test_traits_refuse_a_config_that_leaves_tied_embeddings_to_a_class_default():
    cfg = {k: v for k, v in hf_config_dict("qwen2").items() if k != "tie_word_embeddings"}
    with pytest.raises(UsageError, match=r"my-model: config needs a boolean tie_word_embeddings \(got None\)"):
        traits_of(cfg, where="my-model")


# Where each mutant applies in the catalogue's scenarios (tests/special_distributed/test_mutant_catalogue.py):
# reading traits instead of names must keep exactly these.
CATALOGUE = {
    ("qwen3_moe", "ep2"): {"expert_local_ids", "qkv_concatenated", "diverged_replica"},
    ("deepseek_v3", "ep2"): {"expert_local_ids", "fp32_through_bf16", "bias_sent_as_bf16", "diverged_replica"},
    ("qwen2_tied", "pp2"): {"qkv_concatenated", "tied_embedding_dropped", "diverged_replica"},
    ("qwen2", "pp2"): {"qkv_concatenated"},
    ("qwen3_next", "tp2-sp"): {"gdn_in_proj_flat", "zero_centered_norm_unshifted", "diverged_replica"},
}


def _applying(model: str, layout: Layout) -> set[str]:
    from moeverify.oracles.export.mutants import MUTANTS

    conditional = {
        "expert_local_ids",
        "fp32_through_bf16",
        "bias_sent_as_bf16",
        "qkv_concatenated",
        "tied_embedding_dropped",
        "diverged_replica",
        "gdn_in_proj_flat",
        "zero_centered_norm_unshifted",
    }
    return {
        m.name
        for m in MUTANTS
        if m.name in conditional
        and m.applies(traits=family_traits(model), shape=family_shape(model), layout=layout, world_size=2)
    }


@pytest.mark.parametrize("family, layout_name", sorted(CATALOGUE))
def test_mutants_apply_by_traits_to_families_and_their_user_copies(tmp_path, family, layout_name):
    from moeverify.spec.layout import parse_layout_name

    layout, _ = parse_layout_name(layout_name)
    assert _applying(family, layout) == CATALOGUE[family, layout_name]
    assert _applying(_user_copy(tmp_path, family), layout) == CATALOGUE[family, layout_name]
