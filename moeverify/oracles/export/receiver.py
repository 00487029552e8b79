"""The ``receiver`` subcheck: what an inference engine holds after loading the export, mapped back to HF tensors.

An export can be bit-exact and still reach the rollout engine wrong: the engine fuses ``q``/``k``/``v`` into
``qkv_proj``, ``gate``/``up`` into ``gate_up_proj`` and stacks experts into ``w13`` ``[E, 2I, H]`` and ``w2``
``[E, H, I]``; a swapped half, a load that never happened (the buffer keeps its old bits) or a weight sync that
keeps the previous tensor is invisible to the sender. A receiver is a plugin (``package.module:factory`` or
``file.py:factory``, or a built-in name in ``RECEIVERS``): the factory returns an object with
``load(stream) -> Held``, where ``stream`` yields ``(hf_name, tensor)`` and ``Held`` is what the engine holds in
its own names with, per engine tensor, the ``Part`` s of HF tensors it is made of. ``load`` may be called again
with a later export (a weight sync): it must write into the same buffers.

``compare(held, reference, tally)`` checks, bit for bit, every part of every held tensor against the reference
HF tensor it names (the failure names the engine tensor, the part and the first differing element), every
reference tensor that no part covers (``dropped``) and every part naming a tensor the reference lacks; the
reference may be a stream (one tensor in hand at a time).

``ReceiverRun`` is the subcheck in the export check: the receiver loads what the SUBJECT streamed (the oracle's
merged tensors, handed over through ``SubjectExport``), so a subject bug the engine would hold is seen there too,
and what it holds is compared with a fresh reference export.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import re
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import torch

from moeverify.errors import UsageError, few, more
from moeverify.oracles.export import wire
from moeverify.oracles.results import Tally
from moeverify.spec import plugins
from moeverify.spec.checks import RECEIVERS
from moeverify.spec.models.traits import traits_of
from moeverify.spec.models.user import shape_of


@dataclasses.dataclass(frozen=True, kw_only=True)
class Part:
    """HF tensor ``hf_name`` lies in the engine tensor at ``[index]`` (stacked experts; None: no stacking), then
    ``narrow(dim, start, length)`` (``length`` None: the whole tensor)."""

    hf_name: str
    index: int | None = None
    dim: int = 0
    start: int = 0
    length: int | None = None

    def view(self, tensor: torch.Tensor) -> torch.Tensor:
        t = tensor if self.index is None else tensor[self.index]
        return t if self.length is None else t.narrow(self.dim, self.start, self.length)

    def describe(self) -> str:
        where = "" if self.index is None else f"[{self.index}]"
        if self.length is not None:
            where += f".narrow(dim={self.dim}, {self.start}, {self.length})"
        return f"{where or '(whole)'} = {self.hf_name}"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Held:
    """What the engine holds: tensors by engine name, and the HF parts each is made of."""

    tensors: Mapping[str, torch.Tensor]
    parts: Mapping[str, tuple[Part, ...]]

    def __post_init__(self) -> None:
        missing = sorted(set(self.parts) - set(self.tensors))
        if missing:
            raise UsageError(f"receiver: parts name engine tensors it does not hold: {few(missing)}")


def load_receiver(name: str):
    """The receiver factory for a built-in name, ``package.module:factory`` or ``file.py:factory``."""
    return plugins.load(name, what="receiver", builtins=RECEIVERS)


def _first_difference(got: torch.Tensor, want: torch.Tensor) -> str:
    diff = (
        (got.view(-1) != want.view(-1)) & ~(got.view(-1).isnan() & want.view(-1).isnan())
        if got.is_floating_point()
        else got.view(-1) != want.view(-1)
    )
    flat = int(diff.nonzero()[0].item()) if bool(diff.any()) else -1
    if flat < 0:  # equal values with different bits (-0.0 vs 0.0, NaN payloads)
        bits = got.contiguous().view(-1).view(torch.uint8) != want.contiguous().view(-1).view(torch.uint8)
        flat = int(bits.nonzero()[0].item()) // got.element_size()
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), tuple(got.shape)))
    return (
        f"{int(diff.sum())} of {got.numel()} element(s) differ, first at {list(index)}: "
        f"held {got.view(-1)[flat].item()!r}, reference {want.view(-1)[flat].item()!r}"
    )


def _same_bits(got: torch.Tensor, want: torch.Tensor) -> bool:
    a, b = got.contiguous().view(-1), want.contiguous().view(-1)
    return a.numel() == 0 or torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _wanted(held: Held) -> dict[str, list[tuple[str, Part]]]:
    """HF name -> the (engine tensor, part) pairs that hold it, engine tensors in name order."""
    wanted: dict[str, list[tuple[str, Part]]] = {}
    for engine_name in sorted(held.parts):
        for part in held.parts[engine_name]:
            wanted.setdefault(part.hf_name, []).append((engine_name, part))
    return wanted


def _compare_part(tensor: torch.Tensor, part: Part, want: torch.Tensor, tally: Tally, where: str) -> None:
    try:
        got = part.view(tensor)
    except (IndexError, RuntimeError) as exc:
        tally.fail(f"{where}: part out of range of the held tensor {tuple(tensor.shape)}: {exc}")
        return
    if tuple(got.shape) != tuple(want.shape) or got.dtype != want.dtype:
        tally.fail(f"{where}: held {tuple(got.shape)} {got.dtype} != reference {tuple(want.shape)} {want.dtype}")
    elif not _same_bits(got, want):
        tally.fail(f"{where}: {_first_difference(got, want)}")
    else:
        tally.ok()


def compare(
    held: Held,
    reference: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    tally: Tally,
    *,
    when: str = "",
    copies: Tally | None = None,
    scope: CopiesScope | None = None,
) -> Tally:
    """Check ``held`` against the reference HF tensors, bit for bit; ``when`` prefixes each message.

    ``reference`` is a mapping or a stream of ``(name, tensor)`` (an ``export_hf_weights`` pass): each tensor is
    compared with the parts that hold it as it comes, so only one reference tensor is in hand at a time. With
    ``copies`` and ``scope``, the parts holding the tied embedding and the MTP tensors are also counted there, and
    ``copies`` fails where the receiver holds no tied head or none of the MTP tensors (``receiver_copies``)."""
    wanted = _wanted(held)
    seen: set[str] = set()
    dropped: list[str] = []
    drafts: set[str] = set()
    for name, want in reference.items() if isinstance(reference, Mapping) else reference:
        seen.add(name)
        also: Tally | None = None  # ``copies``, where this tensor is one that receiver_copies covers
        if copies is not None and scope is not None:
            draft = scope.is_draft(name)
            if draft:
                drafts.add(name)
            if draft or name == scope.tied:
                also = copies
        for engine_name, part in wanted.get(name, ()):
            _compare_part(held.tensors[engine_name], part, want, tally, f"{when}{engine_name}{part.describe()}")
            if also is not None:
                _compare_part(held.tensors[engine_name], part, want, also, f"{when}{engine_name}{part.describe()}")
        if name not in wanted:
            dropped.append(name)
    if copies is not None and scope is not None:
        _copies_held(wanted, seen, drafts, scope, copies, when)
    for name in sorted(set(wanted) - seen):
        for engine_name, part in wanted[name]:
            tally.fail(f"{when}{engine_name}{part.describe()}: the reference has no tensor {part.hf_name!r}")
    dropped = sorted(set(dropped))
    if dropped:
        # the oracle sees only the declared parts: a tensor held under no part is as good as never loaded
        bare = sorted(n for n in held.tensors if not held.parts.get(n))
        tally.fail(
            f"{when}dropped: {len(dropped)} reference tensor(s) that no declared part names: {few(dropped)} "
            + (f"(the receiver holds {len(bare)} tensor(s) with no parts, e.g. {few(bare)}: " if bare else "(")
            + "Held.parts must cover every reference tensor)",
            n=len(dropped),
        )
    if tally.checked == 0:
        tally.fail(f"{when}the receiver held no tensor: nothing compared")
    return tally


def _copies_held(wanted, seen: set[str], drafts: set[str], scope: CopiesScope, copies: Tally, when: str) -> None:
    """``receiver_copies``' own requirements: a tied head held beside the embedding, every MTP tensor held."""
    if scope.tied is not None:
        holders = {engine for engine, _ in wanted.get(scope.tied, ())}
        if scope.tied not in seen:
            copies.fail(f"{when}the model ties its output head to {scope.tied!r}, which the reference does not export")
        elif len(holders) < 2:
            copies.fail(
                f"{when}the model ties its output head to {scope.tied!r}, but the receiver holds it only as "
                f"{sorted(holders)}: no output head (a copy or a shared tensor) is declared, so a head left "
                f"stale after a sync would go unseen"
            )
    if scope.mtp_layers:
        missing = sorted(n for n in drafts if n not in wanted)
        if not drafts:
            copies.fail(
                f"{when}the model has {scope.mtp_layers} MTP layer(s), but the reference exports none of "
                f"their tensors: the draft weights cannot be checked"
            )
        elif missing:
            copies.fail(
                f"{when}{len(missing)} MTP (draft) tensor(s) the receiver does not hold: {few(missing)}", n=len(missing)
            )


