"""The replay oracle's ``token_counts`` subcheck on a real 1-rank DeepSeek-V3 (expert bias, padding masks,
router calls of T == E and T != E tokens): moeverify's patch passes, the ``counts_padding`` mutant (padding
tokens counted into ``local_tokens_per_expert``, everything else right) fails it and passes equivalence."""

from __future__ import annotations

import types

import pytest

from moeverify.models.ref import ModelRef
from moeverify import views
from moeverify.checks import ReplayOptions
from moeverify.layout import Layout
from moeverify.oracles.replay import setup as st
from moeverify.oracles.replay import subchecks as sc
from moeverify.oracles.replay import token_counts
from moeverify.oracles.replay.faulty import MUTANTS
from moeverify.oracles.replay.impls import make_impl
from moeverify.router_variants import VARIANTS
from moeverify.oracles.results import Tally

pytestmark = pytest.mark.usefixtures("patched_megatron_world")


def make_setup(impl: str, *, family: str = "deepseek_v3", subchecks=("token_counts",)) -> st.Setup:
    scenario = types.SimpleNamespace(name=f"{family}-unit", family=family, model=ModelRef.builtin(family), seed=0,
                                     layout=Layout())
    ctx = types.SimpleNamespace(scenario=scenario, world_size=1, rank=0, options={})
    opts = ReplayOptions(impl=impl, variants=(VARIANTS["default"],), subchecks=subchecks, microbatches=2)
    implementation = make_impl(impl)
    implementation.apply()
    return st.make_setup(ctx, opts, implementation, VARIANTS["default"], views.rank_coords(Layout(), rank=0,
                                                                                              world_size=1))


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
    sc.variant_on_layout(make_setup("moeverify.oracles.replay.faulty:counts_padding", subchecks=("equivalence",)),
                         tallies, {})
    assert tallies["equivalence"].passed, tallies["equivalence"].failures


def test_token_counts_not_applicable_on_deepseek_v2_with_reason():
    """DeepSeek-V2's tiny model: no expert bias, no aux loss, no z-loss: reported not applicable, not failed."""
    t, notes = run_token_counts(make_setup("moeverify", family="deepseek_v2"))
    assert t.checked == 0 and not t.failures
    assert "no expert bias" in t.not_applicable and "moe_aux_loss_coeff" in t.not_applicable, t.not_applicable
    assert t.as_dict() == {"passed": True, "checked": 0, "failures": [], "not_applicable": t.not_applicable}
    assert notes["token_counts"].startswith("not applicable: ")
