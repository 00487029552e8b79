"""TensorMerge on synthetic shards: coverage mask, conflicts, replicas, shape/dtype and raw-bit comparison."""

import pytest
import torch

from moeverify.errors import SubjectError
from moeverify.oracles.export.merge import TensorMerge
from moeverify.oracles.results import Tally


def _merge(shape=(2, 3), dtype=torch.float32, world_size=2):
    t = {k: Tally() for k in ("conflicts", "replicas", "coverage", "shape_dtype", "bitwise")}
    m = TensorMerge(
        name="w", shape=shape, dtype=dtype, world_size=world_size, conflicts=t["conflicts"], replicas=t["replicas"]
    )
    return m, t


def _finish(m, t, ref):
    m.check_coverage(t["coverage"])
    m.check_against(ref, shape_dtype=t["shape_dtype"], bitwise=t["bitwise"])


def test_merge_two_shards_pass():
    ref = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    m, t = _merge()
    m.write(rank=0, positions_P=torch.tensor([0, 1, 2]), values_P=ref.flatten()[:3])
    m.write(rank=1, positions_P=torch.tensor([3, 4, 5]), values_P=ref.flatten()[3:])
    m.compare_replica(rank=1, positions_P=torch.arange(6), values_P=ref.flatten())
    _finish(m, t, ref)
    assert t and {k: x.failures for k, x in t.items() if not x.passed} == {}
    assert t["coverage"].checked == 6 and t["bitwise"].checked == 6 and t["replicas"].checked == 6


def test_merge_uncovered_element_fails_coverage_only():
    ref = torch.ones(2, 3)
    m, t = _merge()
    m.write(rank=0, positions_P=torch.tensor([0, 1, 2, 3, 5]), values_P=torch.ones(5))
    _finish(m, t, ref)
    assert not t["coverage"].passed
    assert "1 of 6 element(s) never written, flat [4]" in t["coverage"].failures[0]
    assert t["bitwise"].passed and t["conflicts"].passed


def test_merge_conflicting_double_write_names_ranks_and_bits():
    m, t = _merge()
    m.write(rank=0, positions_P=torch.tensor([0, 1]), values_P=torch.tensor([1.0, 2.0]))
    m.write(rank=1, positions_P=torch.tensor([1, 2]), values_P=torch.tensor([3.0, 4.0]))
    msg = t["conflicts"].failures[0]
    assert "flat [1]" in msg and "rank 0 wrote 0x40000000" in msg and "rank 1 wrote 0x40400000" in msg


def test_merge_equal_double_write_is_no_conflict():
    m, t = _merge()
    m.write(rank=0, positions_P=torch.tensor([0, 1]), values_P=torch.tensor([1.0, 2.0]))
    m.write(rank=1, positions_P=torch.tensor([1]), values_P=torch.tensor([2.0]))
    assert t["conflicts"].passed and t["conflicts"].checked == 3


def test_merge_duplicate_position_inside_piece_is_conflict():
    m, t = _merge()
    m.write(rank=0, positions_P=torch.tensor([0, 0]), values_P=torch.tensor([1.0, 2.0]))
    assert not t["conflicts"].passed
    assert "twice in one piece" in t["conflicts"].failures[0]


def test_merge_diverged_replica_fails_replicas():
    m, t = _merge()
    m.write(rank=0, positions_P=torch.arange(6), values_P=torch.zeros(6))
    m.compare_replica(rank=1, positions_P=torch.arange(6), values_P=torch.tensor([0, 0, 0, 1e-8, 0, 0.0]))
    assert not t["replicas"].passed
    assert "rank 1's replica differs" in t["replicas"].failures[0] and "flat [3]" in t["replicas"].failures[0]


def test_merge_negative_zero_differs_bitwise():
    ref = torch.zeros(2, 3)
    m, t = _merge()
    m.write(rank=0, positions_P=torch.arange(6), values_P=torch.tensor([0, 0, -0.0, 0, 0, 0]))
    _finish(m, t, ref)
    assert not t["bitwise"].passed
    assert "first at 2: expected 0x00000000 got 0x80000000" in t["bitwise"].failures[0]


def test_merge_fp32_through_bf16_fails_bitwise_not_shape_dtype():
    ref = torch.tensor([1.0 + 2**-20, 3.0, 1 / 3, 0.1], dtype=torch.float32)
    m, t = _merge(shape=(4,))
    m.write(rank=0, positions_P=torch.arange(4), values_P=ref.to(torch.bfloat16).to(torch.float32))
    _finish(m, t, ref)
    assert t["shape_dtype"].passed
    assert not t["bitwise"].passed and "differ from the reference" in t["bitwise"].failures[0]


def test_merge_bf16_values_for_fp32_reference_fail_shape_dtype():
    ref = torch.tensor([1.0, 2.0], dtype=torch.float32)
    m, t = _merge(shape=(2,))
    m.write(rank=0, positions_P=torch.arange(2), values_P=ref.to(torch.bfloat16))
    _finish(m, t, ref)
    assert not t["shape_dtype"].passed
    assert (
        "expected shape (2,) dtype torch.float32, got shape (2,) dtype torch.bfloat16" in t["shape_dtype"].failures[0]
    )


def test_merge_integer_tensor_uses_mask_not_sentinel():
    ref = torch.tensor([0, 7, 0], dtype=torch.int64)
    m, t = _merge(shape=(3,), dtype=torch.int64)
    m.write(rank=0, positions_P=torch.tensor([0, 1]), values_P=torch.tensor([0, 7]))
    _finish(m, t, ref)
    assert not t["coverage"].passed and "flat [2]" in t["coverage"].failures[0]
    assert t["bitwise"].passed