# --- the fused-layout receiver (vLLM's names and layouts) -----------------------------------------------------

_QKV = re.compile(r"^(?P<pre>.*\.self_attn)\.(?P<which>[qkv])_proj\.(?P<kind>weight|bias)$")
_EXPERT = re.compile(r"^(?P<pre>.*\.experts)\.(?P<e>\d+)\.(?P<which>gate|up|down)_proj\.weight$")
_GATE_UP = re.compile(r"^(?P<pre>.*)\.(?P<which>gate|up)_proj\.weight$")


def _slot(name: str) -> tuple[str, tuple]:
    """``(engine name, order key)`` of HF tensor ``name`` in the fused layout."""
    if m := _QKV.match(name):
        return f"{m['pre']}.qkv_proj.{m['kind']}", (None, "qkv".index(m["which"]))
    if m := _EXPERT.match(name):
        if m["which"] == "down":
            return f"{m['pre']}.w2_weight", (int(m["e"]), 0)
        return f"{m['pre']}.w13_weight", (int(m["e"]), ("gate", "up").index(m["which"]))
    if m := _GATE_UP.match(name):
        return f"{m['pre']}.gate_up_proj.weight", (None, ("gate", "up").index(m["which"]))
    return name, (None, 0)


def fused_layout(
    shapes: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
) -> tuple[dict[str, tuple[tuple[int, ...], torch.dtype]], dict[str, tuple[Part, ...]]]:
    """``(engine name -> (shape, dtype), engine name -> parts)`` of the fused layout for HF ``shapes``."""
    groups: dict[str, list[tuple[tuple, str]]] = {}
    for name in shapes:
        engine, key = _slot(name)
        groups.setdefault(engine, []).append((key, name))
    buffers: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    parts: dict[str, tuple[Part, ...]] = {}
    for engine, members in groups.items():
        members.sort()
        dtypes = {shapes[n][1] for _, n in members}
        if len(dtypes) != 1:
            raise UsageError(f"receiver fused: {engine} fuses tensors of dtypes {sorted(map(str, dtypes))}")
        stacked = members[0][0][0] is not None
        per_index: dict[int | None, list[str]] = {}
        for (index, _), n in members:
            per_index.setdefault(index, []).append(n)
        out: tuple[int, ...] | None = None
        layout: list[Part] = []
        for index, names in per_index.items():
            start = 0
            for n in names:
                shape = shapes[n][0]
                layout.append(Part(hf_name=n, index=index, start=start, length=shape[0] if len(names) > 1 else None))
                start += shape[0]
            rest = shapes[names[0]][0][1:]
            one = (start, *rest)
            if out is not None and out != one:
                raise UsageError(f"receiver fused: {engine} stacks unequal experts: {out} vs {one}")
            out = one
        assert out is not None, "every engine tensor fuses at least one HF tensor"
        shape = (len(per_index), *out) if stacked else out
        if stacked and set(per_index) != set(range(len(per_index))):
            raise UsageError(f"receiver fused: {engine} expert ids are not 0..{len(per_index) - 1}")
        buffers[engine], parts[engine] = (shape, dtypes.pop()), tuple(layout)
    return buffers, parts


