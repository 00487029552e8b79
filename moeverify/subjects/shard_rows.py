"""A reference sharded exporter: every rank yields only its local shard, placed by flat HF positions.

Rows follow Megatron-Bridge's conversion tasks (``bridge.get_conversion_tasks``), which every rank
lists in the same global order (PP gathers names; EP ranks list their own experts at the same
index). A row is named by the task's global parameter name with the expert id replaced by the local
expert index under EP, so all ranks agree; its slots are every HF tensor the task writes, on every
EP rank. Each rank fills only what it owns:

- TP column splits (rows ``tp_rank*a ..``), row splits (columns), vocab padding rows dropped;
- GPT-OSS's experts stacked into one HF tensor (``gate_up_proj`` ``[E, I, 2F]`` gate/up interleaved,
  ``down_proj`` ``[E, F, O]`` transposed, their biases): each expert's shard at its global expert's slice;
- MiniMax-M2's full-dimension q/k norms: dim-0 shards over the unique norm shards (K with fewer KV heads than
  TP is held by several TP ranks, the first of which contributes);
- fused QKV, interleaved per query group: ``[groups, q heads + k + v, head_dim, hidden]``;
- gated MLP ``[gate; up]`` per TP shard;
- experts: global id = ``ep_rank * experts_per_rank + local``, ETP as the expert TP group;
- PP/VPP: non-owning stages yield empty positions with the same slot table;
- replicas (DP, expert-DP, TP-replicated norms/routers/row biases, tied output-layer copies on the
  last stage) yield ``contributes=False`` and still send their values.

A tensor larger than ``ROW_ELEMENTS`` becomes rows ``name#0 .. name#k`` with the same slot table,
each carrying one contiguous range of every slot, so positions stay small (index arithmetic in
``placement``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Iterator

import torch

from moeverify.errors import SubjectError
from moeverify.models.checkpoint import checkpoint_shapes
from moeverify.subjects import placement
from moeverify.subjects.placement import split_range
from moeverify.subjects.slots import AnySlot, DeferredSlots, RangeSlot, RunSlot, ShardRow, Slot

ROW_ELEMENTS = 1 << 24  # a larger HF tensor is cut into several rows (bounded positions per row)

_EXPERT_IN_HF = re.compile(r"experts\.(\d+)")


def _unwrap(module):
    while hasattr(module, "module"):
        module = module.module
    return module


def sharded_rows(ctx) -> Iterator[ShardRow]:
    """Yield one ShardRow per conversion task, tensors deferred until the oracle asks for them."""
    from megatron.core import parallel_state as ps  # lazy: megatron

    shapes = checkpoint_shapes(ctx.hf_path)
    config = _unwrap(ctx.model_chunks[0]).config
    owner = _Owners(
        dp_rank=ps.get_data_parallel_rank(with_context_parallel=True), edp_rank=ps.get_expert_data_parallel_rank()
    )
    tied = bool(getattr(config, "share_embeddings_and_output_weights", False))
    tied_copy = _tied_output_copy(ctx.model_chunks) if tied else None
    for task in ctx.bridge.get_conversion_tasks(ctx.model_chunks):
        if task is None:
            continue
        yield from _rows(task, config=config, shapes=shapes, owner=owner, tied_copy=tied_copy)


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Owners:
    dp_rank: int
    edp_rank: int


def _tied_output_copy(model_chunks):
    """The last stage's output-layer weight when it is a separate copy of the tied embedding."""
    last = _unwrap(model_chunks[-1])
    if getattr(last, "post_process", False) and not getattr(_unwrap(model_chunks[0]), "pre_process", False):
        weight = getattr(getattr(last, "output_layer", None), "weight", None)
        return weight
    return None


def _hf_names(task, config) -> tuple[list[str], list[list[str]]]:
    """Base HF names of the task and, per base name, its names on every EP rank (index = ep rank)."""
    from megatron.bridge.models.conversion.param_mapping import GatedMLPMapping, QKVMapping  # lazy: megatron

    m = task.mapping
    hf = m.hf_param
    gdn = _gdn_in_proj_kind(m)
    if isinstance(m, QKVMapping):
        base = [hf["q"], hf["k"], hf["v"]]
    elif gdn is not None:
        base = [hf[key] for key in _GDN_HF_TENSORS[gdn]]
    elif isinstance(m, GatedMLPMapping):
        base = [hf["gate"], hf["up"]]
    elif isinstance(hf, str):
        base = [hf]
    else:
        raise SubjectError(
            f"row {task.global_param_name!r}: mapping {type(m).__name__} with several HF names "
            f"is not supported by the sharded exporter"
        )
    if not (m.is_expert and m.ep_size > 1) or getattr(m, "is_grouped_export", False):
        return base, [[b] for b in base]  # (stacked experts: every EP rank writes the one HF tensor)
    per_rank = _experts_per_rank(task, config)
    local = _expert_number(task, r"(?:local_experts\.|weight|bias)(\d+)") % per_rank
    per_base = [[_EXPERT_IN_HF.sub(f"experts.{local + per_rank * k}", b) for k in range(m.ep_size)] for b in base]
    return base, per_base


