"""The mutant catalogue: injected weight-export bugs the export oracle must catch.

Each mutant is a subject that wraps the reference ``sharded`` exporter and breaks one thing the way
real weight-sync code has broken it. ``fails`` names the subchecks that must fail; ``collateral``
the ones that may fail as a consequence (a skipped row leaves its tensors unwritten, etc.); every
other subcheck must pass. ``applies(traits=, shape=, layout=, world_size=)`` says where the bug is
observable (expert renumbering needs EP, interleaving needs more than one query group per rank, ...), from the
model's traits and shape read from its HF config (``moeverify.spec.models.traits``), never from its name, so a user
model meets the same mutants as the family it resembles.

The docstrings describe bug classes seen in RL weight-sync code (verl, NeMo-RL, slime and others);
they describe, they do not cite.
"""

from __future__ import annotations

import dataclasses
import re
import weakref
from collections.abc import Callable

import torch

from moeverify.oracles.bits import bits
from moeverify.oracles.export.collect import SUBCHECKS
from moeverify.oracles.export.rows import AnySlot, DeferredSlots, ShardRow, Slot
from moeverify.subjects import placement
from moeverify.subjects.gather_all import gather_tensors
from moeverify.subjects.shard_rows import gdn_dims, sharded_rows


@dataclasses.dataclass(frozen=True, kw_only=True)
class Mutant:
    name: str
    fails: tuple[str, ...]
    collateral: tuple[str, ...] = ()
    factory: Callable
    applies: Callable[..., bool] = lambda **_: True
    doc: str = ""


def _rows(ctx):
    _undo_model_writes()  # what writes_model left in the shared model, before the next mutant reads it
    return sharded_rows(ctx)


# (a view of the element writes_model changed, its bits before): undone when the next mutant starts, so that the
# mutants after it in one scenario (they share one built model) read the model as built
_MODEL_WRITES: list[tuple[torch.Tensor, torch.Tensor]] = []


def _undo_model_writes() -> None:
    while _MODEL_WRITES:
        view, before = _MODEL_WRITES.pop()
        view.copy_(before)


def _concrete(row: ShardRow) -> list[AnySlot]:
    return row.slots.materialize() if isinstance(row.slots, DeferredSlots) else list(row.slots)


def _table(row: ShardRow) -> list[tuple[str, tuple[int, ...]]]:
    """The row's slot table (names and shapes), without building its tensors where they are deferred."""
    if isinstance(row.slots, DeferredSlots):
        return row.slots.table
    return [(s.hf_name, tuple(s.hf_shape)) for s in row.slots]


def _rewrap(row: ShardRow, fn, *, table=None) -> ShardRow:
    """The same row with its slots transformed by ``fn(slots) -> slots`` when they are built."""
    table = table if table is not None else _table(row)
    return ShardRow(row.row, DeferredSlots(table, lambda: fn(_concrete(row))), row.contributes)


def _flip_low_bit(values: torch.Tensor, index: int) -> torch.Tensor:
    out = values.clone()
    b = bits(out)
    b[index] ^= 1
    return out


def _ep_size(ctx) -> int:
    return ctx.layout.ep