def test_merge_legitimate_nan_weight_is_covered_and_equal():
    ref = torch.tensor([float("nan"), 1.0])
    m, t = _merge(shape=(2,))
    m.write(rank=0, positions_P=torch.arange(2), values_P=ref.clone())
    _finish(m, t, ref)
    assert t["coverage"].passed and t["bitwise"].passed


def test_merge_shape_mismatch_fails_shape_dtype_and_bitwise():
    m, t = _merge(shape=(6,))
    m.write(rank=0, positions_P=torch.arange(6), values_P=torch.zeros(6))
    _finish(m, t, torch.zeros(2, 3))
    assert not t["shape_dtype"].passed and "not compared" in t["bitwise"].failures[0]


@pytest.mark.parametrize(
    "positions, values, match",
    [
        (torch.tensor([[0, 1]]), torch.zeros(2), "positions must be 1-D int64"),
        (torch.tensor([0, 1], dtype=torch.int32), torch.zeros(2), "positions must be 1-D int64"),
        (torch.tensor([0, 6]), torch.zeros(2), r"positions outside \[0, 6\): min 0 max 6"),
        (torch.tensor([0, 1]), torch.zeros(3), "sent 3 values for 2 positions"),
    ],
)
def test_merge_bad_piece_raises(positions, values, match):
    m, _ = _merge()
    with pytest.raises(SubjectError, match=match):
        m.write(rank=1, positions_P=positions, values_P=values)


def test_merge_contiguous_range_fast_path_matches_index_path():
    ref = torch.randn(2, 3)
    m, t = _merge()
    m.write(rank=0, positions_P=slice(0, 4), values_P=ref.flatten()[:4])
    m.write(rank=1, positions_P=torch.tensor([4, 5]), values_P=ref.flatten()[4:])
    m.compare_replica(rank=1, positions_P=slice(0, 6), values_P=ref.flatten())
    _finish(m, t, ref)
    assert t and {k: x.failures for k, x in t.items() if not x.passed} == {}


def test_merge_contiguous_range_conflict_and_bad_range():
    m, t = _merge()
    m.write(rank=0, positions_P=slice(0, 3), values_P=torch.zeros(3))
    m.write(rank=1, positions_P=slice(2, 4), values_P=torch.ones(2))
    assert "flat [2]" in t["conflicts"].failures[0]
    with pytest.raises(SubjectError, match=r"range \[5, 8\) with 3 values does not fit \[0, 6\)"):
        m.write(rank=1, positions_P=slice(5, 8), values_P=torch.zeros(3))


def _merge_against(ref, *, name: str, world_size: int, backed: bool):
    """A merge of a 1-D tensor shaped like ``ref``; ``backed``: the merge holds the reference (the runs mode)."""
    t = {k: Tally() for k in ("conflicts", "replicas", "coverage", "shape_dtype", "bitwise")}
    m = TensorMerge(
        name=name,
        shape=tuple(ref.shape),
        dtype=ref.dtype,
        world_size=world_size,
        conflicts=t["conflicts"],
        replicas=t["replicas"],
        reference=ref if backed else None,
    )
    return m, t


@pytest.mark.parametrize("backed", [False, True])
def test_merge_bitwise_names_the_rank_that_wrote_the_differing_elements(backed):
    """An EP rank that writes another expert's rows under this name: bitwise names that rank, not only the bits."""
    ref = torch.arange(6, dtype=torch.float32)
    m, t = _merge_against(ref, name="w", world_size=3, backed=backed)
    m.write(rank=0, positions_P=slice(0, 3), values_P=ref[:3])
    m.write(rank=2, positions_P=torch.tensor([3, 4, 5]), values_P=ref[3:] + 1)
    _finish(m, t, ref)
    assert t["bitwise"].failures == [
        "w: 3 element(s) differ from the reference, flat [3, 4, 5], written by rank 2; "
        "first at 3: expected 0x40400000 got 0x40800000"
    ]
    m, t = _merge(shape=(4,), world_size=3)
    m.write(rank=0, positions_P=torch.tensor([0, 1]), values_P=torch.tensor([9.0, 1.0]))
    m.write(rank=1, positions_P=torch.tensor([2, 3]), values_P=torch.tensor([9.0, 3.0]))
    _finish(m, t, torch.arange(4, dtype=torch.float32))
    assert (
        "written by ranks [0, 1]; first at 0 (rank 0): expected 0x00000000 got 0x41100000" in (t["bitwise"].failures[0])
    )


@pytest.mark.parametrize("backed", [False, True])
def test_merge_coverage_names_the_ranks_around_the_gap(backed):
    """An off-by-one split: coverage names the ranks whose pieces border the gap, and every rank that wrote."""
    ref = torch.arange(64, dtype=torch.bfloat16)
    m, t = _merge_against(ref, name="n", world_size=2, backed=backed)
    m.write(rank=0, positions_P=slice(0, 31), values_P=ref[:31])
    m.write(rank=1, positions_P=torch.arange(32, 64), values_P=ref[32:])
    _finish(m, t, ref)
    assert t["coverage"].failures == [
        "n: 1 of 64 element(s) never written, flat [31] "
        "(first gap after rank 0's piece and before rank 1's; written by ranks [0, 1])"
    ]
    m, t = _merge(shape=(4,), world_size=2)
    m.write(rank=1, positions_P=torch.tensor([0, 1]), values_P=torch.ones(2))
    _finish(m, t, torch.ones(4))
    assert t["coverage"].failures == [
        "w: 2 of 4 element(s) never written, flat [2, 3] (first gap after rank 1's piece; written by rank 1)"
    ]
