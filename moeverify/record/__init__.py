"""Routing dumps: compact per-rank files of routing decisions, merged to a global view and compared.

Python API (DESIGN.md, Routing dumps)::

    from moeverify import record
    record.save("dump/", routes, step=0)        # any Routes; appends a new step to an existing dump
    dump = record.load("dump/")                  # validated; DumpError on anything corrupt
    dump.routes(step=0)                          # merged global Routes
    report = record.diff(dump.routes(), other)   # agreement, overlap@k, first divergent layer, load
    report = record.diff_stream(DumpSource(dump), DumpSource(other_dump))  # the same, a layer at a time

Several ranks: each rank opens a ``RankWriter`` with its ``views.RankCoords`` (or calls ``save`` with
``coords=``, ``layout=``, ``world_size=``), and rank 0 calls ``finalize`` after all ranks closed
(``save`` does the barrier itself when torch.distributed is initialised). ``RouteRecorder``
(``moeverify.record.recorder``) records any Megatron model's routing through forward hooks.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from moeverify.errors import DumpError
from moeverify.layout import Layout
from moeverify.record.diff import DiffReport, diff, diff_stream
from moeverify.record.format import MANIFEST, SCHEMA, VERSION, ModelInfo, ids_dtype_for
from moeverify.record.reader import Dump, load
from moeverify.record.writer import RankWriter, finalize
from moeverify.routes import Routes
from moeverify.views import RankCoords

__all__ = ["Dump", "DiffReport", "ModelInfo", "RankCoords", "RankWriter", "SCHEMA", "VERSION", "diff", "diff_stream",
           "finalize", "ids_dtype_for", "load", "save"]


def save(path: str | os.PathLike, routes: Routes, *, step: int = 0, num_layers: int | None = None,
         moe_layers: Sequence[int] | None = None, seq_len: int | Sequence[int] | None = None,
         batch: int | None = None, probs: Mapping[int, Sequence[torch.Tensor]] | None = None,
         coords: RankCoords | None = None, layout: Layout | None = None, world_size: int = 1,
         zigzag: bool = True) -> Path:
    """Write ``routes`` as step ``step`` of the dump at ``path`` (created, or appended to) and finalise it.

    Args:
        routes: global routes (one process), or this rank's local routes with ``coords``/``layout``.
        num_layers, moe_layers: model shape; default: the layers ``routes`` hold (last one + 1 layers).
        seq_len, batch: micro-batch geometry; needed to merge more than one rank.
        probs: optional ``{layer: [probs_TK per micro-batch]}`` router probabilities.

    With ``world_size > 1`` every rank calls ``save``; under an initialised torch.distributed group
    rank 0 then writes the manifest after a barrier, otherwise the caller runs ``finalize(path)``
    once all ranks have saved.
    """
    path = Path(path)
    default_layers = max(routes.layers) + 1 if routes.layers else 1
    model = ModelInfo(num_layers=num_layers if num_layers is not None else default_layers,
                      moe_layers=tuple(moe_layers if moe_layers is not None else routes.layers),
                      num_experts=routes.num_experts, topk=routes.topk)
    if (path / MANIFEST).exists() and step in load(path).steps:
        raise DumpError(f"{path}: step {step} is already in the dump; pick another step or another path")
    with RankWriter(path, model=model, coords=coords, layout=layout, world_size=world_size, zigzag=zigzag,
                    background=False, append=True) as writer:
        writer.add_routes(routes, step=step, seq_len=seq_len, batch=batch, probs=probs)
    if world_size > 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()
        if torch.distributed.get_rank() == 0:
            finalize(path, world_size=world_size)
        torch.distributed.barrier()
    elif world_size == 1:
        finalize(path, world_size=1)
    return path