class FusedReceiver:
    """Loads an export into preallocated fused buffers, as vLLM lays them out; a later ``load`` (a weight sync)
    writes into the same buffers. Buffers start as NaN (floating) or -1, so a tensor never loaded shows.

    ``tied``: the embedding's HF name where the model ties its output head to it and the export sends no head: the
    engine keeps its own ``lm_head.weight`` buffer, copied from the embedding on every load. ``sleep()`` backs every
    buffer up and clears it (vLLM's sleep mode, level 1); ``wake_up()`` restores that backup."""

    HEAD = "lm_head.weight"

    def __init__(self, *, tied: str | None = None) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self.parts: dict[str, tuple[Part, ...]] = {}
        self._where: dict[str, tuple[str, Part]] = {}
        self._tied = tied
        self._backup: dict[str, torch.Tensor] | None = None

    def allocate(self, shapes: Mapping[str, tuple[tuple[int, ...], torch.dtype]]) -> None:
        buffers, self.parts = fused_layout(shapes)
        tied = self._tied
        if tied is not None and tied in shapes and self.HEAD not in shapes:
            buffers[self.HEAD], self.parts[self.HEAD] = shapes[tied], (Part(hf_name=tied),)
        self.tensors = {
            e: torch.full(s, float("nan") if d.is_floating_point else -1, dtype=d) for e, (s, d) in buffers.items()
        }
        self._where = {
            p.hf_name: (e, p) for e, ps in self.parts.items() for p in ps if e != self.HEAD or p.hf_name == self.HEAD
        }

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Copy one HF tensor into its place (``copy_``: cast to the buffer's dtype, as an engine's loader does)."""
        if name not in self._where:
            raise UsageError(f"receiver fused: weight sync sent {name!r}, which the first load did not")
        engine, part = self._where[name]
        part.view(self.tensors[engine]).copy_(tensor)
        if name == self._tied and self.HEAD in self.tensors and self.HEAD not in self._where:
            self.copy_head(tensor)

    def copy_head(self, embedding: torch.Tensor) -> None:
        """The engine's own output head, copied from the tied embedding."""
        self.tensors[self.HEAD].copy_(embedding)

    def sleep(self) -> None:
        """Back every buffer up and clear it (NaN, or -1), as an engine frees its weights' memory."""
        self._backup = {e: t.clone() for e, t in self.tensors.items()}
        for t in self.tensors.values():
            t.fill_(float("nan") if t.is_floating_point() else -1)

    def wake_up(self) -> Held:
        """Restore the buffers from the backup ``sleep`` took."""
        if self._backup is None:
            raise UsageError("receiver fused: wake_up() without sleep()")
        for e, t in self.tensors.items():
            t.copy_(self._backup[e])
        self._backup = None
        return Held(tensors=self.tensors, parts=self.parts)

    def load(self, stream: Iterable[tuple[str, torch.Tensor]]) -> Held:
        if self.tensors:  # a weight sync: written as it streams in
            for name, tensor in stream:
                self.write(name, tensor)
            return Held(tensors=self.tensors, parts=self.parts)
        items = list(stream)  # the first load lays the buffers out from every shape
        self.allocate({n: (tuple(t.shape), t.dtype) for n, t in items})
        items.reverse()
        while items:  # in the order sent, each sent tensor dropped once copied in
            name, tensor = items.pop()
            self.write(name, tensor)
        return Held(tensors=self.tensors, parts=self.parts)


