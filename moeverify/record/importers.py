"""Converting routes from elsewhere into dumps, and dumps to ``.npz``.

- Rollout engines (vLLM, SGLang routed-experts / R3) return ``[tokens, layers, topk]`` integer arrays:
  ``.npy`` holds one micro-batch, ``.npz`` one micro-batch per array, in key order. Loaded with
  ``allow_pickle=False``.
- megatron-core 0.19.2's ``RouterTracer`` (``transformer/moe/router_trace.py``) writes
  ``router_trace_rank{R}.jsonl``: one record per router call, ``{"step", "stage", "block", "layer",
  "rank", "num_tokens", "topk", "top_indices": [[...], ...]}`` (``"mtp_idx"`` on MTP records). Its
  ``layer`` comes from the module name ``decoder.layers.<n>``, the index within the rank's own
  layer stack, so files of later pipeline stages need ``layer_offset``. Repeated (step, layer)
  records are successive micro-batches.
- ``export_npz`` writes ``step{S}_mb{M}`` ``[tokens, layers, topk]`` arrays plus ``layers``.

Legend: N = tokens, L = layers, K = top-k.
"""

from __future__ import annotations

import json
import os
import re
import zipfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from moeverify.errors import DumpError, RouteError
from moeverify.routes import Routes


def routes_from_arrays(arrays_NLK: Sequence[np.ndarray], *, num_experts: int | None = None,
                       moe_layers: Sequence[int] | None = None, where: str = "input") -> Routes:
    """``Routes`` from ``[tokens, layers, topk]`` arrays, one per micro-batch."""
    if not arrays_NLK:
        raise DumpError(f"{where}: no arrays")
    tensors = []
    for i, arr in enumerate(arrays_NLK):
        if arr.ndim != 3 or not np.issubdtype(arr.dtype, np.integer):
            raise DumpError(f"{where}: array {i}: shape {arr.shape} dtype {arr.dtype} != expected integer "
                            f"[tokens, layers, topk]")
        if arr.shape[1:] != arrays_NLK[0].shape[1:]:
            raise DumpError(f"{where}: array {i}: shape {arr.shape} != (tokens, {arrays_NLK[0].shape[1:]})")
        tensors.append(torch.from_numpy(np.ascontiguousarray(arr).astype(np.int64)))
    layers = list(moe_layers) if moe_layers is not None else list(range(tensors[0].shape[1]))
    if len(layers) != tensors[0].shape[1]:
        raise DumpError(f"{where}: {len(layers)} moe layer number(s) given for {tensors[0].shape[1]} layer(s)")
    if len(set(layers)) != len(layers) or any(layer < 0 for layer in layers):
        dups = sorted({layer for layer in layers if layers.count(layer) > 1})
        raise DumpError(f"{where}: moe layer numbers {layers} must be distinct and >= 0"
                        + (f" (repeated: {dups})" if dups else ""))
    if not any(t.numel() for t in tensors):
        raise DumpError(f"{where}: the arrays hold no tokens (shapes {[tuple(t.shape) for t in tensors]})")
    for i, t in enumerate(tensors):
        _refuse_negative(t, where=f"{where}: array {i}", layers=layers)
    experts = num_experts if num_experts is not None else int(max(int(t.max()) for t in tensors if t.numel())) + 1
    try:
        return Routes.from_stacked(tensors, layers=layers, num_experts=experts)
    except RouteError as exc:
        raise DumpError(f"{where}: {exc}") from None


def _refuse_negative(ids_NLK: torch.Tensor, *, where: str, layers: Sequence[int]) -> None:
    """Negative ids are capture gaps (-1) or garbage, never an expert: refuse them naming token and layer."""
    bad = (ids_NLK < 0).nonzero()
    if bad.numel():
        token, column = int(bad[0, 0]), int(bad[0, 1])
        raise DumpError(f"{where}: token {token} layer {layers[column]}: expert id {int(ids_NLK[token, column].min())}"
                        f" < 0 ({int((ids_NLK < 0).any(dim=2).sum())} token-layer row(s) with negative ids: capture "
                        f"gaps are not routes; Routes.from_rollout handles them for replay)")


