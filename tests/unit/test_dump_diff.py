"""diff: agreement, overlap@k, first divergent layer, expert load, against an independent Python-set reference."""

import json

import pytest
import torch

from moeverify.errors import RouteError
from moeverify.record import diff
from moeverify.record.diff import compare_rows
from moeverify.routing.routes import Routes


def _random(tokens, layers, *, experts=16, topk=4, microbatches=1, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return Routes(
        {
            layer: [torch.rand(tokens, experts, generator=gen).topk(topk, dim=1).indices for _ in range(microbatches)]
            for layer in layers
        },
        num_experts=experts,
        topk=topk,
    )


def _reference(a, b):
    """Per layer: (agreement, overlap@k) from Python sets, token by token."""
    out = {}
    for layer in a.layers:
        same = overlap = n = 0
        for mb in range(a.microbatches):
            for ra, rb in zip(a.get(layer, mb).tolist(), b.get(layer, mb).tolist(), strict=True):
                same += set(ra) == set(rb)
                overlap += len(set(ra) & set(rb))
                n += 1
        out[layer] = (same / n, overlap / (n * a.topk))
    return out


@pytest.mark.parametrize("experts,topk", [(8, 2), (128, 8), (300, 6), (64, 64)])
def test_diff_matches_set_reference(experts, topk):
    a = _random(50, (0, 2), experts=experts, topk=topk, microbatches=2, seed=1)
    b = _random(50, (0, 2), experts=experts, topk=topk, microbatches=2, seed=2)
    # Half the rows equal to A, some of those in another order.
    data = {}
    for layer in a.layers:
        data[layer] = []
        for mb in range(2):
            rows = b.get(layer, mb).clone()
            rows[:25] = a.get(layer, mb)[:25]
            rows[10:20] = rows[10:20].flip(1)
            data[layer].append(rows)
    b = Routes(data, num_experts=experts, topk=topk)
    report = diff(a, b)
    ref = _reference(a, b)
    for i, layer in enumerate(a.layers):
        assert report.agreement_L[i].item() == pytest.approx(ref[layer][0])
        assert report.overlap_at_k_L[i].item() == pytest.approx(ref[layer][1])


def test_diff_injected_disagreement_rate_recovered_exactly():
    a = _random(1000, (1, 3, 5), experts=32, topk=4, microbatches=2)
    data = {layer: [a.get(layer, mb).clone() for mb in range(2)] for layer in a.layers}
    # Layer 3: tokens 0..69 of mb 0 and 0..29 of mb 1 swap one expert for one not chosen: 100 / 2000 differ.
    for mb, n in ((0, 70), (1, 30)):
        rows = data[3][mb]
        for t in range(n):
            unused = next(e for e in range(32) if e not in rows[t].tolist())
            rows[t, 2] = unused
    # Layer 5: 10 tokens of mb 1 (tokens 1000..1009 overall) reordered only: same sets.
    data[5][1][:10] = data[5][1][:10].flip(1)
    b = Routes(data, num_experts=32, topk=4)
    report = diff(a, b)
    result = report.to_json()
    assert result["layers"]["1"] == {**result["layers"]["1"], "agreement": 1.0, "overlap_at_k": 1.0, "tokens": 2000}
    assert result["layers"]["3"]["agreement"] == pytest.approx(1 - 100 / 2000)
    assert result["layers"]["3"]["overlap_at_k"] == pytest.approx(1 - 100 / (2000 * 4))
    assert result["layers"]["5"]["agreement"] == 1.0
    assert result["tokens_diverging_any_layer"] == pytest.approx(100 / 2000)
    assert result["first_divergent_layer"] == {"3": 100}
    worst = report.worst_tokens(200)
    assert {w["token"] for w in worst} == set(range(70)) | set(range(1000, 1030))
    assert {(w["microbatch"], w["token_in_microbatch"]) for w in worst if w["token"] >= 1000} == {
        (1, t) for t in range(30)
    }
    delta = report.load_b_LE[1] - report.load_a_LE[1]
    assert int(delta.sum()) == 0 and int(delta.abs().sum()) > 0


def test_diff_first_divergent_layer_is_earliest():
    a = Routes({0: [torch.tensor([[0, 1], [0, 1]])], 1: [torch.tensor([[2, 3], [2, 3]])]}, num_experts=4, topk=2)
    b = Routes({0: [torch.tensor([[0, 1], [0, 2]])], 1: [torch.tensor([[2, 1], [2, 1]])]}, num_experts=4, topk=2)
    report = diff(a, b)
    assert report.first_divergent_layer() == {0: 1, 1: 1}
    assert report.tokens_diverging_any_layer == 1.0


def test_diff_expert_load_matches_bincount():
    a = _random(40, (0,), experts=8, topk=2, seed=3)
    b = _random(40, (0,), experts=8, topk=2, seed=4)
    report = diff(a, b)
    assert torch.equal(report.load_a_LE[0], torch.bincount(a.get(0, 0).reshape(-1), minlength=8))
    assert torch.equal(report.load_b_LE[0], torch.bincount(b.get(0, 0).reshape(-1), minlength=8))


def test_diff_mixed_dtypes_compare_as_ids():
    a = _random(20, (0,), experts=8, topk=2)
    b = Routes({0: [a.get(0, 0).to(torch.uint8)]}, num_experts=8, topk=2)
    assert diff(a, b).tokens_diverging_any_layer == 0.0


def test_compare_rows_order_insensitive_for_odd_topk():
    a = torch.tensor([[0, 1, 2], [3, 4, 5], [0, 1, 2]], dtype=torch.uint8)
    b = torch.tensor([[2, 0, 1], [3, 4, 6], [7, 6, 5]], dtype=torch.uint8)
    exact, overlap = compare_rows(a, b, num_experts=8)
    assert exact.tolist() == [True, False, False] and overlap.tolist() == [3, 2, 0]


def test_diff_mismatched_layers_raises():
    with pytest.raises(RouteError, match=r"cannot diff: layers: A \[0\], B \[1\]$"):
        diff(_random(4, (0,), experts=8, topk=2), _random(4, (1,), experts=8, topk=2))
    with pytest.raises(RouteError, match=r"cannot diff: layers: A \[0\], B \[0, 1\]; topk: A 2, B 3$"):
        diff(_random(4, (0,), experts=8, topk=2), _random(4, (0, 1), experts=8, topk=3))


def test_diff_mismatched_tokens_raises():
    with pytest.raises(RouteError, match=r"cannot diff: layer 0 mb 0: 4 tokens vs 5 tokens"):
        diff(_random(4, (0,), experts=8, topk=2), _random(5, (0,), experts=8, topk=2))


def test_diff_json_table_and_plot(tmp_path):
    a = _random(300, (0, 1), experts=8, topk=2, seed=5)
    b = _random(300, (0, 1), experts=8, topk=2, seed=6)
    report = diff(a, b)
    json.dumps(report.to_json())
    from rich.console import Console

    console = Console(record=True, width=120)
    console.print(report.table())
    assert "overlap@k" in console.export_text()
    from moeverify.commands.dump_plot import plot_diff

    png = plot_diff(report, tmp_path / "d.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert report.bucket_disagreement(10).shape == (2, 10)
