"""What an export subject yields, and how the oracle checks it where it enters.

A subject yields either ``(hf_name, tensor)`` pairs (a full-tensor export) or ``ShardRow`` records (a
sharded export; the types are declared in ``moeverify.subjects.slots``, below the oracles, for the subjects). Both
become ``Piece`` lists here, validated on the rank that produced them, so a
malformed row is reported with rank, row and slot before anything is sent.

Legend: ``P`` = elements in one piece (its positions and values).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator

import torch

from moeverify.errors import SubjectError
from moeverify.subjects.slots import AnySlot as AnySlot  # re-exported with the slots (moeverify.oracles.export)
from moeverify.subjects.slots import DeferredSlots, RangeSlot, RunSlot, ShardRow, Slot, expand_runs


@dataclasses.dataclass(frozen=True, kw_only=True)
class Piece:
    """A validated slot as the oracle moves it: ``positions_P`` may be None when ``start`` is set (the range
    ``start, start + 1, ...``; the whole tensor for a full-tensor export)."""

    hf_name: str
    hf_shape: tuple[int, ...]
    positions_P: torch.Tensor | None
    values_P: torch.Tensor
    start: int | None = None  # set when the positions are one contiguous range (sent as a range)
    runs_R: torch.Tensor | None = None  # [R, 2] (start, length) of a RunSlot: positions_P is None, built on demand

    def positions(self) -> torch.Tensor | None:
        """``positions_P``, expanded from the runs for a RunSlot's piece (None for a range)."""
        if self.positions_P is None and self.runs_R is not None:
            return expand_runs(self.runs_R[:, 0], self.runs_R[:, 1])
        return self.positions_P

    @property
    def numel(self) -> int:
        return int(self.values_P.numel())


@dataclasses.dataclass(frozen=True, kw_only=True)
class DrainedRow:
    """A row as held after draining: its name, whether it contributes, and how to make its pieces."""

    row: str
    contributes: bool
    table: list[tuple[str, tuple[int, ...]]]
    source: ShardRow | tuple[str, torch.Tensor]  # a sharded row, or a full tensor (name, tensor)


def drain(items, *, rank: int) -> list[DrainedRow]:
    """Turn the subject's iterator into rows; raises SubjectError naming rank and item index.

    The rows are compared after the stream ends, so a tensor a subject yields must keep its values until then: one
    written into after it was yielded (a staging buffer refilled for a later item) is refused, naming the item.
    Seen by torch's in-place write counter (``_version``: ``copy_``, ``out=``, ``fill_``; a write through ``.data``
    or a NumPy view is not counted)."""
    rows, held = [], []
    for index, item in enumerate(items):
        row = _drained(item, rank=rank, index=index)
        rows.append(row)
        held += [(index, name, tensor, tensor._version) for name, tensor in _values_of(row)]
    for index, name, tensor, version in held:
        if tensor._version != version:
            raise SubjectError(
                f"rank {rank} item {index} ({name!r}): its tensor was written into after it was yielded (a staging "
                "buffer refilled for a later item?): the check compares the items once the stream ends, so a yielded "
                "tensor must keep its values until then; yield a copy (tensor.clone()) of a reused buffer"
            )
    return rows


def _values_of(row: DrainedRow) -> list[tuple[str, torch.Tensor]]:
    """The value tensors a drained row holds (a ``DeferredSlots`` row makes its own later: none)."""
    source = row.source
    if isinstance(source, tuple):
        return [source]
    slots = source.slots if isinstance(source, ShardRow) and not isinstance(source.slots, DeferredSlots) else []
    return [(s.hf_name, s.values) for s in slots if isinstance(getattr(s, "values", None), torch.Tensor)]


