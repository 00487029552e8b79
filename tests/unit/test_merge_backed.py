"""A TensorMerge backed by its reference reports exactly what an ordinary merge reports, write by write."""

import pytest
import torch

from moeverify.oracles.export.merge import TensorMerge
from moeverify.oracles.results import Tally

SUBCHECKS = ("conflicts", "replicas", "coverage", "shape_dtype", "bitwise")


def _run(ops, ref, *, backed: bool, dtype=None):
    t = {k: Tally() for k in SUBCHECKS}
    m = TensorMerge(
        name="w",
        shape=tuple(ref.shape),
        dtype=dtype or ref.dtype,
        world_size=4,
        conflicts=t["conflicts"],
        replicas=t["replicas"],
        reference=ref if backed else None,
    )
    for kind, rank, positions, values in ops:
        getattr(m, kind)(rank=rank, positions_P=positions, values_P=values)
    m.check_coverage(t["coverage"])
    m.check_against(ref, shape_dtype=t["shape_dtype"], bitwise=t["bitwise"])
    return {k: (x.checked, x.failures) for k, x in t.items()}, m


def _ref(n=24, dtype=torch.bfloat16):
    return torch.randn(n, generator=torch.Generator().manual_seed(0)).to(dtype).reshape(4, n // 4)


def _flip(v):
    return -v  # other bits (a sign flip differs bitwise even for 0.0)


SCENARIOS = {
    "clean_ranges": lambda r: [
        ("write", 0, slice(0, 12), r[:12]),
        ("write", 1, slice(12, 24), r[12:]),
        ("compare_replica", 2, slice(0, 24), r),
    ],
    "clean_index_with_overlap": lambda r: [
        ("write", 0, torch.arange(0, 16), r[:16]),
        ("write", 1, torch.arange(8, 24), r[8:]),
    ],
    "duplicate_inside_piece": lambda r: [
        ("write", 0, torch.tensor([0, 0, 1]), torch.stack([r[0], _flip(r[0]), r[1]])),
        ("write", 1, slice(2, 24), r[2:]),
    ],
    "conflicting_double_write": lambda r: [
        ("write", 0, slice(0, 24), r),
        ("write", 1, torch.tensor([3, 5]), _flip(r[[3, 5]])),
    ],
    "wrong_then_right": lambda r: [
        ("write", 0, slice(0, 12), _flip(r[:12])),
        ("write", 1, slice(12, 24), r[12:]),
        ("write", 2, slice(0, 12), r[:12]),
    ],
    "diverged_replica": lambda r: [
        ("write", 0, slice(0, 24), r),
        ("compare_replica", 3, torch.tensor([1, 2]), _flip(r[[1, 2]])),
    ],
    "uncovered": lambda r: [("write", 0, slice(0, 20), r[:20]), ("compare_replica", 1, slice(0, 24), r)],
    "wrong_bits_late": lambda r: [("write", 0, slice(0, 12), r[:12]), ("write", 1, slice(12, 24), _flip(r[12:]))],
    "other_dtype_piece": lambda r: [("write", 0, slice(0, 24), r.float())],
}


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_merge_backed_reports_like_ordinary_merge(name):
    ref = _ref()
    ops = SCENARIOS[name](ref.reshape(-1))
    ordinary, _ = _run(ops, ref, backed=False)
    backed, _ = _run(ops, ref, backed=True)
    assert backed == ordinary


def test_merge_backed_clean_keeps_no_values_buffer():
    ref = _ref()
    _, m = _run(SCENARIOS["clean_ranges"](ref.reshape(-1)), ref, backed=True)
    assert m.values_N is None and m.nbytes == ref.numel()  # the writer mask alone


def test_merge_backed_other_reference_is_compared_as_usual():
    ref = _ref()
    flat = ref.reshape(-1)
    t = {k: Tally() for k in SUBCHECKS}
    m = TensorMerge(
        name="w",
        shape=tuple(ref.shape),
        dtype=ref.dtype,
        world_size=2,
        conflicts=t["conflicts"],
        replicas=t["replicas"],
        reference=ref,
    )
    m.write(rank=0, positions_P=slice(0, 24), values_P=flat)
    m.check_coverage(t["coverage"])
    other = ref.clone()
    other.view(-1)[7] = _flip(other.view(-1)[7])
    m.check_against(other, shape_dtype=t["shape_dtype"], bitwise=t["bitwise"])
    assert not t["bitwise"].passed and "1 element(s) differ" in t["bitwise"].failures[0]


def test_merge_backed_reference_of_other_dtype_is_not_used():
    ref = _ref(dtype=torch.float32)
    ops = [("write", 0, slice(0, 24), ref.reshape(-1).to(torch.bfloat16))]
    ordinary, _ = _run(ops, ref, backed=False, dtype=torch.bfloat16)
    backed, m = _run(ops, ref, backed=True, dtype=torch.bfloat16)
    assert backed == ordinary and m.values_N is not None
