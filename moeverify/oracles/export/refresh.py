"""The ``refresh`` subcheck: export, change the weights, export again; the second export must carry the new bits.

Delta and streaming exporters keep state between calls (converted tensors, slot tables, data received from
other pipeline stages); a cache that is not invalidated after an optimizer step sends the old weights with
every name, shape and position right, so a single export checks clean. ``refresh`` runs the oracle once, applies
a deterministic optimizer-like update to every local parameter (and the router's expert bias, which the
aux-loss-free balancer updates between steps; one element in 16 of a large tensor keeps its bits, so that
``refresh_delta`` sees where a second export changes what the weights did not), runs the oracle again against a
fresh reference export, and restores the original weights bit for bit (later checks of the scenario see the model
they were given).

What it reports (``fold``): every subcheck that passed on the first export and fails on the second, with its
messages prefixed ``after the weight update``; and every reference tensor the update left unchanged (a stale
copy of it could not be told from a fresh one, so the check would prove nothing there). It counts the
elements compared bit for bit after the update. Subchecks that already failed on the first export are left
to their own records.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator

import torch

from moeverify.errors import few
from moeverify.oracles.bits import bits
from moeverify.oracles.export.local import digest
from moeverify.oracles.results import Tally

SEED = 20251  # fixed: every run of the check applies the same update


def _generator_seed(shape: tuple[int, ...], seed: int) -> int:
    """A stable seed per local shape: equal-shaped copies (DP, expert-DP, tied, TP-replicated) stay equal."""
    h = seed
    for d in shape:
        h = (h * 1_000_003 + d + 1) % (2**61 - 1)
    return h


# Every HELD-th element (from HELD_AT) of a tensor of at least HELD_FROM elements keeps its bits through the update:
# the places where the weights did not change, where a second export must not change either (``refresh_delta``).
# Smaller tensors (norms, biases) move whole, so every reference tensor still changes somewhere (``refresh``).
HELD, HELD_AT, HELD_FROM = 16, 5, 64


def step_like(tensor: torch.Tensor, *, seed: int = SEED) -> torch.Tensor:
    """An optimizer-like update of ``tensor``: every element moves by a seeded 1.6 % to 4.7 % of its magnitude
    (at least 2^-14 near zero), computed in fp32 and rounded once, enough to change every bf16 element; except, in a
    tensor of ``HELD_FROM`` elements or more, every ``HELD``-th element from ``HELD_AT`` (local flat order), which
    keeps its bits. Equal shapes get equal updates (DP, expert-DP, tied and TP-replicated copies stay equal)."""
    noise = torch.randn(
        tuple(tensor.shape),
        generator=torch.Generator().manual_seed(_generator_seed(tuple(tensor.shape), seed)),
        dtype=torch.float32,
    ).to(tensor.device)
    size = noise.abs().clamp(max=2.0) + 1.0  # in [1, 3]: never a step too small to change a bf16 element
    base = tensor.detach().float()
    out = (base + torch.sign(noise + 1e-30) * size * (base.abs() * 2**-6 + 2**-14)).to(tensor.dtype)
    if tensor.numel() >= HELD_FROM:
        flat = out.reshape(-1)
        flat[HELD_AT::HELD] = tensor.detach().reshape(-1)[HELD_AT::HELD]
        out = flat.reshape(tensor.shape)
    return out


def _updated_tensors(model_chunks: list) -> Iterator[tuple[str, torch.Tensor]]:
    seen: set[int] = set()
    for i, chunk in enumerate(model_chunks):
        named = list(chunk.named_parameters()) + [(n, b) for n, b in chunk.named_buffers() if n.endswith("expert_bias")]
        for name, tensor in named:
            if id(tensor) in seen or not tensor.is_floating_point():
                continue
            seen.add(id(tensor))
            yield f"chunk {i} {name}", tensor


@contextlib.contextmanager
def updated_weights(model_chunks: list, *, seed: int = SEED):
    """Apply ``step_like`` to every local parameter and expert bias in place; restore the original bits on exit.

    Yields the number of tensors updated. The originals are kept as one copy of the local model."""
    saved: list[tuple[torch.Tensor, torch.Tensor]] = []
    try:
        with torch.no_grad():
            for _name, tensor in _updated_tensors(model_chunks):
                saved.append((tensor, tensor.detach().clone()))
                tensor.copy_(step_like(tensor, seed=seed))
        yield len(saved)
    finally:
        with torch.no_grad():
            for tensor, original in saved:
                tensor.copy_(original)


class Fingerprints:
    """A reference export, started on first iteration, recording a digest per tensor name (where ``record``), and
    with ``keep`` a copy of each tensor by name (``kept``: the ``refresh_delta`` subcheck takes them)."""

    def __init__(
        self, export: Callable[[], Iterable[tuple[str, torch.Tensor]]], *, record: bool, keep: bool = False
    ) -> None:
        self._export, self._record, self._keep = export, record, keep
        self.digests: dict[str, str] = {}
        self.kept: dict[str, torch.Tensor] = {}

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in self._export():
            if self._record:
                self.digests[name] = digest(tensor)
            if self._keep:
                self.kept[name] = tensor.detach().clone()  # the export may hand out views of the live weights
            yield name, tensor


class Delta:
    """The ``refresh_delta`` subcheck, on rank 0: the subject's second export must differ from its first EXACTLY
    where the reference changed between them, element by element, and to the new bits.

    ``first`` (a sink of the first export) keeps what the subject streamed; ``second(sink)`` compares each tensor of
    the second with it and with the two references (``Fingerprints`` with ``keep``). Only tensors the first export
    sent right, every element, are judged (the first export's own failures are its subchecks'); each wrong element
    is named by what it holds: the previous export's bits where the weights changed (a frozen base shipped, a copy
    read before the optimizer step or before pending gathers finished), bits of neither version (a buffer reused or
    overwritten before it was read), or a change where the weights did not change."""

    def __init__(self, before: Fingerprints, after: Fingerprints) -> None:
        self._before, self._after = before, after
        self._sent: dict[str, torch.Tensor] = {}
        self.tally = Tally()

    def first(self, name: str, tensor: torch.Tensor) -> None:
        self._sent[name] = tensor.detach().clone()

    def second(self, name: str, tensor: torch.Tensor) -> None:
        s1, r1 = self._sent.pop(name, None), self._before.kept.pop(name, None)
        r2 = self._after.kept.pop(name, None)
        if s1 is None or r1 is None or r2 is None:
            return  # a name one export lacks: key_set's (and refresh's) to report
        shapes = {(tuple(t.shape), t.dtype) for t in (s1, r1, r2, tensor)}
        if len(shapes) != 1:
            return  # a shape or dtype change: shape_dtype's
        s1b, r1b, r2b, s2b = (bits(t.detach().contiguous()).reshape(-1) for t in (s1, r1, r2, tensor))
        judged = s1b == r1b
        if not bool(judged.all()):
            # the first export sent this tensor wrong (its own subchecks say so): elements it got right by chance
            # (a permutation meeting an equal value) would read as a second-export fault of their own
            return
        changed, moved, wrong = r1b != r2b, s1b != s2b, s2b != r2b
        n = int(judged.sum())
        if not n:
            return
        bad = False
        for mask, what in (
            (
                judged & changed & ~moved,
                "kept the previous export's bits where the weights changed "
                "(a frozen base shipped, or a copy read before the optimizer "
                "step or before pending gathers finished)",
            ),
            (
                judged & changed & moved & wrong,
                "hold bits of neither the previous nor the new weights "
                "(a buffer reused or overwritten before it was read)",
            ),
            (judged & ~changed & moved, "changed where the weights did not"),
        ):
            k = int(mask.sum())
            if k:
                bad = True
                first = int(mask.nonzero()[0])
                index = [int(i) for i in torch.unravel_index(torch.tensor(first), tuple(tensor.shape))]
                self.tally.fail(f"{name}: {k} of {n} element(s) {what}; first at {index}", n=0)
        if bad:
            self.tally.checked += n
        else:
            self.tally.ok(n)

    def finish(self) -> Tally:
        if self.tally.checked == 0 and not self.tally.failures:
            self.tally.fail(
                "no element compared between the two exports (no tensor sent right by the first export was sent again)"
            )
        return self.tally


def _tee(*sinks):
    sinks = [s for s in sinks if s is not None]
    if not sinks:
        return None

    def sink(name: str, tensor: torch.Tensor) -> None:
        for s in sinks:
            s(name, tensor)

    return sink


def fold(
    *, first: dict[str, Tally], second: dict[str, Tally], before: dict[str, str], after: dict[str, str], tally: Tally
) -> Tally:
    """The refresh verdict from the two exports' tallies and the reference digests before and after the update."""
    if not after:
        tally.fail("no reference tensor was exported after the weight update: nothing compared")
    unchanged = sorted(n for n, d in after.items() if before.get(n) == d)
    if unchanged:
        tally.fail(
            f"the weight update left {len(unchanged)} reference tensor(s) bit-identical, so a stale copy "
            f"of them cannot be told from a fresh one: {few(unchanged)}"
        )
    for name, t in second.items():
        if t.passed or not first[name].passed:
            continue
        shown = t.failures or ["checked 0 items"]
        for message in shown:
            tally.fail(f"after the weight update (passed before it): {name}: {message}")
    tally.ok(max(second["bitwise"].checked, 0) if "bitwise" in second else 0)
    return tally