def _drained(item, *, rank: int, index: int) -> DrainedRow:
    if isinstance(item, ShardRow):
        if not isinstance(item.row, str):
            raise SubjectError(f"rank {rank} item {index}: ShardRow.row must be a str, got {type(item.row).__name__}")
        if isinstance(item.slots, DeferredSlots):
            table = list(item.slots.table)
        else:
            slots = list(item.slots)
            for j, slot in enumerate(slots):
                _validate_slot(slot, rank=rank, row=item.row, index=j)
            table = [(s.hf_name, tuple(int(x) for x in s.hf_shape)) for s in slots]
            item = dataclasses.replace(item, slots=slots)
        return DrainedRow(row=item.row, contributes=bool(item.contributes), table=table, source=item)
    if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str) and isinstance(item[1], torch.Tensor):
        name, tensor = item
        return DrainedRow(row=name, contributes=rank == 0, table=[(name, tuple(tensor.shape))], source=item)
    raise SubjectError(
        f"rank {rank} item {index}: a subject yields ShardRow records or (hf_name: str, tensor) pairs, "
        f"got {type(item).__name__}{_preview(item)}"
    )


def _preview(item) -> str:
    if isinstance(item, tuple):
        return "(" + ", ".join(type(x).__name__ for x in item) + ")"
    return ""


def _validate_slot(slot, *, rank: int, row: str, index: int) -> int | None:
    """Raise SubjectError naming rank, row and slot; return the start when positions are one range."""
    where = f"rank {rank} row {row!r} slot {index}"
    if not isinstance(slot, (Slot, RangeSlot, RunSlot)):
        raise SubjectError(f"{where}: expected a Slot, RangeSlot or RunSlot, got {type(slot).__name__}")
    where = f"{where} ({slot.hf_name!r})"
    if not isinstance(slot.hf_name, str):
        raise SubjectError(f"{where}: hf_name must be a str, got {type(slot.hf_name).__name__}")
    shape = tuple(slot.hf_shape)
    if not all(isinstance(s, int) and s >= 0 for s in shape):
        raise SubjectError(f"{where}: hf_shape must be non-negative ints, got {slot.hf_shape!r}")
    if isinstance(slot, RangeSlot):
        return _validate_range(slot, where=where, shape=shape)
    if isinstance(slot, RunSlot):
        _validate_runs(slot, where=where, shape=shape)
        return None
    pos, val = slot.positions, slot.values
    if not isinstance(pos, torch.Tensor) or not isinstance(val, torch.Tensor):
        raise SubjectError(
            f"{where}: positions and values must be tensors, got {type(pos).__name__} and {type(val).__name__}"
        )
    if pos.dim() != 1 or pos.dtype != torch.int64:
        raise SubjectError(
            f"{where}: positions must be a 1-D int64 tensor, got shape {tuple(pos.shape)} dtype {pos.dtype}"
        )
    if val.numel() != pos.numel():
        raise SubjectError(f"{where}: values have {val.numel()} elements for {pos.numel()} positions")
    numel = math.prod(shape)
    n = pos.numel()
    start = contiguous_start(pos) if n else None
    if start is not None:  # a plain range: its ends bound it
        lo, hi = int(pos[0]), int(pos[-1])
    else:
        lo, hi = (int(pos.min()), int(pos.max())) if n else (0, -1)
    if n and (lo < 0 or hi >= numel):
        raise SubjectError(f"{where}: positions must lie in [0, {numel}) for shape {shape}, got min {lo} max {hi}")
    return start


def _validate_range(slot: RangeSlot, *, where: str, shape: tuple[int, ...]) -> int | None:
    if not isinstance(slot.values, torch.Tensor):
        raise SubjectError(f"{where}: values must be a tensor, got {type(slot.values).__name__}")
    if isinstance(slot.start, bool) or not isinstance(slot.start, int):
        raise SubjectError(f"{where}: a RangeSlot's start must be an int, got {type(slot.start).__name__}")
    n, numel = slot.values.numel(), math.prod(shape)
    if n and (slot.start < 0 or slot.start + n > numel):
        raise SubjectError(
            f"{where}: positions must lie in [0, {numel}) for shape {shape}, got min "
            f"{slot.start} max {slot.start + n - 1}"
        )
    return slot.start if n else None


