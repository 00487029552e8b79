"""The minimal receiver mutants (``moeverify.spec.bug_classes``' ``minimal``) change what they say and no more: on
synthetic HF tensors, ``one_ulp_in_one_expert`` holds exactly one element one ulp off after the first load
(``receiver``), and ``reload_keeps_one_element`` holds exactly one element of the previous weights after a sync
(``receiver_reload``)."""

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
    held = [
        (
            compare(mutant.load(first.items()), first, Tally()),
            mutant.tensors[W2].clone(),
            control.load(first.items()).tensors[W2].clone(),
        )
    ]
    held.append(
        (
            compare(mutant.load(second.items()), second, Tally(), when="after the weight sync: "),
            mutant.tensors[W2].clone(),
            control.load(second.items()).tensors[W2].clone(),
        )
    )
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


def _held(receiver) -> dict[str, torch.Tensor]:
    return {e: t.clone() for e, t in receiver.tensors.items()}


def _one_element_apart(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[tuple[str, list[int]]]:
    return [(e, idx) for e in a for idx in (bits(a[e]) != bits(b[e])).nonzero().tolist()]


def test_one_rank_one_element_stale_is_reload_keeps_one_element_on_ranks_other_than_0():
    first, second = _export(0), _export(1)
    held, synced = {}, {}
    for rank in (0, 1):
        receiver = MUTANTS["one_rank_one_element_stale"][0](rank=rank)
        receiver.load(first.items())
        synced[rank] = compare(receiver.load(second.items()), second, Tally())
        held[rank] = _held(receiver)
    assert synced[0].passed and not synced[1].passed  # rank 0's engine worker got the whole sync
    assert _one_element_apart(held[0], held[1]) == [(W2, [0, 0, 0])]


def test_repeat_nudges_one_element_moves_one_element_one_ulp_on_a_repeated_load():
    first, second = _export(0), _export(1)
    receiver = MUTANTS["repeat_nudges_one_element"][0]()
    receiver.load(first.items())
    assert compare(receiver.load(second.items()), second, Tally()).passed  # new bits: loaded right
    before = _held(receiver)
    receiver.load(second.items())
    assert _one_element_apart(before, receiver.tensors) == [(W2, [0, 0, 0])]
    assert abs(int(bits(before[W2])[0, 0, 0]) - int(bits(receiver.tensors[W2])[0, 0, 0])) == 1


def test_wake_restores_one_element_gives_back_one_element_of_the_first_load():
    first, second = _export(0), _export(1)
    receiver = MUTANTS["wake_restores_one_element"][0]()
    receiver.load(first.items())
    old = receiver.tensors[W2][0, 0, 0].clone()
    receiver.load(second.items())
    before = _held(receiver)
    receiver.sleep()
    receiver.wake_up()
    assert _one_element_apart(before, receiver.tensors) == [(W2, [0, 0, 0])]
    assert torch.equal(receiver.tensors[W2][0, 0, 0], old)


def test_tied_head_one_element_stale_leaves_one_head_element_at_the_first_copy():
    embedding = "model.embed_tokens.weight"
    first, second = _export(0), _export(1)
    receiver = MUTANTS["tied_head_one_element_stale"][0](hf_path=None)
    receiver._tied = embedding  # the engine ties its head to the embedding (as ``fused`` does for a tied model)
    receiver.load(first.items())
    receiver.load(second.items())
    head, emb = receiver.tensors[receiver.HEAD], second[embedding]
    assert (bits(head) != bits(emb)).nonzero().tolist() == [[0, 0]]
    assert torch.equal(head[0, 0], first[embedding][0, 0])
