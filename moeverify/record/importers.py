"""Converting routes from elsewhere into dumps, and dumps to ``.npz``.

- Rollout engines (vLLM, SGLang routed-experts / R3) return ``[tokens, layers, topk]`` integer arrays:
  ``.npy`` holds one micro-batch, ``.npz`` one micro-batch per array, in key order. Loaded with
  ``allow_pickle=False``.
- megatron-core's ``RouterTracer`` JSONL: ``moeverify.record.router_trace`` (re-exported here).
- ``export_npz`` writes ``step{S}_mb{M}`` ``[tokens, layers, topk]`` arrays plus ``layers``, ``num_experts`` and
  each step's geometry; ``read_export`` reads one step back, in the order and geometry the dump knew.

Legend: N = tokens, L = layers, K = top-k.
"""

from __future__ import annotations

import io
import os
import re
import zipfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from moeverify.errors import DumpError, RouteError, UsageError
from moeverify.files import atomic_write
from moeverify.record.router_trace import read_router_trace, read_router_trace_ranks
from moeverify.routes import Routes

__all__ = ["export_npz", "is_export", "read_arrays", "read_export", "read_router_trace", "read_router_trace_ranks",
           "routes_from_arrays"]


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


EXPORT_MARK = "moeverify_export"  # [1]: version of the export's own layout
_EXPORT_KEY = re.compile(r"^step(\d+)_(?:mb(\d+)|seq_len|batch)$")


def export_npz(dump, path: str | os.PathLike, *, routes_of=None) -> Path:
    """Write every step's merged global routes as ``step{S}_mb{M}`` ``[tokens, layers, topk]`` arrays, with
    ``layers``, ``num_experts`` and, for a step in sequence order, ``step{S}_seq_len`` (per micro-batch) and
    ``step{S}_batch`` (sequences per merged micro-batch): ``dump diff`` reads the file back as a dump
    (``read_export``). ``routes_of(step)``, default ``dump.routes``: e.g. the routes mapped to logical ids.
    Written atomically; ``path`` must end in ``.npz``."""
    path = Path(path)
    if path.suffix != ".npz":
        raise UsageError(f"{path}: an export is a .npz file; give a name ending in .npz")
    arrays = {EXPORT_MARK: np.asarray([1], dtype=np.int64),
              "layers": np.asarray(dump.model.moe_layers, dtype=np.int64)}
    experts = dump.model.num_experts
    for step in sorted(dump.steps):
        routes = dump.routes(step=step) if routes_of is None else routes_of(step)
        experts = routes.num_experts
        for mb in range(routes.microbatches):
            arrays[f"step{step}_mb{mb}"] = routes.stacked(mb).to(dump.ids_dtype if routes_of is None
                                                                 else torch.int64).numpy()
        if dump.token_order(step) == "sequence":
            info = dump.steps[step]
            arrays[f"step{step}_seq_len"] = np.asarray(info.seq_len, dtype=np.int64)
            arrays[f"step{step}_batch"] = np.asarray([dump.layout.dp(dump.world_size) * info.batch], dtype=np.int64)
    arrays["num_experts"] = np.asarray([experts], dtype=np.int64)
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    atomic_write(path, buffer.getvalue())
    return path


def is_export(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a ``.npz`` that ``export_npz`` wrote (or an older export: ``layers`` and step arrays)."""
    path = Path(path)
    if path.suffix != ".npz" or not path.is_file():
        return False
    try:
        with np.load(path, allow_pickle=False) as npz:
            keys = set(npz.files)
    except (OSError, ValueError, zipfile.BadZipFile, EOFError):
        return False
    rest = keys - {EXPORT_MARK, "layers", "num_experts"}
    return "layers" in keys and bool(rest) and all(_EXPORT_KEY.match(k) for k in rest)


def read_export(path: str | os.PathLike, *, step: int | None):
    """``(routes, geometry)`` of one step of an export (``step`` None: the only step): geometry is
    ``(seq_len per micro-batch, batch)`` for a step in sequence order, else None (order unknown)."""
    path = Path(path)
    arrays = dict(zip(*_npz_items(path)))
    steps = sorted({int(m.group(1)) for k in arrays if (m := _EXPORT_KEY.match(k))})
    if step is None:
        if len(steps) != 1:
            raise UsageError(f"{path}: an export of steps {steps}; choose one with --step/--step-b")
        step = steps[0]
    if step not in steps:
        raise UsageError(f"{path}: step {step} not in the export; steps held: {steps}")
    keys = [m for k in arrays if (m := _EXPORT_KEY.match(k))]
    mbs = sorted(int(m.group(2)) for m in keys if m.group(2) and int(m.group(1)) == step)
    if mbs != list(range(len(mbs))):
        raise DumpError(f"{path}: step {step}: micro-batch arrays {mbs} are not 0..{len(mbs) - 1}")
    experts = int(arrays["num_experts"][0]) if "num_experts" in arrays else None
    routes = routes_from_arrays([arrays[f"step{step}_mb{mb}"] for mb in mbs], num_experts=experts,
                                moe_layers=arrays["layers"].tolist(), where=f"{path}: step {step}")
    if f"step{step}_seq_len" not in arrays:
        return routes, None
    seq_len = tuple(int(x) for x in arrays[f"step{step}_seq_len"].tolist())
    batch = int(arrays[f"step{step}_batch"][0])
    counts = [routes.get(routes.layers[0], mb).shape[0] for mb in range(routes.microbatches)]
    if len(seq_len) != len(counts) or any(n != length * batch for n, length in zip(counts, seq_len)):
        raise DumpError(f"{path}: step {step}: micro-batch token counts {counts} != seq_len {list(seq_len)} x batch "
                        f"{batch}")
    return routes, (seq_len, batch)


def _npz_items(path: Path) -> tuple[list[str], list[np.ndarray]]:
    try:
        with np.load(path, allow_pickle=False) as npz:
            return list(npz.files), [npz[k] for k in npz.files]
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as exc:
        raise DumpError(f"{path}: cannot read as .npz: {exc}") from None


def _natural_key(name: str) -> tuple:
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name))
