"""Per-rank local checking: a rank compares its own pieces with its own copy of the reference.

``bridge.export_hf_weights`` yields every full HF tensor on every rank, so a rank other than 0 need
not send the elements it exported: it compares them bit for bit with its local reference and sends
rank 0 a *verdict* per slot instead: ``clean`` (every value has the reference's bits, in the
reference's dtype), the index *runs* it wrote (``[start, length]`` pairs: coverage, conflict and
replica bookkeeping), and a digest of its reference tensor. Rank 0 then replays a clean piece from
its own reference (same bits, by the rank's own comparison) into the ordinary ``TensorMerge``, so
every subcheck counts and reports exactly what it would had the bytes travelled.

Where that cannot be shown the piece travels as before, and rank 0 merges the real bytes: a piece with
other bits than the local reference (so failure messages quote the subject's own bits), a rank whose
reference for the name never arrived or was dropped for memory, a digest that differs from rank 0's
(the reference is not materialised identically on every rank), positions too irregular to describe as
a few runs, or a name rank 0 holds no reference for.

Legend: ``P`` = elements of one piece, ``C`` = elements of one chunk, ``R`` = runs.
"""

from __future__ import annotations

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor

import torch

from moeverify.oracles.bits import bits
from moeverify.oracles.export import intervals

CHUNK = 1 << 20  # elements per comparison / run-finding chunk (bounds temporaries)
MAX_RUNS_FRACTION = 16  # a piece is described by runs only if it has at most P / this many ...
MIN_RUNS = 64  # ... or this many (else it travels: a few runs are cheaper than its bytes, many are not)
_RAMP = torch.arange(1, CHUNK + 1, dtype=torch.int64)


def digest(tensor: torch.Tensor) -> str:
    """A position-sensitive checksum of ``tensor``'s raw bytes, with its dtype and shape.

    It only has to tell whether two ranks' copies of one reference tensor are the same; every
    element comparison is exact. Two wrapping int64 sums: the plain words, and the words weighted by
    their index (so a permutation or a zero-filled copy changes it).
    """
    raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    if raw.numel() % 8:
        raw = torch.cat([raw, torch.zeros(8 - raw.numel() % 8, dtype=torch.uint8)])
    words = raw.view(torch.int64)
    starts = range(0, words.numel(), CHUNK)
    pool = _digest_pool() if len(starts) >= 4 else None
    sums = list(pool.map(lambda a: _sums(words, a), starts)) if pool is not None else [_sums(words, a) for a in starts]
    plain, weighted = sum(p for p, _ in sums), sum(w for _, w in sums)  # exact integers: any order, same digest
    mix = f"{tensor.dtype}|{tuple(tensor.shape)}|{plain & (2**64 - 1)}|{weighted & (2**64 - 1)}"
    return hashlib.sha256(mix.encode()).hexdigest()[:16]


def _sums(words: torch.Tensor, a: int) -> tuple[int, int]:
    """Chunk ``a``'s plain sum and its index-weighted sum (one pass each, no product temporary)."""
    w_C = words[a : a + CHUNK]
    total = int(w_C.sum())
    return total, int(torch.dot(w_C, _RAMP[: w_C.numel()])) + a * total


_POOL: list = []


def _digest_pool() -> ThreadPoolExecutor | None:
    """Threads for a large tensor's digest chunks (torch releases the GIL in them): the cores this host has per
    local rank, at most 4; None where that is one (the chunks then run in the calling thread)."""
    if not _POOL:
        per_rank = (os.cpu_count() or 1) // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
        workers = max(1, min(4, per_rank))
        _POOL.append(
            ThreadPoolExecutor(max_workers=workers, thread_name_prefix="moeverify-digest") if workers > 1 else None
        )
    return _POOL[0]


def runs(positions_P: torch.Tensor, *, limit: int) -> list[list[int]] | None:
    """``positions_P`` as ``[start, length]`` runs of consecutive indices, in order; None past ``limit`` runs."""
    found = intervals.index_runs(positions_P, limit=limit, chunk=CHUNK)
    return None if found is None else torch.stack(found, dim=1).tolist()


def same_as_reference(
    positions_P: torch.Tensor | None, values_P: torch.Tensor, *, start: int | None, ref_N: torch.Tensor
) -> bool:
    """Whether every value has ``ref_N``'s bits at its position (dtype must already agree)."""
    n = values_P.numel()
    for a in range(0, n, CHUNK):
        b = min(a + CHUNK, n)
        if start is not None:
            exp_C = ref_N[start + a : start + b]
        else:
            assert positions_P is not None, "a piece that is not one range carries its positions"
            exp_C = ref_N[positions_P[a:b]]
        if not torch.equal(bits(values_P[a:b]), bits(exp_C)):
            return False
    return True


