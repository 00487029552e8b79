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
import re
from collections.abc import Iterable, Iterator, Mapping

import torch

from moeverify.spec import plugins
from moeverify.errors import UsageError
from moeverify.oracles.results import Tally
from moeverify.spec.checks import RECEIVERS

SHOW = 8  # names quoted per message


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
            raise UsageError(f"receiver: parts name engine tensors it does not hold: {missing[:SHOW]}")


def load_receiver(name: str):
    """The receiver factory for a built-in name, ``package.module:factory`` or ``file.py:factory``."""
    return plugins.load(name, what="receiver", builtins=RECEIVERS)


def _first_difference(got: torch.Tensor, want: torch.Tensor) -> str:
    diff = (got.view(-1) != want.view(-1)) & ~(got.view(-1).isnan() & want.view(-1).isnan()) \
        if got.is_floating_point() else got.view(-1) != want.view(-1)
    flat = int(diff.nonzero()[0].item()) if bool(diff.any()) else -1
    if flat < 0:  # equal values with different bits (-0.0 vs 0.0, NaN payloads)
        bits = got.contiguous().view(-1).view(torch.uint8) != want.contiguous().view(-1).view(torch.uint8)
        flat = int(bits.nonzero()[0].item()) // got.element_size()
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), tuple(got.shape)))
    return (f"{int(diff.sum())} of {got.numel()} element(s) differ, first at {list(index)}: "
            f"held {got.view(-1)[flat].item()!r}, reference {want.view(-1)[flat].item()!r}")


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


def compare(held: Held, reference: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], tally: Tally,
            *, when: str = "") -> Tally:
    """Check ``held`` against the reference HF tensors, bit for bit; ``when`` prefixes each message.

    ``reference`` is a mapping or a stream of ``(name, tensor)`` (an ``export_hf_weights`` pass): each tensor is
    compared with the parts that hold it as it comes, so only one reference tensor is in hand at a time."""
    wanted = _wanted(held)
    seen: set[str] = set()
    dropped: list[str] = []
    for name, want in (reference.items() if isinstance(reference, Mapping) else reference):
        seen.add(name)
        for engine_name, part in wanted.get(name, ()):
            _compare_part(held.tensors[engine_name], part, want, tally, f"{when}{engine_name}{part.describe()}")
        if name not in wanted:
            dropped.append(name)
    for name in sorted(set(wanted) - seen):
        for engine_name, part in wanted[name]:
            tally.fail(f"{when}{engine_name}{part.describe()}: the reference has no tensor {part.hf_name!r}")
    dropped = sorted(set(dropped))
    if dropped:
        more = f" (+{len(dropped) - SHOW} more)" if len(dropped) > SHOW else ""
        tally.fail(f"{when}dropped: {len(dropped)} reference tensor(s) the receiver never loaded: "
                   f"{dropped[:SHOW]}{more}", n=len(dropped))
    if tally.checked == 0:
        tally.fail(f"{when}the receiver held no tensor: nothing compared")
    return tally


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


def fused_layout(shapes: Mapping[str, tuple[tuple[int, ...], torch.dtype]]):
    """``(engine name -> (shape, dtype), engine name -> parts)`` of the fused layout for HF ``shapes``."""
    groups: dict[str, list[tuple[tuple, str]]] = {}
    for name in shapes:
        engine, key = _slot(name)
        groups.setdefault(engine, []).append((key, name))
    buffers, parts = {}, {}
    for engine, members in groups.items():
        members.sort()
        dtypes = {shapes[n][1] for _, n in members}
        if len(dtypes) != 1:
            raise UsageError(f"receiver fused: {engine} fuses tensors of dtypes {sorted(map(str, dtypes))}")
        stacked = members[0][0][0] is not None
        per_index: dict[int | None, list[str]] = {}
        for (index, _), n in members:
            per_index.setdefault(index, []).append(n)
        out, layout = None, []
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
        shape = (len(per_index), *out) if stacked else out
        if stacked and sorted(per_index) != list(range(len(per_index))):
            raise UsageError(f"receiver fused: {engine} expert ids are not 0..{len(per_index) - 1}")
        buffers[engine], parts[engine] = (shape, dtypes.pop()), tuple(layout)
    return buffers, parts


