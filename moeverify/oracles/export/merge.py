"""Merge sharded export pieces into one HF tensor and compare it bit for bit: plain tensors only.

The export oracle gathers, per row, each rank's pieces (flat ``positions`` into an HF tensor and the
``values`` written there) to rank 0 and feeds them here one chunk at a time. A ``TensorMerge`` holds
one HF tensor being assembled:

- ``values_N``: a flat buffer in the subject's dtype; floats start as NaN (the sentinel),
- ``writer_N``: who wrote each element, ``rank + 1`` (0 = not written). It is the explicit coverage
  mask: integer tensors and legitimately-NaN weights are covered or not regardless of their value.

A merge opened with its reference already in hand (same shape and dtype) keeps no values buffer while
every piece matches the reference bit for bit (each piece is compared on arrival), and no writer mask
either: it records the runs of elements written (``intervals.py``; *run mode*) and counts coverage
from them. The first piece with other bits, or a replica to compare, turns it into an ordinary merge
(the mask built from the runs, the values from the reference), so every subcheck counts and reports
the same. (The memory gate counts such a merge as free; the fallback allocates what an ordinary
merge holds, on a failing or replicated tensor only.)

Legend: ``N`` = elements of the HF tensor, ``P`` = elements of one piece (positions and values).
Every comparison is on raw bits (``moeverify.oracles.bits``), never on float values, so ``-0.0 != 0.0`` and NaN
payloads count, and a tensor is compared in the reference's own dtype.
"""

from __future__ import annotations

import math

import torch

from moeverify.errors import SHOW, SubjectError, more
from moeverify.oracles.bits import bits, hex_bits
from moeverify.oracles.export import intervals
from moeverify.oracles.results import Tally

