"""Per-rank local checking (``moeverify.oracles.export.local``): runs, digests, verdicts, and rank 0's replay
of a clean piece from its reference reporting exactly what merging the real bytes reports."""

import pytest
import torch

from moeverify.oracles.export import local
from moeverify.oracles.export.feed import ReferenceFeed
from moeverify.oracles.export.merge import TensorMerge
from moeverify.oracles.export.rows import Piece
from moeverify.oracles.results import Tally

SUBCHECKS = ("conflicts", "replicas", "coverage", "shape_dtype", "bitwise")


def _ref(n=48, dtype=torch.bfloat16):
    return torch.randn(n, generator=torch.Generator().manual_seed(1)).to(dtype).reshape(6, n // 6)


def _expand(runs):
    return [p for s, n in runs for p in range(s, s + n)]


@pytest.mark.parametrize("positions", [[3, 4, 5, 9, 10, 0, 1, 1, 2], [7], list(range(20)), [5, 4, 3]])
def test_local_runs_expand_back_to_the_positions(positions):
    pos = torch.tensor(positions, dtype=torch.int64)
    assert _expand(local.runs(pos, limit=len(positions))) == positions


def test_local_runs_across_chunk_boundary(monkeypatch):
    monkeypatch.setattr(local, "CHUNK", 4)
    positions = list(range(0, 6)) + list(range(10, 17)) + [3]
    found = local.runs(torch.tensor(positions), limit=10)
    assert found == [[0, 6], [10, 7], [3, 1]]


def test_local_runs_past_limit_is_none():
    assert local.runs(torch.arange(0, 20, 2), limit=3) is None


def test_local_run_chunks_cover_the_runs_in_order(monkeypatch):
    monkeypatch.setattr(local, "CHUNK", 8)
    runs = [[0, 3], [10, 2], [20, 9], [40, 1], [50, 5]]
    got = []
    for c in local.run_chunks(runs):
        got += list(range(c.start, c.stop)) if isinstance(c, slice) else c.tolist()
    assert got == _expand(runs)


def test_local_digest_tells_copies_apart_from_changed_tensors():
    ref = _ref()
    same = local.digest(ref.clone())
    assert local.digest(ref) == same
    swapped = ref.clone().reshape(-1)
    swapped[[0, 1]] = swapped[[1, 0]]
    changed = [torch.zeros_like(ref), swapped.reshape(ref.shape), ref.float(), ref.reshape(-1), ref.reshape(-1)[:47]]
    assert [local.digest(t) == same for t in changed] == [False] * 5


def _piece(ref, positions, values, start=None):
    return Piece(hf_name="w", hf_shape=tuple(ref.shape), positions_P=positions, values_P=values, start=start)


def test_local_verdict_clean_dirty_and_unknown():
    ref = _ref()
    flat = ref.reshape(-1)
    pos = torch.tensor([0, 1, 2, 30, 31, 32, 33])
    clean = local.verdict(_piece(ref, pos, flat[pos]), ref, "d")
    assert clean == {"runs": [[0, 3], [30, 4]], "digest": "d"}
    assert local.verdict(_piece(ref, None, flat[4:10].clone(), start=4), ref, "d")["runs"] == [[4, 6]]
    dirty = flat[pos].clone()
    dirty[3] = -dirty[3]
    assert local.verdict(_piece(ref, pos, dirty), ref, "d") is None
    assert local.verdict(_piece(ref, pos, flat[pos].float()), ref, "d") is None  # other dtype: bytes travel
    assert local.verdict(_piece(ref, pos, flat[pos]), None, None) is None  # no local reference
    big = _ref(n=600)
    scattered = torch.arange(0, 600, 2)  # 300 runs of one: too irregular to describe, so the bytes travel
    assert local.verdict(_piece(big, scattered, big.reshape(-1)[scattered]), big, "d") is None


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
    flat = ref.reshape(-1)
    for kind, rank, positions, values in ops:
        if kind == "replay":  # a clean piece of another rank, replayed from rank 0's reference
            m.write_reference(rank=rank, positions_P=positions, reference_N=flat)
        else:
            getattr(m, kind)(rank=rank, positions_P=positions, values_P=values)
    m.check_coverage(t["coverage"])
    m.check_against(ref, shape_dtype=t["shape_dtype"], bitwise=t["bitwise"])
    return {k: (x.checked, x.failures) for k, x in t.items()}


def _flip(v):
    return -v


REPLAYS = {
    "ranges": lambda r: [("write", 0, slice(0, 24), r[:24]), ("replay", 1, slice(24, 48), None)],
    "index_overlap": lambda r: [("replay", 1, torch.arange(0, 30), None), ("write", 0, slice(20, 48), r[20:])],
    "after_wrong_write": lambda r: [("write", 0, slice(0, 24), _flip(r[:24])), ("replay", 2, slice(10, 48), None)],
    "before_wrong_write": lambda r: [("replay", 2, slice(0, 30), None), ("write", 0, slice(20, 48), _flip(r[20:]))],
    "uncovered": lambda r: [("replay", 3, slice(0, 40), None)],
    "duplicates": lambda r: [("replay", 1, torch.tensor([0, 0, 1, 2]), None), ("write", 0, slice(3, 48), r[3:])],
}


@pytest.mark.parametrize("backed", [True, False])
@pytest.mark.parametrize("name", sorted(REPLAYS))
def test_local_replay_reports_like_the_bytes_travelling(name, backed):
    ref = _ref()
    flat = ref.reshape(-1)
    ops = REPLAYS[name](flat)
    travelled = [
        ("write", rank, pos, flat[pos]) if kind == "replay" else (kind, rank, pos, v) for kind, rank, pos, v in ops
    ]
    assert _run(ops, ref, backed=backed) == _run(travelled, ref, backed=False)


def test_local_references_keep_until_last_row_then_drop():
    refs = local.LocalReferences(tables=[[("a", (2,))], [("b", (2,)), ("a", (2,))]], checkpoint_names={"a", "b"})
    assert refs.wanted() == {"a", "b"} and refs.wants_reference(["a"])
    refs.take_reference("a", torch.zeros(2))
    refs.take_reference("b", None)  # dropped by the feed for memory: seen, not held
    assert not refs.wants_reference(["a", "b"]) and refs.reference("b") == (None, None)
    assert refs.reference("a")[1] == local.digest(torch.zeros(2))
    refs.row_done(0, [("a", (2,))])
    assert "a" in refs.held
    refs.row_done(1, [("b", (2,)), ("a", (2,))])
    assert not refs.held and refs.nbytes() == 0
    refs.take_reference("a", torch.zeros(2))  # after its last row: not kept
    assert not refs.held


def test_local_feed_ungated_drops_unwanted_and_over_bound():
    items = [
        ("t0", torch.zeros(100, dtype=torch.bfloat16)),
        ("skip", torch.zeros(100, dtype=torch.bfloat16)),
        ("t1", torch.zeros(100, dtype=torch.bfloat16)),
    ]
    feed = ReferenceFeed(items, keep=True, numels={n: t.numel() for n, t in items}, gate=False, wanted={"t0", "t1"})
    feed.report(10**6)  # holdings far past the bound: wanted tensors arrive as (name, None), none is waited on
    feed.start()
    taken = []

    class Store:
        def take_reference(self, name, tensor):
            taken.append((name, tensor is None))

        def nbytes(self):
            return 10**6

    feed.finish(Store())
    assert taken == [("t0", True), ("t1", True)]


def test_local_digests_computed_off_thread_and_dropped_tensors_released():
    import gc
    import weakref

    digests = local.Digests()
    kept, dropped = _ref(), _ref(n=600)
    digests.add("kept", kept)
    digests.add("dropped", dropped)
    gone = weakref.ref(dropped)
    digests.drop("dropped")
    del dropped
    assert digests.get("kept") == local.digest(kept) and digests.get("dropped") is None
    digests.close()
    gc.collect()
    assert gone() is None


def test_digest_the_same_with_and_without_its_thread_pool(monkeypatch):
    """A large tensor's chunks are summed on a thread pool where the host has cores to spare: the digest (exact
    integer sums) must not depend on that, nor on the order chunks finish in."""
    from concurrent.futures import ThreadPoolExecutor

    from moeverify.oracles.export import local

    x = torch.randn(5 * local.CHUNK * 4 + 3).to(torch.bfloat16)  # 5+ chunks of words: the pool is used
    monkeypatch.setattr(local, "_POOL", [None])
    serial = local.digest(x)
    monkeypatch.setattr(local, "_POOL", [ThreadPoolExecutor(max_workers=3)])
    assert local.digest(x) == serial
    y = x.clone()
    y[-1] = -y[-1] if y[-1] != 0 else 1.0
    assert local.digest(y) != serial


def test_verdict_of_a_run_slot_piece_uses_its_runs():
    """A RunSlot's piece (no positions tensor) is judged on its runs: clean -> those runs; other bits, or more runs
    than a verdict may carry -> None (it travels, positions expanded)."""
    from moeverify.oracles.export.local import verdict
    from moeverify.oracles.export.rows import Piece, expand_runs

    ref = torch.randn(64, 32).to(torch.bfloat16)
    runs = torch.tensor([[32 * o + 16, 16] for o in range(64)])  # the second half of every row (a row-split shard)
    values = ref.reshape(-1)[expand_runs(runs[:, 0], runs[:, 1])]
    piece = Piece(hf_name="w", hf_shape=(64, 32), positions_P=None, values_P=values, runs_R=runs)
    assert verdict(piece, ref, "d") == {"runs": runs.tolist(), "digest": "d"}
    assert torch.equal(piece.positions(), expand_runs(runs[:, 0], runs[:, 1]))
    dirty = values.clone()
    dirty[40] = -dirty[40] - 1
    assert (
        verdict(Piece(hf_name="w", hf_shape=(64, 32), positions_P=None, values_P=dirty, runs_R=runs), ref, "d") is None
    )
    many = torch.tensor([[2 * i, 1] for i in range(1024)])  # 1024 one-element runs of 1024 elements: too many
    sparse = ref.reshape(-1)[many[:, 0]]
    assert (
        verdict(Piece(hf_name="w", hf_shape=(64, 32), positions_P=None, values_P=sparse, runs_R=many), ref, "d") is None
    )
