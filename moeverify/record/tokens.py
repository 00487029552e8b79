"""Token identity of two dumps: whether their micro-batches fed the same input sequences.

A dump written by the autopatch recording carries a fingerprint per input sequence of every micro-batch
(``step{S}/mb{M}/fingerprints``, ``format``); two sides' sequences are the same when their fingerprints are
equal, micro-batch by micro-batch and data-parallel rank by data-parallel rank (the ranks of one DP group hold
the same sequences). A side without fingerprints has its token identity unknown.
"""

from __future__ import annotations

import dataclasses

import torch

from moeverify.record.reader import Dump


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class TokenCheck:
    """``sequences`` compared, of which ``differ`` had other tokens; ``first``: where the first one is."""

    sequences: int
    differ: int
    first: str | None

    def line(self) -> str:
        return f"tokens differ in {self.differ} of {self.sequences} sequences" + (
            f" (first: {self.first})" if self.first else ""
        )

    def as_json(self) -> dict:
        return {"sequences": self.sequences, "differ": self.differ, "first": self.first}


def fingerprints(dump: Dump, step: int) -> dict[tuple[int, int], torch.Tensor]:
    """``{(micro-batch, dp rank): [B] fingerprints}`` of one step, from the first rank of each DP rank that has them."""
    out: dict[tuple[int, int], torch.Tensor] = {}
    if step not in dump.steps:
        return out
    for rank in sorted(dump.coords):
        dp = dump.coords[rank].dp
        for mb in range(dump.steps[step].microbatches):
            if (mb, dp) not in out:
                got = dump.fingerprints(step=step, rank=rank, mb=mb)
                if got is not None:
                    out[(mb, dp)] = got
    return out


def compare(a: Dump, step_a: int, b: Dump, step_b: int) -> TokenCheck | str:
    """The two sides' token identity compared, or why it is unknown (one line)."""
    layouts = [dump.layout.name(dump.world_size) for dump in (a, b)]
    if layouts[0] != layouts[1]:
        return (
            f"token identity unknown: A ran layout {layouts[0]}, B {layouts[1]}; fingerprints are taken of each "
            f"rank's own input sequences, so they are compared between dumps of one layout only"
        )
    fa, fb = fingerprints(a, step_a), fingerprints(b, step_b)
    unknown = [
        f"{side} ({dump.path}, step {step})"
        for side, dump, step, fps in (("A", a, step_a, fa), ("B", b, step_b, fb))
        if not fps
    ]
    if unknown:
        return (
            f"token identity unknown: {' and '.join(unknown)} carr{'y' if len(unknown) > 1 else 'ies'} no token "
            f"fingerprints (recorded before they were written, or the job's forwards had no input_ids); routing "
            f"divergence below may be on other tokens"
        )
    sequences = differ = 0
    first = None
    for key in sorted(set(fa) | set(fb)):
        x, y = fa.get(key), fb.get(key)
        if x is None or y is None:
            continue  # only one side knows this micro-batch's tokens
        count = max(x.numel(), y.numel())
        bad = list(range(count)) if x.shape != y.shape else (x != y).nonzero().flatten().tolist()
        sequences += count
        differ += len(bad)
        if bad and first is None:
            first = f"micro-batch {key[0]}, dp rank {key[1]}, sequence {bad[0]}" + (
                "" if x.shape == y.shape else f" ({x.numel()} vs {y.numel()} sequences)"
            )
    return TokenCheck(sequences=sequences, differ=differ, first=first)
