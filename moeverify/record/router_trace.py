"""Reading megatron-core's ``RouterTracer`` JSONL (``transformer/moe/router_trace.py``, 0.19.2) as routes.

The tracer writes ``router_trace_rank{R}.jsonl``: one record per router call, ``{"step", "stage", "block",
"layer", "rank", "num_tokens", "topk", "top_indices": [[...], ...]}`` (``"mtp_idx"`` on MTP records, which are
skipped). Its ``layer`` comes from the module name ``decoder.layers.<n>``, the index within the rank's own
layer stack, so files of later pipeline stages need a layer offset. A rank whose stage holds no MoE layer
writes an empty file. A record carries no micro-batch number and no sign of *why* the router ran:

- Without activation recompute, a step's records are whole forward passes, one per micro-batch, each over
  the stage's MoE layers in ascending order.
- With recompute, the router runs again in backward: each recomputed layer is recorded twice per
  micro-batch (forward, then recompute). Imported as they stand, the micro-batches would double.

So without the micro-batch count (``microbatches``) a step is taken only when it is one whole forward pass;
several passes are refused (a recompute that routed otherwise would read as another micro-batch). With it, each layer
must hold that many records, or twice that many; in the second case the records are paired by equal ids (the recompute
of a micro-batch repeats its forward's ids) and the later record of each pair is dropped. That is proven only when every
distinct ids tensor of the layer occurs exactly twice: a recompute that routed otherwise, or two micro-batches with the
same ids, is refused, never guessed. Legend: T = tokens, K = top-k.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path

import torch

from moeverify.errors import DumpError, RouteError, UsageError
from moeverify.routing import views
from moeverify.routing.routes import Routes

TRACE_FILE = re.compile(r"^router_trace_rank(\d+)\.jsonl$")


@dataclasses.dataclass(frozen=True, slots=True)
class _Call:
    line: int
    layer: int
    ids_TK: torch.Tensor


def read_router_trace(
    path: str | os.PathLike,
    *,
    num_experts: int | None = None,
    step: int | None = None,
    layer_offset: int = 0,
    rank: int | None = None,
    microbatches: int | None = None,
    allow_empty: bool = False,
) -> dict[int, Routes]:
    """``{step: Routes}`` from one ``router_trace_rank{R}.jsonl`` (decoder records; MTP skipped).

    Args:
        rank: every record must say that rank.
        microbatches: the job's micro-batches per step on this rank; with it, recompute records are
            identified and dropped (module docstring), without it a step that may hold them is refused.
        allow_empty: a file without decoder records gives ``{}`` (a pipeline stage without MoE layers).
    """
    path = Path(path)
    named = TRACE_FILE.match(path.name)  # a record that names its rank names the file's (where the name says one)
    calls = _parse(
        path, step=step, layer_offset=layer_offset, rank=rank, named=None if named is None else int(named[1])
    )
    if not calls:
        if allow_empty:
            return {}
        raise DumpError(f"{path}: no decoder router_trace records" + ("" if step is None else f" for step {step}"))
    if not any(c.ids_TK.numel() for step_calls in calls.values() for c in step_calls):
        raise DumpError(f"{path}: the router_trace records hold no tokens (num_tokens 0 throughout)")
    topk = next(iter(calls.values()))[0].ids_TK.shape[1]
    experts = num_experts
    if experts is None:
        experts = 1 + max(int(c.ids_TK.max()) for step_calls in calls.values() for c in step_calls if c.ids_TK.numel())
    out = {}
    for s, step_calls in sorted(calls.items()):
        per_layer = _microbatches(step_calls, microbatches=microbatches, where=f"{path}: step {s}")
        try:
            out[s] = Routes(per_layer, num_experts=experts, topk=topk)
        except RouteError as exc:
            raise DumpError(f"{path}: step {s}: {exc}") from None
    return out


_BLOCKS = frozenset({"decoder", "mtp"})  # what megatron-core 0.19.2's RouterTracer writes (MTP records skipped)


def _int_field(rec: dict, key: str) -> int:
    """A record's integer field (``KeyError`` if absent); strings, floats and booleans are refused."""
    value = rec[key]
    if type(value) is not int or value < 0:
        raise TypeError(f"{key} {value!r} is not a non-negative integer")
    return value