COMPARE_CHUNK = 1 << 22  # elements per comparison chunk, to bound temporaries


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` (same dtype and element count) hold the same raw bits.

    Compared eight bytes at a time where both are contiguous and 8-byte aligned (several times
    faster than element by element for 2-byte dtypes), else through ``bits``.
    """
    if (
        a.is_contiguous()
        and b.is_contiguous()
        and (a.numel() * a.element_size()) % 8 == 0
        and a.data_ptr() % 8 == 0
        and b.data_ptr() % 8 == 0
    ):
        try:
            return torch.equal(
                a.reshape(-1).view(torch.uint8).view(torch.int64), b.reshape(-1).view(torch.uint8).view(torch.int64)
            )
        except RuntimeError:  # a view torch refuses: compare element by element below
            pass
    return torch.equal(bits(a), bits(b))


def _as_index(positions) -> torch.Tensor:
    if isinstance(positions, slice):
        return torch.arange(positions.start, positions.stop, dtype=torch.int64)
    return positions


def _ranks(ranks) -> str:
    ranks = sorted(set(ranks))
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"


def _index_list(idx_K: torch.Tensor, total: int) -> str:
    return f"{[int(i) for i in idx_K[:SHOW]]}{more(total, SHOW)}"


class TensorMerge:
    """One HF tensor being assembled from pieces; failures go to the tallies passed in."""

    def __init__(
        self,
        *,
        name: str,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        world_size: int,
        conflicts: Tally,
        replicas: Tally,
        reference: torch.Tensor | None = None,
    ) -> None:
        self.name = name
        self.shape = tuple(int(s) for s in shape)
        self.dtype = dtype
        self.numel = math.prod(self.shape)
        # backed by the reference (already in hand, same shape and dtype): while every written element
        # has the reference's bits, the merged bits ARE the reference's, so no values buffer is kept;
        # the first write with other bits materialises the buffer (a copy of the reference) and the
        # merge goes on as an ordinary one. Written elements hold the subject's bits either way.
        self._ref_N: torch.Tensor | None = None
        self.values_N: torch.Tensor | None = None
        self.writer_N: torch.Tensor | None = None
        self._writer_dtype = torch.uint8 if world_size < 255 else torch.int32
        self._runs: list[torch.Tensor] | None = None  # run mode: [R, 3] (start, length, rank) per write
        if reference is not None and tuple(reference.shape) == self.shape and reference.dtype == dtype:
            self._ref_N = reference.reshape(-1)
            self._runs = []
        else:
            self.values_N = torch.empty(self.numel, dtype=dtype)
            if dtype.is_floating_point:
                self.values_N.fill_(float("nan"))
            else:
                self.values_N.zero_()
            self.writer_N = torch.zeros(self.numel, dtype=self._writer_dtype)
        self._conflicts = conflicts
        self._replicas = replicas
        self.dtype_seen: set[torch.dtype] = set()
        self.senders: set[int] = set()  # ranks that wrote at least one element (coverage names them)
        self.n_missing: int | None = None  # set by check_coverage

    @staticmethod
    def nbytes_for(shape: tuple[int, ...], dtype: torch.dtype, world_size: int, *, backed: bool = False) -> int:
        """Bytes a merge of ``shape`` and ``dtype`` allocates (values and writer mask; none when ``backed``)."""
        if backed:
            return 0
        width = torch.empty((), dtype=dtype).element_size() + (1 if world_size < 255 else 4)
        return math.prod(int(s) for s in shape) * width

    @property
    def nbytes(self) -> int:
        values = 0 if self.values_N is None else self.values_N.numel() * self.values_N.element_size()
        writer = 0 if self.writer_N is None else self.writer_N.numel() * self.writer_N.element_size()
        return values + writer + (sum(r.numel() * 8 for r in self._runs) if self._runs is not None else 0)

    def run_mode(self, reference_N: torch.Tensor | None = None) -> bool:
        """Whether writes are kept as runs (and, given ``reference_N``, backed by that very tensor)."""
        if self._runs is None:
            return False
        return reference_N is None or (
            reference_N.data_ptr() == self._reference().data_ptr()
            and reference_N.dtype == self.dtype
            and reference_N.numel() == self.numel
        )

    def _writer(self) -> torch.Tensor:
        """The writer mask, built from the runs when the merge leaves run mode."""
        if self.writer_N is None:
            runs = torch.cat(self._runs) if self._runs else torch.zeros(0, 3, dtype=torch.int64)
            self.writer_N = intervals.writer_mask(runs, self.numel, self._writer_dtype)
            self._runs = None
        return self.writer_N

    def _reference(self) -> torch.Tensor:
        """The reference backing the merge: it has one while in run mode or without a values buffer."""
        assert self._ref_N is not None, "only a merge opened with its reference is backed by it"
        return self._ref_N

    def _clean_runs(
        self, positions_P: slice | torch.Tensor, values_P: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(starts_R, lengths_R)`` of a piece with the reference's bits at its positions, else None."""
        found: tuple[torch.Tensor, torch.Tensor] | None
        if isinstance(positions_P, slice):
            found = (torch.tensor([positions_P.start]), torch.tensor([positions_P.stop - positions_P.start]))
        else:
            found = intervals.index_runs(positions_P, limit=max(64, positions_P.numel() // 16))
        if found is None or not _same_bits(values_P, self._reference()[positions_P]):
            return None
        return found

    def _merged_bits(self) -> torch.Tensor:
        """Raw bits of the merged values (the reference's while backed)."""
        return bits(self.values_N if self.values_N is not None else self._reference())

    def _materialize(self) -> torch.Tensor:
        """The values buffer, made from the reference the first time it is needed."""
        if self.values_N is None:
            self.values_N = self._reference().clone()
        return self.values_N

    # -- writes --------------------------------------------------------------------------------
    def _check_piece(self, rank: int, positions_P, values_P: torch.Tensor) -> torch.Tensor:
        if isinstance(positions_P, slice):  # a contiguous range [start, stop): checked by arithmetic
            start, stop = positions_P.start, positions_P.stop
            if not 0 <= start <= stop <= self.numel or stop - start != values_P.numel():
                raise SubjectError(
                    f"{self.name}: rank {rank} range [{start}, {stop}) with {values_P.numel()} "
                    f"values does not fit [0, {self.numel})"
                )
            self.dtype_seen.add(values_P.dtype)
            return values_P.reshape(-1).to(self.dtype)
        if positions_P.dim() != 1 or positions_P.dtype != torch.int64:
            raise SubjectError(
                f"{self.name}: rank {rank} positions must be 1-D int64, got "
                f"{tuple(positions_P.shape)} {positions_P.dtype}"
            )
        if values_P.numel() != positions_P.numel():
            raise SubjectError(
                f"{self.name}: rank {rank} sent {values_P.numel()} values for {positions_P.numel()} positions"
            )
        if positions_P.numel() and (int(positions_P.min()) < 0 or int(positions_P.max()) >= self.numel):
            raise SubjectError(
                f"{self.name}: rank {rank} positions outside [0, {self.numel}): "
                f"min {int(positions_P.min())} max {int(positions_P.max())}"
            )
        self.dtype_seen.add(values_P.dtype)
        return values_P.reshape(-1).to(self.dtype)

    def write(self, *, rank: int, positions_P, values_P: torch.Tensor) -> None:
        """A contributing piece: write it; an element already written with other bits is a conflict.

        ``positions_P`` is a 1-D int64 tensor, or a ``slice`` for a contiguous range (the fast path:
        views instead of gathers, and no duplicates are possible inside it).
        """
        values_P = self._check_piece(rank, positions_P, values_P)
        if not values_P.numel():
            return
        self.senders.add(rank)
        if self._runs is not None:
            found = self._clean_runs(positions_P, values_P)
            if found is not None:  # the reference's bits: no conflict possible, none lost
                starts_R, lengths_R = found
                self._runs.append(intervals.as_runs(starts_R, lengths_R, rank))
                self._conflicts.ok(int(values_P.numel()))
                return
        writer_N = self._writer()
        earlier_P = writer_N[positions_P]
        if self.values_N is None and _same_bits(values_P, self._reference()[positions_P]):
            # all new bits are the reference's, so are all earlier ones: no conflict, none lost
            if isinstance(positions_P, slice) and not int(torch.count_nonzero(earlier_P)):
                writer_N[positions_P] = rank + 1
            else:
                fresh_P = _as_index(positions_P)[earlier_P == 0]
                writer_N[fresh_P] = rank + 1
            self._conflicts.ok(int(values_P.numel()))
            return
        values_N = self._materialize()
        n_double, n_differ = int(torch.count_nonzero(earlier_P)), 0
        if n_double:
            covered_P = earlier_P != 0
            positions_P = _as_index(positions_P)
            old_K = bits(values_N)[positions_P[covered_P]]
            new_K = bits(values_P)[covered_P]
            differ_K = old_K != new_K
            n_differ = int(differ_K.sum())
            if n_differ:
                where = positions_P[covered_P][differ_K]
                first = int(differ_K.nonzero()[0])
                self._conflicts.fail(
                    f"{self.name}: {n_differ} element(s) written twice with different bits, "
                    f"flat {_index_list(where, n_differ)}; first: rank "
                    f"{int(earlier_P[covered_P][first]) - 1} wrote {hex_bits(int(old_K[first]), self.dtype)}, "
                    f"rank {rank} wrote {hex_bits(int(new_K[first]), self.dtype)}",
                    n=n_differ,
                )
            fresh_P = ~covered_P
            positions_P, values_P = positions_P[fresh_P], values_P[fresh_P]
        values_N[positions_P] = values_P
        writer_N[positions_P] = rank + 1
        n_lost = 0
        if not isinstance(positions_P, slice):
            # duplicates inside one piece: the last write won; an element whose stored bits differ lost one
            lost_P = bits(values_N)[positions_P] != bits(values_P)
            n_lost = int(lost_P.sum())
            if n_lost:
                self._conflicts.fail(
                    f"{self.name}: rank {rank} wrote {n_lost} element(s) twice in one piece with different bits, "
                    f"flat {_index_list(positions_P[lost_P], n_lost)}",
                    n=n_lost,
                )
        self._conflicts.ok(int(values_P.numel()) - n_lost + n_double - n_differ)

    def write_reference(self, *, rank: int, positions_P, reference_N: torch.Tensor) -> None:
        """A contributing piece that rank ``rank`` showed equal to ``reference_N`` at ``positions_P``.

        The same as ``write(values_P=reference_N[positions_P])``; while the merge is backed by this very
        reference it only marks the writers (the bits are known to be the reference's).
        """
        if (
            self.values_N is not None
            or self._ref_N is None
            or reference_N.data_ptr() != self._ref_N.data_ptr()
            or reference_N.dtype != self.dtype
            or reference_N.numel() != self.numel
        ):
            self.write(rank=rank, positions_P=positions_P, values_P=reference_N.reshape(-1)[positions_P])
            return
        n = positions_P.stop - positions_P.start if isinstance(positions_P, slice) else int(positions_P.numel())
        if not n:
            return
        if isinstance(positions_P, slice) and not 0 <= positions_P.start <= positions_P.stop <= self.numel:
            raise SubjectError(
                f"{self.name}: rank {rank} range [{positions_P.start}, {positions_P.stop}) does not "
                f"fit [0, {self.numel})"
            )
        self.dtype_seen.add(self.dtype)
        if not isinstance(positions_P, slice) and (int(positions_P.min()) < 0 or int(positions_P.max()) >= self.numel):
            raise SubjectError(
                f"{self.name}: rank {rank} positions outside [0, {self.numel}): "
                f"min {int(positions_P.min())} max {int(positions_P.max())}"
            )
        self.senders.add(rank)
        if self._runs is not None:
            found = (
                (torch.tensor([positions_P.start]), torch.tensor([n]))
                if isinstance(positions_P, slice)
                else intervals.index_runs(positions_P, limit=max(64, n // 16))
            )
            if found is not None:
                starts_R, lengths_R = found
                self._runs.append(intervals.as_runs(starts_R, lengths_R, rank))
                self._conflicts.ok(n)
                return
        writer_N = self._writer()
        earlier_P = writer_N[positions_P]
        if isinstance(positions_P, slice) and not int(torch.count_nonzero(earlier_P)):
            writer_N[positions_P] = rank + 1
        else:
            writer_N[_as_index(positions_P)[earlier_P == 0]] = rank + 1
        self._conflicts.ok(n)

    def write_runs(self, *, rank: int, runs_R2: torch.Tensor, values_P: torch.Tensor) -> bool:
        """In run mode, a contributing piece given as runs ``[R, 2]`` (values in run order): kept as its runs
        when every value has the reference's bits (True); otherwise nothing is written (False: the caller
        writes it element by element, as any piece)."""
        if self._runs is None or values_P.dtype != self.dtype or not runs_R2.shape[0]:
            return False
        if not intervals.same_bits_at_runs(values_P.reshape(-1), runs_R2, self._reference()):
            return False
        self.dtype_seen.add(values_P.dtype)
        if values_P.numel():
            self.senders.add(rank)
        self._runs.append(intervals.as_runs(runs_R2[:, 0], runs_R2[:, 1], rank))
        self._conflicts.ok(int(values_P.numel()))
        return True

    def write_reference_runs(self, *, rank: int, runs_R: list[list[int]]) -> None:
        """In run mode: ``write_reference`` of the reference backing the merge at ``[start, length]`` runs."""
        if not runs_R:
            return
        assert self._runs is not None, "write_reference_runs is for a merge in run mode (run_mode())"
        runs = torch.tensor(runs_R, dtype=torch.int64).reshape(-1, 2)
        lo, hi = int(runs[:, 0].min()), int((runs[:, 0] + runs[:, 1]).max())
        if lo < 0 or hi > self.numel or int(runs[:, 1].min()) < 0:
            raise SubjectError(f"{self.name}: rank {rank} runs reach [{lo}, {hi}), outside [0, {self.numel})")
        self.dtype_seen.add(self.dtype)
        if int(runs[:, 1].sum()):
            self.senders.add(rank)
        self._runs.append(intervals.as_runs(runs[:, 0], runs[:, 1], rank))
        self._conflicts.ok(int(runs[:, 1].sum()))

    def compare_replica(self, *, rank: int, positions_P, values_P: torch.Tensor) -> None:
        """A ``contributes=False`` piece: its bits must equal the merged bits where something was written."""
        values_P = self._check_piece(rank, positions_P, values_P)
        if not values_P.numel():
            return
        writer_P = self._writer()[positions_P]
        covered_P = writer_P != 0  # uncovered elements are the coverage subcheck's to report
        merged_P = self._merged_bits()[positions_P]
        differ_P = (merged_P != bits(values_P)) & covered_P
        n_bad = int(differ_P.sum())
        if n_bad:
            where = _as_index(positions_P)[differ_P]
            first = int(differ_P.nonzero()[0])
            self._replicas.fail(
                f"{self.name}: rank {rank}'s replica differs from the merged value at {n_bad} element(s), "
                f"flat {_index_list(where, n_bad)}; first: merged (rank {int(writer_P[first]) - 1}) "
                f"{hex_bits(int(merged_P[first]), self.dtype)} vs replica "
                f"{hex_bits(int(bits(values_P)[first]), self.dtype)}",
                n=n_bad,
            )
        self._replicas.ok(int(covered_P.sum()) - n_bad)

    def merged(self) -> torch.Tensor:
        """The tensor the subject streamed, in its shape and dtype: what an engine loading it would receive.

        Elements never written are NaN (0 in integer tensors): the engine would keep whatever it held there.
        Called once, after the final checks: it hands over (and may overwrite) the merge's own buffers, and a
        fully written merge backed by its reference returns that reference (the same bits, shown on write)."""
        if self.values_N is None and self._missing() == 0:
            return self._reference().view(self.shape)
        values_N, writer_N = self._materialize(), self._writer()
        if self._missing():
            values_N[writer_N == 0] = float("nan") if self.dtype.is_floating_point else 0
        return values_N.view(self.shape)

    # -- final checks --------------------------------------------------------------------------
    def check_coverage(self, coverage: Tally) -> None:
        n_missing = 0
        shown: list[int] = []
        if self._runs is not None:
            runs = torch.cat(self._runs) if self._runs else torch.zeros(0, 3, dtype=torch.int64)
            n_missing, shown = intervals.gaps(runs, self.numel)
        else:
            writer_N = self._writer()
            for start in range(0, self.numel, COMPARE_CHUNK):
                writer_C = writer_N[start : start + COMPARE_CHUNK]
                k = writer_C.numel() - int(torch.count_nonzero(writer_C))
                if k and len(shown) < SHOW:
                    shown += ((writer_C == 0).nonzero().flatten()[: SHOW - len(shown)] + start).tolist()
                n_missing += k
        self.n_missing = n_missing
        if n_missing:
            coverage.fail(
                f"{self.name}: {n_missing} of {self.numel} element(s) never written, flat "
                f"{_index_list(torch.tensor(shown), n_missing)}{self._gap_writers(shown[0])}",
                n=n_missing,
            )
        coverage.ok(self.numel - n_missing)

    def _first_writer(self, i: int) -> int | None:
        """The rank that first wrote element ``i`` (None: unwritten or outside the tensor)."""
        if not 0 <= i < self.numel:
            return None
        if self._runs is None:
            w = int(self._writer()[i])
            return w - 1 if w else None
        for run in self._runs:  # in write order: the earliest covering run wins, as in the writer mask
            hit = (run[:, 0] <= i) & (i < run[:, 0] + run[:, 1])
            if bool(hit.any()):
                return int(run[int(hit.nonzero()[0]), 2])
        return None

    def _gap_writers(self, a: int) -> str:
        """Who wrote around the gap that starts at flat ``a``, and every rank that wrote into the tensor."""
        if not self.senders:
            return "; no rank wrote any element of it"
        if self._runs is None:  # the first written element past the gap, a chunk at a time (bounded temporaries)
            b, writer_N = self.numel, self._writer()
            for start in range(a, self.numel, COMPARE_CHUNK):
                written_C = writer_N[start : start + COMPARE_CHUNK] != 0
                if bool(written_C.any()):
                    b = start + int(written_C.to(torch.uint8).argmax())
                    break
        else:
            runs = torch.cat(self._runs) if self._runs else torch.zeros(0, 3, dtype=torch.int64)
            later = runs[(runs[:, 1] > 0) & (runs[:, 0] > a), 0]
            b = int(later.min()) if later.numel() else self.numel
        before, after = self._first_writer(a - 1), self._first_writer(b)
        around = [
            f"after rank {before}'s piece" if before is not None else "",
            "" if after is None else f"before rank {after}'s",
        ]
        where = " and ".join(x for x in around if x)
        return f" ({'first gap ' + where + '; ' if where else ''}written by {_ranks(self.senders)})"

    def _missing(self) -> int:
        if self.n_missing is None and self._runs is not None:
            self.n_missing = intervals.gaps(
                torch.cat(self._runs) if self._runs else torch.zeros(0, 3, dtype=torch.int64), self.numel
            )[0]
        elif self.n_missing is None:
            self.n_missing = self.numel - int(torch.count_nonzero(self._writer()))
        return self.n_missing

    def check_against(self, reference: torch.Tensor, *, shape_dtype: Tally, bitwise: Tally) -> None:
        """Shape and dtype, then raw bits in the reference's dtype, over the elements written."""
        ref_shape, ref_dtype = tuple(reference.shape), reference.dtype
        got_dtypes = sorted(str(d) for d in self.dtype_seen) or [str(ref_dtype)]  # nothing written: coverage's
        ok_shape = self.shape == ref_shape
        ok_dtype = got_dtypes == [str(ref_dtype)]
        shape_dtype.check(
            ok_shape and ok_dtype,
            f"{self.name}: expected shape {ref_shape} dtype {ref_dtype}, got shape {self.shape} "
            f"dtype {'/'.join(got_dtypes)}",
        )
        if not ok_shape:
            bitwise.fail(f"{self.name}: not compared: shape {self.shape} != reference {ref_shape}")
            return
        self._compare_bits(reference.reshape(-1), bitwise)

    def _compare_bits(self, ref_N: torch.Tensor, bitwise: Tally) -> None:
        if self.values_N is None:
            backing = self._reference()
            if ref_N.data_ptr() == backing.data_ptr() and ref_N.dtype == backing.dtype:
                bitwise.ok(self.numel - self._missing())  # every written element was checked on write
                return
        values_N = self._materialize()  # another reference than the one backing it: compare as usual
        writer_N = self._writer()
        # the merged values are cast INTO the reference dtype (exact when dtypes agree), never
        # both through a narrower one: an fp32 tensor that went through bf16 keeps its lost bits
        if self.dtype == ref_N.dtype and self.n_missing == 0 and _same_bits(values_N, ref_N):
            bitwise.ok(self.numel)  # fully written and identical: one pass, no per-element bookkeeping
            return
        n_bad, n_ok = 0, 0
        first_bad: tuple[int, int, int, int] | None = None
        shown: list[int] = []
        culprits: set[int] = set()
        for start in range(0, self.numel, COMPARE_CHUNK):
            stop = min(start + COMPARE_CHUNK, self.numel)
            covered_C = writer_N[start:stop] != 0
            got_C = bits(values_N[start:stop].to(ref_N.dtype))
            exp_C = bits(ref_N[start:stop])
            differ_C = (got_C != exp_C) & covered_C
            bad = int(differ_C.sum())
            n_ok += int(covered_C.sum()) - bad
            if bad:
                idx_C = differ_C.nonzero().flatten()
                culprits.update(int(w) - 1 for w in torch.unique(writer_N[start:stop][differ_C]).tolist())
                if first_bad is None:
                    i = int(idx_C[0])
                    first_bad = (start + i, int(exp_C[i]), int(got_C[i]), int(writer_N[start + i]) - 1)
                shown += [start + int(i) for i in idx_C[: SHOW - len(shown)]]
                n_bad += bad
        if first_bad is not None:  # there is a first bad element exactly when n_bad > 0
            flat, exp, got, rank = first_bad
            by = "" if len(culprits) == 1 else f" (rank {rank})"
            unshown = more(n_bad, len(shown))
            bitwise.fail(
                f"{self.name}: {n_bad} element(s) differ from the reference, flat {shown}{unshown}, written by "
                f"{_ranks(culprits)}; first at {flat}{by}: expected {hex_bits(exp, ref_N.dtype)} "
                f"got {hex_bits(got, ref_N.dtype)}",
                n=n_bad,
            )
        bitwise.ok(n_ok)