def fused(*, hf_path=None, **_options) -> FusedReceiver:
    """The built-in ``fused`` receiver (with an output head copied from the embedding where the model ties them)."""
    return FusedReceiver(tied=copies_scope(hf_path).tied)


class SubjectExport:
    """Rank 0's sink for what the subject streamed (``Collector``'s ``sink``): merged tensors by name, handed to
    the receiver as a stream that lets each go as it is taken, so the receiver's copy replaces this one."""

    def __init__(self) -> None:
        self._tensors: dict[str, torch.Tensor] = {}

    def __call__(self, name: str, tensor: torch.Tensor) -> None:
        self._tensors[name] = tensor

    def __len__(self) -> int:
        return len(self._tensors)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        while self._tensors:
            name = next(iter(self._tensors))
            yield name, self._tensors.pop(name)


def _make(factory, kwargs: dict, *, rank: int, world_size: int):
    """``factory(**kwargs, rank=, world_size=)``; a factory written before receivers ran on every rank (without
    ``rank`` / ``world_size`` parameters or ``**kwargs``) is called as before, without them."""
    extra = {"rank": rank, "world_size": world_size}
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):  # no signature to read: call it the documented way
        return factory(**kwargs, **extra)
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        extra = {k: v for k, v in extra.items() if k in params}
    return factory(**kwargs, **extra)


