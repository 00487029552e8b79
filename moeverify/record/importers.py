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
import stat
import zipfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from moeverify.errors import DumpError, RouteError, UsageError
from moeverify.files import atomic_write
from moeverify.record.format import MAX_EXPERTS
from moeverify.record.router_trace import read_router_trace, read_router_trace_ranks
from moeverify.routing import npy_file
from moeverify.routing.routes import Routes

__all__ = [
    "export_npz",
    "is_export",
    "read_arrays",
    "read_export",
    "read_router_trace",
    "read_router_trace_ranks",
    "routes_from_arrays",
]


def routes_from_arrays(
    arrays_NLK: Sequence[np.ndarray],
    *,
    num_experts: int | None = None,
    moe_layers: Sequence[int] | None = None,
    where: str = "input",
    names: Sequence[str] | None = None,
) -> Routes:
    """``Routes`` from ``[tokens, layers, topk]`` arrays, one per micro-batch (``names``: how messages name
    them, e.g. their npz keys; default ``array {i}``)."""
    if not arrays_NLK:
        raise DumpError(f"{where}: no arrays")
    names = list(names) if names is not None else [f"array {i}" for i in range(len(arrays_NLK))]
    for name, arr in zip(names, arrays_NLK, strict=True):
        if not isinstance(arr, np.ndarray) or arr.ndim != 3 or not np.issubdtype(arr.dtype, np.integer):
            got = (
                f"shape {arr.shape} dtype {arr.dtype}"
                if isinstance(arr, np.ndarray)
                else f"{type(arr).__name__} (not a .npy member)"
            )
            raise DumpError(f"{where}: {name}: {got} != expected integer [tokens, layers, topk]")
        if arr.shape[1:] != arrays_NLK[0].shape[1:]:
            raise DumpError(f"{where}: {name}: shape {arr.shape} != (tokens, {arrays_NLK[0].shape[1:]})")
    layers = list(moe_layers) if moe_layers is not None else list(range(arrays_NLK[0].shape[1]))
    limit = num_experts if num_experts is not None else MAX_EXPERTS
    for name, arr in zip(names, arrays_NLK, strict=True):
        _refuse_huge(arr, limit=limit, where=f"{where}: {name}", layers=layers)
    tensors = [torch.from_numpy(np.ascontiguousarray(arr).astype(np.int64)) for arr in arrays_NLK]
    if len(layers) != tensors[0].shape[1]:
        raise DumpError(f"{where}: {len(layers)} moe layer number(s) given for {tensors[0].shape[1]} layer(s)")
    if len(set(layers)) != len(layers) or any(layer < 0 for layer in layers):
        dups = sorted({layer for layer in layers if layers.count(layer) > 1})
        raise DumpError(
            f"{where}: moe layer numbers {layers} must be distinct and >= 0" + (f" (repeated: {dups})" if dups else "")
        )
    if not any(t.numel() for t in tensors):
        raise DumpError(f"{where}: the arrays hold no tokens (shapes {[tuple(t.shape) for t in tensors]})")
    for name, t in zip(names, tensors, strict=True):
        _refuse_negative(t, where=f"{where}: {name}", layers=layers)
    experts = num_experts if num_experts is not None else int(max(int(t.max()) for t in tensors if t.numel())) + 1
    try:
        return Routes.from_stacked(tensors, layers=layers, num_experts=experts)
    except RouteError as exc:
        raise DumpError(f"{where}: {exc}") from None


def _refuse_huge(arr_NLK: np.ndarray, *, limit: int, where: str, layers: Sequence[int]) -> None:
    """Ids at or above ``limit`` refused on the raw values, before any widening: a uint64 of 2**63 or more
    would wrap to a negative id, and a huge id would size the expert count."""
    if arr_NLK.size == 0 or int(arr_NLK.max()) < limit:
        return
    token, column, _ = (int(x[0]) for x in np.nonzero(arr_NLK >= limit))
    raise DumpError(
        f"{where}: token {token} layer {layers[column]}: expert id {int(arr_NLK[token, column].max())} "
        f"out of range [0, {limit}) ({int((arr_NLK >= limit).sum())} such id(s))"
    )


def _refuse_negative(ids_NLK: torch.Tensor, *, where: str, layers: Sequence[int]) -> None:
    """Negative ids are capture gaps (-1) or garbage, never an expert: refuse them naming token and layer."""
    bad = (ids_NLK < 0).nonzero()
    if bad.numel():
        token, column = int(bad[0, 0]), int(bad[0, 1])
        raise DumpError(
            f"{where}: token {token} layer {layers[column]}: expert id {int(ids_NLK[token, column].min())}"
            f" < 0 ({int((ids_NLK < 0).any(dim=2).sum())} token-layer row(s) with negative ids: capture "
            f"gaps are not routes; Routes.from_rollout handles them for replay)"
        )


