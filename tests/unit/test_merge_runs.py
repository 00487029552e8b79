"""A merge in run mode (backed by its reference, coverage kept as index runs) reports exactly what an
ordinary merge reports: random write sequences, clean and dirty, ranges and index sets, replays of other
ranks' clean pieces and replicas, compared subcheck by subcheck and message by message."""

import random

import pytest
import torch

from moeverify.errors import SubjectError
from moeverify.oracles.export import intervals
from moeverify.oracles.export.merge import TensorMerge
from moeverify.oracles.export.oracle import _replay
from moeverify.oracles.results import Tally

SUBCHECKS = ("conflicts", "replicas", "coverage", "shape_dtype", "bitwise")


def _reference(n: int, rng: random.Random) -> torch.Tensor:
    values = [rng.choice([0.0, -0.0, 1.5, float("nan"), rng.uniform(-2, 2)]) for _ in range(n)]
    return torch.tensor(values).to(torch.bfloat16)


def _positions(n: int, rng: random.Random):
    a = rng.randrange(n)
    b = rng.randrange(a, n + 1)
    style = rng.choice(["slice", "index", "strided", "shuffled", "duplicates"])
    if style == "slice":
        return slice(a, b)
    idx = torch.arange(a, b)
    if style == "strided":
        idx = idx[:: rng.choice([2, 3])]
    elif style == "shuffled":
        idx = idx[torch.randperm(idx.numel(), generator=torch.Generator().manual_seed(rng.randrange(999)))]
    elif style == "duplicates" and idx.numel():
        idx = torch.cat([idx, idx[: rng.randrange(1, idx.numel() + 1)]])
    return idx


def _values(ref_N: torch.Tensor, positions, rng: random.Random) -> torch.Tensor:
    values = ref_N[positions].clone()
    if values.numel() and rng.random() < 0.3:  # a dirty piece: some elements with other bits
        hit = torch.tensor(rng.sample(range(values.numel()), rng.randrange(1, values.numel() + 1)))
        values[hit] = torch.where(values[hit] == 0, torch.tensor(0.5, dtype=values.dtype), -values[hit])
    return values


def _runs(n: int, rng: random.Random) -> list[list[int]]:
    cuts = sorted(rng.sample(range(n + 1), min(n + 1, 2 * rng.randrange(1, 4))))
    return [[a, b - a] for a, b in zip(cuts[::2], cuts[1::2], strict=True)]


def _ops(n: int, rng: random.Random) -> list:
    ops = []
    for _ in range(rng.randrange(1, 7)):
        rank = rng.randrange(4)
        kind = rng.choice(["write", "write", "replay", "replay_replica", "compare_replica", "write_reference"])
        if kind in ("replay", "replay_replica"):
            ops.append((kind, rank, _runs(n, rng), None))
        else:
            ops.append((kind, rank, _positions(n, rng), rng.random()))
    return ops


def _apply(ops, ref, *, backed: bool, seed: int):
    rng = random.Random(seed)
    ref_N = ref.reshape(-1)
    t = {k: Tally() for k in SUBCHECKS}
    m = TensorMerge(
        name="w",
        shape=tuple(ref.shape),
        dtype=ref.dtype,
        world_size=4,
        conflicts=t["conflicts"],
        replicas=t["replicas"],
        reference=ref if backed else None,
    )
    for kind, rank, where, _ in ops:
        if kind == "write":
            m.write(rank=rank, positions_P=where, values_P=_values(ref_N, where, rng))
        elif kind == "compare_replica":
            m.compare_replica(rank=rank, positions_P=where, values_P=_values(ref_N, where, rng))
        elif kind == "write_reference":
            m.write_reference(rank=rank, positions_P=where, reference_N=ref_N)
        else:
            _replay(m, rank=rank, runs=where, reference=ref, contributes=kind == "replay")
    m.check_coverage(t["coverage"])
    m.check_against(ref, shape_dtype=t["shape_dtype"], bitwise=t["bitwise"])
    return {k: (x.checked, x.failures) for k, x in t.items()}