def _validate_runs(slot: RunSlot, *, where: str, shape: tuple[int, ...]) -> None:
    starts, lengths, val = slot.starts, slot.lengths, slot.values
    if not all(isinstance(t, torch.Tensor) for t in (starts, lengths, val)):
        raise SubjectError(
            f"{where}: starts, lengths and values must be tensors, got {type(starts).__name__}, "
            f"{type(lengths).__name__} and {type(val).__name__}"
        )
    for what, t in (("starts", starts), ("lengths", lengths)):
        if t.dim() != 1 or t.dtype != torch.int64:
            raise SubjectError(
                f"{where}: {what} must be a 1-D int64 tensor, got shape {tuple(t.shape)} dtype {t.dtype}"
            )
    if starts.numel() != lengths.numel():
        raise SubjectError(f"{where}: {starts.numel()} starts for {lengths.numel()} lengths")
    numel, n = math.prod(shape), int(lengths.sum()) if lengths.numel() else 0
    if lengths.numel() and int(lengths.min()) < 0:
        raise SubjectError(f"{where}: run lengths must be >= 0, got min {int(lengths.min())}")
    if val.numel() != n:
        raise SubjectError(f"{where}: values have {val.numel()} elements for runs of {n} positions")
    if n:
        used = lengths > 0
        lo, hi = int(starts[used].min()), int((starts + lengths)[used].max()) - 1
        if lo < 0 or hi >= numel:
            raise SubjectError(f"{where}: positions must lie in [0, {numel}) for shape {shape}, got min {lo} max {hi}")
    return None


def contiguous_start(positions_P: torch.Tensor | None) -> int | None:
    """The start of ``positions_P`` when it is exactly ``start, start+1, ...`` (0 for a whole tensor), else None."""
    if positions_P is None:
        return 0
    n = positions_P.numel()
    if n == 0:
        return None
    first = int(positions_P[0])
    if int(positions_P[-1]) - first != n - 1:
        return None
    # compared chunk by chunk against one small ramp: no position-sized temporary
    ramp = torch.arange(min(n, _RAMP), dtype=torch.int64)
    for a in range(0, n, _RAMP):
        chunk = positions_P[a : a + _RAMP]
        if not torch.equal(chunk - (first + a), ramp[: chunk.numel()]):
            return None
    return first


_RAMP = 1 << 18  # elements per contiguity check chunk


def pieces(row: DrainedRow, *, rank: int) -> list[Piece]:
    """Materialise a drained row's pieces (validated); raises SubjectError naming rank, row and slot."""
    src = row.source
    if isinstance(src, tuple):
        name, tensor = src
        return [
            Piece(
                hf_name=name,
                hf_shape=tuple(tensor.shape),
                positions_P=None,
                values_P=tensor.detach().reshape(-1).cpu(),
                start=0,
            )
        ]
    deferred = isinstance(src.slots, DeferredSlots)
    slots = src.slots.materialize() if isinstance(src.slots, DeferredSlots) else src.slots
    out = []
    for j, slot in enumerate(slots):
        runs_R = None
        if isinstance(slot, RangeSlot):  # no positions tensor: the range's start says it all
            pos = None if slot.values.numel() else torch.empty(0, dtype=torch.int64)
            start = (
                _validate_slot(slot, rank=rank, row=row.row, index=j)
                if deferred
                else (slot.start if slot.values.numel() else None)
            )
        elif isinstance(slot, RunSlot):  # no positions tensor: the runs say it all
            if deferred:
                _validate_slot(slot, rank=rank, row=row.row, index=j)
            keep = slot.lengths > 0
            runs_R = torch.stack([slot.starts[keep], slot.lengths[keep]], dim=1)
            pos, start = (None, None) if slot.values.numel() else (torch.empty(0, dtype=torch.int64), None)
            if runs_R.shape[0] == 1:  # one run: a range
                pos, start, runs_R = None, int(runs_R[0, 0]), None
        else:
            pos = slot.positions.cpu()
            start = (
                _validate_slot(slot, rank=rank, row=row.row, index=j)
                if deferred
                else (contiguous_start(pos) if pos.numel() else None)
            )
        out.append(
            Piece(
                hf_name=slot.hf_name,
                hf_shape=tuple(int(x) for x in slot.hf_shape),
                positions_P=pos,
                values_P=slot.values.detach().reshape(-1).cpu(),
                start=start,
                runs_R=runs_R if pos is None and start is None else None,
            )
        )
    return out


def iterate_subject(factory: Callable, context) -> Iterator:
    """Call the factory and iterate what it returns (kept separate so a raise is caught in one place)."""
    result = factory(context)
    if result is None:
        raise SubjectError("the subject factory returned None; it must return an iterator of rows")
    yield from result
