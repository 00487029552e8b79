"""The replay oracle's ``token_counts`` subcheck on a real 1-rank DeepSeek-V3 (expert bias, padding masks,
router calls of T == E and T != E tokens): moeverify's patch passes, the ``counts_padding`` mutant (padding
tokens counted into ``local_tokens_per_expert``, everything else right) fails it and passes equivalence."""

from __future__ import annotations

import types

import pytest

from moeverify.oracles.replay import setup as st
from moeverify.oracles.replay import subchecks as sc
from moeverify.oracles.replay import token_counts
from moeverify.oracles.replay.faulty import MUTANTS
from moeverify.oracles.replay.impls import make_impl
from moeverify.oracles.results import Tally
from moeverify.routing import views
from moeverify.spec.checks import ReplayOptions
from moeverify.spec.layout import Layout
from moeverify.spec.models.ref import ModelRef
from moeverify.spec.router_variants import VARIANTS

pytestmark = pytest.mark.usefixtures("patched_megatron_world")


def make_setup(impl: str, *, family: str = "deepseek_v3", subchecks=("token_counts",), dtype="fp32") -> st.Setup:
    scenario = types.SimpleNamespace(
        name=f"{family}-unit", family=family, model=ModelRef.builtin(family), seed=0, layout=Layout()
    )
    ctx = types.SimpleNamespace(scenario=scenario, world_size=1, rank=0, options={})
    opts = ReplayOptions(impl=impl, variants=(VARIANTS["default"],), subchecks=subchecks, microbatches=2, dtype=dtype)
    implementation = make_impl(impl)
    implementation.apply()
    return st.make_setup(
        ctx, opts, implementation, VARIANTS["default"], views.rank_coords(Layout(), rank=0, world_size=1)
    )


def run_token_counts(setup: st.Setup) -> tuple[Tally, dict]:
    t, notes = Tally(), {}
    token_counts.run(setup, t, notes)
    return t, notes


def test_token_counts_moeverify_passes_both_cases():
    t, notes = run_token_counts(make_setup("moeverify"))
    assert t.passed, t.failures
    assert notes["token_counts_cases"] == ["T==E: S=4 B=2", "T!=E: S=16 B=2"]
    assert t.checked >= 2 * 3 * 2  # per case: padding present, 3 layers' counts, tracked losses, ...


def test_token_counts_mutant_counts_padding_fails_only_token_counts():
    assert MUTANTS["counts_padding"] == "token_counts"
    setup = make_setup("moeverify.oracles.replay.faulty:counts_padding")
    t, _ = run_token_counts(setup)
    assert not t.passed
    assert any("T==E" in f and "local_tokens_per_expert" in f and "count(s) too many" in f for f in t.failures)
    assert any("T!=E" in f and "local_tokens_per_expert" in f for f in t.failures)
    # the neighbour that sees outputs and gradients passes: nothing but the counts is wrong
    tallies = {"equivalence": Tally()}
    sc.variant_on_layout(
        make_setup("moeverify.oracles.replay.faulty:counts_padding", subchecks=("equivalence",)), tallies, {}
    )
    assert tallies["equivalence"].passed, tallies["equivalence"].failures


def test_token_counts_minimal_mutant_one_count_extra_fails_by_one_count_per_case():
    """Sensitivity (``bug_classes`` minimal): one token counted twice, for one expert of one layer, per replayed
    pass."""
    assert MUTANTS["one_count_extra"] == "token_counts"
    t, _ = run_token_counts(make_setup("moeverify.oracles.replay.faulty:one_count_extra"))
    counts = [f for f in t.failures if "local_tokens_per_expert" in f]
    assert len(counts) == 2 == len(t.failures), t.failures  # one layer per case, nothing else wrong
    assert all("1 count(s) too many, 0 too few" in f for f in counts), counts
    assert any("T==E" in f for f in counts) and any("T!=E" in f for f in counts), counts


def test_token_counts_not_applicable_on_deepseek_v2_with_reason():
    """DeepSeek-V2's tiny model: no expert bias, no aux loss, no z-loss: reported not applicable, not failed."""
    t, notes = run_token_counts(make_setup("moeverify", family="deepseek_v2"))
    assert t.checked == 0 and not t.failures
    assert "no expert bias" in t.not_applicable and "moe_aux_loss_coeff" in t.not_applicable, t.not_applicable
    assert t.as_dict() == {"passed": True, "checked": 0, "failures": [], "not_applicable": t.not_applicable}
    assert notes["token_counts"].startswith("not applicable: ")


