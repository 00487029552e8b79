"""Routing dumps: compact per-rank files of routing decisions, merged to a global view and compared.

Python API (docs/design.md, "Public contract"; the format in docs/dumps.md)::

    from moeverify import record
    record.save("dump/", routes, step=0)        # any Routes; appends a new step to an existing dump
    record.save("dump/", routes, step=1, seq_len=S, batch=B, order="router")  # with the token order recorded
    dump = record.load("dump/")                  # validated; DumpError on anything corrupt
    dump.routes(step=0)                          # merged global Routes
    report = record.diff(dump.routes(), other)   # agreement, overlap@k, first divergent layer, load
    report = record.diff_stream(DumpSource(dump), DumpSource(other_dump))  # the same, a layer at a time

Several ranks: each rank opens a ``RankWriter`` with its ``views.RankCoords`` (or calls ``save`` with
``coords=``, ``layout=``, ``world_size=``), and rank 0 calls ``finalize`` after all ranks closed
(``save`` does the barrier itself when torch.distributed is initialised). ``RouteRecorder``
(``moeverify.patches.recorder``) records any Megatron model's routing through forward hooks.

Modules: ``format`` (names, the dtypes a dump holds, manifest), ``writer`` (atomic per-rank files), ``commit``
(``finalize``), ``saving`` (``save``), ``reader`` (``load``, ``Dump``), ``layer_read`` (one indexed tensor),
``order`` and ``tokens`` (token order and identity of two sources), ``stream`` (layer sources), ``diff`` and
``diff_report`` (comparing two routings), ``summary`` (``inspect``), ``rollout`` (a dump lined up with a rollout
engine's routes), ``importers`` (routes from elsewhere, ``.npz`` out), ``router_trace`` (megatron-core's
``RouterTracer`` JSONL).
"""

from __future__ import annotations

from moeverify.record.commit import finalize
from moeverify.record.diff import DiffReport, diff, diff_stream
from moeverify.record.format import MANIFEST, SCHEMA, VERSION, ModelInfo, ids_dtype_for
from moeverify.record.reader import Dump, load
from moeverify.record.saving import save
from moeverify.record.writer import RankWriter
from moeverify.routing.views import RankCoords

__all__ = [
    "Dump",
    "DiffReport",
    "MANIFEST",
    "ModelInfo",
    "RankCoords",
    "RankWriter",
    "SCHEMA",
    "VERSION",
    "diff",
    "diff_stream",
    "finalize",
    "ids_dtype_for",
    "load",
    "save",
]
