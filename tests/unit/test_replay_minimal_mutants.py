"""The replay subchecks' sensitivity (``moeverify.spec.bug_classes``' ``minimal``): each minimal mutant of
``moeverify.oracles.replay.faulty`` (one token of one layer, one ulp of one routing weight, one layer's recompute)
runs through the replay oracle on a 1-rank tiny Qwen3-MoE, in process, and fails the subchecks it is declared to
fail (``faulty.MUTANTS`` and ``faulty.ALSO_FAILS``) with the reason, no others. ``one_count_extra`` (token_counts)
runs in ``test_replay_token_counts.py``."""

from __future__ import annotations

import types

import pytest

from moeverify.oracles.replay import oracle
from moeverify.oracles.replay.faulty import ALSO_FAILS, CAUGHT_BY, MUTANTS
from moeverify.spec.layout import Layout
from moeverify.spec.models.ref import ModelRef

pytestmark = pytest.mark.usefixtures("patched_megatron_world")


def _run(mutant: str, subchecks: list[str], **options) -> dict:
    scenario = types.SimpleNamespace(
        name="qwen3_moe-unit", family="qwen3_moe", model=ModelRef.builtin("qwen3_moe"), seed=0, layout=Layout()
    )
    ctx = types.SimpleNamespace(
        scenario=scenario,
        world_size=1,
        rank=0,
        backend="cpu",
        options={"replay_impl": f"moeverify.oracles.replay.faulty:{mutant}", "replay_subchecks": subchecks, **options},
    )
    return oracle.run(ctx)


def _failed(tallies) -> dict[str, list[str]]:
    return {name: t.failures for name, t in tallies.items() if not t.passed}


# (mutant, subchecks run, {subcheck: a reason its failures must include}); every other subcheck run must pass
CASES = [
    (
        "one_token_one_layer_route",
        ["equivalence", "drift", "cross_layout", "native_parity", "weights"],
        {
            "equivalence": "replay vs plain pass: routing map (layer, mb) (0, 0)",
            "drift": "layer 0 mb 0: 1 of 32 token(s) did not follow the recorded routes (first token 0)",
            "cross_layout": "did not follow the 1-rank reference routes",
            "native_parity": "vs native RouterReplay: routing map",
            "weights": "replay vs recorded pass: routing map",
        },
    ),
    (
        "one_ulp_one_prob",
        ["equivalence", "weights", "native_parity"],
        # one ulp of token 0's first weight; top-2 normalisation moves its other weight too: 2 of 32 x 8 probs differ
        {
            "equivalence": "replay vs plain pass: router probs (layer, mb) (0, 0): 2 of 256 element(s) differ",
            "weights": "replay vs recorded pass: router probs (layer, mb) (0, 0): 2 of 256 element(s) differ",
            "native_parity": "vs native RouterReplay: router probs (layer, mb) (0, 0): 2 of 256 element(s) differ",
        },
    ),
    ("one_layer_no_recompute_replay", ["recompute"], {"recompute": "recompute routed"}),
    # one weight on the moved router: right on the weights the routes were recorded with (the router picks them)
    (
        "one_masked_weight",
        ["drift", "weights"],
        {"weights": "router moved: layer 0 mb 0: 1 replayed expert weight(s) are 0 in 1 of 32 token(s)"},
    ),
    ("one_layer_fifo_recompute", ["backward_order"], {"backward_order": "it replayed another micro-batch's routes"}),
]


@pytest.mark.parametrize("mutant, subchecks, reasons", CASES, ids=[c[0] for c in CASES])
def test_minimal_replay_mutant_fails_its_subchecks_with_the_reason(mutant, subchecks, reasons):
    assert set(reasons) == {MUTANTS[mutant], *ALSO_FAILS.get(mutant, ())}
    tallies = _run(mutant, subchecks)
    failed = _failed(tallies)
    assert set(failed) == set(reasons), failed
    for name, reason in reasons.items():
        assert any(reason in f for f in failed[name]), (name, failed[name][:5])
    assert all(tallies[name].checked > 0 for name in subchecks), {n: t.checked for n, t in tallies.items()}


# The catalogue's coarse replay mutants, each through the subcheck it exists for (``faulty.CAUGHT_BY``; the same
# cases run under torchrun in make release: tests/special_distributed/test_replay_oracle.py); others may fail beside it
COARSE = [(m, sub, reason) for (m, sub), reason in CAUGHT_BY.items()]


@pytest.mark.parametrize("mutant, subcheck, reason", COARSE, ids=[f"{m}-{s}" for m, s, _ in COARSE])
def test_coarse_replay_mutant_fails_the_subcheck_it_exists_for(mutant, subcheck, reason):
    tallies = _run(mutant, [subcheck])
    failures = tallies[subcheck].failures
    assert not tallies[subcheck].passed and any(reason in f for f in failures), failures[:5]


def test_fifo_recompute_passes_recompute_where_backward_runs_in_forward_order():
    # the queue-order twin is right when backward follows forward order: only backward_order can see it
    tallies = _run("fifo_recompute", ["recompute"], replay_recompute=["full"])
    assert tallies["recompute"].passed and tallies["recompute"].checked > 0, tallies["recompute"].failures[:5]


def test_masked_probs_passes_every_other_subcheck_and_fails_weights_naming_the_zero_weights():
    """ISEEKYAN/Megatron-LM #79: weights read from the moved router's own post-top-k probabilities pass equivalence,
    drift, recompute and native_parity (on the recording's weights the router picks every replayed expert, and drift
    compares ids); weights, with the router moved, names the zero weights in every MoE layer. moeverify's own patch,
    the same build and perturbation, passes."""
    subchecks = ["equivalence", "drift", "recompute", "native_parity", "weights"]
    failed = _failed(_run("masked_probs", subchecks))
    assert set(failed) == {"weights"}, failed
    zeros = [f for f in failed["weights"] if " replayed expert weight(s) are 0 in " in f]
    assert {f.split("router moved: ")[1].split(" mb ")[0] for f in zeros} == {f"layer {n}" for n in range(4)}, zeros
    control = _run("masked_probs", ["drift", "weights"], replay_impl="moeverify")
    assert control["weights"].passed and control["weights"].checked > 1, control["weights"].failures[:3]
