"""``Routes``: validation of every bad route, rollout import, layer selection, views delegation.

Legend: T = tokens, L = MoE layers, K = top-k, E = experts.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from moeverify.errors import RouteError
from moeverify.routing.routes import Routes, safe_routes, validate_topk_ids
from moeverify.spec.layout import Layout

E, K = 8, 2


def ids(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.int64)


def test_validate_topk_ids_wrong_shape_raises():
    with pytest.raises(RouteError, match=r"layer 3 rank 1 mb 2: route shape \(4, 3\) != expected \(T=4, K=2\)"):
        validate_topk_ids(
            torch.zeros(4, 3, dtype=torch.int64), layer=3, microbatch=2, num_experts=E, topk=K, tokens=4, rank=1
        )


def test_validate_topk_ids_float_dtype_raises():
    with pytest.raises(RouteError, match="layer 0 rank 0 mb 0: route dtype torch.float32 is not an integer"):
        validate_topk_ids(torch.zeros(4, 2), layer=0, microbatch=0, num_experts=E, topk=K, rank=0)


@pytest.mark.parametrize("bad", [-1, E])
def test_validate_topk_ids_out_of_range_raises(bad):
    with pytest.raises(RouteError, match=rf"layer 1 rank 0 mb 0: expert id {bad} out of range \[0, {E}\)"):
        validate_topk_ids(ids([[0, 1], [2, bad]]), layer=1, microbatch=0, num_experts=E, topk=K, rank=0)


def test_validate_topk_ids_duplicate_expert_raises():
    with pytest.raises(RouteError, match=r"layer 1 rank 0 mb 0: token 1 routes to expert\(s\) twice: \[5, 5\]"):
        validate_topk_ids(ids([[0, 1], [5, 5]]), layer=1, microbatch=0, num_experts=E, topk=K, rank=0)


@pytest.mark.parametrize("tokens", [100, 2_000])  # below and above the size where columns are compared
@pytest.mark.parametrize("dtype", [torch.uint8, torch.int16, torch.int64])
def test_validate_topk_ids_duplicates_found_alike_on_small_and_large_tensors(tokens, dtype):
    gen = torch.Generator().manual_seed(tokens)
    good = torch.rand(tokens, 128, generator=gen).topk(8, dim=1).indices.to(dtype)
    validate_topk_ids(good, layer=0, microbatch=0, num_experts=128, topk=8, rank=0)
    bad = good.clone()
    for row, (i, j) in ((tokens - 1, (7, 0)), (tokens // 2, (3, 4)), (tokens // 3, (1, 6))):
        bad[row, i] = bad[row, j]
    with pytest.raises(RouteError, match=rf"token {tokens // 3} routes to expert\(s\) twice: .* \(3 such row\(s\)\)"):
        validate_topk_ids(bad, layer=0, microbatch=0, num_experts=128, topk=8, rank=0)


def test_routes_microbatch_count_differs_raises():
    with pytest.raises(RouteError, match=r"micro-batch count differs between layers: \{0: 1, 1: 2\}"):
        Routes({0: [ids([[0, 1]])], 1: [ids([[0, 1]]), ids([[2, 3]])]}, num_experts=E, topk=K)


def test_routes_select_keeps_only_named_layers():
    routes = Routes({0: [ids([[0, 1]])], 2: [ids([[2, 3]])], 5: [ids([[4, 5]])]}, num_experts=E, topk=K)
    picked = routes.select((2, 5))
    assert picked.layers == (2, 5) and torch.equal(picked.get(5, 0), ids([[4, 5]]))


def test_routes_select_missing_layer_raises():
    routes = Routes({0: [ids([[0, 1]])]}, num_experts=E, topk=K)
    with pytest.raises(RouteError, match=r"select: layer\(s\) \[3\] not held; layers held: \[0\]"):
        routes.select((0, 3))


def test_safe_routes_distinct_and_spread_over_experts():
    safe_TK = safe_routes(12, topk=3, num_experts=E)
    assert [len(set(row)) for row in safe_TK.tolist()] == [3] * 12
    counts_E = torch.bincount(safe_TK.flatten(), minlength=E)
    assert int(counts_E.max() - counts_E.min()) <= 1  # round-robin: every expert within one of the others


def test_from_rollout_numpy_fills_engine_missing_last_row():
    rollout_TLK = np.array([[[0, 1], [2, 3]], [[4, 5], [6, 7]], [[1, 2], [3, 4]]], dtype=np.int32)
    routes = Routes.from_rollout(rollout_TLK, layers=(1, 3), num_experts=E, tokens=4)
    assert routes.layers == (1, 3) and routes.microbatches == 1
    layer1_TK = routes.get(1, 0)
    assert layer1_TK.shape == (4, K)
    assert torch.equal(layer1_TK[:3], ids([[0, 1], [4, 5], [1, 2]]))
    assert torch.equal(layer1_TK[3], safe_routes(1, topk=K, num_experts=E, start=3)[0])
    assert torch.equal(routes.get(3, 0)[:3], ids([[2, 3], [6, 7], [3, 4]]))


def test_from_rollout_pad_rows_get_safe_distinct_routes():
    rollout_TLK = torch.full((6, 1, K), -1, dtype=torch.int64)
    rollout_TLK[:2, 0] = ids([[3, 4], [5, 6]])
    pad_T = torch.tensor([False, False, True, True, True, True])
    routes = Routes.from_rollout(rollout_TLK, layers=(0,), num_experts=E, pad_T=pad_T)
    pads_TK = routes.get(0, 0)[2:]
    assert torch.equal(routes.get(0, 0)[:2], ids([[3, 4], [5, 6]]))
    assert len(set(pads_TK.flatten().tolist())) == 4 * K  # 4 pad rows over 8 distinct experts, none piled on 0


def test_from_rollout_split_into_microbatches():
    rollout_TLK = safe_routes(10, topk=K, num_experts=E).unsqueeze(1)
    routes = Routes.from_rollout(rollout_TLK, layers=(0,), num_experts=E, split=(4, 6))
    assert routes.microbatches == 2 and routes.get(0, 1).shape == (6, K)
    assert torch.equal(routes.get(0, 1), rollout_TLK[4:, 0])


def test_from_rollout_wrong_token_count_raises():
    with pytest.raises(RouteError, match=r"rollout routes hold 3 tokens != expected 5 \(or 4, the engine's"):
        Routes.from_rollout(np.zeros((3, 1, K), dtype=np.int64) + [0, 1], layers=(0,), num_experts=E, tokens=5)


def test_from_rollout_wrong_layer_count_raises():
    with pytest.raises(
        RouteError,
        match=r"rollout routes hold 2 layer columns, which fits neither numbering: "
        r"expected 1 MoE layers \(pass num_layers=",
    ):
        Routes.from_rollout(np.zeros((3, 2, K), dtype=np.int64), layers=(0,), num_experts=E)


def test_from_rollout_float_dtype_raises():
    with pytest.raises(RouteError, match="rollout routes dtype torch.float64 is not an integer dtype"):
        Routes.from_rollout(np.zeros((3, 1, K)), layers=(0,), num_experts=E)


@pytest.mark.parametrize("gap", [[-1, -1], [0, 0]])
def test_from_rollout_capture_gap_on_real_token_raises(gap):
    bad_TLK = np.array([[[0, 1]], [gap]])
    with pytest.raises(RouteError, match=r"rollout routes: token 1 MoE column 0: capture gap .*" + re.escape(str(gap))):
        Routes.from_rollout(bad_TLK, layers=(0,), num_experts=E)


def test_from_rollout_left_padded_batch_names_the_forms_that_take_its_padding():
    # A left-padded [B, S, L, K] batch: request 1's padding comes first, as -1 rows. lengths= and rows= cut a
    # request's end, so the message names what does take leading padding (pad_T= belongs to one flat sequence).
    batch_BSLK = np.array([[[[0, 1]], [[1, 2]], [[2, 3]]], [[[-1, -1]], [[0, 1]], [[1, 2]]]])
    with pytest.raises(RouteError, match=r"rollout request 1: token 0 .* capture gap .* left-padded batch's padding"):
        Routes.from_rollout(batch_BSLK, layers=(0,), num_experts=E, lengths=[3, 2])
    flat = Routes.from_rollout(
        batch_BSLK.reshape(6, 1, 2), layers=(0,), num_experts=E, pad_T=[False] * 3 + [True, False, False]
    )
    assert flat.get(0, 0)[4:].tolist() == [[0, 1], [1, 2]]


def test_from_rollout_split_given_as_one_count_is_refused_clearly():
    with pytest.raises(RouteError, match=r"split= takes the token count of each micro-batch \(a list, e.g. \[2\] \*"):
        Routes.from_rollout(np.array([[[0, 1]], [[1, 2]], [[2, 3]], [[3, 0]]]), layers=(0,), num_experts=E, split=2)


def test_from_rollout_capture_gap_on_pad_token_gets_safe_route():
    routes = Routes.from_rollout(np.array([[[0, 1]], [[-1, -1]]]), layers=(0,), num_experts=E, pad_T=[False, True])
    assert routes.get(0, 0)[1].tolist() == safe_routes(2, topk=K, num_experts=E)[1].tolist()


def test_from_rollout_out_of_range_id_raises():
    with pytest.raises(RouteError, match=r"layer 0 mb 0: expert id -3 out of range"):
        Routes.from_rollout(np.array([[[0, 1]], [[-3, 2]]]), layers=(0,), num_experts=E)


def test_routes_copy_caller_buffer():
    buffer_TLK = np.array([[[0, 1]], [[2, 3]]])
    routes = Routes.from_rollout(buffer_TLK, layers=(0,), num_experts=E)
    buffer_TLK[:] = 5  # a reused rollout buffer: the validated routes must not change
    assert routes.get(0, 0).tolist() == [[0, 1], [2, 3]]
    source = ids([[0, 1]])
    held = Routes({0: [source]}, num_experts=E, topk=K)
    source.fill_(50)
    assert held.get(0, 0).tolist() == [[0, 1]]


def test_replay_ids_private_int64_copy_made_once_per_device():
    routes = Routes({0: [ids([[0, 1], [2, 3]])]}, num_experts=E, topk=K)
    first = routes.replay_ids(0, 0, "cpu")
    assert first.dtype == torch.int64 and routes.replay_ids(0, 0, torch.device("cpu")) is first
    routes.get(0, 0).fill_(7)  # writing into what get() returned does not reach what replay uses
    assert routes.replay_ids(0, 0, "cpu").tolist() == [[0, 1], [2, 3]]
    with pytest.raises(RouteError, match="mb 1"):
        routes.replay_ids(0, 1, "cpu")


def requests(lengths, *, short: bool, layers: int = 1, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [torch.rand(n - short, layers, E, generator=g).argsort(dim=-1)[..., :K] for n in lengths]


def test_from_rollout_requests_missing_last_rows_sequence_major():
    lengths, seq_len = [3, 5], 6
    arrays = requests(lengths, short=True)
    routes = Routes.from_rollout(
        [a.numpy() for a in arrays], layers=(2,), num_experts=E, lengths=lengths, seq_len=seq_len
    )
    got_TK = routes.get(2, 0)
    assert got_TK.shape == (2 * seq_len, K)
    for b, (a, n) in enumerate(zip(arrays, lengths, strict=True)):
        assert torch.equal(got_TK[b * seq_len : b * seq_len + n - 1], a[:, 0])
        filler_TK = got_TK[b * seq_len + n - 1 : (b + 1) * seq_len]  # the missing row and padding: safe routes
        assert (filler_TK.sort(dim=1).values[:, 1:] != filler_TK.sort(dim=1).values[:, :-1]).all()


def test_from_rollout_padded_batch_equals_request_list():
    lengths = [4, 2]
    arrays = requests(lengths, short=False, layers=2, seed=1)
    padded_BSLK = torch.full((2, 4, 2, K), -1, dtype=torch.int64)
    for b, a in enumerate(arrays):
        padded_BSLK[b, : a.shape[0]] = a
    from_list = Routes.from_rollout(arrays, layers=(1, 3), num_experts=E, lengths=lengths)
    from_padded = Routes.from_rollout(padded_BSLK, layers=(1, 3), num_experts=E, lengths=lengths)
    assert from_list == from_padded


def test_from_rollout_requests_need_lengths():
    with pytest.raises(RouteError, match="several rollout requests need lengths="):
        Routes.from_rollout(requests([3, 3], short=False), layers=(0,), num_experts=E)


def test_from_rollout_request_wrong_length_raises():
    with pytest.raises(RouteError, match=r"rollout request 1 hold 2 tokens != expected 5 \(or 4"):
        Routes.from_rollout(requests([3, 2], short=False), layers=(0,), num_experts=E, lengths=[3, 5])


def test_from_rollout_all_layer_numbering_takes_moe_columns():
    all_TLK = torch.stack([safe_routes(3, topk=K, num_experts=E, start=10 * layer) for layer in range(3)], dim=1)
    all_TLK[:, 0] = -1  # the dense first layer: the engine captured nothing there
    routes = Routes.from_rollout(all_TLK, layers=(1, 2), num_experts=E, num_layers=3)
    assert routes.get(2, 0).tolist() == safe_routes(3, topk=K, num_experts=E, start=20).tolist()


def test_from_rollout_layer_count_fitting_neither_refused():
    with pytest.raises(
        RouteError,
        match=r"hold 4 layer columns, which fits neither numbering: expected 2 MoE "
        r"layers or 3 decoder layers",
    ):
        Routes.from_rollout(np.zeros((3, 4, K), dtype=np.int64), layers=(1, 2), num_experts=E, num_layers=3)


def test_from_rollout_string_refused():
    with pytest.raises(RouteError, match="rollout routes must be an integer array, got str"):
        Routes.from_rollout("routes", layers=(0,), num_experts=E)


def test_from_rollout_split_not_partition_raises():
    with pytest.raises(RouteError, match=r"split \[2, 2\] does not partition 5 tokens"):
        Routes.from_rollout(
            safe_routes(5, topk=K, num_experts=E).unsqueeze(1), layers=(0,), num_experts=E, split=(2, 2)
        )


def test_routes_to_local_to_global_roundtrip_pp2_sp():
    from moeverify.routing import views

    layout, world = Layout(tp=2, pp=2, sp=True), 4
    seq_len, batch, num_layers = 4, 2, 4
    tokens = seq_len * batch
    global_routes = Routes(
        {layer: [safe_routes(tokens, topk=K, num_experts=E, start=layer)] for layer in (1, 3)}, num_experts=E, topk=K
    )
    local = {
        c: global_routes.to_local(layout, coords=c, seq_len=seq_len, batch=batch, num_layers=num_layers)
        for c in views.all_rank_coords(layout, world_size=world)
    }
    assert {c.rank: r.layers for c, r in local.items()} == {0: (1,), 1: (1,), 2: (3,), 3: (3,)}
    assert {c.rank: tuple(r.get(r.layers[0], 0).shape) for c, r in local.items()} == {
        rank: (tokens // 2, K) for rank in range(4)
    }
    merged = Routes.to_global(
        local, layout, world_size=world, seq_len=seq_len, batch=batch, num_layers=num_layers, moe_layers=(1, 3)
    )
    assert merged == global_routes


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(per_layer={0: "ids"}, num_experts=4, topk=2), r"layer 0: expected a list of \[T, K\] tensors"),
        (dict(per_layer="abc", num_experts=4, topk=2), r"routes must be a mapping"),
        (dict(per_layer={-1: []}, num_experts=4, topk=2), r"layer key -1 must be a global layer number"),
        (dict(per_layer={0: [], "1": []}, num_experts=4, topk=2), r"layer key '1' must be a global layer number"),
        (dict(per_layer={0: [[[0, 1], [1]]]}, num_experts=4, topk=2), r"route must be a torch.Tensor, got list"),
        (dict(per_layer={}, num_experts=4.0, topk=2), r"num_experts and topk must be integers"),
        (dict(per_layer={}, num_experts=4, topk=True), r"num_experts and topk must be integers"),
    ],
)
def test_routes_refuse_malformed_containers_by_name(kwargs, match):
    with pytest.raises(RouteError, match=match):
        Routes(**kwargs)


def test_routes_accept_numpy_integer_layers_and_counts():
    import numpy as np

    r = Routes({np.int64(3): [torch.tensor([[0, 1]])]}, num_experts=np.int64(4), topk=2)
    assert r.layers == (3,) and r.num_experts == 4 and type(r.num_experts) is int


# -- layer numbering (issue 25 item 3): an axis that fits two numberings is refused, never guessed -------------
def _dense_plus_mtp(tokens: int = 4):
    """A model of 3 decoder layers (0 dense, 1 and 2 MoE) plus MTP layer 3: 3 routers, 3 decoder layers. Returns
    the routes of each router (reference), the engine array numbered by decoder layer (a valid-looking column for
    the dense layer) and the array numbered by router."""
    g = torch.Generator().manual_seed(3)
    ref = {layer: torch.rand(tokens, E, generator=g).argsort(dim=1)[:, :K] for layer in (1, 2, 3)}
    dense_TK = torch.rand(tokens, E, generator=g).argsort(dim=1)[:, :K]  # what an engine wrote for the dense layer
    by_decoder_TLK = torch.stack([dense_TK, ref[1], ref[2]], dim=1)
    by_router_TLK = torch.stack([ref[1], ref[2], ref[3]], dim=1)
    return ref, by_decoder_TLK, by_router_TLK


@pytest.mark.parametrize("num_layers", [3, None])
def test_from_rollout_layer_axis_fitting_two_numberings_refused(num_layers):
    _, by_decoder_TLK, _ = _dense_plus_mtp()
    with pytest.raises(
        RouteError,
        match=r"rollout routes: 3 layer columns fit two numberings: one column per router "
        r"\(3 routers \[1, 2, 3\].*one column per decoder layer \(3 decoder layers"
        r'.*say which, numbering="routers" or numbering="decoder"',
    ):
        Routes.from_rollout(by_decoder_TLK, layers=(1, 2, 3), num_experts=E, num_layers=num_layers)
    if num_layers is None:  # the count is unknown: the message names it too
        with pytest.raises(
            RouteError,
            match=r"3 decoder layers if \[3\] are MTP layers.*"
            r"or give the model's decoder layer count, num_layers=",
        ):
            Routes.from_rollout(by_decoder_TLK, layers=(1, 2, 3), num_experts=E)


def test_from_rollout_layer_numbering_mutant_reading_routers_replays_the_dense_column(monkeypatch):
    # The broken inference this check exists for: take the router reading whenever its count fits. It replays
    # the dense layer's column as MoE layer 1, silently; the check (layer_numbering.ambiguous) refuses it.
    from moeverify.routing import layer_numbering

    ref, by_decoder_TLK, _ = _dense_plus_mtp()
    monkeypatch.setattr(layer_numbering, "ambiguous", lambda *a, **k: False)
    wrong = Routes.from_rollout(by_decoder_TLK, layers=(1, 2, 3), num_experts=E, num_layers=3)
    assert not torch.equal(wrong.get(1, 0), ref[1])  # MoE layer 1 got the dense layer's routes


def test_from_rollout_explicit_numbering_reads_each_layer_its_column():
    ref, by_decoder_TLK, by_router_TLK = _dense_plus_mtp()
    routes = Routes.from_rollout(by_router_TLK, layers=(1, 2, 3), num_experts=E, num_layers=3, numbering="routers")
    assert routes.layers == (1, 2, 3)
    assert [layer for layer in routes.layers if not torch.equal(routes.get(layer, 0), ref[layer])] == []
    # One column per decoder layer: the MoE columns by layer number (the MTP layer has none: asked for, refused)
    routes = Routes.from_rollout(by_decoder_TLK, layers=(1, 2), num_experts=E, num_layers=3, numbering="decoder")
    assert routes.layers == (1, 2)
    assert [layer for layer in routes.layers if not torch.equal(routes.get(layer, 0), ref[layer])] == []
    assert Routes.from_rollout(by_decoder_TLK, layers=(1, 2), num_experts=E, num_layers=3) == routes  # one reading
    with pytest.raises(RouteError, match=r"layer\(s\) \[3\] lie outside the 3 decoder layer columns \(an MTP layer"):
        Routes.from_rollout(by_decoder_TLK, layers=(1, 2, 3), num_experts=E, num_layers=3, numbering="decoder")
    with pytest.raises(RouteError, match=r'hold 3 layer column\(s\), not one per router: numbering="routers" needs 2'):
        Routes.from_rollout(by_decoder_TLK, layers=(1, 2), num_experts=E, num_layers=3, numbering="routers")
    with pytest.raises(RouteError, match=r'numbering="all": not a numbering; one of \[.routers., .decoder.\]'):
        Routes.from_rollout(by_router_TLK, layers=(1, 2, 3), num_experts=E, numbering="all")


def test_from_rollout_requests_layer_axis_fitting_two_numberings_refused():
    _, by_decoder_TLK, by_router_TLK = _dense_plus_mtp()
    with pytest.raises(RouteError, match=r"rollout request 0: 3 layer columns fit two numberings"):
        Routes.from_rollout([by_decoder_TLK[:3]], layers=(1, 2, 3), num_experts=E, lengths=[4], num_layers=3)
    padded = Routes.from_rollout(
        by_router_TLK[None], layers=(1, 2, 3), num_experts=E, lengths=[4], num_layers=3, numbering="routers"
    )
    assert torch.equal(padded.get(3, 0), by_router_TLK[:, 2])


def test_from_rollout_routers_of_all_moe_model_need_no_numbering():
    # Both readings take the same columns (every layer MoE, no MTP): nothing to refuse.
    all_TLK = torch.stack([safe_routes(3, topk=K, num_experts=E, start=layer) for layer in range(3)], dim=1)
    assert Routes.from_rollout(all_TLK, layers=(0, 1, 2), num_experts=E).get(2, 0).tolist() == all_TLK[:, 2].tolist()


# -- a padded [B, S, L, K] batch accepts what the list form accepts (issue 25 item 6) ---------------------------
def _padded(arrays, *, fill: int = -1, width: int | None = None):
    S = width if width is not None else max(a.shape[0] for a in arrays)
    padded_BSLK = torch.full((len(arrays), S, *arrays[0].shape[1:]), fill, dtype=torch.int64)
    for b, a in enumerate(arrays):
        padded_BSLK[b, : a.shape[0]] = a
    return padded_BSLK


@pytest.mark.parametrize("fill, width", [(-1, None), (-1, 6), (0, None)])
def test_from_rollout_padded_batch_of_unequal_lengths_equals_request_list(fill, width):
    lengths = [6, 3, 5]
    arrays = requests(lengths, short=True, layers=2, seed=4)  # each request one row short: the engine's way
    from_list = Routes.from_rollout(arrays, layers=(1, 3), num_experts=E, lengths=lengths)
    padded_BSLK = _padded(arrays, fill=fill, width=width)
    assert Routes.from_rollout(padded_BSLK, layers=(1, 3), num_experts=E, lengths=lengths) == from_list
    rows = [a.shape[0] for a in arrays]  # e.g. the rollout attention mask's row sums
    assert Routes.from_rollout(padded_BSLK, layers=(1, 3), num_experts=E, lengths=lengths, rows=rows) == from_list


def test_from_rollout_padded_batch_mutant_slicing_lengths_raises_the_false_alarm(monkeypatch):
    # The broken reading this fixes: each request cut at its training length, so a shorter request's padded last
    # row reads as a capture gap on a real token. The control (the reading above) accepts the same batch.
    from moeverify.routing import rollout_arrays

    lengths = [6, 3]
    padded_BSLK = _padded(requests(lengths, short=True, seed=10))
    Routes.from_rollout(padded_BSLK, layers=(0,), num_experts=E, lengths=lengths)
    monkeypatch.setattr(
        rollout_arrays,
        "_unpad",
        lambda batch, *, lengths, rows: [batch[b, : min(n, batch.shape[1])] for b, n in enumerate(lengths)],
    )
    with pytest.raises(RouteError, match=r"rollout request 1: token 2 MoE column 0: capture gap"):
        Routes.from_rollout(padded_BSLK, layers=(0,), num_experts=E, lengths=lengths)


def test_from_rollout_padded_batch_real_capture_gap_still_refused():
    lengths = [6, 3]
    arrays = requests(lengths, short=True, seed=5)
    arrays[0][2] = -1  # a gap on a real token, rows after it captured
    with pytest.raises(RouteError, match=r"rollout request 0: token 2 MoE column 0: capture gap"):
        Routes.from_rollout(arrays, layers=(0,), num_experts=E, lengths=lengths)
    with pytest.raises(RouteError, match=r"rollout request 0: token 2 MoE column 0: capture gap"):
        Routes.from_rollout(_padded(arrays), layers=(0,), num_experts=E, lengths=lengths)
    # The engine returned every row and the last is a gap: the list form refuses it; with rows= the padded form too
    full = requests(lengths, short=False, seed=5)
    full[1][2] = -1
    with pytest.raises(RouteError, match=r"rollout request 1: token 2 MoE column 0: capture gap"):
        Routes.from_rollout(full, layers=(0,), num_experts=E, lengths=lengths)
    with pytest.raises(RouteError, match=r"rollout request 1: token 2 MoE column 0: capture gap"):
        Routes.from_rollout(_padded(full), layers=(0,), num_experts=E, lengths=lengths, rows=[6, 3])
    # Two rows missing at the end is not the engine's one missing row: the one before it is a gap
    two_short = [a[:-1] for a in arrays[1:]]
    with pytest.raises(RouteError, match=r"rollout request 0: token 1 MoE column 0: capture gap"):
        Routes.from_rollout(_padded(two_short, width=3), layers=(0,), num_experts=E, lengths=[3])


def test_from_rollout_rows_argument_checked():
    arrays = requests([4, 3], short=True, seed=6)
    with pytest.raises(RouteError, match=r"rows= gives 1 request\(s\), the padded batch holds 2"):
        Routes.from_rollout(_padded(arrays), layers=(0,), num_experts=E, lengths=[4, 3], rows=[3])
    with pytest.raises(RouteError, match=r"rows= request 1: 9 rows outside the padded batch's \[0, 3\]"):
        Routes.from_rollout(_padded(arrays), layers=(0,), num_experts=E, lengths=[4, 3], rows=[3, 9])
    with pytest.raises(RouteError, match=r"rows= gives the rows of each request of a padded"):
        Routes.from_rollout(arrays, layers=(0,), num_experts=E, lengths=[4, 3], rows=[3, 2])


# -- physical expert slots mapped to logical ids (issue 25 item 5) ----------------------------------------------
P = 12  # physical slots: 8 logical experts, 4 of them with a second replica
SLOTS_TO_LOGICAL = [5, 0, 7, 3, 1, 6, 2, 4, 3, 0, 6, 5]


def _physical(logical_TLK: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """Each logical id as one of its slots, the replica chosen at random (what an EPLB engine records)."""
    g = torch.Generator().manual_seed(seed)
    slots = {e: [s for s, x in enumerate(SLOTS_TO_LOGICAL) if x == e] for e in range(E)}
    pick = torch.randint(0, 2, logical_TLK.shape, generator=g)
    return (
        logical_TLK.clone()
        .apply_(lambda e: -1 if e < 0 else slots[e][0])
        .where(pick == 0, logical_TLK.clone().apply_(lambda e: -1 if e < 0 else slots[e][-1]))
    )


@pytest.mark.parametrize("form", ["list", "json", "npy", "dict"])
def test_from_rollout_expert_map_replays_physical_slots_as_logical_ids(tmp_path, form):
    import json

    lengths = [5, 3]
    logical = requests(lengths, short=True, layers=2, seed=7)
    physical = [_physical(a, seed=b) for b, a in enumerate(logical)]
    assert any(int(a.max()) >= E for a in physical)
    expected = Routes.from_rollout(logical, layers=(1, 3), num_experts=E, lengths=lengths)
    given = {
        "list": SLOTS_TO_LOGICAL,
        "dict": {"physical_to_logical_map": {"1": SLOTS_TO_LOGICAL, "3": SLOTS_TO_LOGICAL}},
    }.get(form)
    if form == "json":
        given = tmp_path / "map.json"
        given.write_text(json.dumps([SLOTS_TO_LOGICAL, SLOTS_TO_LOGICAL]))
    elif form == "npy":
        given = str(tmp_path / "map.npy")
        np.save(given, np.array(SLOTS_TO_LOGICAL))
    got = Routes.from_rollout(physical, layers=(1, 3), num_experts=E, lengths=lengths, expert_map=given)
    assert got == expected
    padded = Routes.from_rollout(_padded(physical), layers=(1, 3), num_experts=E, lengths=lengths, expert_map=given)
    assert padded == expected
    one = Routes.from_rollout(physical[0], layers=(1, 3), num_experts=E, tokens=5, expert_map=given)
    assert torch.equal(one.get(3, 0), expected.get(3, 0)[:5])


def test_from_rollout_unmapped_physical_slots_refused_naming_the_map():
    physical = _physical(requests([5], short=True, seed=8)[0], seed=1)
    assert int(physical.max()) >= E
    with pytest.raises(
        RouteError,
        match=r"rollout routes: token \d+ layer 0: expert id \d+ out of range \[0, 8\) "
        r".*physical expert slots .*pass expert_map=",
    ):
        Routes.from_rollout(physical, layers=(0,), num_experts=E)


def test_from_rollout_expert_map_checked_like_the_dump_commands():
    from moeverify.routing.expert_map import ExpertMapError

    physical = _physical(requests([4], short=True, seed=9)[0], seed=2)
    with pytest.raises(ExpertMapError, match=r"maps onto 8 logical experts, num_experts is 16"):
        Routes.from_rollout(physical, layers=(0,), num_experts=16, expert_map=SLOTS_TO_LOGICAL)
    with pytest.raises(ExpertMapError, match=r"layer 0: logical expert\(s\) \[4\] have no physical slot"):
        Routes.from_rollout(physical, layers=(0,), num_experts=E, expert_map=[0, 1, 2, 3, 5, 6, 7, 7])
    with pytest.raises(ExpertMapError, match=r"expert id 12 is no slot of expert_map= \(expected \[0, 12\)\)"):
        Routes.from_rollout(np.array([[[12, 1]]]), layers=(0,), num_experts=E, expert_map=SLOTS_TO_LOGICAL)
    with pytest.raises(
        ExpertMapError,
        match=r"physical slots \[3, 8\] map through expert_map= to logical experts "
        r"\[3, 3\]: two replicas",
    ):
        Routes.from_rollout(np.array([[[3, 8]]]), layers=(0,), num_experts=E, expert_map=SLOTS_TO_LOGICAL)
    with pytest.raises(ExpertMapError, match=r"MoE layer\(s\) \[3\] missing"):
        Routes.from_rollout(
            physical.expand(-1, 2, -1), layers=(1, 3), num_experts=E, expert_map={"1": SLOTS_TO_LOGICAL}
        )
