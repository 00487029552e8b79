"""What a sharded export subject yields: ``ShardRow`` records of ``Slot`` / ``RangeSlot`` / ``RunSlot`` pieces.

Declared here, below the oracles, so that the subjects import them one way; ``moeverify.oracles.export`` re-exports
them (the public ``from moeverify.oracles.export import ShardRow``) and validates what a subject yields
(``oracles/export/rows.py``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import overload

import torch

from moeverify.errors import SubjectError


@dataclasses.dataclass(frozen=True, kw_only=False)
class Slot:
    """Elements of one HF tensor written by one rank: flat ``positions`` and the ``values`` there."""

    hf_name: str
    hf_shape: tuple[int, ...]
    positions: torch.Tensor
    values: torch.Tensor


@dataclasses.dataclass(frozen=True, kw_only=False)
class RangeSlot:
    """A slot whose elements go to the one range ``start, start + 1, ...`` of the flat HF tensor.

    The same as ``Slot(hf_name, hf_shape, torch.arange(start, start + values.numel()), values)``, without
    building (and checking) a positions tensor as large as the values: a sharded exporter uses it for
    dim-0 shards and replicated tensors. ``positions`` builds the range on demand.
    """

    hf_name: str
    hf_shape: tuple[int, ...]
    start: int
    values: torch.Tensor

    @property
    def positions(self) -> torch.Tensor:
        return torch.arange(self.start, self.start + self.values.numel(), dtype=torch.int64)


@dataclasses.dataclass(frozen=True, kw_only=False)
class RunSlot:
    """A slot whose elements go to runs of consecutive flat HF positions: run ``i`` is ``starts[i], starts[i] + 1,
    ..., starts[i] + lengths[i] - 1``, the values in run order.

    The same as ``Slot`` with those positions expanded, without building them: a sharded exporter uses it for
    row-split and per-head shards (a few hundred runs instead of millions of positions). ``positions`` expands
    them on demand.
    """

    hf_name: str
    hf_shape: tuple[int, ...]
    starts: torch.Tensor
    lengths: torch.Tensor
    values: torch.Tensor

    @property
    def positions(self) -> torch.Tensor:
        return expand_runs(self.starts, self.lengths)


AnySlot = Slot | RangeSlot | RunSlot  # what a row's slots may be


def expand_runs(starts_R: torch.Tensor, lengths_R: torch.Tensor) -> torch.Tensor:
    """The positions ``(starts_R, lengths_R)`` describe, in order."""
    total = int(lengths_R.sum()) if lengths_R.numel() else 0
    offsets_R = torch.cumsum(lengths_R, 0) - lengths_R
    return torch.arange(total, dtype=torch.int64) + torch.repeat_interleave(starts_R - offsets_R, lengths_R)


@dataclasses.dataclass(frozen=True, kw_only=False)
class ShardRow:
    """One row of a sharded export: the same ``row`` name and slot table on every rank."""

    row: str
    slots: Sequence[AnySlot]
    contributes: bool = True


class DeferredSlots(Sequence[AnySlot]):
    """A slot list whose table (names, shapes) is known up front and whose tensors are built on use.

    A sharded subject can hand these out so that draining its rows costs no tensor memory: the
    oracle reads ``table`` for lockstep bookkeeping and materialises one row at a time. ``build`` must
    be local (no collectives): the oracle may call it on a helper thread, beside the reference
    export's own collectives.
    """

    def __init__(self, table: Sequence[tuple[str, tuple[int, ...]]], build: Callable[[], Sequence[AnySlot]]):
        self.table = [(str(n), tuple(int(s) for s in shape)) for n, shape in table]
        self._build = build

    def materialize(self) -> list[AnySlot]:
        slots = list(self._build())
        got = [(s.hf_name, tuple(s.hf_shape)) for s in slots]
        if got != self.table:
            raise SubjectError(f"deferred slots built {got}, but their table promised {self.table}")
        return slots

    def __len__(self) -> int:
        return len(self.table)

    @overload
    def __getitem__(self, i: int) -> AnySlot: ...

    @overload
    def __getitem__(self, i: slice) -> list[AnySlot]: ...

    def __getitem__(self, i: int | slice) -> AnySlot | list[AnySlot]:
        return self.materialize()[i]