@pytest.mark.parametrize("seed", range(400))
def test_merge_run_mode_reports_like_an_ordinary_merge(seed):
    rng = random.Random(seed)
    n = rng.choice([1, 7, 40, 200])
    ref = _reference(n, rng)
    ops = _ops(n, rng)
    assert _apply(ops, ref, backed=True, seed=seed) == _apply(ops, ref, backed=False, seed=seed)


def test_merge_run_mode_clean_pieces_hold_no_mask():
    ref = _reference(4096, random.Random(1))
    t = {k: Tally() for k in SUBCHECKS}
    m = TensorMerge(
        name="w",
        shape=(4096,),
        dtype=ref.dtype,
        world_size=4,
        conflicts=t["conflicts"],
        replicas=t["replicas"],
        reference=ref,
    )
    m.write(rank=0, positions_P=slice(0, 2048), values_P=ref[:2048])
    strided = torch.cat([torch.arange(2048 + 128 * k, 2048 + 128 * k + 64) for k in range(16)])  # a row-split shard
    m.write(rank=1, positions_P=strided, values_P=ref[strided])
    _replay(m, rank=2, runs=[[2048 + 128 * k + 64, 64] for k in range(16)], reference=ref, contributes=True)
    assert m.run_mode() and m.writer_N is None and m.values_N is None and m.nbytes < 4096 // 4
    m.check_coverage(t["coverage"])
    assert t["coverage"].passed and t["coverage"].checked == 4096 and m.writer_N is None


def test_merge_run_mode_names_the_earliest_writer_after_leaving_it():
    ref = _reference(16, random.Random(2))
    t = {k: Tally() for k in SUBCHECKS}
    m = TensorMerge(
        name="w",
        shape=(16,),
        dtype=ref.dtype,
        world_size=4,
        conflicts=t["conflicts"],
        replicas=t["replicas"],
        reference=ref,
    )
    _replay(m, rank=3, runs=[[4, 4]], reference=ref, contributes=True)
    m.write(rank=1, positions_P=slice(0, 8), values_P=ref[:8])
    bad = ref[:8].clone()
    bad[5] = -bad[5] if bad[5] != 0 else 1.0
    m.write(rank=2, positions_P=slice(0, 8), values_P=bad)  # leaves run mode
    assert not m.run_mode()
    assert "first: rank 3 wrote" in t["conflicts"].failures[0] and "flat [5]" in t["conflicts"].failures[0]


@pytest.mark.parametrize(
    "runs, match",
    [([[-1, 2]], r"runs reach \[-1, 1\)"), ([[10, 7]], r"runs reach \[10, 17\)"), ([[3, -1]], r"runs reach")],
)
def test_merge_run_mode_refuses_runs_outside_the_tensor(runs, match):
    ref = _reference(16, random.Random(3))
    m = TensorMerge(
        name="w", shape=(16,), dtype=ref.dtype, world_size=2, conflicts=Tally(), replicas=Tally(), reference=ref
    )
    with pytest.raises(SubjectError, match=match):
        m.write_reference_runs(rank=1, runs_R=runs)


def test_intervals_gaps_and_mask():
    runs = torch.tensor([[5, 3, 0], [0, 2, 1], [6, 4, 2], [12, 0, 3]])
    missing, shown = intervals.gaps(runs, 14)
    assert (missing, shown) == (7, [2, 3, 4, 10, 11])
    mask = intervals.writer_mask(runs, 14, torch.uint8)
    assert mask.tolist() == [2, 2, 0, 0, 0, 1, 1, 1, 3, 3, 0, 0, 0, 0]
    assert int((mask == 0).sum()) == missing
    assert intervals.gaps(torch.zeros(0, 3, dtype=torch.int64), 3) == (3, [0, 1, 2])
    assert intervals.index_runs(torch.tensor([4, 5, 6, 9, 9, 10]), limit=8)[1].tolist() == [3, 1, 2]
    assert intervals.index_runs(torch.arange(0, 40, 2), limit=8) is None