def read_arrays(path: str | os.PathLike, *, fmt: str | None = None) -> list[np.ndarray]:
    """The arrays of an ``.npy`` (one) or ``.npz`` (all, in key order) file, never unpickling."""
    path = Path(path)
    kind = fmt or path.suffix.lstrip(".")
    try:
        if kind == "npy":
            return [np.load(path, allow_pickle=False)]
        if kind == "npz":
            with np.load(path, allow_pickle=False) as npz:
                return [npz[key] for key in sorted(npz.files, key=_natural_key)]
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as exc:
        raise DumpError(f"{path}: cannot read as .{kind}: {exc}") from None
    raise DumpError(f"{path}: unknown array format {kind!r}; use npy or npz")


def read_router_trace(path: str | os.PathLike, *, num_experts: int | None = None, step: int | None = None,
                      layer_offset: int = 0, rank: int | None = None) -> dict[int, Routes]:
    """``{step: Routes}`` from one ``router_trace_rank{R}.jsonl`` file (decoder records; MTP skipped); with
    ``rank``, every record must say that rank."""
    path = Path(path)
    per_step: dict[int, dict[int, list[torch.Tensor]]] = {}
    topk = None
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise DumpError(f"{path}: unreadable: {exc}") from None
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            if not isinstance(rec, dict):
                raise TypeError(f"a JSON {type(rec).__name__}, not an object")
            if rec.get("block", "decoder") != "decoder" or (step is not None and rec["step"] != step):
                continue
            rows = rec["top_indices"]
            odd = next((v for row in rows for v in row if type(v) is not int), None) if isinstance(rows, list) else rows
            if odd is not None:  # floats or booleans are never truncated into ids
                raise TypeError(f"top_indices hold {odd!r}, not integer expert ids")
            ids_TK = torch.tensor(rows, dtype=torch.int64).view(int(rec["num_tokens"]), int(rec["topk"]))
            rec_step, layer = int(rec["step"]), int(rec["layer"]) + layer_offset
            if rank is not None and rec.get("rank") != rank:
                raise ValueError(f"the record says rank {rec.get('rank')!r}, the file name rank {rank}")
        except (ValueError, KeyError, TypeError, RuntimeError) as exc:
            raise DumpError(f"{path}:{lineno}: not a router_trace record: {exc}") from None
        if topk not in (None, ids_TK.shape[1]):
            raise DumpError(f"{path}:{lineno}: topk {ids_TK.shape[1]} != {topk} of earlier records")
        topk = ids_TK.shape[1]
        if ids_TK.numel() and int(ids_TK.min()) < 0:
            raise DumpError(f"{path}:{lineno}: layer {layer}: expert id {int(ids_TK.min())} < 0")
        per_step.setdefault(rec_step, {}).setdefault(layer, []).append(ids_TK)
    if not per_step:
        raise DumpError(f"{path}: no decoder router_trace records" + ("" if step is None else f" for step {step}"))
    if not any(t.numel() for layers in per_step.values() for mbs in layers.values() for t in mbs):
        raise DumpError(f"{path}: the router_trace records hold no tokens (num_tokens 0 throughout)")
    experts = num_experts
    if experts is None:
        experts = 1 + max(int(t.max()) for layers in per_step.values() for mbs in layers.values() for t in mbs
                          if t.numel())
    out = {}
    for s, layers in sorted(per_step.items()):
        try:
            out[s] = Routes(layers, num_experts=experts, topk=topk)
        except RouteError as exc:
            raise DumpError(f"{path}: step {s}: {exc}") from None
    return out