def read_arrays(path: str | os.PathLike, *, fmt: str | None = None) -> list[np.ndarray]:
    """The arrays of an ``.npy`` (one) or ``.npz`` (all, in key order) file, never unpickling."""
    return list(read_named_arrays(path, fmt=fmt).values())


def read_named_arrays(path: str | os.PathLike, *, fmt: str | None = None) -> dict[str, np.ndarray]:
    """``{name: array}`` of an ``.npy`` (its file name) or ``.npz`` (its keys, in natural key order); refuses a
    path that is not a regular file (a FIFO would block) and an npz member that is not a ``.npy``."""
    path = Path(path)
    kind = fmt or path.suffix.lstrip(".")
    if kind not in ("npy", "npz"):
        raise DumpError(f"{path}: unknown array format {kind!r}; use npy or npz")
    _check_regular(path)
    if kind == "npy":
        return {path.name: npy_file.load_npy(path, error=DumpError)}
    out = npy_file.load_npz(path, error=DumpError, order=lambda keys: sorted(keys, key=_natural_key))
    for key, value in out.items():
        if not isinstance(value, np.ndarray):
            raise DumpError(
                f"{path}: npz member {key!r} is not a .npy array ({type(value).__name__}); an .npz of "
                f"routes holds .npy members only"
            )
    return {f"npz key {key!r}": value for key, value in out.items()}


def _check_regular(path: Path) -> None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise DumpError(f"{path}: no such file") from None
    except OSError as exc:
        raise DumpError(f"{path}: cannot read: {exc}") from None
    if not stat.S_ISREG(st.st_mode):
        raise DumpError(f"{path}: not a regular file (a FIFO, device or directory); give an .npy/.npz file")


EXPORT_MARK = "moeverify_export"  # [1]: version of the export's own layout
_EXPORT_KEY = re.compile(r"^step(0|[1-9]\d*)_(?:mb(0|[1-9]\d*)|seq_len|batch)$")  # canonical numbers only
_EXPORT_STEPLIKE = re.compile(r"^step\d+_")  # a key an export might hold: checked strictly by read_export
_EXPORT_VERSIONS = (1,)


def export_npz(dump, path: str | os.PathLike, *, routes_of=None) -> Path:
    """Write every step's merged global routes as ``step{S}_mb{M}`` ``[tokens, layers, topk]`` arrays, with
    ``layers``, ``num_experts`` and, for a step in sequence order, ``step{S}_seq_len`` (per micro-batch) and
    ``step{S}_batch`` (sequences per merged micro-batch): ``dump diff`` reads the file back as a dump
    (``read_export``). ``routes_of(step)``, default ``dump.routes``: e.g. the routes mapped to logical ids.
    Written atomically; ``path`` must end in ``.npz``."""
    path = Path(path)
    if path.suffix != ".npz":
        raise UsageError(f"{path}: an export is a .npz file; give a name ending in .npz")
    arrays = {EXPORT_MARK: np.asarray([1], dtype=np.int64), "layers": np.asarray(dump.model.moe_layers, dtype=np.int64)}
    experts = dump.model.num_experts
    for step in sorted(dump.steps):
        routes = dump.routes(step=step) if routes_of is None else routes_of(step)
        experts = routes.num_experts
        for mb in range(routes.microbatches):
            arrays[f"step{step}_mb{mb}"] = (
                routes.stacked(mb).to(dump.ids_dtype if routes_of is None else torch.int64).numpy()
            )
        if dump.token_order(step) == "sequence":
            info = dump.steps[step]
            arrays[f"step{step}_seq_len"] = np.asarray(info.seq_len, dtype=np.int64)
            arrays[f"step{step}_batch"] = np.asarray([dump.layout.dp(dump.world_size) * info.batch], dtype=np.int64)
    arrays["num_experts"] = np.asarray([experts], dtype=np.int64)
    buffer = io.BytesIO()
    np.savez(buffer, allow_pickle=True, **arrays)  # the default, named: no array can be taken for it
    atomic_write(path, buffer.getvalue())
    return path


