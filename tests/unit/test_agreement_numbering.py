"""The agreement guard's numbering check (``agreement.numbering_faults``) on synthetic routing.

The trainer's routing is native top-k of seeded scores; the engine's is the same tokens' top-k of the same scores
(a healthy job), of scores moved by noise (drift: a bf16 engine, a trainer some steps on), of other scores (another
model: no numbering at all), or the healthy ids renumbered: every permutation of 8 experts, a swapped pair, an EPLB
map gone stale. Which experts moved is known here from the renumbering itself, never read off the guard.
Legend: T = tokens, E = experts, K = top-k.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from moeverify.errors import RouteError
from moeverify.patches import agreement

E, K = 8, 2


def scores(tokens: int, seed: int, *, experts: int = E, skew: float = 0.0) -> torch.Tensor:
    """``[T, E]`` router scores; ``skew`` > 0 makes low-numbered experts popular (an expert bias)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, experts, generator=g, dtype=torch.float64) - skew * torch.arange(experts)


def topk(scores_TE: torch.Tensor, k: int = K) -> torch.Tensor:
    return scores_TE.topk(k, dim=1).indices


def pairs(engine_TK: torch.Tensor, trainer_TK: torch.Tensor, experts: int = E) -> torch.Tensor:
    """The engine-id x trainer-id table, counted here by hand."""
    table = torch.zeros(experts, experts, dtype=torch.int64)
    for eng, nat in zip(engine_TK.tolist(), trainer_TK.tolist(), strict=True):
        for e in eng:
            for f in nat:
                table[e, f] += 1
    return table