class ReceiverRun:
    """The receiver subchecks of one export check: the receiver loads what the SUBJECT streamed (its pieces as the
    oracle merged them on rank 0: ``sink`` before each ``run_subject``), and what it holds is compared with a fresh
    reference export, streamed tensor by tensor (``check`` after each ``run_subject``, with the weights as they
    were exported).

    A receiver is made on EVERY rank (the factory gets ``rank`` and ``world_size``, as an engine's TP/EP workers
    would), and rank 0 broadcasts the merged stream to every rank: each rank's receiver loads it and is compared
    with that rank's own reference export. Rank 0's verdicts are ``receiver``, ``receiver_repeat``,
    ``receiver_reload``, ``receiver_wake`` and ``receiver_copies``; every other rank's are gathered into
    ``receiver_ranks`` (``finish``), so an engine worker other than the first that keeps old weights is seen.

    - ``receiver_repeat``: after every load (the first, and with ``refresh`` the weight sync), the same export
      loaded a second time (a sync of unchanged weights, a retried update) must reproduce every held tensor as that
      load left them (before any sleep/wake cycle, whose faults are ``receiver_wake``'s alone), each repeat judged
      against the load before it: a loader that re-applies a layout shuffle on every load passes the first load and
      fails here, and one that answers a repeat from state captured at the first repeat fails the second;
    - ``receiver_wake``: after every load, where the receiver has ``sleep()`` and ``wake_up()`` (vLLM's sleep
      mode), a sleep/wake cycle must give back the bits held before it (not a backup of older weights, nor one taken
      at the first sleep only);
    - ``receiver_copies``: where the model ties its output head to the embedding or has MTP (draft) layers, the
      engine must hold them (a tied head as a part naming the embedding beside the embedding's own, every MTP tensor
      as a part), and they are compared bit for bit after every load: a tied ``lm_head`` copied once and left stale,
      or a draft model the sync never reaches, fails here.
    """

    def __init__(self, factory, sctx) -> None:
        self._sctx = sctx
        self._receiver = _make(
            factory, {**sctx.options, "hf_path": sctx.hf_path}, rank=sctx.rank, world_size=sctx.world_size
        )
        self._subject: SubjectExport | None = None
        self._held: Held | None = None
        self._scope = copies_scope(sctx.hf_path)
        self._mine: dict[str, Tally] = {}  # this rank's verdicts, by subcheck
        self.tallies: dict[str, Tally] = {}  # rank 0's result, after ``finish``

    def sink(self) -> SubjectExport | None:
        """A fresh sink for the next ``run_subject`` (None on ranks other than 0)."""
        self._subject = SubjectExport() if self._sctx.rank == 0 else None
        return self._subject

    def skip(self, name: str, why: str) -> None:
        self._mine[name] = Tally()
        self._mine[name].fail(f"skipped: {why}")

    def check(
        self, name: str, export: dict[str, Tally], *, when: str = "", repeat: bool = False, wake: bool = False
    ) -> None:
        """Load the subject's export just merged into every rank's receiver and compare what it holds (every rank
        calls it); ``wake``: then a sleep/wake cycle (``receiver_wake``); ``repeat``: then load the same export
        again (``receiver_repeat``). Both run after every load the check makes, each judged against that load, one
        verdict per subcheck over every cycle: a receiver's state captured at the first cycle and reused cannot
        pass the second."""
        sctx = self._sctx
        tally = self._mine[name] = Tally()
        copies = self._mine.setdefault("receiver_copies", Tally()) if self._scope.applies else None
        items, why = self._stream(export)
        reference = sctx.bridge.export_hf_weights(sctx.model_chunks, cpu=True, show_progress=False)
        held = None
        if items is None:
            tally.fail(f"{when}skipped: {why}")
        else:
            try:
                held = self._held = self._receiver.load(iter(items))
            except Exception as exc:  # noqa: BLE001 - the engine refusing the subject's export is a finding
                tally.fail(f"{when}the receiver could not load the subject's export: {type(exc).__name__}: {exc}")
        if held is None or items is None:  # (items is None: nothing was loaded)
            for _ in reference:
                pass
            if repeat:
                self.skip("receiver_repeat", "the first load did not complete")
            return
        compare(held, reference, tally, when=when, copies=copies, scope=self._scope)
        if not (wake or repeat):
            return
        # what this load left: sleep/wake must give it back, and loading the same export again must reproduce it
        loaded = _snapshot(held)
        after = "the weight sync" if name == "receiver_reload" else "the first load"
        if wake:
            held = self._wake(held, loaded, after)
        if repeat:
            self._repeat(held, items, loaded, after)

    def _stream(self, export: dict[str, Tally]) -> tuple[list | None, str]:
        """Every rank's copy of what the subject streamed (rank 0's merged tensors, broadcast), or None and why."""
        sctx = self._sctx
        ok = bool(export["lockstep"].passed)
        if sctx.world_size == 1:
            subject, self._subject = self._subject, None
            if not ok:
                return None, "lockstep failed, the subject's export was not merged"
            assert subject is not None, "rank 0 streams into the sink() it was handed"
            return list(subject), ""
        group = wire.control_group(float(sctx.timeout_s))
        header = None
        if sctx.rank == 0:
            merged = list(self._subject) if ok and self._subject is not None else []
            header = {"ok": ok, "tensors": [[n, list(t.shape), str(t.dtype).removeprefix("torch.")] for n, t in merged]}
        header = wire.broadcast_json(header, group=group, rank=sctx.rank)
        self._subject = None
        if not header["ok"]:
            return None, "lockstep failed on rank 0, the subject's export was not merged"
        items = []
        for i, (name, shape, dtype) in enumerate(header["tensors"]):
            mine = merged[i][1] if sctx.rank == 0 else None
            items.append(
                (
                    name,
                    wire.broadcast_tensor(
                        mine, shape=tuple(shape), dtype=getattr(torch, dtype), group=group, rank=sctx.rank
                    ),
                )
            )
        return items, ""

    def _repeat(self, held: Held, items: list, loaded: dict[str, torch.Tensor], after: str) -> None:
        tally = self._mine.setdefault("receiver_repeat", Tally())  # one verdict over every cycle
        self._held = load_again(self._receiver, held, items, loaded, tally, after=after) or held

    def _wake(self, held: Held, loaded: dict[str, torch.Tensor], after: str) -> Held:
        """The cycle after a load (``held``: what the receiver holds now); returns what it holds after."""
        tally = self._mine.setdefault("receiver_wake", Tally())  # one verdict over every cycle
        self._held = sleep_wake(self._receiver, held, loaded, tally, after=after) or held
        return self._held

    def finish(self) -> dict[str, Tally]:
        """Rank 0's verdicts under their names and every other rank's gathered into ``receiver_ranks`` (every rank
        calls it); the result (rank 0's) is also ``tallies``."""
        sctx = self._sctx
        mine = self._mine
        if "receiver_copies" not in mine and not self._scope.applies:
            mine["receiver_copies"] = Tally()
            mine["receiver_copies"].skip("the model ties no output head to its embedding and has no MTP layers")
        if sctx.world_size == 1:
            ranks = Tally()
            ranks.skip("one rank: rank 0's receiver is every rank's")
            self.tallies = {**mine, "receiver_ranks": ranks}
            return self.tallies
        group = wire.control_group(float(sctx.timeout_s))
        gathered = wire.gather_json(
            {k: t.as_dict() for k, t in mine.items()}, group=group, rank=sctx.rank, world_size=sctx.world_size
        )
        if gathered is None:  # not rank 0
            self.tallies = {}
            return self.tallies
        ranks = Tally()
        for r, theirs in enumerate(gathered[1:], start=1):
            for name, sub in theirs.items():
                if sub.get("not_applicable"):
                    continue
                if sub["passed"]:
                    ranks.ok(max(sub["checked"], 1))
                for message in sub["failures"]:
                    ranks.fail(f"rank {r}: {name}: {message}")
        self.tallies = {**mine, "receiver_ranks": ranks}
        return self.tallies