# -- the mutants ------------------------------------------------------------------------------------
def expert_local_ids(ctx):
    """Experts exported under rank-local ids. Bug class: an EP rank names its experts 0..E/EP-1
    instead of ``ep_rank * E/EP + local`` when streaming to the rollout engine, so every EP rank
    overwrites expert 0's tensors and the other experts are never updated."""

    def fix(slots):
        out = [Slot(s.hf_name, s.hf_shape, s.positions[:0], s.values[:0]) for s in slots]
        names = [s.hf_name for s in slots]
        for s in slots:
            if s.positions.numel():
                per = int(re.search(r"experts\.(\d+)", s.hf_name).group(1)) % max(1, _experts(ctx) // _ep_size(ctx))
                j = names.index(re.sub(r"experts\.(\d+)", f"experts.{per}", s.hf_name, count=1))
                out[j] = Slot(out[j].hf_name, out[j].hf_shape, s.positions, s.values)
        return out

    for row in _rows(ctx):
        yield _rewrap(row, fix) if "@ep" in row.row else row


def _experts(ctx) -> int:
    model = ctx.model_chunks[0]
    while hasattr(model, "module"):
        model = model.module
    return model.config.num_moe_experts or 0


def uncovered_element(ctx):
    """One element never sent. Bug class: an off-by-one in a shard's slice end (``[start:stop-1]``)
    or a vocab-padding trim that cuts a real row, leaving stale weights in the engine."""
    done = False
    for row in _rows(ctx):
        if not done and ctx.rank == 0 and row.contributes:
            slots = _concrete(row)
            full = [i for i, s in enumerate(slots) if s.positions.numel()]
            if full:  # the first row where rank 0 really writes something: drop its last element
                done, i = True, full[0]
                s = slots[i]
                slots[i] = Slot(s.hf_name, s.hf_shape, s.positions[:-1], s.values.reshape(-1)[:-1])
                row = ShardRow(row.row, slots, True)
        yield row


def conflicting_write(ctx):
    """Two ranks both write one element with different bits. Bug class: two ranks both believe they
    own a replicated tensor (a DP replica that has drifted, or a wrong "first rank" test) and both
    push it, so the engine ends with whichever arrived last. Where the last rank holds no replica,
    it writes one of its own elements twice instead."""
    rows = list(_rows(ctx))
    if ctx.rank == ctx.world_size - 1:
        replica = next((i for i, r in enumerate(rows) if not r.contributes), None)
        if replica is not None:
            rows[replica] = ShardRow(rows[replica].row, _changed_first(rows[replica]), True)
        else:
            first = next(i for i, r in enumerate(rows) if r.contributes)
            rows[first] = _rewrap(rows[first], _twice)
    yield from rows


def _changed_first(row):
    def fn(slots):
        out = list(slots)
        for i, s in enumerate(out):
            if s.positions.numel():
                out[i] = Slot(s.hf_name, s.hf_shape, s.positions, _flip_low_bit(s.values.reshape(-1), 0))
                break
        return out

    return DeferredSlots(_table(row), lambda: fn(_concrete(row)))


def _twice(slots):
    out = list(slots)
    for i, s in enumerate(out):
        if s.positions.numel():
            v = s.values.reshape(-1)
            out[i] = Slot(
                s.hf_name,
                s.hf_shape,
                torch.cat([s.positions, s.positions[:1]]),
                torch.cat([v, _flip_low_bit(v[:1], 0)]),
            )
            break
    return out


def extra_row(ctx):
    """One rank yields a row the others do not. Bug class: a rank-local parameter (an MTP head, an
    adapter, a buffer only one stage registers) streamed by one rank only, which hangs a collective
    sync or desynchronises every later tensor."""
    yield from _rows(ctx)
    if ctx.rank == ctx.world_size - 1:
        yield ShardRow("extra.rank_local.weight", [], True)


def different_slot_table(ctx):
    """One rank declares a different shape for a tensor. Bug class: a rank that computed the full
    shape from its local shard (``local * tp`` with the wrong tp, or before vocab padding removal),
    so the receiver allocates the wrong buffer."""
    first = True
    for row in _rows(ctx):
        if first and ctx.rank == ctx.world_size - 1:
            table = [(n, (s[0] + 1, *s[1:])) if i == 0 else (n, s) for i, (n, s) in enumerate(_table(row))]
            row = _rewrap(
                row,
                lambda slots, t=table: [Slot(n, s, x.positions, x.values) for (n, s), x in zip(t, slots, strict=True)],
                table=table,
            )
        first = False
        yield row


def flipped_bit(ctx):
    """One bit flipped in one element on every rank that holds it. Bug class: a lossy transport or an
    in-place op on a shared buffer during sync (e.g. a fused kernel writing into the export view)."""
    first = True
    for row in _rows(ctx):
        if first:

            def fn(slots):
                out = list(slots)
                s = out[0]
                hit = (s.positions == 0).nonzero().flatten()
                if hit.numel():
                    out[0] = Slot(s.hf_name, s.hf_shape, s.positions, _flip_low_bit(s.values.reshape(-1), int(hit[0])))
                return out

            row = _rewrap(row, fn)
        first = False
        yield row


def _map_named(ctx, match: Callable[[str], bool], change: Callable[[torch.Tensor], torch.Tensor]):
    for row in _rows(ctx):
        if any(match(n) for n, _ in _table(row)):
            row = _rewrap(
                row,
                lambda slots: [
                    Slot(s.hf_name, s.hf_shape, s.positions, change(s.values)) if match(s.hf_name) else s for s in slots
                ],
            )
        yield row


def fp32_through_bf16(ctx):
    """DeepSeek-V3's fp32 ``e_score_correction_bias`` squeezed through bf16 and back to fp32. Bug class:
    a sync path that casts the whole state dict to the engine's bf16 dtype, losing the router bias's
    low bits while dtype checks still see fp32."""
    yield from _map_named(
        ctx, lambda n: n.endswith("e_score_correction_bias"), lambda v: v.to(torch.bfloat16).to(v.dtype)
    )


def bias_sent_as_bf16(ctx):
    """The fp32 router bias sent as bf16. Bug class: the same cast, without casting back: the engine
    receives a tensor of the wrong dtype."""
    yield from _map_named(ctx, lambda n: n.endswith("e_score_correction_bias"), lambda v: v.to(torch.bfloat16))


def qkv_concatenated(ctx):
    """Fused QKV split as ``[q_all; k_all; v_all]`` instead of interleaved per query group. Bug class:
    a converter that treats Megatron's per-group ``[q heads, k, v]`` layout as plain concatenation;
    invisible with one query group per rank, wrong otherwise."""

    def fn(slots):
        q, k, v = slots
        if not q.positions.numel():
            return slots
        n_q, n_k = q.values.numel(), k.values.numel()
        groups, heads = _local_groups(ctx), n_q // n_k
        per = n_k // groups
        w = torch.cat(
            [q.values.reshape(groups, heads, per), k.values.reshape(groups, 1, per), v.values.reshape(groups, 1, per)],
            dim=1,
        ).reshape(-1)  # Megatron's local layout
        return [
            Slot(q.hf_name, q.hf_shape, q.positions, w[:n_q]),
            Slot(k.hf_name, k.hf_shape, k.positions, w[n_q : n_q + n_k]),
            Slot(v.hf_name, v.hf_shape, v.positions, w[n_q + n_k :]),
        ]

    for row in _rows(ctx):
        yield _rewrap(row, fn) if row.row.endswith("linear_qkv.weight") else row


def _local_groups(ctx) -> int:
    model = ctx.model_chunks[0]
    while hasattr(model, "module"):
        model = model.module
    return model.config.num_query_groups // ctx.layout.tp


def gate_up_swapped(ctx):
    """Gate and up projections exchanged. Bug class: splitting Megatron's fused ``[gate; up]`` fc1 in the
    wrong order (or per TP shard vs globally), so SiLU is applied to the up projection."""

    def fn(slots):
        out = list(slots)
        full = [i for i, s in enumerate(out) if s.positions.numel()]
        gates = [i for i in full if "gate_proj" in out[i].hf_name]
        ups = [i for i in full if "up_proj" in out[i].hf_name]
        for g, u in zip(gates, ups, strict=True):
            a, b = out[g], out[u]
            out[g], out[u] = (
                Slot(a.hf_name, a.hf_shape, a.positions, b.values),
                Slot(b.hf_name, b.hf_shape, b.positions, a.values),
            )
        return out

    for row in _rows(ctx):
        names = [n for n, _ in _table(row)]
        yield _rewrap(row, fn) if any("gate_proj" in n for n in names) else row


def tied_embedding_dropped(ctx):
    """The tied embedding never sent. Bug class: a sync that skips ``embed_tokens`` because the output
    layer "already shares it", or sends only the last stage's output-layer copy under PP."""
    for row in _rows(ctx):
        if not row.row.endswith("embedding.word_embeddings.weight"):
            yield row


def key_renamed(ctx):
    """One HF name misspelt. Bug class: a hand-written name map out of date with the engine's names
    (``model.norm`` vs ``model.final_layernorm``): the engine ignores the unknown key silently."""
    for row in _rows(ctx):
        if any(n == "model.norm.weight" for n, _ in _table(row)):
            table = [("model.final_norm.weight" if n == "model.norm.weight" else n, s) for n, s in _table(row)]
            row = _rewrap(
                row,
                lambda slots, t=table: [Slot(n, s, x.positions, x.values) for (n, s), x in zip(t, slots, strict=True)],
                table=table,
            )
        yield row


def extra_key(ctx):
    """A key the model does not have. Bug class: exporting an internal buffer (rotary inv_freq, an
    expert-load counter) that the engine rejects or, worse, loads into an unrelated slot."""
    yield from _rows(ctx)
    pos = torch.arange(4, dtype=torch.int64) if ctx.rank == 0 else torch.empty(0, dtype=torch.int64)
    yield ShardRow("extra.buffer", [Slot("model.extra_buffer", (4,), pos, torch.zeros(pos.numel()))], ctx.rank == 0)


def diverged_replica(ctx):
    """A data-parallel replica that differs from the copy that is sent. Bug class: ranks that skipped an
    optimizer step or a broadcast (expert-DP or tied embedding copies out of sync), invisible when
    only one rank's copy is exported."""
    done = False
    for row in _rows(ctx):
        if not done and not row.contributes and ctx.rank == ctx.world_size - 1:
            done = True
            row = ShardRow(row.row, _changed_first(row), False)
        yield row


def writes_model(ctx):
    """The lowest bit of one element of one parameter (the last rank's first) flipped in place while exporting.
    Bug class: a converter that applies a norm offset, a scale or a cast to the parameter itself instead of to its
    copy; the reference export, read after the subject, sees the changed model and agrees with it. The next mutant
    undoes the write (``_rows``): the mutants of a scenario share one model."""
    yield from _rows(ctx)
    if ctx.rank == ctx.world_size - 1:
        param = next(p for chunk in ctx.model_chunks for p in chunk.parameters() if p.numel())
        element = param.data.view(-1)[:1]
        _MODEL_WRITES.append((element, element.clone()))
        element.copy_(_flip_low_bit(element.clone(), 0))


def raises_mid_stream(ctx):
    """A rank that raises half way through. Bug class: an exporter that crashes on one rank (an
    unsupported mapping, OOM on a large tensor) while the others wait in a collective forever."""
    rows = list(_rows(ctx))
    for i, row in enumerate(rows):
        if ctx.rank == ctx.world_size - 1 and i == len(rows) // 2:
            raise RuntimeError(f"injected failure at row {i} ({row.row})")
        yield row


def _hybrid(*, traits, shape, layout, world_size) -> bool:
    return traits.linear_attention


def gdn_in_proj_flat(ctx):
    """Qwen3-Next's gated delta net in_proj written as flat ``[q; k; v; z]`` and ``[b; a]`` instead of grouped
    per key head. Bug class: a converter written for Qwen3.5's separate, flat projections reused for Qwen3-Next,
    whose ``in_proj_qkvz``/``in_proj_ba`` interleave each key head's q, k, v, z (b, a)."""

    model = ctx.model_chunks[0]
    while hasattr(model, "module"):
        model = model.module
    dims = gdn_dims(model.config)

    def moved(tensor: str):  # grouped HF row -> flat HF row, over the whole tensor
        sections = "qkvz" if tensor == "qkvz" else "ba"
        sizes = {
            "q": dims.nk * dims.dk,
            "k": dims.nk * dims.dk,
            "v": dims.nv * dims.dv,
            "z": dims.nv * dims.dv,
            "b": dims.nv,
            "a": dims.nv,
        }
        perm: dict[int, int] = {}
        start = 0
        for sec in sections:
            j = torch.arange(sizes[sec])
            perm.update(zip(placement.gdn_grouped_row(dims, sec, j).tolist(), (start + j).tolist(), strict=True))
            start += sizes[sec]
        return torch.tensor([perm[i] for i in range(start)])

    perms = {t: moved(t) for t in ("qkvz", "ba")}

    def fn(slots):
        out = []
        for slot in slots:
            tensor = "qkvz" if slot.hf_name.endswith("in_proj_qkvz.weight") else "ba"
            inner = slot.hf_shape[-1]
            rows = perms[tensor][slot.positions // inner]
            out.append(Slot(slot.hf_name, slot.hf_shape, rows * inner + slot.positions % inner, slot.values))
        return out

    for row in _rows(ctx):
        yield _rewrap(row, fn) if row.row.endswith("self_attention.in_proj.weight") else row


def zero_centered_norm_unshifted(ctx):
    """The gated delta net's output norm sent as Megatron holds it (``weight - 1``, its norm scales by
    ``1 + weight``) while HF's ``linear_attn.norm`` scales by ``weight``. Bug class: an exporter that copies
    every norm as is, unaware that one of a family's norms is zero-centered in Megatron and not in HF."""
    yield from _map_named(ctx, lambda n: n.endswith("linear_attn.norm.weight"), lambda v: v - 1)


def _last_rank_has_replica(*, traits, shape, layout, world_size) -> bool:
    return layout.dp(world_size) > 1 or layout.tp > 1 or (traits.tied_embeddings and layout.pp > 1)


# every subcheck a lockstep failure skips (each is then failed "skipped: lockstep failed")
_AFTER_LOCKSTEP = SUBCHECKS[1:]

MUTANTS: tuple[Mutant, ...] = (
    Mutant(
        name="expert_local_ids",
        fails=("conflicts", "coverage"),
        collateral=("bitwise", "replicas"),
        factory=expert_local_ids,
        applies=lambda *, traits, shape, layout, world_size: layout.ep > 1,
    ),
    Mutant(name="uncovered_element", fails=("coverage",), factory=uncovered_element),
    Mutant(
        name="conflicting_write", fails=("conflicts",), collateral=("bitwise", "replicas"), factory=conflicting_write
    ),
    Mutant(name="extra_row", fails=("lockstep",), collateral=_AFTER_LOCKSTEP, factory=extra_row),
    Mutant(
        name="different_slot_table",
        fails=("slot_tables",),
        collateral=("coverage", "key_set"),
        factory=different_slot_table,
    ),
    Mutant(name="flipped_bit", fails=("bitwise",), factory=flipped_bit),
    Mutant(
        name="fp32_through_bf16",
        fails=("bitwise",),
        factory=fp32_through_bf16,
        applies=lambda *, traits, shape, layout, world_size: traits.expert_bias,
    ),
    Mutant(
        name="bias_sent_as_bf16",
        fails=("shape_dtype",),
        collateral=("bitwise",),
        factory=bias_sent_as_bf16,
        applies=lambda *, traits, shape, layout, world_size: traits.expert_bias,
    ),
    Mutant(
        name="qkv_concatenated",
        fails=("bitwise",),
        factory=qkv_concatenated,
        applies=lambda *, traits, shape, layout, world_size: not traits.mla and shape.num_query_groups // layout.tp > 1,
    ),
    Mutant(name="gate_up_swapped", fails=("bitwise",), factory=gate_up_swapped),
    Mutant(
        name="tied_embedding_dropped",
        fails=("key_set", "coverage"),
        factory=tied_embedding_dropped,
        applies=lambda *, traits, shape, layout, world_size: traits.tied_embeddings,
    ),
    Mutant(name="key_renamed", fails=("key_set", "coverage"), factory=key_renamed),
    Mutant(name="extra_key", fails=("key_set",), factory=extra_key),
    Mutant(name="diverged_replica", fails=("replicas",), factory=diverged_replica, applies=_last_rank_has_replica),
    Mutant(
        name="gdn_in_proj_flat",
        fails=("bitwise",),
        factory=gdn_in_proj_flat,
        applies=lambda *, traits, shape, layout, world_size: traits.gdn_in_proj == "grouped",
    ),
    Mutant(
        name="zero_centered_norm_unshifted", fails=("bitwise",), factory=zero_centered_norm_unshifted, applies=_hybrid
    ),
    # the written element may be a replica the last rank sends (a DP or PP copy): replicas may see it too
    Mutant(name="writes_model", fails=("model_intact",), collateral=("replicas",), factory=writes_model),
    Mutant(name="raises_mid_stream", fails=("lockstep",), collateral=_AFTER_LOCKSTEP, factory=raises_mid_stream),
)


# -- stale state between exports: caught by ``refresh`` (a second export after a weight update) -------------
_STALE: dict[str, weakref.WeakKeyDictionary] = {}


def _cache(ctx, kind: str) -> dict:
    """Per model (the first chunk, weakly held) and per mutant: what the exporter kept from its first call."""

    caches = _STALE.setdefault(kind, weakref.WeakKeyDictionary())
    return caches.setdefault(ctx.model_chunks[0], {})


def _kept(slots) -> list[Slot]:
    return [Slot(s.hf_name, s.hf_shape, s.positions.clone(), s.values.reshape(-1).clone()) for s in slots]


def stale_conversion_cache(ctx):
    """Converted tensors cached from the first export and sent again on every later one. Bug class: a delta or
    streaming exporter that memoises its conversion (QKV/gate-up re-layout, dtype cast) per parameter name and
    never invalidates it after an optimizer step: names, shapes and positions stay right, the weights are the
    first step's forever."""
    cache = _cache(ctx, "conversion")
    for row in _rows(ctx):
        yield _rewrap(row, lambda slots, r=row.row: cache.setdefault(r, _kept(slots)))


def stale_one_row(ctx):
    """One row's slots (its table and the values built with it) cached from the first export. Bug class: a
    cached per-row slot table that carries its tensors along (an expert row's gathered block, a fused row built
    once); every other row is fresh, so only that row's tensors stay at the first step's weights."""
    cache = _cache(ctx, "one_row")
    rows = list(_rows(ctx))
    expert = [i for i, r in enumerate(rows) if "@ep" in r.row or any("experts" in n for n, _ in _table(r))]
    keep = expert[0] if expert else len(rows) - 1
    for i, row in enumerate(rows):
        yield _rewrap(row, lambda slots, r=row.row: cache.setdefault(r, _kept(slots))) if i == keep else row


def stale_pp_broadcast(ctx):
    """A full-tensor exporter that keeps what it received from other pipeline stages. Bug class: cached
    PP-collective data (the broadcast of a stage's converted tensors, or the name/shape exchange with its
    buffers) reused on later exports: this rank's own stage is fresh, the others' tensors are the first
    step's."""

    _undo_model_writes()  # it reads the model without _rows
    cache = _cache(ctx, "pp_broadcast")
    local = _local_hf_names(ctx)
    for name, tensor in gather_tensors(ctx):
        yield name, tensor if name in local else cache.setdefault(name, tensor.clone())


def _local_hf_names(ctx) -> set[str]:
    """HF names converted from parameters this rank holds (its pipeline stage)."""
    names: set[str] = set()
    for task in ctx.bridge.get_conversion_tasks(ctx.model_chunks):
        if task is not None and task.param_weight is not None:
            names.update(str(n) for n in _hf_names(task.mapping))
    return names


def _hf_names(mapping) -> list[str]:
    param = mapping.hf_param
    return list(param.values()) if isinstance(param, dict) else [param]


MUTANTS = MUTANTS + (
    Mutant(name="stale_conversion_cache", fails=("refresh",), factory=stale_conversion_cache),
    Mutant(
        name="stale_one_row",
        fails=("refresh",),
        factory=stale_one_row,
        applies=lambda *, traits, shape, layout, world_size: layout.ep > 1,
    ),
    Mutant(
        name="stale_pp_broadcast",
        fails=("refresh",),
        factory=stale_pp_broadcast,
        applies=lambda *, traits, shape, layout, world_size: layout.pp > 1,
    ),
)


# -- minimal mutants: the smallest unit a subcheck is shown to see (``moeverify.spec.bug_classes``' ``minimal``)
# ----------
def _first_written(ctx, change: Callable[[AnySlot, str], Slot]):
    """The rows, with rank 0's first written slot (the first tensor piece it really sends) passed through ``change``."""
    done = False
    for row in _rows(ctx):
        if not done and ctx.rank == 0 and row.contributes:
            slots = _concrete(row)
            full = [i for i, s in enumerate(slots) if s.positions.numel()]
            if full:
                done = True
                slots[full[0]] = change(slots[full[0]], row.row)
                row = ShardRow(row.row, slots, True)
        yield row


def stale_one_element(ctx):
    """One element, one step stale: the first element rank 0 sends is kept from the first export and sent again on
    every later one, every other element fresh. Bug class: a delta exporter whose change detection misses one
    element (a per-block checksum that a small update does not move, an off-by-one in the dirty range)."""
    cache = _cache(ctx, "one_element")

    def keep_first(s: AnySlot, row: str) -> Slot:
        values = s.values.reshape(-1).clone()
        values[:1] = cache.setdefault(row, values[:1].clone())
        return Slot(s.hf_name, s.hf_shape, s.positions, values)

    yield from _first_written(ctx, keep_first)


def one_shard_widened(ctx):
    """One rank's piece of one tensor sent in a wider dtype (bf16 as fp32, fp32 as fp64), every value exact. Bug
    class: a per-shard conversion path (a gather buffer allocated in fp32, an upcast before a copy) taken on one
    rank only: the engine receives the tensor in two dtypes, or casts it on load."""

    def widened(s: AnySlot, row: str) -> Slot:
        wide = torch.float64 if s.values.dtype == torch.float32 else torch.float32
        return Slot(s.hf_name, s.hf_shape, s.positions, s.values.to(wide))

    yield from _first_written(ctx, widened)


MUTANTS = MUTANTS + (
    # one element is one element under any layout: run (two exports each) on the catalogue's EP scenarios only
    Mutant(
        name="stale_one_element",
        fails=("refresh", "refresh_delta"),
        factory=stale_one_element,
        applies=lambda *, traits, shape, layout, world_size: layout.ep > 1,
    ),
    Mutant(name="one_shard_widened", fails=("shape_dtype",), factory=one_shard_widened),
)


# -- the live post-step model (issue #37): caught by ``refresh_delta`` (the second export differs from the first
# exactly where the weights changed), each also failing ``refresh`` -----------------------------------------------
def _calls(ctx, kind: str) -> int:
    """How many times this mutant's subject was called on this model, this call included."""
    cache = _cache(ctx, kind)
    cache["calls"] = cache.get("calls", 0) + 1
    return cache["calls"]


def _lora_target(row: ShardRow) -> bool:
    return any(k in n for n, _ in _table(row) for k in ("self_attn", "mlp", "linear_attn"))


def lora_frozen_base(ctx):
    """A LoRA sync that ships the frozen base: the adapted modules (attention and MLP projections) are sent as the
    base weights held since start-up, not base + the trained adapters merged; every other tensor is live. Bug
    class: a refit that reads the wrapped module's ``base_layer.weight`` (or merges the adapters into a copy it
    then drops) and sends the step-0 weights with every later update."""
    cache = _cache(ctx, "lora_base")
    for row in _rows(ctx):
        yield _rewrap(row, lambda slots, r=row.row: cache.setdefault(r, _kept(slots))) if _lora_target(row) else row


def _halves_from(previous: list[Slot], slots: list[Slot]) -> list[Slot]:
    """``slots`` with the second half of each piece's values taken from ``previous`` (the same piece, earlier)."""
    out = []
    for old, new in zip(previous, slots, strict=True):
        values = new.values.reshape(-1).clone()
        half = values.numel() // 2
        values[half:] = old.values.reshape(-1)[half:]
        out.append(Slot(new.hf_name, new.hf_shape, new.positions, values))
    return out


def read_before_gathers(ctx):
    """Each piece read before the distributed optimizer's parameter all-gather finished: the first half of its
    elements (this rank's own updated shard) is the new step's, the second half (gathered from the other data-
    parallel ranks) still the previous step's. Bug class: an export started on a parameter buffer while an
    overlapped, deferred all-gather is still in flight (no wait on its handle before the read)."""
    cache = _cache(ctx, "before_gathers")

    def fn(slots, r):
        fresh = _kept(slots)
        previous = cache.get(r)
        cache[r] = fresh
        return fresh if previous is None else _halves_from(previous, fresh)

    for row in _rows(ctx):
        yield _rewrap(row, lambda slots, r=row.row: fn(slots, r))


def read_before_step(ctx):
    """The refit copy not ordered after the optimizer step: every export reads the weights as they were before the
    step it is meant to ship, one step behind (the first export, before any step, is right). Bug class: a weight
    sync launched on another stream or thread without waiting for the optimizer step's event, so it reads the
    previous step's weights."""
    cache = _cache(ctx, "before_step")

    def fn(slots, r):
        previous, cache[r] = cache.get(r), _kept(slots)
        return cache[r] if previous is None else previous

    for row in _rows(ctx):
        yield _rewrap(row, lambda slots, r=row.row: fn(slots, r))


def bucket_reused_early(ctx):
    """A bucket buffer reused before every rank read it: from the second export on, the last rank's first piece is
    read after its buffer was refilled with the next piece's values (the bucket pool is allocated on the first
    export and reused after). Bug class: a bucketed broadcast that recycles a staging buffer on the sender's
    schedule, not after every receiver signalled it had copied the bucket out."""
    second = _calls(ctx, "bucket") > 1
    rows = list(_rows(ctx))
    if not second or ctx.rank != ctx.world_size - 1:
        yield from rows
        return
    pieces = [(i, j) for i, r in enumerate(rows) if r.contributes for j, (_n, _s) in enumerate(_table(r))]
    first = pieces[0][0] if pieces else None

    def refill(slots):
        out = list(slots)
        written = [k for k, s in enumerate(out) if s.positions.numel()]
        if written:
            k = written[0]
            s = out[k]
            values = s.values.reshape(-1)
            nxt = torch.roll(values, 1)  # the next bucket's bytes, as far as this rank can tell: not this piece's
            out[k] = Slot(s.hf_name, s.hf_shape, s.positions, nxt)
        return out

    for i, row in enumerate(rows):
        yield _rewrap(row, refill) if i == first else row


def _delta_scenario(*, traits, shape, layout, world_size) -> bool:
    return layout.ep > 1 and traits.expert_bias  # one scenario of the catalogue's (DeepSeek-V3 EP 2): each runs twice


MUTANTS = MUTANTS + (
    Mutant(
        name="lora_frozen_base",
        fails=("refresh_delta",),
        collateral=("refresh",),
        factory=lora_frozen_base,
        applies=_delta_scenario,
    ),
    Mutant(
        name="read_before_gathers",
        fails=("refresh_delta",),
        collateral=("refresh",),
        factory=read_before_gathers,
        applies=_delta_scenario,
    ),
    Mutant(
        name="read_before_step",
        fails=("refresh_delta",),
        collateral=("refresh",),
        factory=read_before_step,
        applies=_delta_scenario,
    ),
    Mutant(
        name="bucket_reused_early",
        fails=("refresh_delta",),
        collateral=("refresh",),
        factory=bucket_reused_early,
        applies=_delta_scenario,
    ),
)