def verdict(piece, reference: torch.Tensor | None, ref_digest: str | None) -> dict | None:
    """The local verdict on one piece: ``{"runs", "digest"}`` when it is clean, else None (it travels)."""
    if reference is None or not piece.numel:
        return None
    if tuple(reference.shape) != tuple(piece.hf_shape) or reference.dtype != piece.values_P.dtype:
        return None  # shape or dtype differ: rank 0 reports them from the real bytes
    ref_N = reference.reshape(-1)
    limit = max(MIN_RUNS, piece.numel // MAX_RUNS_FRACTION)
    if piece.runs_R is not None:  # a RunSlot's piece: its runs as given, compared without an index
        if piece.runs_R.shape[0] > limit or not intervals.same_bits_at_runs(piece.values_P, piece.runs_R, ref_N):
            return None
        return {"runs": piece.runs_R.tolist(), "digest": ref_digest}
    found: list[list[int]] | None
    if piece.start is not None:
        found = [[piece.start, piece.numel]]
    else:
        found = runs(piece.positions_P, limit=limit)
        if found is None:
            return None
    if not same_as_reference(piece.positions_P, piece.values_P, start=piece.start, ref_N=ref_N):
        return None
    return {"runs": found, "digest": ref_digest}


def run_chunks(runs_R: list[list[int]]):
    """Yield ``positions_C`` (a slice, or an int64 index over several short runs) of at most ~CHUNK elements."""
    batch: list[tuple[int, int]] = []
    size = 0
    for start, length in runs_R:
        if length >= CHUNK // 4:  # a long run: as slices, no index built
            if batch:
                yield _index(batch)
                batch, size = [], 0
            for a in range(0, length, CHUNK):
                yield slice(start + a, start + min(a + CHUNK, length))
            continue
        batch.append((start, length))
        size += length
        if size >= CHUNK:
            yield _index(batch)
            batch, size = [], 0
    if batch:
        yield _index(batch)


def _index(batch: list[tuple[int, int]]):
    if len(batch) == 1:
        start, length = batch[0]
        return slice(start, start + length)
    starts = torch.tensor([s for s, _ in batch], dtype=torch.int64)
    lengths = torch.tensor([n for _, n in batch], dtype=torch.int64)
    offsets = torch.cumsum(lengths, 0) - lengths
    return torch.arange(int(lengths.sum()), dtype=torch.int64) + torch.repeat_interleave(starts - offsets, lengths)


class Digests:
    """Digests of reference tensors, computed on a helper thread as they arrive (off a row's path).

    Used on the ranks other than 0; rank 0 digests on its main thread, which mostly waits for its export
    (measured: a digest thread there made the oracle slower and its peak RSS higher).

    A queued digest holds its tensor through a holder that ``drop`` empties, so a reference dropped
    before its digest ran is freed at once (never kept alive past the memory gate by the queue).
    """

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moeverify-export-digest")
        self._futures: dict = {}

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name not in self._futures:
            holder = [tensor]
            self._futures[name] = (holder, self._pool.submit(_digest_held, holder))

    def get(self, name: str) -> str | None:
        entry = self._futures.get(name)
        return None if entry is None else entry[1].result()

    def drop(self, name: str) -> None:
        entry = self._futures.pop(name, None)
        if entry is not None:
            entry[0].clear()
            entry[1].cancel()

    def close(self) -> None:
        for name in list(self._futures):
            self.drop(name)
        self._pool.shutdown(wait=True, cancel_futures=True)


def _digest_held(holder: list) -> str | None:
    tensor = holder[0] if holder else None
    return None if tensor is None else digest(tensor)


class LocalReferences:
    """A rank's reference tensors (other than rank 0's), kept from arrival until the last row naming them.

    ``tables``: the rank's own slot tables, row by row. A name the feed dropped (over its memory bound)
    or that never arrives leaves its pieces to travel.
    """

    def __init__(self, *, tables: list[list[tuple[str, tuple]]], checkpoint_names: set[str]) -> None:
        self.last_row: dict[str, int] = {}
        for i, table in enumerate(tables):
            for name, _ in table:
                self.last_row[name] = i
        self.checkpoint_names = checkpoint_names
        self.held: dict[str, torch.Tensor] = {}
        self.digests = Digests()
        self.seen: set[str] = set()  # arrived (kept or dropped)
        self.next_row = 0  # rows before it are done: a reference arriving after its last row is dropped

    def wanted(self) -> set[str]:
        return set(self.last_row) & self.checkpoint_names

    def take_reference(self, name: str, tensor: torch.Tensor | None) -> None:
        self.seen.add(name)
        if tensor is not None and self.last_row.get(name, -1) >= self.next_row and name not in self.held:
            self.held[name] = tensor
            self.digests.add(name, tensor)

    def wants_reference(self, names: list[str]) -> bool:
        return any(n in self.checkpoint_names and n in self.last_row and n not in self.seen for n in names)

    def reference(self, name: str) -> tuple[torch.Tensor | None, str | None]:
        tensor = self.held.get(name)
        return (None, None) if tensor is None else (tensor, self.digests.get(name))

    def row_done(self, index: int, table: list[tuple[str, tuple]]) -> None:
        self.next_row = index + 1
        for name, _ in table:
            if self.last_row.get(name) == index:
                self.held.pop(name, None)
                self.digests.drop(name)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.held.values())

    def close(self) -> None:
        self.digests.close()