class FusedReceiver:
    """Loads an export into preallocated fused buffers, as vLLM lays them out; a later ``load`` (a weight sync)
    writes into the same buffers. Buffers start as NaN (floating) or -1, so a tensor never loaded shows."""

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self.parts: dict[str, tuple[Part, ...]] = {}
        self._where: dict[str, tuple[str, Part]] = {}

    def allocate(self, shapes: Mapping[str, tuple[tuple[int, ...], torch.dtype]]) -> None:
        buffers, self.parts = fused_layout(shapes)
        self.tensors = {e: torch.full(s, float("nan") if d.is_floating_point else -1, dtype=d)
                        for e, (s, d) in buffers.items()}
        self._where = {p.hf_name: (e, p) for e, ps in self.parts.items() for p in ps}

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Copy one HF tensor into its place (``copy_``: cast to the buffer's dtype, as an engine's loader does)."""
        if name not in self._where:
            raise UsageError(f"receiver fused: weight sync sent {name!r}, which the first load did not")
        engine, part = self._where[name]
        part.view(self.tensors[engine]).copy_(tensor)

    def load(self, stream: Iterable[tuple[str, torch.Tensor]]) -> Held:
        if self.tensors:  # a weight sync: written as it streams in
            for name, tensor in stream:
                self.write(name, tensor)
            return Held(tensors=self.tensors, parts=self.parts)
        items = list(stream)  # the first load lays the buffers out from every shape
        self.allocate({n: (tuple(t.shape), t.dtype) for n, t in items})
        for i, (name, tensor) in enumerate(items):
            items[i] = None  # each sent tensor is dropped once copied in
            self.write(name, tensor)
        return Held(tensors=self.tensors, parts=self.parts)


def fused(**_options) -> FusedReceiver:
    """The built-in ``fused`` receiver."""
    return FusedReceiver()


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


class ReceiverRun:
    """The ``receiver`` subcheck (and ``receiver_reload``) of one export check: the receiver loads what the SUBJECT
    streamed (its pieces as the oracle merged them on rank 0: ``sink`` before each ``run_subject``), and what it
    holds is compared with a fresh reference export, streamed tensor by tensor (``check`` after each
    ``run_subject``, with the weights as they were exported). The receiver is made and loaded on rank 0; every
    rank takes part in each reference export (a collective)."""

    def __init__(self, factory, sctx) -> None:
        self._sctx = sctx
        self._receiver = factory(**{**sctx.options, "hf_path": sctx.hf_path}) if sctx.rank == 0 else None
        self._subject: SubjectExport | None = None
        self.tallies: dict[str, Tally] = {}

    def sink(self) -> SubjectExport | None:
        """A fresh sink for the next ``run_subject`` (None on ranks other than 0)."""
        self._subject = SubjectExport() if self._sctx.rank == 0 else None
        return self._subject

    def skip(self, name: str, why: str) -> None:
        self.tallies[name] = Tally()
        self.tallies[name].fail(f"skipped: {why}")

    def check(self, name: str, export: dict[str, Tally], *, when: str = "") -> Tally:
        """Load the subject's export just merged into the receiver and compare what it holds; every rank calls it."""
        tally = self.tallies[name] = Tally()
        sctx = self._sctx
        reference = sctx.bridge.export_hf_weights(sctx.model_chunks, cpu=True, show_progress=False)
        if self._receiver is None:  # other ranks: their part of the export's collectives
            for _ in reference:
                pass
            return tally
        held = None
        if not export["lockstep"].passed:
            tally.fail(f"{when}skipped: lockstep failed, the subject's export was not merged")
        else:
            try:
                held = self._receiver.load(self._subject)
            except Exception as exc:  # noqa: BLE001 - the engine refusing the subject's export is a finding
                tally.fail(f"{when}the receiver could not load the subject's export: {type(exc).__name__}: {exc}")
        self._subject = None
        if held is None:
            for _ in reference:
                pass
            return tally
        return compare(held, reference, tally, when=when)


__all__ = ["Held", "Part", "RECEIVERS", "FusedReceiver", "ReceiverRun", "SubjectExport", "compare", "fused",
           "fused_layout", "load_receiver"]
