"""Large gradients kept as prints (``oracles/replay/grad_print.py``): equal exactly when bitwise equal, a mismatch
named by block, and small gradients kept whole."""

from __future__ import annotations

import pytest
import torch

from moeverify.oracles.replay import grad_print
from moeverify.oracles.replay.compare import compare_maps
from moeverify.oracles.replay.grad_print import BLOCK, GradPrint


def test_print_equal_only_when_bitwise_equal():
    g = torch.randn(3 * BLOCK + 5, dtype=torch.float32)
    base = GradPrint.of(g)
    assert base.same(GradPrint.of(g.clone())) and len(base.blocks) == 4
    for flat in (0, 2 * BLOCK + 7, 3 * BLOCK + 4):
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
    checked, failures = compare_maps(
        expected, {"w": grad_print.keep(moved_big), "r": grad_print.keep(moved_small)}, what="grad"
    )
    assert checked == 2 and len(failures) == 2
    assert failures[0].startswith("grad r: 1 of 10 element(s) differ; first at flat index 4")
    assert failures[1].startswith(
        f"grad w: 1 of 2 block(s) of {BLOCK} elements differ; first in flat [{BLOCK}, {2 * BLOCK}); sum "
    )
    checked, failures = compare_maps(expected, {"w": moved_big, "r": small}, what="grad")  # a tensor vs a print
    assert checked == 2 and len(failures) == 1 and failures[0].startswith("grad w: 1 of 2 block(s)")
    assert compare_maps(expected, {"w": grad_print.keep(big.clone()), "r": small.clone()}, what="grad") == (2, [])


def _device() -> torch.device:
    import os

    return torch.device("cuda" if os.environ.get("MOEVERIFY_TEST_BACKEND") == "cuda" else "cpu")


def _lin64_reference(values: list[int], *, block: int, width: int) -> tuple[bytes, ...]:
    """The ``lin64`` digest in plain Python integers: per block and lane, the wrapping sum of each element's bits
    (sign-extended) times its position's key: splitmix64's finalizer of (1-based position times golden plus the
    lane constant), made odd; the last block padded with zero bits."""
    mask = (1 << 64) - 1

    def mix(x):
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & mask
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & mask
        return x ^ (x >> 31)

    out = []
    for start in range(0, len(values), block):
        chunk = values[start : start + block] + [0] * (block - len(values[start : start + block]))
        sums = []
        for lane in grad_print._LANES:
            total = 0
            for j, v in enumerate(chunk):
                signed = v - (1 << width) if v >= 1 << (width - 1) else v
                total += signed * (mix(((j + 1) * 0x9E3779B97F4A7C15 + lane) & mask) | 1)
            sums.append((total & mask).to_bytes(8, "little"))
        out.append(b"".join(sums))
    return tuple(out)


def test_lin64_digest_equals_its_pure_python_reference(monkeypatch):
    """The GPU digest (torch int64, here on the test backend's device) is the function its docstring states: equal
    to a plain-Python reference bit for bit, bf16 and fp32, with a padded last block."""
    monkeypatch.setattr(grad_print, "BLOCK", 64)
    for dtype, width in ((torch.float32, 32), (torch.bfloat16, 16)):
        g = torch.randn(150, generator=torch.Generator().manual_seed(3)).to(dtype)
        got = GradPrint.of(g.to(_device()), digest="lin64")
        raw = [int(v) & ((1 << width) - 1) for v in g.view(torch.int32 if width == 32 else torch.int16).tolist()]
        assert got.blocks == _lin64_reference(raw, block=64, width=width), dtype


def test_lin64_prints_equal_only_when_bitwise_equal(monkeypatch):
    """One ulp anywhere, -0.0 for 0.0, two elements swapped inside a block or across blocks: another print; the same
    bits (NaN payloads too): the same print. A print of each digest kind is never the same as the other's."""
    monkeypatch.setattr(grad_print, "BLOCK", 1 << 12)
    block = grad_print.BLOCK
    g = torch.randn(3 * block + 5, generator=torch.Generator().manual_seed(5)).to(_device())
    base = GradPrint.of(g, digest="lin64")
    assert len(base.blocks) == 4 and base.same(GradPrint.of(g.clone(), digest="lin64"))
    changed = []
    for flat in (0, 2 * block + 7, 3 * block + 4):
        other = g.clone()
        other[flat] = torch.nextafter(other[flat], torch.tensor(float("inf"), device=g.device))
        changed.append(GradPrint.of(other, digest="lin64"))
    for i, j in ((3, 9), (5, block + 5)):
        other = g.clone()
        other[[i, j]] = other[[j, i]]
        changed.append(GradPrint.of(other, digest="lin64"))
    negzero = torch.zeros(block + 1, device=g.device)
    changed.append(GradPrint.of(-negzero, digest="lin64"))
    assert [base.same(c) for c in changed[:-1]] == [False] * 5
    assert not GradPrint.of(negzero, digest="lin64").same(changed[-1])
    nan = torch.full((block + 1,), float("nan"), device=g.device)
    assert GradPrint.of(nan, digest="lin64").same(GradPrint.of(nan.clone(), digest="lin64"))
    blake = GradPrint.of(g.cpu(), digest="blake2b")
    assert not base.same(blake) and "cannot be compared" in base.describe(blake)
    assert base.describe(changed[1]).startswith("1 of 4 block(s)") and "first in flat [8192, 12288)" in base.describe(
        changed[1]
    )


