"""Writing routing dumps: atomic files and a per-rank writer that can run off the training thread; each rank's
writer ends with its record, which ``commit.finalize`` folds into ``manifest.json`` (written last).

Format version 2 (``format.VERSION``): layers arrive one at a time and are buffered per (step, micro-batch);
a flush packs each micro-batch's buffered layers into one ``[L, T, K]`` tensor. Legend: L = packed layers,
T = tokens (local router order), K = top-k.
"""

from __future__ import annotations

import json
import os
import queue
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save as st_save

from moeverify.errors import DumpError, MoEVerifyError
from moeverify.files import atomic_write
from moeverify.record import format as fmt
from moeverify.record.commit import record_from_manifest, uncommitted_steps, write_json
from moeverify.routing.routes import Routes, validate_topk_ids
from moeverify.routing.views import RankCoords
from moeverify.spec.layout import Layout

# Work items: ("layer", ...) and ("tokens", ...) carry the arguments of _store_layer / _store_tokens; the two
# markers below are told apart by identity.
_Item = tuple[Any, ...]
_FLUSH: _Item = ("flush",)
_STOP: _Item = ("stop",)


class RankWriter:
    """Writes one rank's routes to ``rank{R:05d}[.pNNN].safetensors`` in a dump directory (format v2).

    ``add``/``add_routes`` copy tensors to CPU on the caller's thread and queue them; a background
    thread (bounded queue) narrows dtypes, validates and buffers them per (step, micro-batch). ``flush()``
    packs each buffered micro-batch's layers into one ``[L, T, K]`` tensor and writes them as one part file
    (one per distinct set of buffered layers); ``close()`` flushes and writes the rank's record. Errors of
    the background thread are raised by the next call. Nothing is pickled.

    Args:
        path: the dump directory (created).
        model: the model shape (``format.ModelInfo``).
        coords: this rank's coordinates (``moeverify.routing.views.RankCoords``); default rank 0.
        layout, world_size: the layout the routes were recorded under.
        zigzag: the CP sequence split used (see ``moeverify.routing.views``).
        background: run the worker thread (False: do the work inline).
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        model: fmt.ModelInfo,
        coords: RankCoords | None = None,
        layout: Layout | None = None,
        world_size: int = 1,
        zigzag: bool = True,
        background: bool = True,
        queue_size: int = 256,
        append: bool = False,
    ):
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.model, self.layout, self.world_size, self.zigzag = model, layout or Layout(), world_size, zigzag
        self.coords = coords or RankCoords(rank=0)
        self.layout.validate(world_size=world_size)
        self._ids_dtype = fmt.ids_dtype_for(model.num_experts)
        self._packs: dict[tuple[int, int], dict[int, tuple[torch.Tensor, torch.Tensor | None]]] = {}
        self._pending_tokens: dict[str, torch.Tensor] = {}
        self._names: set[str] = set()
        self._steps: dict[int, dict] = {}
        self._files: list[dict] = []
        self._probs_dtype: str | None = None
        self._error: BaseException | None = None
        self._closed = False
        self._old_steps: frozenset[int] = frozenset()
        if append:
            self._resume()
        self._queue: queue.Queue[_Item] | None = None
        self._thread: threading.Thread | None = None
        if background:
            self._queue = queue.Queue(maxsize=queue_size)
            self._thread = threading.Thread(
                target=self._work, args=(self._queue,), name=f"moeverify-dump-rank{self.coords.rank}", daemon=True
            )
            self._thread.start()

    def _resume(self) -> None:
        """Continue an existing rank record: keep its files and steps; new steps go to new part files."""
        rec_path = self.path / fmt.rank_record_file(self.coords.rank)
        if rec_path.is_file():
            try:
                rec = json.loads(rec_path.read_text())
            except (OSError, ValueError) as exc:
                raise DumpError(f"{rec_path}: unreadable rank record: {exc}") from None
        else:
            rec = record_from_manifest(self.path, self.coords.rank)
            if rec is None:
                return
            rec_path = self.path / fmt.MANIFEST
        mine = {"model": self.model.as_dict(), "layout": self.layout.as_dict(), "world_size": self.world_size}
        for key, value in mine.items():
            if rec.get(key) != value:
                raise DumpError(f"{rec_path}: cannot append: {key} {rec.get(key)!r} != {value!r}")
        if rec.get("version") != fmt.VERSION:
            raise DumpError(
                f"{rec_path}: cannot append: the dump is format version {rec.get('version')!r}, this "
                f"writer writes version {fmt.VERSION} (one dump holds one version); write the new "
                f"steps to a new dump directory"
            )
        uncommitted = uncommitted_steps(self.path, rec)
        if uncommitted:
            raise DumpError(
                f"{rec_path}: step(s) {uncommitted} were written but never committed to "
                f"{fmt.MANIFEST} (a run ended between the rank files and the manifest). "
                f"`moeverify dump finalize {self.path}` commits them, "
                f"`moeverify dump finalize {self.path} --drop-uncommitted` discards them"
            )
        self._files = list(rec["files"])
        self._probs_dtype = rec.get("probs_dtype")
        self._steps = {
            int(s): {
                "microbatches": i["microbatches"],
                "batch": i["batch"],
                "seq_len": dict(enumerate(i["seq_len"] or [])),
            }
            for s, i in rec["steps"].items()
        }
        self._old_steps = frozenset(self._steps)

    # -- caller side ------------------------------------------------------------------------------
    def add(
        self,
        *,
        step: int,
        mb: int,
        layer: int,
        ids_TK: torch.Tensor,
        probs_TK: torch.Tensor | None = None,
        validated: bool = False,
    ) -> None:
        """Queue one layer's routes of one micro-batch (``validated``: range and duplicates already checked)."""
        item = ("layer", step, mb, layer, _to_cpu(ids_TK), None if probs_TK is None else _to_cpu(probs_TK), validated)
        self._submit(item)

    def add_tokens(
        self,
        *,
        step: int,
        mb: int,
        seq_len: int | None = None,
        batch: int | None = None,
        positions_T: torch.Tensor | None = None,
        seq_ids_T: torch.Tensor | None = None,
        fingerprints_B: torch.Tensor | None = None,
    ) -> None:
        """Record a micro-batch's geometry (global ``seq_len``, per-DP-rank ``batch``), token ids and the token
        identity of its input sequences (``fingerprints_B``, see ``format``)."""
        item = (
            "tokens",
            step,
            mb,
            seq_len,
            batch,
            None if positions_T is None else _to_cpu(positions_T),
            None if seq_ids_T is None else _to_cpu(seq_ids_T),
            None if fingerprints_B is None else _to_cpu(fingerprints_B),
        )
        self._submit(item)

    def add_routes(
        self,
        routes: Routes,
        *,
        step: int = 0,
        seq_len: int | Sequence[int] | None = None,
        batch: int | None = None,
        probs: Mapping[int, Sequence[torch.Tensor]] | None = None,
    ) -> None:
        """Queue every layer and micro-batch of ``routes`` (local to this rank) for ``step``."""
        if (routes.num_experts, routes.topk) != (self.model.num_experts, self.model.topk):
            raise DumpError(
                f"{self.path}: routes have num_experts {routes.num_experts}, topk {routes.topk}; the "
                f"dump's model has {self.model.num_experts}, {self.model.topk}"
            )
        lens = [seq_len] * routes.microbatches if seq_len is None or isinstance(seq_len, int) else list(seq_len)
        if len(lens) != routes.microbatches:
            raise DumpError(f"{self.path}: {len(lens)} seq_len(s) for {routes.microbatches} micro-batch(es)")
        for mb in range(routes.microbatches):
            if seq_len is not None or batch is not None:
                self.add_tokens(step=step, mb=mb, seq_len=lens[mb], batch=batch)
            for layer in routes.layers:
                p = None if probs is None else probs[layer][mb]
                self.add(step=step, mb=mb, layer=layer, ids_TK=routes.get(layer, mb), probs_TK=p, validated=True)

    def flush(self) -> None:
        """Wait for queued tensors and write them as one part file (atomically)."""
        self._submit(_FLUSH)
        if self._queue is not None:
            self._queue.join()
        self._raise_pending()

    def close(self) -> None:
        """Flush, stop the worker and write this rank's record (``rank{R:05d}.json``)."""
        if self._closed:
            return
        self.flush()
        if self._queue is not None and self._thread is not None:  # set together, by a background writer
            self._queue.put(_STOP)
            self._thread.join()
        self._closed = True
        write_json(self.path / fmt.rank_record_file(self.coords.rank), self._record())

    def __enter__(self) -> RankWriter:
        return self

    def __exit__(self, *exc) -> None:
        if exc[0] is None:
            self.close()
        elif self._queue is not None:
            self._queue.put(_STOP)

    def _submit(self, item: _Item) -> None:
        self._raise_pending()
        if self._closed:
            raise DumpError(f"{self.path}: writer of rank {self.coords.rank} is closed")
        if self._queue is None:
            self._handle(item)
        else:
            self._queue.put(item)

    def _raise_pending(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            if isinstance(error, MoEVerifyError):
                raise error
            raise DumpError(f"{self.path}: background writer of rank {self.coords.rank} failed: {error!r}") from error

    # -- worker side ------------------------------------------------------------------------------
    def _work(self, items: queue.Queue[_Item]) -> None:
        while True:
            item = items.get()
            try:
                if item is _STOP:
                    return
                if self._error is None:
                    self._handle(item)
            except BaseException as exc:  # handed to the caller's next call
                self._error = exc
            finally:
                items.task_done()

    def _handle(self, item: _Item) -> None:
        if item is _FLUSH:
            self._write_part()
        elif item[0] == "layer":
            self._store_layer(*item[1:])
        else:
            self._store_tokens(*item[1:])

    def _store_layer(
        self, step: int, mb: int, layer: int, ids_TK: torch.Tensor, probs_TK: torch.Tensor | None, validated: bool
    ) -> None:
        if layer not in self.model.moe_layers:
            raise DumpError(
                f"{self.path}: layer {layer} is not an MoE layer of the model {list(self.model.moe_layers)}"
            )
        if not validated:
            validate_topk_ids(
                ids_TK,
                layer=layer,
                microbatch=mb,
                num_experts=self.model.num_experts,
                topk=self.model.topk,
                rank=self.coords.rank,
            )
        elif ids_TK.dim() != 2 or ids_TK.shape[1] != self.model.topk:
            raise DumpError(
                f"layer {layer} rank {self.coords.rank} mb {mb}: route shape {tuple(ids_TK.shape)} != "
                f"expected (T, K={self.model.topk})"
            )
        if probs_TK is not None:
            if probs_TK.dtype not in fmt.PROB_DTYPES or tuple(probs_TK.shape) != tuple(ids_TK.shape):
                raise DumpError(
                    f"layer {layer} rank {self.coords.rank} mb {mb}: probs {probs_TK.dtype} "
                    f"{tuple(probs_TK.shape)} != expected float {tuple(ids_TK.shape)}"
                )
            self._probs_dtype = fmt.PROB_DTYPES[probs_TK.dtype]
            probs_TK = probs_TK.contiguous()
        self._claim(step, fmt.tensor_name(step=step, mb=mb, layer=layer, kind="ids"))
        self._packs.setdefault((step, mb), {})[layer] = (ids_TK.to(self._ids_dtype).contiguous(), probs_TK)
        info = self._steps.setdefault(step, {"microbatches": 0, "seq_len": {}, "batch": None})
        info["microbatches"] = max(info["microbatches"], mb + 1)

    def _store_tokens(self, step, mb, seq_len, batch, positions_T, seq_ids_T, fingerprints_B=None) -> None:
        info = self._steps.setdefault(step, {"microbatches": 0, "seq_len": {}, "batch": None})
        info["microbatches"] = max(info["microbatches"], mb + 1)
        if seq_len is not None:
            info["seq_len"][mb] = int(seq_len)
        if batch is not None:
            if info["batch"] not in (None, int(batch)):
                raise DumpError(f"{self.path}: step {step}: batch {batch} != {info['batch']} given before")
            info["batch"] = int(batch)
        for kind, t in (("positions", positions_T), ("seq_ids", seq_ids_T), (fmt.FINGERPRINTS, fingerprints_B)):
            if t is not None:
                name = fmt.packed_name(step=step, mb=mb, kind=kind)
                self._claim(step, name)
                self._pending_tokens[name] = t.reshape(-1).to(fmt.INDEX_DTYPE).contiguous()

    def _claim(self, step: int, name: str) -> None:
        """``name`` (a layer's v1 name, or a token tensor's) is recorded once, in a step not yet in the dump."""
        if step in self._old_steps:
            raise DumpError(f"{self.path}: step {step} is already in the dump")
        if name in self._names:
            raise DumpError(
                f"{self.path}: rank {self.coords.rank} recorded {name} twice (a recompute forward "
                f"recorded again, or a step/micro-batch number reused)"
            )
        self._names.add(name)

    def _write_part(self) -> None:
        """Pack the buffered micro-batches; one part file per distinct layer list (the file entry's ``layers``)."""
        groups: dict[tuple[int, ...], dict[str, torch.Tensor]] = {}
        for (step, mb), held in sorted(self._packs.items()):
            layers = tuple(sorted(held))
            groups.setdefault(layers, {}).update(self._pack(step, mb, layers, held))
        if self._pending_tokens:
            first = next(iter(groups), ())
            groups.setdefault(first, {}).update(self._pending_tokens)
        for layers, tensors in groups.items():
            name = fmt.rank_file(self.coords.rank, len(self._files))
            metadata = {"schema": fmt.SCHEMA, "version": str(fmt.VERSION), "rank": str(self.coords.rank)}
            data = st_save(tensors, metadata=metadata)
            atomic_write(self.path / name, data)
            self._files.append({"name": name, "bytes": len(data), "tensors": len(tensors), "layers": list(layers)})
        self._packs, self._pending_tokens = {}, {}

    def _pack(
        self, step: int, mb: int, layers: tuple[int, ...], held: Mapping[int, tuple[torch.Tensor, torch.Tensor | None]]
    ) -> dict[str, torch.Tensor]:
        """``{step{S}/mb{M}/ids: [L, T, K]}`` (and ``probs``) of one micro-batch's buffered layers."""
        where = f"{self.path}: rank {self.coords.rank} step {step} mb {mb}"
        tokens = {layer: held[layer][0].shape[0] for layer in layers}
        if len(set(tokens.values())) > 1:
            raise DumpError(
                f"{where}: layers hold different token counts {tokens}; the layers of one micro-batch "
                f"are packed into one [L, T, K] tensor and must hold the same T"
            )
        out = {fmt.packed_name(step=step, mb=mb, kind="ids"): torch.stack([held[layer][0] for layer in layers])}
        probs = {layer: probs_TK for layer in layers if (probs_TK := held[layer][1]) is not None}
        if probs:
            with_probs = list(probs)
            if len(with_probs) != len(layers):
                raise DumpError(
                    f"{where}: probs given for layer(s) {with_probs} but not for "
                    f"{sorted(set(layers) - set(with_probs))}; a packed micro-batch holds probs for "
                    f"all of its layers or none"
                )
            dtypes = {layer: fmt.PROB_DTYPES[probs_TK.dtype] for layer, probs_TK in probs.items()}
            if len(set(dtypes.values())) > 1:
                raise DumpError(f"{where}: probs dtypes differ between layers {dtypes}; give one float dtype")
            out[fmt.packed_name(step=step, mb=mb, kind="probs")] = torch.stack(list(probs.values()))
        return out

    def _record(self) -> dict:
        steps = {}
        for step, info in sorted(self._steps.items()):
            lens = info["seq_len"]
            full = len(lens) == info["microbatches"]
            steps[str(step)] = {
                "microbatches": info["microbatches"],
                "batch": info["batch"],
                "seq_len": [lens[m] for m in range(info["microbatches"])] if full else None,
            }
        return {
            "schema": fmt.SCHEMA,
            "version": fmt.VERSION,
            "rank": self.coords.rank,
            "coords": self.coords.as_dict(),
            "model": self.model.as_dict(),
            "layout": self.layout.as_dict(),
            "world_size": self.world_size,
            "zigzag": self.zigzag,
            "files": self._files,
            "steps": steps,
            "ids_dtype": fmt.ID_DTYPE_NAMES[self._ids_dtype],
            "probs_dtype": self._probs_dtype,
        }


def _to_cpu(t: torch.Tensor) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise DumpError(f"expected a torch.Tensor, got {type(t).__name__}")
    t = t.detach()
    # A copy: the caller may reuse or modify its buffer after add() returns.
    return t.to("cpu", copy=True) if t.device.type == "cpu" else t.to("cpu")