def drifted(scores_TE: torch.Tensor, sigma: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return scores_TE + sigma * torch.randn(scores_TE.shape, generator=g, dtype=torch.float64)


def agreement_of(a_TK, b_TK) -> float:
    return (a_TK.sort(1).values == b_TK.sort(1).values).all(1).double().mean().item()


@pytest.mark.parametrize("sigma", [0.0, 0.01, 0.3, 0.6])
@pytest.mark.parametrize("skew", [0.0, 0.5])
def test_a_healthy_engine_drifted_or_not_is_never_named(sigma, skew):
    for seed in range(20):
        s = scores(100, seed, skew=skew)
        trainer, engine = topk(s), topk(drifted(s, sigma, 1000 + seed))
        assert agreement.numbering_faults(pairs(engine, trainer), topk=K) == [], (sigma, skew, seed)
    if sigma == 0.6:  # the drift is real: a quarter or more of the tokens change routes
        assert agreement_of(engine, trainer) < 0.75


def test_drift_where_one_trainer_expert_takes_over_anothers_tokens_is_not_a_numbering():
    # the trainer moved: expert 2 now wins every token expert 3 won, and keeps its own (expert 3 is dead)
    for seed in range(10):
        s = scores(200, 40 + seed)
        moved = s.clone()
        moved[:, 2] = torch.maximum(s[:, 2], s[:, 3]) + 0.01
        moved[:, 3] = -10.0
        engine, trainer = topk(s), topk(moved)
        table = pairs(engine, trainer)
        assert table[3, 2] >= 0.9 * table[3].sum() // K and table[3, 3] == 0  # engine id 3 "routes like" trainer 2
        assert agreement.numbering_faults(table, topk=K) == [], seed


@pytest.mark.parametrize("skew", [0.0, 1.0, 2.0])
def test_ids_with_no_relation_are_left_to_the_chance_floor(skew):
    # another model's routes, popular experts included (skew: the trainer sends most tokens to experts 0 and 1):
    # a row follows the trainer's shares, no expert "is" another
    for seed in range(20):
        trainer, engine = topk(scores(100, seed, skew=skew)), topk(scores(100, 500 + seed, skew=skew))
        assert agreement.numbering_faults(pairs(engine, trainer), topk=K) == [], (skew, seed)


def test_every_permutation_of_8_experts_is_named_on_100_tokens():
    # the engine's id of trainer expert f is perm[f]; the healthy table's rows move with it
    s = scores(100, 7)
    trainer = topk(s)
    healthy = pairs(topk(drifted(s, 0.01, 8)), trainer)
    assert agreement.numbering_faults(healthy, topk=K) == []
    perms = [p for p in itertools.permutations(range(E)) if p != tuple(range(E))]
    tables = torch.empty(len(perms), E, E, dtype=torch.int64)
    for i, perm in enumerate(perms):
        tables[i, list(perm)] = healthy  # row perm[f] of the engine's table is row f of the healthy one
    missed, wrong, fixed_points = [], [], 0
    for perm, found in zip(perms, agreement.numbering_faults_of(tables, topk=K), strict=True):
        if not found:
            missed.append(perm)
        fixed_points += sum(p == i for i, p in enumerate(perm))
        for e, f, _, _, _ in found:
            if perm[f] != e:  # named engine expert e as trainer expert f: the renumbering says otherwise
                wrong.append((perm, e, f))
    assert missed == [] and wrong == []
    assert fixed_points > 0  # permutations that keep some experts' numbers are among them


def test_the_issue_permutation_passed_the_floor_and_is_named():
    perm = [1, 4, 2, 3, 7, 5, 6, 0]  # 4 of 8 experts keep their number
    s = scores(100, 3)
    trainer = topk(s)
    engine = torch.tensor(perm)[topk(s)]
    overlap = sum(len(set(a) & set(b)) for a, b in zip(engine.tolist(), trainer.tolist(), strict=True)) / (100 * K)
    _, floor = agreement.chance_floor(topk=K, num_experts=E, slots=100 * K)
    assert overlap > floor  # the chance floor alone lets it through
    found = agreement.numbering_faults(pairs(engine, trainer), topk=K)
    assert {e for e, *_ in found} == {p for i, p in enumerate(perm) if p != i}
    assert all(perm[f] == e for e, f, *_ in found)


@pytest.mark.parametrize("experts,k", [(8, 2), (64, 8), (128, 8)])
def test_a_swapped_pair_is_named_and_only_it(experts, k):
    tokens = 40 * experts // k  # about 40 tokens an expert
    s = scores(tokens, 11, experts=experts)
    trainer = topk(drifted(s, 0.05, 12), k)
    swap = torch.arange(experts)
    swap[[2, 5]] = swap[[5, 2]]  # a stale EPLB map: two experts moved, every other id right
    engine = swap[topk(s, k)]
    found = agreement.numbering_faults(pairs(engine, trainer, experts), topk=k)
    assert sorted((e, f) for e, f, *_ in found) == [(2, 5), (5, 2)]


def test_the_guard_counts_the_pairs_and_fails_the_step_naming_expert_and_layer():
    s = scores(200, 5)
    trainer = topk(s)
    stale = torch.tensor([0, 1, 2, 6, 4, 5, 3, 7])  # experts 3 and 6 swapped
    guard = agreement.Guard(numbering=True, log=False)
    try:
        guard.count(5, stale[trainer], trainer, kind="training", num_experts=E)
        guard.count(2, trainer, trainer, kind="training", num_experts=E)  # a healthy layer beside it
        with pytest.raises(RouteError) as err:
            guard.end_step()
        msg = str(err.value)
        assert "training pass layer 5 rank 0: engine expert" in msg
        assert any(
            f"engine expert {e} routes like trainer expert {f} in 100% of its" in msg for e, f in [(3, 6), (6, 3)]
        )
        assert "(+1 more engine expert(s) of this layer); 1 pass-layer(s) so" in msg
        rows = {r["layer"]: r for r in guard.history}
        assert "numbering_faults" not in rows[2] and len(rows[5]["numbering_faults"]) == 2
        table = torch.zeros(E * E, dtype=torch.int64)
        table += pairs(stale[trainer], trainer).reshape(-1)
        assert sorted(map(tuple, rows[5]["numbering_faults"])) == sorted(
            agreement.numbering_faults(table.view(E, E), topk=K)
        )
    finally:
        guard.close()


def test_padding_and_natively_routed_tokens_stay_out_of_the_pairs():
    s = scores(64, 9)
    trainer = topk(s)
    engine = torch.tensor([1, 0, 2, 3, 4, 5, 6, 7])[trainer]  # every token renumbered ...
    pad_T = torch.ones(64, dtype=torch.bool)
    guard = agreement.Guard(numbering=True, log=False)
    try:
        guard.count(1, engine, trainer, kind="training", num_experts=E, pad_T=pad_T)  # ... but all padding
        assert guard.end_step() == {1: None}
    finally:
        guard.close()