def test_token_counts_not_applicable_on_gpt_oss_whose_aux_coefficient_has_no_loss_type():
    """GPT-OSS's bridge builds ``moe_router_load_balancing_type 'none'`` beside ``moe_aux_loss_coeff 0.001``: Megatron
    computes no aux loss, the model has no expert bias and no z-loss. Reported not applicable with the reason (it
    used to be found applicable on the coefficient alone, then check 0 items and fail on a GPU suite run)."""
    t, notes = run_token_counts(make_setup("moeverify", family="gpt_oss"))
    assert t.checked == 0 and not t.failures
    assert "moe_router_load_balancing_type 'none'" in t.not_applicable, t.not_applicable
    assert t.as_dict() == {"passed": True, "checked": 0, "failures": [], "not_applicable": t.not_applicable}
    assert notes["token_counts"].startswith("not applicable: ")


def test_a_reference_pass_that_left_nothing_to_compare_fails_by_name():
    """Found applicable, yet native routing's pass left no count buffer, tracked loss or global_aux_loss total: the
    applicability rule and Megatron disagree, a failure that says so (not a bare "checked 0 items")."""
    import torch

    from moeverify.oracles.replay.pass_checks import check_token_counts

    padding_T = torch.tensor([False, True])
    calls = {(0, 0): (torch.tensor([[True, False], [False, True]]), padding_T)}
    empty = token_counts.Observed(calls=calls, counts={}, aux={}, global_counts={})
    t = Tally()
    check_token_counts(t, reference=empty, got=empty, prefix="T==E: ")
    assert not t.passed and t.checked == 1
    assert t.failures[0].startswith("T==E: native routing's pass left nothing to compare"), t.failures


def test_bf16_build_counts_compared_as_megatron_holds_them_and_finding_f13_noted():
    """``replay_dtype: bf16``: megatron-core 0.19.2's Float16Module casts the count buffer to bf16 (finding F13); the
    subcheck compares it with the counts accumulated the same way in bf16, passes for moeverify, notes the evidence,
    and still fails the counts_padding mutant."""
    t, notes = run_token_counts(make_setup("moeverify", dtype="bf16"))
    assert t.passed, t.failures
    evidence = notes["findings"][token_counts.FINDING]["evidence"]
    assert {e["dtype"] for e in evidence} == {"torch.bfloat16"} and {e["case"] for e in evidence} == {"T==E", "T!=E"}
    bad, _ = run_token_counts(make_setup("moeverify.oracles.replay.faulty:counts_padding", dtype="bf16"))
    assert any("local_tokens_per_expert" in f and "count(s) too many" in f for f in bad.failures), bad.failures


def test_bf16_counts_above_256_are_held_rounded_and_a_wrong_count_still_fails():
    """Synthetic calls: 301 tokens to experts 0 and 1 twice (602 exact, no bf16 value): the bf16 buffer holds what
    two rounded additions give; that passes (and is reported rounded), eight more fails."""
    import torch

    from moeverify.oracles.replay.pass_checks import check_token_counts, held_token_counts, reference_token_counts

    map_TE = torch.zeros(302, 4, dtype=torch.bool)
    map_TE[:, :2] = True
    padding_T = torch.zeros(302, dtype=torch.bool)
    padding_T[-1] = True  # one padding token per call, left out of the counts
    calls = {(0, 0): (map_TE, padding_T), (0, 1): (map_TE, padding_T)}
    exact_E = reference_token_counts(calls, layer=0, num_experts=4)
    held_E = held_token_counts(calls, layer=0, num_experts=4, dtype=torch.bfloat16)
    assert exact_E.tolist() == [602.0, 602.0, 0.0, 0.0] and held_E.float().tolist()[:2] != [602.0, 602.0]
    reference = token_counts.Observed(calls=calls, counts={0: exact_E}, aux={}, global_counts={})
    t = Tally()
    evidence = check_token_counts(
        t,
        reference=reference,
        got=token_counts.Observed(calls=calls, counts={0: held_E.clone()}, aux={}, global_counts={}),
        prefix="",
    )
    assert t.passed and t.checked == 1, t.failures
    assert evidence == [{"layer": 0, "dtype": "torch.bfloat16", "max_exact": 602.0, "experts_rounded": 2}]
    t = Tally()
    check_token_counts(
        t,
        reference=reference,
        got=token_counts.Observed(calls=calls, counts={0: held_E + 8}, aux={}, global_counts={}),
        prefix="",
    )
    assert not t.passed and "local_tokens_per_expert" in t.failures[0], t.failures