def _parse(
    path: Path, *, step: int | None, layer_offset: int, rank: int | None, named: int | None = None
) -> dict[int, list[_Call]]:
    """The decoder records of each step, in file order; every record checked, naming its line."""
    if not path.is_file():  # a FIFO or a device would block the read, or never end
        raise DumpError(f"{path}: not a regular file" if path.exists() else f"{path}: no such file")
    try:
        lines = path.read_bytes().decode("utf-8").splitlines()
    except OSError as exc:
        raise DumpError(f"{path}: unreadable: {exc}") from None
    except UnicodeDecodeError as exc:
        at = path.read_bytes()[: exc.start].count(b"\n") + 1
        raise DumpError(f"{path}:{at}: not UTF-8 text (byte {exc.start}): not a router_trace JSONL file") from None
    calls: dict[int, list[_Call]] = {}
    topk = None
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            if not isinstance(rec, dict):
                raise TypeError(f"a JSON {type(rec).__name__}, not an object")
            block = rec.get("block", "decoder")
            if block not in _BLOCKS:
                raise ValueError(f"block {block!r} is none of the tracer's {sorted(_BLOCKS)}")
            if block == "mtp" or (step is not None and _int_field(rec, "step") != step):
                continue
            rows = rec["top_indices"]
            odd = next((v for row in rows for v in row if type(v) is not int), None) if isinstance(rows, list) else rows
            if odd is not None:  # floats or booleans are never truncated into ids
                raise TypeError(f"top_indices hold {odd!r}, not integer expert ids")
            num_tokens, topk_of = _int_field(rec, "num_tokens"), _int_field(rec, "topk")
            if num_tokens != len(rows) or topk_of < 1:
                raise ValueError(
                    f"num_tokens {num_tokens} / topk {topk_of} do not describe the {len(rows)} row(s) of top_indices"
                )
            ids_TK = torch.tensor(rows, dtype=torch.int64).view(num_tokens, topk_of)
            rec_step, layer = _int_field(rec, "step"), _int_field(rec, "layer") + layer_offset
            if "rank" in rec:  # one file's records name their rank; a damaged one is not ignored
                _int_field(rec, "rank")
            if rank is not None and rec.get("rank") != rank:
                raise ValueError(f"the record says rank {rec.get('rank')!r}, the file name rank {rank}")
            if named is not None and "rank" in rec and rec["rank"] != named:
                raise ValueError(f"the record says rank {rec['rank']!r}, the file name ({path.name}) rank {named}")
        except KeyError as exc:
            raise DumpError(f"{path}:{lineno}: not a router_trace record: field {exc} missing") from None
        except (ValueError, TypeError, RuntimeError) as exc:
            raise DumpError(f"{path}:{lineno}: not a router_trace record: {exc}") from None
        if topk not in (None, ids_TK.shape[1]):
            raise DumpError(f"{path}:{lineno}: topk {ids_TK.shape[1]} != {topk} of earlier records")
        topk = ids_TK.shape[1]
        if ids_TK.numel() and int(ids_TK.min()) < 0:
            raise DumpError(f"{path}:{lineno}: layer {layer}: expert id {int(ids_TK.min())} < 0")
        calls.setdefault(rec_step, []).append(_Call(line=lineno, layer=layer, ids_TK=ids_TK))
    return calls