def export_npz(dump, path: str | os.PathLike, *, routes_of=None) -> Path:
    """Write every step's merged global routes as ``step{S}_mb{M}`` ``[tokens, layers, topk]`` arrays
    (``routes_of(step)``, default ``dump.routes``: e.g. the routes mapped to logical expert ids)."""
    arrays = {"layers": np.asarray(dump.model.moe_layers, dtype=np.int64)}
    for step in sorted(dump.steps):
        routes = dump.routes(step=step) if routes_of is None else routes_of(step)
        for mb in range(routes.microbatches):
            stacked = torch.stack([routes.get(layer, mb) for layer in routes.layers], dim=1)
            arrays[f"step{step}_mb{mb}"] = stacked.numpy()
    path = Path(path)
    np.savez(path, **arrays)
    return path if path.suffix == ".npz" else path.with_name(path.name + ".npz")


def _natural_key(name: str) -> tuple:
    import re

    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name))


_TRACE_FILE = re.compile(r"^router_trace_rank(\d+)\.jsonl$")


def read_router_trace_ranks(directory: str | os.PathLike, *, layout, world_size: int, num_layers: int,
                            num_experts: int | None = None) -> dict[int, dict[int, Routes]]:
    """Every rank's ``router_trace_rank{R}.jsonl`` of one job of ``world_size`` ranks: ``{rank: {step: local Routes}}``.

    Megatron-Core's ``RouterTracer`` numbers layers as the chunk's module names do (``decoder.layers.<n>``, local
    to the pipeline stage); each rank's layers are moved to global numbers by its stage's first layer under
    ``layout`` (Megatron's default rank order ``tp-cp-ep-dp-pp``). Refused: a file of a rank outside the job or
    under another spelling, a rank's file missing, a record naming another rank, VPP (a rank's chunks share layer
    numbers there, so they cannot be told apart), ranks holding different steps, a layer outside its stage.
    """
    from moeverify import views
    from moeverify.errors import UsageError

    directory = Path(directory)
    files = {}
    for path in sorted(directory.iterdir()):
        found = _TRACE_FILE.match(path.name)
        if found:
            rank = int(found.group(1))
            if path.name != f"router_trace_rank{rank}.jsonl" or rank >= world_size:
                raise DumpError(f"{path}: not a trace of this job (ranks 0..{world_size - 1}, named "
                                f"router_trace_rank<R>.jsonl); move it out of {directory}")
            files[rank] = path
    missing = sorted(set(range(world_size)) - set(files))
    if missing:
        raise DumpError(f"{directory}: router_trace file(s) of rank(s) {missing} missing (found ranks {sorted(files)}); "
                        f"merging needs every rank's trace of the {world_size}-rank job")
    if layout.vpp_chunks > 1:
        raise UsageError("router_trace numbers a rank's layers per model chunk (decoder.layers.<n> in each chunk), so "
                         "under VPP a rank's chunks share layer numbers and cannot be placed; record VPP jobs with "
                         "RouteRecorder or the autopatch instead")
    if num_experts is None:  # one expert count for every rank (a rank's trace may not show the highest id)
        num_experts = max(r.num_experts for path in files.values() for r in read_router_trace(path).values())
    out = {}
    for rank in range(world_size):
        coords = views.rank_coords(layout, rank=rank, world_size=world_size)
        stage = views.chunk_layers(layout, pp_rank=coords.pp, vp_stage=0, num_layers=num_layers)
        steps = read_router_trace(files[rank], num_experts=num_experts, layer_offset=stage.start, rank=rank)
        for step, routes in steps.items():
            outside = [layer for layer in routes.layers if layer not in stage]
            if outside:
                raise DumpError(f"{files[rank]}: step {step}: layer(s) {[x - stage.start for x in outside]} (global "
                                f"{outside}) outside pipeline stage {coords.pp}'s {len(stage)} layers "
                                f"[{stage.start}, {stage.stop}) of --num-layers {num_layers}")
        if out and sorted(steps) != sorted(out[0]):
            raise DumpError(f"{files[rank]}: steps {sorted(steps)} != rank 0's {sorted(out[0])}")
        out[rank] = steps
    return out