def test_compare_maps_prints_a_tensor_with_the_digest_it_meets():
    """A kept tensor met by a ``lin64`` print (a GPU pass against a host copy) is printed with ``lin64``, not told
    apart by the digest kind."""
    big = torch.randn(2 * BLOCK, generator=torch.Generator().manual_seed(1))
    gpu_like = {"w": GradPrint.of(big, digest="lin64")}
    assert compare_maps(gpu_like, {"w": big.clone()}, what="grad") == (1, [])
    moved = big.clone()
    moved[7] += 1.0
    checked, failures = compare_maps(gpu_like, {"w": moved}, what="grad")
    assert checked == 1 and len(failures) == 1 and failures[0].startswith("grad w: 1 of 2 block(s)")


def test_blake2b_blocks_hashed_on_threads_are_the_blocks_in_order():
    """The host digest hashes blocks on threads: the same bytes as one BLAKE2b per block, in block order."""
    import hashlib

    from moeverify.oracles.replay import grad_print as gp

    g = torch.randn(3 * gp.BLOCK + 5, generator=torch.Generator().manual_seed(3))
    raw = g.numpy().view("int32")
    want = tuple(
        hashlib.blake2b(raw[i : i + gp.BLOCK], digest_size=16).digest() for i in range(0, raw.shape[0], gp.BLOCK)
    )
    assert GradPrint.of(g, digest="blake2b").blocks == want and len(want) == 4


def test_keep_all_reads_a_pass_back_at_once_and_equals_one_print_each(monkeypatch):
    """A pass's gradients kept together (one host read of every GPU print) are what each kept alone gives: small
    ones as host tensors, large ones as prints of the same blocks, sums and maxima; an unknown digest is refused."""
    monkeypatch.setattr(grad_print, "BLOCK", 1 << 12)
    monkeypatch.setattr(grad_print, "KEEP", 100)
    gen = torch.Generator().manual_seed(11)
    grads = {
        f"g{i}": torch.randn(n, generator=gen).to(dtype).to(_device())
        for i, (n, dtype) in enumerate(
            [(50, torch.float32), (5000, torch.float32), (3 * (1 << 12), torch.bfloat16), (101, torch.bfloat16)]
        )
    }
    together = grad_print.keep_all(grads)
    for key, g in grads.items():
        alone = grad_print.keep(g)
        if isinstance(alone, GradPrint):
            got = together[key]
            assert isinstance(got, GradPrint) and got.same(alone) and got.absmax == alone.absmax, key
            assert got.total == pytest.approx(alone.total, rel=1e-12, abs=1e-12), key  # for messages only
            assert got.absmax == float(g.float().abs().max()) and len(got.blocks) == -(-g.numel() // (1 << 12))
        else:
            assert torch.equal(together[key], alone) and together[key].device.type == "cpu", key
    with pytest.raises(ValueError, match="unknown digest 'md5'"):
        GradPrint.of(grads["g1"], digest="md5")


def test_gradients_of_one_size_digested_together_are_each_its_own_print(monkeypatch):
    """``finish`` digests tensors of one device, dtype and size together, a few at a time: every tensor's print is
    the one it has alone (blocks bit for bit, its own shape although another shape has its size), one ulp in one
    member changes that member's print only, and a group's digests equal the pure-Python reference."""
    monkeypatch.setattr(grad_print, "BLOCK", 64)
    monkeypatch.setattr(grad_print, "_ROWS", 7)  # 3 blocks a tensor: 2 tensors at once, groups split unevenly
    gen = torch.Generator().manual_seed(17)
    shapes = [(150,), (10, 15), (150,), (3, 50), (150,), (150,), (151,)]
    grads = {
        f"g{i}": torch.randn(shape, generator=gen).to(torch.bfloat16).to(_device()) for i, shape in enumerate(shapes)
    }

    def batch(tensors: dict) -> dict:
        b = grad_print.Batch()
        for key, t in tensors.items():
            b.add(key, t, digest="lin64")
        return b.finish()

    together = batch(grads)
    for key, g in grads.items():
        alone = GradPrint.of(g, digest="lin64")
        assert together[key].same(alone) and together[key].shape == tuple(g.shape), key
        raw = [int(v) & 0xFFFF for v in g.cpu().reshape(-1).view(torch.int16).tolist()]
        assert together[key].blocks == _lin64_reference(raw, block=64, width=16), key
    moved = dict(grads)
    moved["g3"] = grads["g3"].clone()
    moved["g3"][1, 7] = torch.nextafter(
        moved["g3"][1, 7].float(), torch.tensor(float("inf"), device=moved["g3"].device)
    ).to(torch.bfloat16)
    if torch.equal(moved["g3"], grads["g3"]):  # bf16 rounding ate the ulp: flip the lowest bit instead
        moved["g3"].view(torch.int16)[1, 7] ^= 1
    again = batch(moved)
    assert [k for k in grads if not again[k].same(together[k])] == ["g3"]
