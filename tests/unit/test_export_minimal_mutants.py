"""The minimal receiver mutants (``moeverify.bug_classes``' ``minimal``) change what they say and no more: on synthetic
HF tensors, ``one_ulp_in_one_expert`` holds exactly one element one ulp off after the first load (``receiver``), and
``reload_keeps_one_element`` holds exactly one element of the previous weights after a sync (``receiver_reload``)."""

import torch
from test_export_receiver import _export

from moeverify.oracles.bits import bits
from moeverify.oracles.export.receiver import compare
from moeverify.oracles.export.receiver_mutants import CONTROLS, MUTANTS
from moeverify.oracles.results import Tally

W2 = "model.layers.0.mlp.experts.w2_weight"


def _loads(name: str):
    factory, _ = MUTANTS[name]
    first, second = _export(0), _export(1)
    mutant, control = factory(), CONTROLS["fused"]()
    held = [(compare(mutant.load(first.items()), first, Tally()), mutant.tensors[W2].clone(),
             control.load(first.items()).tensors[W2].clone())]
    held.append((compare(mutant.load(second.items()), second, Tally(), when="after the weight sync: "),
                 mutant.tensors[W2].clone(), control.load(second.items()).tensors[W2].clone()))
    return held


def test_one_ulp_in_one_expert_holds_one_element_one_ulp_off():
    (tally, got, want), (again, _, _) = _loads("one_ulp_in_one_expert")
    assert len(tally.failures) == 1 and " 1 of " in tally.failures[0] and again.passed, tally.failures
    differ = (bits(got) != bits(want)).nonzero().tolist()
    assert differ == [[0, 0, 0]]
    assert abs(int(bits(got)[0, 0, 0]) - int(bits(want)[0, 0, 0])) == 1  # one ulp: adjacent bit patterns


def test_reload_keeps_one_element_holds_one_stale_element_after_a_sync():
    (first, _, _), (tally, got, want) = _loads("reload_keeps_one_element")
    assert first.passed and len(tally.failures) == 1 and " 1 of " in tally.failures[0], tally.failures
    assert (bits(got) != bits(want)).nonzero().tolist() == [[0, 0, 0]]
    assert torch.equal(got[0, 0, 0], _loads_first_value())


def _loads_first_value() -> torch.Tensor:
    return CONTROLS["fused"]().load(_export(0).items()).tensors[W2][0, 0, 0].clone()
