"""Rank 0's side of the export oracle: open merges, reference tensors in hand, and the final checks.

Rows arrive in the subject's order and reference tensors in the bridge's order. A merge is opened
when a row first names an HF tensor, becomes *complete* after the last row that names it, and is
checked as soon as its reference tensor is in hand; then both are dropped. Only reference tensors
that the subject will still need are kept, so memory stays at a few tensors when both orders agree.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable

import torch

from moeverify.errors import SHOW_NAMES, few, more
from moeverify.oracles.export.local import digest
from moeverify.oracles.export.merge import TensorMerge
from moeverify.oracles.results import Tally
from moeverify.spec.checks import CHECKS

SUBCHECKS = CHECKS[
    "export"
].subchecks  # lockstep, slot_tables, coverage, conflicts, replicas, ... (moeverify.spec.checks)
# emitted only with the check's options: ``refresh`` (refresh.py), ``receiver`` and, with both, ``receiver_reload``
OPTIONAL_SUBCHECKS = CHECKS["export"].optional_subchecks
ALL_SUBCHECKS = SUBCHECKS + OPTIONAL_SUBCHECKS  # every name the export check can emit
REFERENCE = "the reference (Megatron-Bridge's export_hf_weights)"  # the culprit reference_keys names


def new_tallies() -> dict[str, Tally]:
    return {name: Tally() for name in SUBCHECKS}


def _names(names: Iterable[str]) -> str:
    return few(sorted(names))


class Collector:
    """Rank 0 state for one export check."""

    def __init__(
        self,
        *,
        tallies: dict[str, Tally],
        tables: list[list[tuple[str, tuple]]],
        checkpoint_names: set[str] | dict[str, tuple[int, ...]],
        world_size: int,
        sink=None,
    ) -> None:
        self.t = tallies
        self.sink = sink  # called as sink(name, tensor) with each merged subject tensor once it is checked
        self.world_size = world_size
        # names, or names with their shapes (then reference_keys compares the reference's shapes with them)
        self.checkpoint_shapes = dict(checkpoint_names) if isinstance(checkpoint_names, dict) else None
        self.checkpoint_names = set(checkpoint_names)
        self.last_row: dict[str, int] = {}
        for i, table in enumerate(tables):
            for name, _ in table:
                self.last_row[name] = i
        self.subject_names = set(self.last_row)
        self.reference_names: list[str] = []
        self.reference_shapes: dict[str, tuple[int, ...]] = {}
        self.subject_elements: dict[str, int] = {}  # elements of a merge finished without any reference
        self.merges: dict[str, TensorMerge] = {}
        self.complete: set[str] = set()
        self.held: dict[str, torch.Tensor] = {}  # reference tensors pulled before their merge completed
        # digests of held references (other ranks' verdicts are trusted only where theirs match), computed on
        # first use on this thread: a helper thread could keep a dropped reference alive past the memory gate
        self.digests: dict[str, str] = {}
        self.done: set[str] = set()
        # elements of other ranks' pieces: replayed from rank 0's reference (checked locally) vs received
        self.elements = {"checked_locally": 0, "received": 0}

    # -- merges -------------------------------------------------------------------------------
    def merge_for(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> TensorMerge:
        if name not in self.merges:
            self.merges[name] = TensorMerge(
                name=name,
                shape=shape,
                dtype=dtype,
                world_size=self.world_size,
                conflicts=self.t["conflicts"],
                replicas=self.t["replicas"],
                reference=self.held.get(name),
            )
        return self.merges[name]

    def backs(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> bool:
        """Whether a merge of ``name`` opened now starts backed by its reference (and so allocates nothing)."""
        held = self.held.get(name)
        return held is not None and tuple(held.shape) == tuple(shape) and held.dtype == dtype

    def nbytes(self) -> int:
        """Bytes held: open merges and reference tensors kept for later (the memory gate's input)."""
        return sum(m.nbytes for m in self.merges.values()) + sum(
            t.numel() * t.element_size() for t in self.held.values()
        )

    def row_done(self, index: int, table: list[tuple[str, tuple]]) -> None:
        """After row ``index``: merges it finished become complete; check those whose reference is held."""
        for name, _ in table:
            if self.last_row.get(name) == index:
                self.complete.add(name)
        for name in sorted(self.complete):
            if name in self.held:
                self._finish(name, self.held.pop(name))
            elif name not in self.checkpoint_names:
                self._finish(name, None)  # no reference will come: key_set reports it

    def wants_reference(self, names: list[str]) -> bool:
        """True while a complete merge, or the next row (``names``), waits for a reference not yet pulled."""
        waiting = [n for n in names if n in self.checkpoint_names and n not in self.done]
        return any(name not in self.held for name in [*self.complete, *waiting])

    # -- references ---------------------------------------------------------------------------
    def reference(self, name: str) -> tuple[torch.Tensor | None, str | None]:
        """Rank 0's reference for ``name`` if held, with its digest (``local.digest``)."""
        tensor = self.held.get(name)
        if tensor is None:
            return None, None
        if name not in self.digests:
            self.digests[name] = digest(tensor)
        return tensor, self.digests[name]

    def take_reference(self, name: str, tensor: torch.Tensor) -> None:
        self.reference_names.append(name)
        self.reference_shapes[name] = tuple(tensor.shape)
        if name in self.complete:
            self._finish(name, tensor)
        elif name in self.subject_names and name not in self.done:
            self.held[name] = tensor
        elif name not in self.subject_names:
            n = tensor.numel()
            self.t["coverage"].fail(f"{name}: not exported by the subject; all {n} element(s) unwritten", n=max(n, 1))

    def close(self) -> None:
        self.digests.clear()

    def finish_all(self) -> None:
        """After the reference is exhausted: check what is left (merges without a reference, etc.)."""
        for name in sorted(set(self.merges) | set(self.held) | self.complete):
            if name in self.done:
                continue
            self._finish(name, self.held.pop(name, None))
        self._key_set()
        self._reference_keys()

    def _finish(self, name: str, reference: torch.Tensor | None) -> None:
        self.complete.discard(name)
        self.done.add(name)
        self.digests.pop(name, None)
        merge = self.merges.pop(name, None)
        if merge is None:  # a row named it but no rank could send (e.g. its row was skipped)
            if reference is not None:
                self.t["coverage"].fail(
                    f"{name}: no piece was merged (its row was skipped); {reference.numel()} element(s) unwritten",
                    n=max(reference.numel(), 1),
                )
            return
        merge.check_coverage(self.t["coverage"])
        if reference is None:
            self.subject_elements[name] = merge.numel
        else:
            merge.check_against(reference, shape_dtype=self.t["shape_dtype"], bitwise=self.t["bitwise"])
        if self.sink is not None:  # what the subject streamed, as an engine would receive it (the receiver's input)
            self.sink(name, merge.merged())

    def _key_set(self) -> None:
        """The subject's names against the reference's and the source checkpoint's (the reference's own
        names against the checkpoint are ``reference_keys``, which names the bridge as the culprit)."""
        tally = self.t["key_set"]
        subject, reference, checkpoint = self.subject_names, set(self.reference_names), self.checkpoint_names
        everything = subject | reference | checkpoint
        bad = set()
        if reference - subject:
            tally.fail(f"missing from the subject (in the reference): {_names(reference - subject)}")
            bad |= reference - subject
        if subject - reference:
            blamed = (subject & checkpoint) - reference
            tally.fail(
                f"extra in the subject (not in the reference): {_names(subject - reference)}"
                + (
                    f"; {len(blamed)} of them are in the source checkpoint, which {REFERENCE} lacks "
                    f"(see reference_keys): their bits were not compared"
                    if blamed
                    else ""
                )
            )
            bad |= subject - reference
        if checkpoint - subject - reference:
            tally.fail(
                f"missing from the subject and the reference (in the source checkpoint): "
                f"{_names(checkpoint - subject - reference)}"
            )
            bad |= checkpoint - subject - reference
        if (subject & reference) - checkpoint:
            tally.fail(
                f"in the subject and the reference but not in the source checkpoint: "
                f"{_names((subject & reference) - checkpoint)}"
            )
            bad |= (subject & reference) - checkpoint
        tally.ok(len(everything - bad))

    def _reference_keys(self) -> None:
        """The reference's own names and shapes against the source checkpoint: a finding about the bridge."""
        tally = self.t["reference_keys"]
        reference, checkpoint = set(self.reference_names), self.checkpoint_names
        dupes = sorted(n for n, c in collections.Counter(self.reference_names).items() if c > 1)
        bad = set(dupes)
        missing, extra = checkpoint - reference, reference - checkpoint
        if missing:
            shapes = self.checkpoint_shapes or {}
            sent = {n: self.subject_elements[n] for n in missing if n in self.subject_elements}
            evidence = [f"{n} {tuple(shapes[n]) if n in shapes else ''}".rstrip() for n in sorted(missing)[:SHOW_NAMES]]
            tally.fail(
                f"{REFERENCE} dropped {len(missing)} tensor(s) of the source checkpoint: "
                f"{evidence}{more(len(missing), SHOW_NAMES)} (name and checkpoint shape); "
                + (
                    f"the subject exported {len(sent)} of them ({sum(sent.values())} element(s)), "
                    f"unverified bit for bit for want of a reference"
                    if sent
                    else "the subject did not export them"
                )
            )
            bad |= missing
        if extra:
            tally.fail(f"{REFERENCE} exported {len(extra)} name(s) the source checkpoint lacks: {_names(extra)}")
            bad |= extra
        if dupes:
            tally.fail(f"{REFERENCE} yielded names more than once: {_names(dupes)}")
        if self.checkpoint_shapes is not None:
            for name in sorted(reference & checkpoint):
                want, got = tuple(self.checkpoint_shapes[name]), self.reference_shapes[name]
                if want != got:
                    tally.fail(f"{name}: {REFERENCE} exported shape {got}, the source checkpoint holds {want}")
                    bad.add(name)
        tally.ok(len((reference | checkpoint) - bad))


__all__ = ["ALL_SUBCHECKS", "Collector", "OPTIONAL_SUBCHECKS", "SUBCHECKS", "new_tallies"]