def _experts_per_rank(task, config) -> int:
    return config.num_moe_experts // task.mapping.ep_size


def _row_name(task, config) -> str:
    name = task.global_param_name
    m = task.mapping
    if m.is_expert and m.ep_size > 1:
        per_rank = _experts_per_rank(task, config)
        name = re.sub(r"(local_experts\.)(\d+)", lambda x: f"{x.group(1)}{int(x.group(2)) % per_rank}@ep", name)
        name = re.sub(r"((?:weight|bias))(\d+)$", lambda x: f"{x.group(1)}{int(x.group(2)) % per_rank}@ep", name)
    return name


def _rows(task, *, config, shapes, owner: _Owners, tied_copy) -> Iterator[ShardRow]:
    """The task's rows: one, or several ``#k`` rows for a large tensor (same table, a range each)."""
    base, per_base = _hf_names(task, config)
    names = [n for group in per_base for n in group]
    embedding = task.global_param_name.endswith("embedding.word_embeddings.weight")
    tied_name = (
        _tied_lm_head(task, shapes)
        if (embedding and getattr(config, "share_embeddings_and_output_weights", False))
        else None
    )
    if tied_name:
        names.append(tied_name)
    missing = [n for n in names if n not in shapes]
    if missing:
        raise SubjectError(f"row {task.global_param_name!r}: HF name(s) {missing} are not in the source checkpoint")
    table = [(n, tuple(shapes[n])) for n in names]
    weight, kind = task.param_weight, None
    contributes = True  # a stage that owns nothing of this row yields empty positions (nothing to replicate)
    if weight is None and embedding and tied_copy is not None:
        # the last stage's copy of the tied embedding (a column-parallel output layer): a replica
        weight, kind, contributes = tied_copy, "column", False
    elif weight is not None:
        contributes = _owns(task, owner)
    placers: dict[str, placement.Placer] = {}

    def build(k: int, parts: int) -> list[AnySlot]:
        if weight is not None and not placers:
            placers.update(
                _place(task, weight.detach(), config=config, shapes=shapes, per_base=per_base, kind=kind or _kind(task))
            )
            if tied_name and base[0] in placers:
                placers[tied_name] = placers[base[0]]
        slots: list[AnySlot] = []
        for name, shape in table:
            placer = placers.get(name)
            if placer is None:
                slots.append(Slot(name, shape, torch.empty(0, dtype=torch.int64), torch.empty(0)))
                continue
            a, b = split_range(placer.n, parts, k)
            if placer.offset is not None:  # one range: no positions tensor built
                slots.append(RangeSlot(name, shape, a + placer.offset, placer.values(a, b)))
            elif placer.runs is not None:  # runs of consecutive positions (row-split, per head): none built
                starts_R, lengths_R = placer.runs(a, b)
                slots.append(RunSlot(name, shape, starts_R, lengths_R, placer.values(a, b)))
            else:
                slots.append(Slot(name, shape, placer.positions(a, b), placer.values(a, b)))
        if k == parts - 1:
            placers.clear()
        return slots

    parts = max(1, -(-max(math.prod(s) for _, s in table) // ROW_ELEMENTS))
    name = _row_name(task, config)
    for k in range(parts):
        row_name = name if parts == 1 else f"{name}#{k}"
        yield ShardRow(row_name, DeferredSlots(table, functools.partial(build, k, parts)), contributes)


def _tied_lm_head(task, shapes) -> str | None:
    name = task.mapping.hf_param
    candidate = "lm_head.weight" if name.startswith("model.") else None
    return candidate if candidate in shapes else None


def _kind(task) -> str:
    from megatron.bridge.models.conversion import param_mapping as pm  # lazy: megatron

    m = task.mapping
    if getattr(m, "is_grouped_export", False):  # megatron-bridge 0.6.2: experts stacked as one [E, ...] HF tensor
        kind = _stacked_kind(m)
        if kind is None:
            raise SubjectError(
                f"row {task.global_param_name!r}: mapping {type(m).__name__} exports experts stacked "
                f"into one HF tensor ({m.hf_param}) in a layout the sharded exporter does not "
                "place (it places GPT-OSS's); test this family's export with --subject bridge"
            )
        return kind
    if isinstance(m, pm.QKVMapping):
        return "qkv"
    gdn = _gdn_in_proj_kind(m)
    if gdn is not None:
        return gdn
    if isinstance(m, pm.GDNConv1dMapping):
        return "gdn_conv1d"
    if isinstance(m, pm.RMSNorm2ZeroCenteredRMSNormMapping):  # before AutoMapping, its base class
        if m._detect_parallelism_type(task.megatron_module) != "replicated":
            raise SubjectError(f"row {task.global_param_name!r}: a zero-centered norm that is not replicated")
        return "zero_centered_norm"
    if isinstance(m, pm.GatedMLPMapping):
        return "gated"
    if isinstance(m, pm.AutoMapping):
        if m.permute_dims is not None:
            raise SubjectError(f"row {task.global_param_name!r}: AutoMapping with permute_dims is not supported")
        return m._detect_parallelism_type(task.megatron_module)
    full_dim_norm = _full_dim_norm_mapping()
    if full_dim_norm is not None and isinstance(m, full_dim_norm):
        return "full_dim_norm"
    for cls, kind in (
        (pm.ColumnParallelMapping, "column"),
        (pm.RowParallelMapping, "row"),
        (pm.ReplicatedMapping, "replicated"),
        (pm.DirectMapping, "replicated"),
    ):
        if isinstance(m, cls):
            return kind
    raise SubjectError(
        f"row {task.global_param_name!r}: mapping {type(m).__name__} is not supported by the "
        f"sharded exporter (supported: QKV, GatedMLP, Auto, Column, Row, Replicated, Direct, "
        f"MiniMax-M2's full-dimension q/k norm, gated delta net in_proj/conv1d, zero-centered norm)"
    )


# The HF tensors of a gated delta net's in_proj (megatron-bridge 0.6.2): Qwen3-Next's two head-grouped ones
# (GDNLinearMapping), Qwen3.5's four flat ones (GDNLinearMappingSeparate). Each key is the bridge's name for the
# tensor and spells the sections it holds, one letter each (q, k, v, z, b, a).
_GDN_HF_TENSORS = {"gdn_in_proj_grouped": ("qkvz", "ba"), "gdn_in_proj_flat": ("qkv", "z", "b", "a")}


def _gdn_in_proj_kind(m) -> str | None:
    from megatron.bridge.models.conversion import param_mapping as pm  # lazy: megatron

    if isinstance(m, pm.GDNLinearMappingSeparate):
        return "gdn_in_proj_flat"
    if isinstance(m, pm.GDNLinearMapping):
        return "gdn_in_proj_grouped"
    return None


def gdn_dims(config) -> placement.GdnDims:
    """The gated delta net's head counts and sizes of a Megatron ``config`` (Qwen3-Next's linear attention)."""
    return placement.GdnDims(
        dk=config.linear_key_head_dim,
        dv=config.linear_value_head_dim,
        nk=config.linear_num_key_heads,
        nv=config.linear_num_value_heads,
    )


def _place_gdn(w: torch.Tensor, *, kind: str, names: list[str], config, tp: int, r: int) -> dict:
    """A GDN shard's sections into their HF tensors (``names`` in ``_GDN_HF_TENSORS`` order, or conv1d's one)."""
    dims = gdn_dims(config)
    sections = placement.gdn_sections(dims, tp=tp, r=r, gates=kind != "gdn_conv1d")
    row = placement.gdn_grouped_row if kind == "gdn_in_proj_grouped" else placement.gdn_flat_row
    tensors = _GDN_HF_TENSORS.get(kind, ("qkv",))
    out = {}
    for name, tensor in zip(names, tensors, strict=True):
        parts = [(local, row(dims, sec, j)) for sec, (local, j) in sections.items() if sec in tensor]
        local_rows = torch.cat([p[0] for p in parts])
        out[name] = placement.row_map(w, local_rows=local_rows, hf_rows=torch.cat([p[1] for p in parts]))
    return out


def _stacked_kind(m) -> str | None:
    """GPT-OSS's stacked expert mappings (megatron-bridge 0.6.2 ``gpt_oss_bridge``): ``gate_up_proj`` ``[E, I, 2F]``
    with gate and up interleaved, ``down_proj`` ``[E, F, O]`` transposed, biases ``[E, 2F]`` and ``[E, O]``."""
    try:
        from megatron.bridge.models.gpt_oss.gpt_oss_bridge import (  # lazy: megatron
            GPTOSSMLPDownProjMapping,
            GPTOSSMLPGateUpProjMapping,
        )
    except ImportError:
        return None
    if isinstance(m, GPTOSSMLPGateUpProjMapping):
        return "stacked_gate_up"
    if isinstance(m, GPTOSSMLPDownProjMapping):
        return "stacked_down"
    return None


def _stacked_expert(task) -> int:
    """The global expert number of a grouped expert parameter (``...weight{g}``/``bias{g}``, renumbered under EP
    by the bridge's conversion tasks)."""
    return _expert_number(task, r"(?:weight|bias)(\d+)$")


def _expert_number(task, pattern: str) -> int:
    """The expert number ``pattern``'s group finds in the task's parameter name."""
    found = re.search(pattern, task.global_param_name)
    if found is None:
        raise SubjectError(
            f"row {task.global_param_name!r}: an expert parameter without an expert number (no {pattern!r} in it)"
        )
    return int(found.group(1))


def _full_dim_norm_mapping():
    """MiniMax-M2's mapping of its full-dimension q/k norms (megatron-bridge 0.6.2:
    ``minimax_m2_bridge._FullDimQKNormMapping``): the weight is split on dim 0 over ``shard_world_size`` unique
    shards, each held by ``tp / shard_world_size`` consecutive TP ranks (K norm with fewer KV heads than TP)."""
    try:
        from megatron.bridge.models.minimax_m2.minimax_m2_bridge import _FullDimQKNormMapping  # lazy: megatron
    except ImportError:
        return None
    return _FullDimQKNormMapping


def _norm_shards(task) -> tuple[int, int]:
    """(unique shards, TP ranks per shard) of a full-dimension norm (its module's ``shard_world_size``)."""
    shards = task.megatron_module.shard_world_size
    if task.mapping.tp_size % shards:
        raise SubjectError(
            f"row {task.global_param_name!r}: {shards} norm shards do not divide TP {task.mapping.tp_size}"
        )
    return shards, task.mapping.tp_size // shards


def _owns(task, owner: _Owners) -> bool:
    """Whether this rank's copy is the one that contributes (all other copies are replicas)."""
    m = task.mapping
    first_replica = owner.edp_rank == 0 if m.is_expert else owner.dp_rank == 0
    kind = _kind(task)
    if kind == "full_dim_norm":
        return first_replica and m.tp_rank % _norm_shards(task)[1] == 0
    if kind == "stacked_down" and task.param_weight.dim() == 1:
        return first_replica and m.tp_rank == 0  # a row-parallel bias: whole on every expert-TP rank
    tp_replicated = kind in ("replicated", "zero_centered_norm") or (kind == "row" and task.param_weight.dim() == 1)
    return first_replica and (not tp_replicated or m.tp_rank == 0)


def _place(task, w: torch.Tensor, *, config, shapes, per_base, kind: str) -> dict:
    """HF name -> Placer for this rank's own names (its EP rank's experts)."""
    m = task.mapping
    tp, r = m.tp_size, m.tp_rank
    if kind in ("stacked_gate_up", "stacked_down"):
        place = placement.stacked_gate_up if kind == "stacked_gate_up" else placement.stacked_down
        name = per_base[0][0]
        return {name: place(w, expert=_stacked_expert(task), tp=tp, r=r, hf_shape=tuple(shapes[name]))}
    ep_rank = m.ep_rank if (m.is_expert and m.ep_size > 1) else 0
    mine = [group[ep_rank] for group in per_base]
    if kind.startswith("gdn_"):
        return _place_gdn(w, kind=kind, names=mine, config=config, tp=tp, r=r)
    if kind == "zero_centered_norm":  # Megatron holds weight - 1 (its norm scales by 1 + weight); HF the weight
        return {mine[0]: placement.replicated(w + 1)}
    if kind == "qkv":
        heads = config.num_attention_heads
        head_dim = config.kv_channels or config.hidden_size // heads
        return dict(
            zip(
                mine,
                placement.qkv(
                    w,
                    heads=heads,
                    groups=config.num_query_groups,
                    head_dim=head_dim,
                    tp=tp,
                    r=r,
                    output_gate=bool(config.attention_output_gate),
                ),
                strict=True,
            )
        )
    if kind == "gated":
        return dict(zip(mine, placement.gated(w, tp=tp, r=r, hf_rows=shapes[mine[0]][0]), strict=True))
    if kind == "column":
        return {mine[0]: placement.column(w, tp=tp, r=r, hf_rows=shapes[mine[0]][0])}
    if kind == "full_dim_norm":
        shards, per_shard = _norm_shards(task)
        return {mine[0]: placement.column(w, tp=shards, r=r // per_shard, hf_rows=shapes[mine[0]][0])}
    if kind == "row" and w.dim() == 2:
        return {mine[0]: placement.row(w, tp=tp, r=r)}
    return {mine[0]: placement.replicated(w)}