def _microbatches(calls: list[_Call], *, microbatches: int | None, where: str) -> dict[int, list[torch.Tensor]]:
    """``{layer: [ids_TK per micro-batch]}`` of one step's records, recompute records dropped or refused."""
    by_layer: dict[int, list[_Call]] = {}
    for call in calls:
        by_layer.setdefault(call.layer, []).append(call)
    if microbatches is None:
        _require_plain_forwards(calls, layers=sorted(by_layer), where=where)
        return {layer: [c.ids_TK for c in held] for layer, held in sorted(by_layer.items())}
    out = {}
    for layer, held in sorted(by_layer.items()):
        if len(held) == microbatches:
            out[layer] = [c.ids_TK for c in held]
        elif len(held) == 2 * microbatches:
            out[layer] = [c.ids_TK for c in _drop_recompute(held, where=f"{where}: layer {layer}")]
        else:
            raise DumpError(
                f"{where}: layer {layer} has {len(held)} record(s) (lines {held[0].line}..{held[-1].line}) "
                f"!= expected --microbatches {microbatches} (or {2 * microbatches} under activation "
                f"recompute, forward and recompute)"
            )
    return out


def _require_plain_forwards(calls: list[_Call], *, layers: list[int], where: str) -> None:
    """Refuse a step that is not one whole forward pass over ``layers`` (each once, ascending).

    Several passes are refused too: a recompute that routed otherwise than its forward reads as another
    micro-batch, so without the job's micro-batch count they cannot be told apart.
    """
    passes: list[list[_Call]] = []
    for call in calls:
        if not passes or call.layer <= passes[-1][-1].layer:
            passes.append([])
        passes[-1].append(call)
    fix = (
        "Activation recompute runs the router again in backward, so a micro-batch is recorded twice; give "
        "--microbatches N (the job's micro-batches per step on this rank) to have recompute records identified "
        "and dropped, or trace without recompute"
    )
    for one in passes:
        got = [c.layer for c in one]
        if got != layers:
            raise DumpError(
                f"{where}: the records from line {one[0].line} pass layer(s) {got}, not a whole forward "
                f"over the traced layers {layers}. {fix}"
            )
    if len(passes) > 1:
        raise DumpError(
            f"{where}: {len(passes)} passes over the traced layers (lines {passes[0][0].line}, "
            f"{', '.join(str(one[0].line) for one in passes[1:])}): micro-batches, or forwards and their "
            f"recomputes (a recompute that routed otherwise than its forward reads as another micro-batch), "
            f"which the trace does not tell apart. Give --microbatches N (the job's micro-batches per step "
            f"on this rank): each layer must then hold N records, or 2N under recompute"
        )


def _drop_recompute(held: list[_Call], *, where: str) -> list[_Call]:
    """The forward records of a layer recorded twice per micro-batch: of each pair of equal ids, the first."""
    groups: dict[tuple, list[_Call]] = {}
    for call in held:
        groups.setdefault(_fingerprint(call.ids_TK), []).append(call)
    for group in groups.values():
        if len(group) != 2 or not torch.equal(group[0].ids_TK, group[1].ids_TK):
            lines = [c.line for c in group]
            what = (
                "no other record with the same ids (a recompute that routed differently from its forward?)"
                if len(group) == 1
                else f"{len(group)} records with the same ids, so the pairs are ambiguous"
            )
            raise DumpError(
                f"{where}: {len(held)} records (twice --microbatches: forward and recompute), but the "
                f"record(s) at line(s) {lines} have {what}; refusing to guess which are recomputes"
            )
    firsts = {id(group[0]) for group in groups.values()}
    return [c for c in held if id(c) in firsts]


def _fingerprint(ids_TK: torch.Tensor) -> tuple:
    return tuple(ids_TK.shape), ids_TK.numpy().tobytes()  # exact: equal keys are equal ids