def run_twice(run_subject, factory, sctx, *, seed: int = SEED, receiver=None) -> dict[str, Tally]:
    """The oracle's tallies for the first export, plus ``refresh`` from a second export after an update.

    ``run_subject(factory, sctx, reference=..., sink=...)`` is the oracle's own entry point (passed in, not
    imported, so this module stays free of the per-row machinery). ``receiver`` (a ``receiver.ReceiverRun``): the
    receiver loads what the subject streamed each time, ``receiver`` after the first export and ``receiver_reload``
    (the same receiver, a weight sync) after the second, while the updated weights are in place."""

    def reference():
        return Fingerprints(
            lambda: sctx.bridge.export_hf_weights(sctx.model_chunks, cpu=True, show_progress=False),
            record=sctx.rank == 0,
            keep=sctx.rank == 0,
        )

    first_reference, second_reference = reference(), reference()
    delta = Delta(first_reference, second_reference) if sctx.rank == 0 else None
    first = run_subject(
        factory, sctx, reference=first_reference, sink=_tee(receiver and receiver.sink(), delta and delta.first)
    )
    if receiver is not None:  # a sleep/wake cycle and a repeat after each load, each judged against that load
        receiver.check("receiver", first, wake=True, repeat=True)
    refresh, delta_tally = Tally(), Tally()
    if not first["lockstep"].passed:
        refresh.fail("skipped: lockstep failed on the first export, no weight update was made")
        delta_tally.fail("skipped: lockstep failed on the first export, no weight update was made")
        if receiver is not None:
            receiver.skip("receiver_reload", "lockstep failed on the first export, no weight update was made")
        return {**first, "refresh": refresh, "refresh_delta": delta_tally}
    with updated_weights(sctx.model_chunks, seed=seed):
        second = run_subject(
            factory, sctx, reference=second_reference, sink=_tee(receiver and receiver.sink(), delta and delta.second)
        )
        if receiver is not None:
            receiver.check("receiver_reload", second, when="after the weight sync: ", wake=True, repeat=True)
    fold(first=first, second=second, before=first_reference.digests, after=second_reference.digests, tally=refresh)
    if "model_intact" in first and "model_intact" in second:  # the second export must leave the model intact too
        for failure in second["model_intact"].failures:
            first["model_intact"].fail(f"second export (after the weight update): {failure}")
    if delta is not None:
        delta_tally = delta.finish()
    return {**first, "refresh": refresh, "refresh_delta": delta_tally}