def is_export(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a ``.npz`` that ``export_npz`` wrote (or an older export: ``layers`` and step arrays).
    A file with the export mark is one even when damaged: ``read_export`` then says what is wrong with it."""
    path = Path(path)
    if path.suffix != ".npz" or not path.is_file():
        return False
    try:
        with np.load(path, allow_pickle=False) as npz:
            keys = set(npz.files)
    except (OSError, ValueError, zipfile.BadZipFile, EOFError):
        return False
    if EXPORT_MARK in keys:
        return True
    rest = keys - {"layers", "num_experts"}
    return "layers" in keys and bool(rest) and all(_EXPORT_STEPLIKE.match(k) for k in rest)


def read_export(path: str | os.PathLike, *, step: int | None):
    """``(routes, geometry)`` of one step of an export (``step`` None: the only step): geometry is
    ``(seq_len per micro-batch, batch)`` for a step in sequence order, else None (order unknown)."""
    path = Path(path)
    _check_regular(path)
    arrays = dict(zip(*_npz_items(path), strict=True))
    bad = "not a valid export"
    for key, value in arrays.items():
        if not isinstance(value, np.ndarray):
            raise DumpError(f"{path}: {bad}: npz member {key!r} is not a .npy array")
    unexpected = sorted(
        k for k in arrays if k not in (EXPORT_MARK, "layers", "num_experts") and not _EXPORT_KEY.match(k)
    )
    if unexpected or "layers" not in arrays:
        raise DumpError(
            f"{path}: {bad}: "
            + (f"key(s) {unexpected} unexpected" if unexpected else "'layers' missing")
            + "; an export holds moeverify_export, layers, num_experts and step{S}_mb{M}/_seq_len/_batch"
        )
    if EXPORT_MARK in arrays:
        (version,) = _export_ints(arrays, EXPORT_MARK, path=path, length=1)
        if version not in _EXPORT_VERSIONS:
            raise DumpError(
                f"{path}: {bad}: {EXPORT_MARK} version {version} unknown; this moeverify reads {list(_EXPORT_VERSIONS)}"
            )
    layers = _export_ints(arrays, "layers", path=path, lo=0)
    if list(layers) != sorted(set(layers)) or not layers:
        raise DumpError(
            f"{path}: {bad}: 'layers' {list(layers)!r:.80} must be non-empty and strictly ascending "
            f"(as export_npz writes it)"
        )
    experts = (
        _export_ints(arrays, "num_experts", path=path, length=1, lo=1, hi=MAX_EXPERTS + 1)[0]
        if "num_experts" in arrays
        else None
    )
    keys = [m for k in arrays if (m := _EXPORT_KEY.match(k))]
    steps = sorted({int(m.group(1)) for m in keys})
    if step is None:
        if len(steps) != 1:
            raise UsageError(f"{path}: an export of steps {steps}; choose one with --step/--step-b")
        step = steps[0]
    if step not in steps:
        raise UsageError(f"{path}: step {step} not in the export; steps held: {steps}")
    mbs = sorted(int(m.group(2)) for m in keys if m.group(2) and int(m.group(1)) == step)
    if mbs != list(range(len(mbs))) or not mbs:
        raise DumpError(f"{path}: step {step}: micro-batch arrays {mbs} are not 0..{len(mbs) - 1}")
    names = [f"step{step}_mb{mb}" for mb in mbs]
    routes = routes_from_arrays(
        [arrays[n] for n in names],
        num_experts=experts,
        moe_layers=list(layers),
        where=f"{path}: step {step}",
        names=[f"npz key {n!r}" for n in names],
    )
    has = [f"step{step}_{k}" in arrays for k in ("seq_len", "batch")]
    if not any(has):
        return routes, None
    if not all(has):
        raise DumpError(
            f"{path}: {bad}: step {step}: step{step}_seq_len and step{step}_batch must be both present or both absent"
        )
    seq_len = _export_ints(arrays, f"step{step}_seq_len", path=path, length=len(mbs), lo=1)
    (batch,) = _export_ints(arrays, f"step{step}_batch", path=path, length=1, lo=1)
    counts = [routes.get(routes.layers[0], mb).shape[0] for mb in range(routes.microbatches)]
    if any(n != length * batch for n, length in zip(counts, seq_len, strict=True)):
        raise DumpError(
            f"{path}: step {step}: micro-batch token counts {counts} != seq_len {list(seq_len)} x batch {batch}"
        )
    return routes, (seq_len, batch)


def _export_ints(
    arrays: dict, key: str, *, path: Path, length: int | None = None, lo: int | None = None, hi: int | None = None
) -> tuple[int, ...]:
    """An export's metadata array ``key``: 1-D, an integer dtype, ``length`` values (if given) in ``[lo, hi)``."""
    arr = arrays[key]
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer) or (length is not None and arr.shape[0] != length):
        want = f"({length},)" if length is not None else "(n,)"
        raise DumpError(
            f"{path}: not a valid export: {key!r} shape {arr.shape} dtype {arr.dtype} != expected integer {want}"
        )
    values = tuple(int(x) for x in arr.tolist())
    out = [v for v in values if (lo is not None and v < lo) or (hi is not None and v >= hi)]
    if out:
        raise DumpError(
            f"{path}: not a valid export: {key!r} value {out[0]} outside "
            f"[{lo if lo is not None else '-inf'}, {hi if hi is not None else 'inf'})"
        )
    return values


def _npz_items(path: Path) -> tuple[list[str], list[np.ndarray]]:
    members = npy_file.load_npz(path, error=DumpError, order=list)
    return list(members), list(members.values())


def _natural_key(name: str) -> tuple:
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name))
