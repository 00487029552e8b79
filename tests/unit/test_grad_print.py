"""Large gradients kept as prints (``oracles/replay/grad_print.py``): equal exactly when bitwise equal, a mismatch
named by block, and small gradients kept whole."""

from __future__ import annotations

import torch

from moeverify.oracles.replay import grad_print
from moeverify.oracles.replay.compare import compare_maps
from moeverify.oracles.replay.grad_print import BLOCK, GradPrint


def test_print_equal_only_when_bitwise_equal():
    g = torch.randn(3 * BLOCK + 5, dtype=torch.float32)
    base = GradPrint.of(g)
    assert base.same(GradPrint.of(g.clone())) and len(base.blocks) == 4
    for flat, value in [(0, None), (2 * BLOCK + 7, None), (3 * BLOCK + 4, None)]:
        other = g.clone()
        other[flat] = torch.nextafter(other[flat], torch.tensor(float("inf")))  # one ulp
        assert not base.same(GradPrint.of(other))
    negzero = torch.zeros(BLOCK + 1)
    assert not GradPrint.of(negzero).same(GradPrint.of(-negzero))  # -0.0 != 0.0, as everywhere bitwise
    nan = torch.full((BLOCK + 1,), float("nan"))
    assert GradPrint.of(nan).same(GradPrint.of(nan.clone()))  # the same payload: equal, though the sums are NaN
    assert not base.same(GradPrint.of(g.to(torch.float64).float().reshape(1, -1)))  # another shape
    assert not base.same(GradPrint.of(g.double()))


def test_compare_maps_names_the_block_and_keeps_small_grads_exact():
    big, small = torch.randn(2 * BLOCK), torch.randn(10)
    expected = {"w": grad_print.keep(big), "r": grad_print.keep(small)}
    assert isinstance(expected["w"], GradPrint) and isinstance(expected["r"], torch.Tensor)
    moved_big, moved_small = big.clone(), small.clone()
    moved_big[BLOCK + 3] += 1.0
    moved_small[4] += 1.0
    checked, failures = compare_maps(expected, {"w": grad_print.keep(moved_big), "r": grad_print.keep(moved_small)},
                                     what="grad")
    assert checked == 2 and len(failures) == 2
    assert failures[0].startswith("grad r: 1 of 10 element(s) differ; first at flat index 4")
    assert failures[1].startswith(f"grad w: 1 of 2 block(s) of {BLOCK} elements differ; first in flat "
                                  f"[{BLOCK}, {2 * BLOCK}); sum ")
    checked, failures = compare_maps(expected, {"w": moved_big, "r": small}, what="grad")  # a tensor vs a print
    assert checked == 2 and len(failures) == 1 and failures[0].startswith("grad w: 1 of 2 block(s)")
    assert compare_maps(expected, {"w": grad_print.keep(big.clone()), "r": small.clone()}, what="grad") == (2, [])