def _snapshot(held: Held) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in held.tensors.items()}


def sleep_wake(
    receiver, held: Held, loaded: Mapping[str, torch.Tensor], tally: Tally, *, after: str = "the weight sync"
) -> Held | None:
    """``receiver_wake``: a ``sleep()`` / ``wake_up()`` cycle must give back ``loaded`` (the bits the last load left,
    snapshotted); returns what the receiver holds after it (None where it has no cycle or the cycle raised). The
    check runs it after every load (``after`` names which), each cycle judged against the load before it: a backup
    taken at the first sleep only (verl #7904) gives the first cycle back right and the second one wrong."""
    sleep, wake_up = getattr(receiver, "sleep", None), getattr(receiver, "wake_up", None)
    if not (callable(sleep) and callable(wake_up)):
        if not tally.checked and not tally.failures:
            tally.skip("the receiver has no sleep() and wake_up(): no reload cycle to check")
        return None
    try:
        sleep()
        held = wake_up() or held
    except Exception as exc:  # noqa: BLE001 - a failing cycle is a finding
        tally.fail(f"sleep/wake after {after}: the receiver raised {type(exc).__name__}: {exc}")
        return None
    same_held(held, loaded, tally, when=f"after sleep/wake following {after}: ")
    return held


def load_again(
    receiver,
    held: Held,
    items: list,
    loaded: Mapping[str, torch.Tensor],
    tally: Tally,
    *,
    after: str = "the weight sync",
) -> Held | None:
    """``receiver_repeat``: loading the same export ``items`` again must reproduce ``loaded`` (the bits its first
    load left, snapshotted before any sleep/wake cycle), whatever the receiver held just before: a repeat that
    restores what a broken sleep/wake cycle changed passes, the cycle is ``receiver_wake``'s finding. A tensor the
    cycle changed and the repeat left as the cycle gave it is not judged here (``receiver_wake`` reports it). The
    check repeats every load (``after`` names which), each judged against that load."""
    started = _snapshot(held)
    try:
        again = receiver.load(iter(items))
    except Exception as exc:  # noqa: BLE001 - a receiver that refuses a second load of the same export
        tally.fail(f"loading the export of {after} again: the receiver raised {type(exc).__name__}: {exc}")
        return None
    same_held(again, loaded, tally, when=f"after loading the export of {after} a second time: ", started=started)
    return again


