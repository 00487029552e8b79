"""The replay slot order's fast path and the pieces it rests on (issue 36, "replay at native speed").

- ``topk_order`` (CUDA): one top-k of a set's ``[T, K]`` keys at its ascending ids gives native's grad-mode order
  wherever native picked that set, ties included (run with ``MOEVERIFY_TEST_BACKEND=cuda``; skipped on CPU ranks,
  where the argsort rule of ``canonical_slots`` serves);
- a shape whose check fails is served by the old path (a native top-k per call), never by ``topk_order``;
- ids kept ascending once per ``Routes`` (``replay_ids(..., ascending=True)``) and in the in-job route table;
- the agreement guard's per-call histogram gives the counts of a brute-force count, padding and natively routed
  tokens apart.
"""

from __future__ import annotations

import pytest
import torch

from moeverify.patches import agreement, replay_state
from moeverify.routing.routes import Routes

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="topk_order's rule is the CUDA top-k's")


def _native(scores, topk, num_groups=None, group_topk=None):  # Megatron's plain _compute_topk
    return torch.topk(scores, k=topk, dim=1, sorted=torch.is_grad_enabled())


@cuda
@pytest.mark.parametrize("experts,topk", [(8, 2), (64, 6), (128, 8), (512, 8)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_topk_order_is_native_grad_mode_order_on_tie_heavy_scores(experts, topk, dtype):
    g = torch.Generator(device="cuda").manual_seed(experts + topk)
    scores = (torch.randint(0, 4, (4096, experts), generator=g, device="cuda").to(torch.float32) * 0.5).to(dtype)
    with torch.no_grad():
        _, native_TK = replay_state.grad_mode_topk(_native, scores, topk)
        ours_TK = replay_state.topk_order(scores, native_TK.sort(dim=1).values)
    assert torch.equal(ours_TK, native_TK)
    ids_TK = replay_state.canonical_ids(scores, native_TK.sort(dim=1).values, _native, topk=topk)
    assert torch.equal(ids_TK, native_TK)


@cuda
def test_a_shape_failing_the_check_takes_the_old_path(monkeypatch):
    scores = torch.rand(64, 16, device="cuda")
    ids_TK = torch.rand(64, 16, device="cuda").argsort(dim=1)[:, :4].sort(dim=1).values
    called = []

    def native(s, k, num_groups=None, group_topk=None):
        called.append(1)
        return _native(s, k)

    key = (scores.device, scores.dtype, 16, 4, None, None)
    monkeypatch.setitem(replay_state._TOPK_ORDER, key, False)
    replay_state.canonical_ids(scores, ids_TK, native, topk=4)
    assert called  # the native top-k of the old rule ran


def _counting_native():
    called = []

    def native(s, k, num_groups=None, group_topk=None):
        called.append(1)
        return _native(s, k, num_groups, group_topk)

    return native, called


def test_cpu_rows_without_ties_take_descending_order_and_no_native_topk():
    g = torch.Generator().manual_seed(3)
    scores = torch.rand(512, 32, generator=g)  # fp32 uniform: no two keys of a row equal
    sorted_ids = torch.rand(512, 32, generator=g).argsort(dim=1)[:, :6].sort(dim=1).values
    native, called = _counting_native()
    ids = replay_state.canonical_ids(scores, sorted_ids, native, topk=6)
    expected = sorted_ids.gather(1, scores.gather(1, sorted_ids).argsort(dim=1, descending=True, stable=True))
    assert torch.equal(ids, expected) and not called


@pytest.mark.parametrize("tie", ["equal", "nan"])
def test_cpu_rows_with_tied_or_nan_keys_take_the_native_order(tie):
    scores = torch.tensor([[0.5, 0.5, 0.1, 0.9, 0.2, 0.3]] * 4)
    if tie == "nan":
        scores[:, 0] = scores[:, 1] = float("nan")
    with torch.no_grad():
        _, native_TK = replay_state.grad_mode_topk(_native, scores, 3)
    native, called = _counting_native()
    ids = replay_state.canonical_ids(scores, native_TK.sort(dim=1).values, native, topk=3)
    assert called and torch.equal(ids, native_TK)


def test_replay_table_is_made_once_per_device_with_token_counts():
    routes = Routes(
        {0: [torch.tensor([[3, 1], [0, 5]]), torch.tensor([[2, 1]])], 4: [torch.tensor([[1, 0]])] * 2},
        num_experts=6,
        topk=2,
    )
    given, ids, tokens = routes.replay_table("cpu")
    assert routes.replay_table("cpu")[1] is ids
    assert tokens == {0: (2, 1), 4: (1, 1)}
    assert torch.equal(ids[0][0], torch.tensor([[1, 3], [0, 5]])) and ids[0][0] is routes.replay_ids(
        0, 0, "cpu", ascending=True
    )
    assert torch.equal(given[0][0], torch.tensor([[3, 1], [0, 5]])) and given[0][0] is routes.replay_ids(0, 0, "cpu")


def test_replay_ids_ascending_is_one_sorted_private_copy():
    ids = torch.tensor([[3, 1, 2], [0, 5, 4]])
    routes = Routes({0: [ids]}, num_experts=6, topk=3)
    first = routes.replay_ids(0, 0, "cpu", ascending=True)
    assert first.tolist() == [[1, 2, 3], [0, 4, 5]]
    assert routes.replay_ids(0, 0, "cpu", ascending=True) is first
    assert routes.replay_ids(0, 0, "cpu").tolist() == ids.tolist()  # the unsorted copy is another tensor


def test_guard_histogram_counts_as_by_hand():
    torch.manual_seed(0)
    t, e, k = 200, 16, 4
    native_TK = torch.rand(t, e).argsort(dim=1)[:, :k]
    replayed_TK = native_TK.clone()
    replayed_TK[::3] = torch.stack([torch.randperm(e)[:k] for _ in range(replayed_TK[::3].shape[0])])  # off native
    pad_T = torch.zeros(t, dtype=torch.bool)
    pad_T[-10:] = True
    native_T = torch.zeros(t, dtype=torch.bool)
    native_T[5:15] = True
    native_T[-3:] = True  # padding too: counted as padding
    guard = agreement.Guard()
    try:
        guard.count(3, replayed_TK, native_TK, num_experts=e, pad_T=pad_T, routed_natively_T=native_T)
        guard.count(3, replayed_TK, native_TK, num_experts=e)
        guard.end_step()
        rows = {row["layer"]: row for row in guard.history}
    finally:
        guard.close()
    row = rows[3]
    hits = torch.tensor([len(set(a.tolist()) & set(b.tolist())) for a, b in zip(replayed_TK, native_TK, strict=True)])
    counted = ~pad_T & ~native_T
    agree = int((hits[counted] == k).sum()) + int((hits == k).sum())
    tokens = int(counted.sum()) + t
    assert row["tokens"] == tokens and row["routed"] == 2 * t
    assert row["padding"] == int(pad_T.sum()) and row["routed_natively"] == int((native_T & ~pad_T).sum())
    assert row["agreement"] == agree / tokens
    assert row["overlap"] == (int(hits[counted].sum()) + int(hits.sum())) / (tokens * k)


def _given_order_case(tokens=64, experts=16, topk=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(tokens, experts, generator=g)
    with torch.no_grad():
        _, native_TK = replay_state.grad_mode_topk(_native, scores, topk)
    return scores, native_TK


def test_a_given_order_whose_scores_strictly_descend_is_kept_as_given():
    scores, native_TK = _given_order_case()
    scores.requires_grad_()
    values_TK, ids_TK = replay_state.canonical_replay(
        scores, native_TK.sort(dim=1).values, _native, topk=4, given_TK=native_TK
    )
    assert ids_TK is native_TK  # no order computed: the recording's own order is the one
    assert torch.equal(values_TK, scores.gather(1, native_TK))
    values_TK.sum().backward()
    assert scores.grad is not None and int((scores.grad != 0).sum()) == native_TK.numel()


@pytest.mark.parametrize("case", ["shuffled", "tie", "nan", "inf"])
def test_a_given_order_that_is_not_the_one_takes_the_full_rule(case):
    scores, native_TK = _given_order_case(seed=3)
    given_TK = native_TK.clone()
    if case == "shuffled":  # the rollout engine's order: another slot order of the same sets
        given_TK = given_TK.flip(dims=(1,))
    elif case == "tie":  # two selected experts of row 5 score alike: the order is by ascending id there
        scores[5, given_TK[5, 1]] = scores[5, given_TK[5, 0]]
    elif case == "nan":
        scores[7, given_TK[7, 2]] = float("nan")
    else:
        scores[9, given_TK[9, 0]] = float("inf")
        scores[9, given_TK[9, 1]] = float("inf")
    sorted_TK = given_TK.sort(dim=1).values
    full = replay_state.canonical_ids(scores, sorted_TK, _native, topk=4)
    _, ids_TK = replay_state.canonical_replay(scores, sorted_TK, _native, topk=4, given_TK=given_TK)
    assert ids_TK is not given_TK
    assert torch.equal(ids_TK, full)


@pytest.mark.parametrize("shape", [(0, 4), (5, 1)])
def test_a_given_order_with_no_pair_to_compare_is_kept(shape):
    given_TK = torch.arange(shape[0] * shape[1]).view(shape) % 8
    _, ids_TK = replay_state.canonical_replay(
        torch.randn(shape[0], 8), given_TK.sort(dim=1).values, _native, topk=shape[1], given_TK=given_TK
    )
    assert ids_TK is given_TK


def _devices():
    return ["cpu", pytest.param("cuda", marks=cuda)]


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("given", ["kept", "shuffled", "none"])
def test_replay_plan_values_are_the_scores_at_the_ordered_ids_and_a_recompute_repeats_them(device, given):
    scores, native_TK = _given_order_case(tokens=256, experts=32, topk=6, seed=5)
    scores = scores.to(device).requires_grad_()
    native_TK = native_TK.to(device)
    given_TK = {"kept": native_TK, "shuffled": native_TK.flip(dims=(1,)), "none": None}[given]
    sorted_TK = native_TK.sort(dim=1).values
    values_TK, ids_TK, base_TK, pos_TK = replay_state.replay_plan(scores, sorted_TK, _native, topk=6, given_TK=given_TK)
    assert torch.equal(ids_TK, native_TK)  # the scores' own descending order, whichever way it was found
    assert torch.equal(values_TK, scores.gather(1, native_TK))
    again_TK, again_ids_TK = replay_state.replay_values(scores, ids_TK, base_TK, pos_TK)
    assert torch.equal(again_TK, values_TK) and torch.equal(again_ids_TK, ids_TK)
    (grad_plan,) = torch.autograd.grad(values_TK.square().sum(), scores)
    (grad_gather,) = torch.autograd.grad(scores.gather(1, native_TK).square().sum(), scores)
    assert torch.equal(grad_plan, grad_gather)  # the gradient of native replay's single gather, bitwise


@cuda
@pytest.mark.usefixtures("patched_megatron_world")
@pytest.mark.parametrize("reentrant", [True, False])
def test_checkpointed_replay_on_the_gpu_recomputes_its_forwards_ops(reentrant):
    """A checkpointed replay on the GPU, both checkpoint kinds: the recompute repeats its forward's ops (under the
    non-reentrant checkpoint it must save what the forward saved, one for one) and the gradients are a plain
    replay's, bitwise."""
    from test_router_replay import hidden, make_router, random_routes
    from torch.utils.checkpoint import checkpoint

    from moeverify.patches import router_replay as rr

    routes = random_routes([0], microbatches=2, seed=21)
    xs = [hidden(60 + i).cuda().requires_grad_() for i in range(2)]
    plain = make_router(1, seed=22).cuda()
    with rr.ReplaySession(plain).replay(routes):
        for x in xs:
            plain(x)[0].square().sum().backward()
    router = make_router(1, seed=22).cuda()
    session = rr.ReplaySession(router)
    with session.replay(routes):
        for x in xs:
            checkpoint(lambda inp: router(inp)[0], x, use_reentrant=reentrant).square().sum().backward()
    session.check_consumed()
    assert torch.equal(router.weight.grad, plain.weight.grad)