def read_router_trace_ranks(
    directory: str | os.PathLike,
    *,
    layout,
    world_size: int,
    num_layers: int,
    num_experts: int | None = None,
    moe_layers=None,
    microbatches: int | None = None,
) -> dict[int, dict[int, Routes]]:
    """Every rank's ``router_trace_rank{R}.jsonl`` of one job of ``world_size`` ranks: ``{rank: {step: local Routes}}``.

    The tracer numbers layers as the chunk's module names do (``decoder.layers.<n>``, local to the pipeline
    stage); each rank's layers are moved to global numbers by its stage's first layer under ``layout``
    (Megatron's default rank order ``tp-cp-ep-dp-pp``). ``moe_layers`` (global): the model's MoE layers; with
    them a stage holding none of them has an empty trace (``{}``, no steps), and every other stage must trace
    exactly its own. Refused: a file of a rank outside the job or under another spelling, a rank's file
    missing, a record naming another rank, VPP (a rank's chunks share layer numbers there, so they cannot be
    told apart), an empty trace where the stage is not known to be dense, ranks holding different steps, a
    layer outside its stage.
    """

    directory = Path(directory)
    files = _rank_files(directory, world_size=world_size)
    if layout.vpp_chunks > 1:
        raise UsageError(
            "router_trace numbers a rank's layers per model chunk (decoder.layers.<n> in each chunk), so "
            "under VPP a rank's chunks share layer numbers and cannot be placed; record VPP jobs with "
            "RouteRecorder or the autopatch instead"
        )
    out = {}
    for rank in range(world_size):
        coords = views.rank_coords(layout, rank=rank, world_size=world_size)
        stage = views.chunk_layers(layout, pp_rank=coords.pp, vp_stage=0, num_layers=num_layers)
        own = None if moe_layers is None else [layer for layer in moe_layers if layer in stage]
        steps = read_router_trace(
            files[rank],
            num_experts=num_experts,
            layer_offset=stage.start,
            rank=rank,
            microbatches=microbatches,
            allow_empty=not own,
        )
        if not steps and own is None:
            raise DumpError(
                f"{files[rank]}: no decoder router_trace records. If pipeline stage {coords.pp} (layers "
                f"[{stage.start}, {stage.stop})) holds no MoE layer, give --moe-layers (the model's MoE "
                f"layers) so that this can be checked"
            )
        for step, routes in steps.items():
            outside = [layer for layer in routes.layers if layer not in stage]
            if outside:
                raise DumpError(
                    f"{files[rank]}: step {step}: layer(s) {[x - stage.start for x in outside]} (global "
                    f"{outside}) outside pipeline stage {coords.pp}'s {len(stage)} layers "
                    f"[{stage.start}, {stage.stop}) of --num-layers {num_layers}"
                )
            if own is not None and list(routes.layers) != own:
                raise DumpError(
                    f"{files[rank]}: step {step}: traced MoE layer(s) {list(routes.layers)} != pipeline "
                    f"stage {coords.pp}'s MoE layers {own} of --moe-layers"
                )
        out[rank] = steps
    traced = [rank for rank in out if out[rank]]
    if not traced:
        raise DumpError(f"{directory}: no rank's trace holds a decoder record")
    for rank in traced:
        if sorted(out[rank]) != sorted(out[traced[0]]):
            raise DumpError(f"{files[rank]}: steps {sorted(out[rank])} != rank {traced[0]}'s {sorted(out[traced[0]])}")
    experts = max(r.num_experts for steps in out.values() for r in steps.values())
    if num_experts is None:  # one expert count for every rank (a rank's trace may not show the highest id)
        out = {rank: {s: _widened(r, experts) for s, r in steps.items()} for rank, steps in out.items()}
    return out


def _rank_files(directory: Path, *, world_size: int) -> dict[int, Path]:
    files = {}
    for path in sorted(directory.iterdir()):
        found = TRACE_FILE.match(path.name)
        if found:
            rank = int(found.group(1))
            if path.name != f"router_trace_rank{rank}.jsonl" or rank >= world_size:
                raise DumpError(
                    f"{path}: not a trace of this job (ranks 0..{world_size - 1}, named "
                    f"router_trace_rank<R>.jsonl); move it out of {directory}"
                )
            files[rank] = path
    missing = sorted(set(range(world_size)) - set(files))
    if missing:
        raise DumpError(
            f"{directory}: router_trace file(s) of rank(s) {missing} missing (found ranks "
            f"{sorted(files)}); "
            f"merging needs every rank's trace of the {world_size}-rank job"
        )
    return files


def _widened(routes: Routes, num_experts: int) -> Routes:
    if routes.num_experts == num_experts:
        return routes
    return Routes(
        {layer: [routes.get(layer, mb) for mb in range(routes.microbatches)] for layer in routes.layers},
        num_experts=num_experts,
        topk=routes.topk,
    )