def same_held(
    held: Held,
    before: Mapping[str, torch.Tensor],
    tally: Tally,
    *,
    when: str,
    started: Mapping[str, torch.Tensor] | None = None,
) -> Tally:
    """Every tensor in ``before`` still held with the same shape, dtype and bits; ``when`` prefixes each message.

    ``started``: what was held just before the step judged, where something else (a sleep/wake cycle) may have
    changed it since ``before``: a tensor that differs from ``before`` there and that the step left exactly as it
    was is not judged (nor counted): the step did not change it, the earlier change is another subcheck's."""
    unjudged = 0
    for name in sorted(before):
        got = held.tensors.get(name)
        if got is None:
            tally.fail(f"{when}{name}: no longer held")
        elif tuple(got.shape) != tuple(before[name].shape) or got.dtype != before[name].dtype:
            tally.fail(
                f"{when}{name}: held {tuple(got.shape)} {got.dtype}, before {tuple(before[name].shape)} "
                f"{before[name].dtype}"
            )
        elif _same_bits(got, before[name]):
            tally.ok()
        elif _left_as_started(got, before[name], None if started is None else started.get(name)):
            unjudged += 1
        else:
            tally.fail(f"{when}{_changed(held, name, got, before[name])}")
    if tally.checked == 0 and not unjudged:
        tally.fail(f"{when}the receiver held no tensor: nothing compared")
    elif tally.checked == 0:
        tally.skip(f"{when}every tensor was changed before this step and left as it was: see receiver_wake")
    return tally


def _changed(held: Held, engine_name: str, got: torch.Tensor, before: torch.Tensor) -> str:
    """Where engine tensor ``engine_name`` changed, named by the HF tensor of its first changed part as ``compare``
    names it (``w2_weight[0] = ...experts.0.down_proj.weight``), the engine tensor alone where no part changed."""
    changed = []
    for part in held.parts.get(engine_name, ()):
        try:
            now, then = part.view(got), part.view(before)
        except (IndexError, RuntimeError):
            continue
        if not _same_bits(now, then):
            changed.append((part, now, then))
    if not changed:
        return f"{engine_name}: {_first_difference(got, before).replace('reference', 'before')}"
    part, now, then = changed[0]
    also = more(len(changed), 1, what=f"part(s) of {engine_name} changed")
    return f"{engine_name}{part.describe()}: {_first_difference(now, then).replace('reference', 'before')}{also}"


def _left_as_started(got: torch.Tensor, before: torch.Tensor, started: torch.Tensor | None) -> bool:
    """Whether ``got`` is ``started`` unchanged, and ``started`` already differed from ``before``."""
    return (
        started is not None
        and tuple(started.shape) == tuple(got.shape)
        and started.dtype == got.dtype
        and _same_bits(got, started)
        and not _same_bits(started, before)
    )


@dataclasses.dataclass(frozen=True)
class CopiesScope:
    """What ``receiver_copies`` covers for a model: its tied embedding, and its MTP layers' HF names."""

    tied: str | None  # the embedding's HF name where the output head is tied to it
    mtp_layers: int
    num_layers: int

    @property
    def applies(self) -> bool:
        return self.tied is not None or self.mtp_layers > 0

    def is_draft(self, hf_name: str) -> bool:
        """Whether ``hf_name`` belongs to an MTP layer (``mtp.*``, or ``model.layers.N.*`` past the decoder)."""
        if not self.mtp_layers:
            return False
        if hf_name.startswith("mtp."):
            return True
        m = _LAYER.match(hf_name)
        return m is not None and int(m[1]) >= self.num_layers


_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_EMBEDDING = "model.embed_tokens.weight"


def copies_scope(hf_path: str | Path | None) -> CopiesScope:
    """``CopiesScope`` of the HF checkpoint at ``hf_path`` (none without a ``config.json``), read as every check reads
    a model: its traits (``moeverify.spec.models.traits``) and shape."""
    path = Path(hf_path) / "config.json" if hf_path is not None else None
    if path is None or not path.is_file():
        return CopiesScope(tied=None, mtp_layers=0, num_layers=0)
    config = json.loads(path.read_text())
    traits = traits_of(config, where=str(path))
    return CopiesScope(
        tied=_EMBEDDING if traits.tied_embeddings else None,
        mtp_layers=traits.mtp_layers,
        num_layers=shape_of(config, where=str(path)).num_layers,
    )


__all__ = [
    "Held",
    "Part",
    "RECEIVERS",
    "FusedReceiver",
    "ReceiverRun",
    "SubjectExport",
    "compare",
    "fused",
    "fused_layout",
    "load_again",
    "load_receiver",
    "same_held",
    "sleep_wake",
]
