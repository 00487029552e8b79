"""Reading routing dumps: strict validation at load, then per-rank and merged global routes.

``load`` checks the manifest (schema, version, keys), every rank file (present, byte size, safetensors
header, rank metadata) and every tensor (name, dtype, shape, layers and micro-batches a rank must
hold) before any data is read. Every problem is a ``DumpError`` naming the file and tensor, with
expected vs got. Both format versions are read (``format.VERSIONS``) and indexed per layer alike: a v2
packed ``[L, T, K]`` tensor gives one index entry per layer, whose bytes are read alone (``layer_read``: one
positioned read of that layer's span). Legend: L = packed layers, T = tokens (local router order), K = top-k.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from moeverify.errors import SHOW_NAMES, DumpError, LayoutError, RouteError, few, more
from moeverify.record import format as fmt
from moeverify.record.layer_read import Entry, checked_offset, data_spans, read, sequence_order
from moeverify.routing import views
from moeverify.routing.routes import Routes, validate_topk_ids
from moeverify.runtime.dtypes import SAFETENSORS
from moeverify.spec.layout import Layout

_REQUIRED = ("schema", "version", "model", "layout", "world_size", "zigzag", "ids_dtype", "steps", "ranks")
_LAYOUT_KEYS = {"tp", "pp", "cp", "ep", "etp", "vpp", "sp"}  # written by every version; pp_first/... optional


class Dump:
    """A validated routing dump. Use ``routes(step)`` for the merged global view."""

    def __init__(self, path: Path, manifest: dict):
        self.path = path
        self.manifest = manifest
        where = f"{path / fmt.MANIFEST}"
        self.version = manifest["version"]
        self.model = fmt.ModelInfo.from_dict(manifest["model"], where=where)
        self.world_size = fmt.strict_int(manifest["world_size"], where=where, key="world_size", lo=1)
        rank_keys = {fmt.int_key(key, where=where, what="ranks"): key for key in manifest["ranks"]}
        if set(rank_keys) != set(range(len(rank_keys))) or self.world_size != len(rank_keys):
            # bounded by the ranks listed: world_size alone never sizes anything
            missing = [r for r in range(min(self.world_size, len(rank_keys) + SHOW_NAMES)) if r not in rank_keys]
            missing = missing[:SHOW_NAMES]
            n_missing = self.world_size - sum(1 for r in rank_keys if 0 <= r < self.world_size)
            extra = sorted(r for r in rank_keys if r >= self.world_size)
            raise DumpError(
                f"{where}: rank(s) {missing}{more(n_missing, len(missing))} of "
                f"world_size {self.world_size} missing from the manifest"
                + (f"; rank(s) {few(extra)} listed outside it" if extra else "")
            )
        layout = manifest["layout"]
        absent = sorted(_LAYOUT_KEYS - set(layout))
        if absent:
            raise DumpError(f"{where}: layout is missing key(s) {absent} (got {sorted(layout)})")
        try:
            self.layout = Layout.from_mapping(layout, where=f"{where}: layout")
            self.layout.validate(world_size=self.world_size)
        except (LayoutError, TypeError, ValueError) as exc:
            raise DumpError(f"{where}: {exc}") from None
        self.zigzag = fmt.strict_bool(manifest["zigzag"], where=where, key="zigzag")
        self.ids_dtype = self._dtype_of(manifest, "ids_dtype", where=where)
        if self.ids_dtype != fmt.ids_dtype_for(self.model.num_experts):
            raise DumpError(
                f"{where}: ids_dtype {manifest['ids_dtype']} != expected "
                f"{fmt.ID_DTYPE_NAMES[fmt.ids_dtype_for(self.model.num_experts)]} for "
                f"{self.model.num_experts} experts"
            )
        # probs_dtype: absent in older dumps (any float dtype then); null: the dump holds no probs
        self.probs_dtype = (
            self._dtype_of(manifest, "probs_dtype", where=where) if manifest.get("probs_dtype") is not None else None
        )
        self._probs_declared = "probs_dtype" not in manifest or self.probs_dtype is not None
        self.steps = {
            fmt.int_key(s, where=where, what="steps"): fmt.step_info(i, where=f"{where}: steps[{s!r}]")
            for s, i in manifest["steps"].items()
        }
        self.coords = {
            rank: self._rank_coords(
                manifest["ranks"][key]["coords"], rank=rank, where=f"{where}: ranks[{key!r}].coords"
            )
            for rank, key in sorted(rank_keys.items())
        }
        self._held: dict[int, tuple[int, ...]] = {}  # rank -> its MoE layers (``_layers``)
        self._index: dict[tuple[int, int, int, int | None, str], Entry] = {}
        self._tensor_counts: list[tuple[Path, int, int, int]] = []  # (file, rank, held, listed in the manifest)
        self._token_ids_checked: set[int] = set()  # steps whose positions/seq_ids layer_routes has checked
        self._orders: dict[tuple[int, int, int], tuple | None] = {}  # (rank, seq_len, batch) -> sequence_order
        for rank, entry in sorted(manifest["ranks"].items(), key=lambda kv: int(kv[0])):
            for file in entry["files"]:
                self._index_file(int(rank), file)
        for rank in sorted(self.coords):
            self._check_rank_complete(rank)
        probs = next((e for k, e in self._index.items() if k[4] == "probs"), None)
        if probs is not None and not self._probs_declared:
            raise DumpError(
                f"{probs.file}: tensor {probs.label}: probs in the file, but {self.path / fmt.MANIFEST} "
                f"has probs_dtype null (a dump without router probabilities)"
            )
        for file, rank, held, listed in self._tensor_counts:  # after the checks that name the tensor
            if held != listed:
                raise DumpError(
                    f"{file}: holds {held} tensor(s) != {listed} listed in {self.path / fmt.MANIFEST} "
                    f"(rank {rank} file {file.name} 'tensors')"
                )

    # -- public -----------------------------------------------------------------------------------
    @property
    def has_probs(self) -> bool:
        return any(key[4] == "probs" for key in self._index)

    @property
    def has_fingerprints(self) -> bool:
        """Whether any micro-batch carries token fingerprints (``format``); without them token identity is unknown."""
        return any(key[4] == fmt.FINGERPRINTS for key in self._index)

    def fingerprints(self, *, step: int = 0, rank: int = 0, mb: int = 0) -> torch.Tensor | None:
        """``[B]`` int64 fingerprints of micro-batch ``mb``'s input sequences on ``rank``, or None (not recorded)."""
        key = (rank, step, mb, None, fmt.FINGERPRINTS)
        return self._read(*key) if key in self._index else None

    def local_routes(self, *, step: int = 0, rank: int = 0) -> Routes:
        """The routes rank ``rank`` recorded in ``step``: its MoE layers, its tokens in local order."""
        return self._local(rank, step, self._layers(rank), checked=True).chosen_by("dump")

    def local_probs(self, *, step: int = 0, rank: int = 0) -> dict[int, list[torch.Tensor]]:
        """Router probabilities ``{layer: [probs_TK per micro-batch]}`` of one rank (empty if not recorded)."""
        info = self._step(step)
        return {
            layer: [self._read(rank, step, mb, layer, "probs") for mb in range(info.microbatches)]
            for layer in self._layers(rank)
            if (rank, step, 0, layer, "probs") in self._index
        }

    def token_order(self, step: int = 0) -> str | None:
        """``"sequence"`` when ``routes(step)`` is in sequence order (``g = b * S + s``; the step recorded its
        geometry, or several ranks were merged), None when it is as saved, in an order the dump does not know."""
        return "sequence" if self.geometry(step) is not None else None

    def geometry(self, step: int = 0) -> tuple[tuple[int, ...], int] | None:
        """``(seq_len per micro-batch, batch per DP rank)`` as ``step`` recorded them; None where it did not."""
        info = self._step(step)
        return None if info.seq_len is None or info.batch is None else (info.seq_len, info.batch)

    def routes(self, step: int = 0) -> Routes:
        """The merged global routes of ``step``: ``[tokens, topk]`` per MoE layer and micro-batch."""
        info = self._step(step)
        if self.world_size == 1 and info.seq_len is None:
            return self.local_routes(step=step, rank=0)
        self._geometry(step, info)
        for rank in sorted(self.coords):
            self._check_token_ids(rank, step, info)
        return self._merged(step, info, layers=self.model.moe_layers, where=f"{self.path}: step {step}")[0].chosen_by(
            "dump"
        )

    def microbatch_tokens(self, *, step: int = 0) -> list[int]:
        """Tokens per micro-batch of ``routes(step)``, from the index alone (no data read)."""
        info = self._step(step)
        if self.world_size == 1 and info.seq_len is None:
            layers = self._layers(0)
            return [
                self._index[(0, step, mb, layers[0], "ids")].shape[0] if layers else 0
                for mb in range(info.microbatches)
            ]
        seq_len, batch = self._geometry(step, info)
        return [self.layout.dp(self.world_size) * batch * length for length in seq_len]

    def layer_routes(self, *, step: int = 0, layer: int, like: Routes | None = None) -> Routes:
        """One MoE layer of ``routes(step)`` (same merge, order and checks), reading only that layer's tensors.
        ``like``: validated routes whose identical rows need no check of their own (``Routes.adopt``)."""
        return self._layer(step, layer, like=like, gather=True)[0]

    def layer_rows(
        self, *, step: int = 0, layer: int, like: Routes | None = None
    ) -> tuple[Routes, list[torch.Tensor | None]]:
        """``layer_routes``, except that a layer one rank alone holds keeps that rank's row order: its routes
        (same checks) and, per micro-batch, the global token of each row (None: row ``t`` is token ``t``, as
        after any merge). For a caller that needs the global token of a few rows only (``diff_stream``: the
        differing ones), which then saves moving every row."""
        return self._layer(step, layer, like=like, gather=False)

    def _layer(
        self, step: int, layer: int, *, like: Routes | None, gather: bool
    ) -> tuple[Routes, list[torch.Tensor | None]]:
        info = self._step(step)
        if layer not in self.model.moe_layers:
            raise DumpError(f"{self.path}: layer {layer} is not an MoE layer of the dump {list(self.model.moe_layers)}")
        if self.world_size == 1 and info.seq_len is None:
            held = (layer,) if layer in self._layers(0) else ()
            return self._local(0, step, held, checked=True, like=like), [None] * info.microbatches
        self._geometry(step, info)
        if step not in self._token_ids_checked:
            for rank in sorted(self.coords):
                self._check_token_ids(rank, step, info)
            self._token_ids_checked.add(step)
        return self._merged(
            step, info, layers=(layer,), where=f"{self.path}: step {step}: layer {layer}", like=like, gather=gather
        )

    def _local(
        self, rank: int, step: int, layers: tuple[int, ...], *, checked: bool, like: Routes | None = None
    ) -> Routes:
        """Rank ``rank``'s ids of ``layers`` in ``step``; ``checked=False`` leaves the ids to the merge's check."""
        info = self._step(step)
        held = {
            layer: [self._read(rank, step, mb, layer, "ids") for mb in range(info.microbatches)]
            for layer in layers
            if layer in self._layers(rank)
        }
        if not checked:
            return Routes.unchecked(held, num_experts=self.model.num_experts, topk=self.model.topk)
        try:
            return Routes.adopt(held, num_experts=self.model.num_experts, topk=self.model.topk, like=like)
        except RouteError as exc:
            error = exc
        try:  # the error path only: check again, naming the rank (Routes does not know it)
            for layer, mbs in held.items():
                for mb, ids_TK in enumerate(mbs):
                    validate_topk_ids(
                        ids_TK,
                        layer=layer,
                        microbatch=mb,
                        num_experts=self.model.num_experts,
                        topk=self.model.topk,
                        rank=rank,
                    )
        except RouteError as exc:
            error = exc
        raise DumpError(f"{self._rank_files(rank, step)}: step {step}: {error}") from None

    def _merged(
        self,
        step: int,
        info: fmt.StepInfo,
        *,
        layers: tuple[int, ...],
        where: str,
        like: Routes | None = None,
        gather: bool = True,
    ) -> tuple[Routes, list[torch.Tensor | None]]:
        """The ranks' ``layers`` merged to the global view, and tokens as ``layer_rows`` gives them. The ids are
        validated once, as merged: every rank's row is in the merged view (replicas are compared equal first).
        On a failure each rank's tensors are checked on their own, so that the message names the file. Layers
        that one rank alone holds are put in order by one gather of whole rows as they are read
        (``layer_read.sequence_order``), or, with ``gather=False`` (one layer), left in that rank's order."""
        seq_len, batch = self._geometry(step, info)
        holders = {layer: [r for r in sorted(self.coords) if layer in self._layers(r)] for layer in layers}
        if all(len(ranks) == 1 for ranks in holders.values()):
            merged = self._gathered(
                step, info, {layer: ranks[0] for layer, ranks in holders.items()}, where=where, like=like, gather=gather
            )
            if merged is not None:
                return merged
        local = {self.coords[r]: self._local(r, step, layers, checked=False) for r in sorted(self.coords)}
        try:
            return Routes.to_global(
                local,
                self.layout,
                world_size=self.world_size,
                seq_len=seq_len,
                batch=batch,
                num_layers=self.model.num_layers,
                moe_layers=layers,
                zigzag=self.zigzag,
            ), [None] * info.microbatches
        except (RouteError, LayoutError) as exc:
            for rank in sorted(self.coords):
                self._local(rank, step, layers, checked=True)  # raises naming the rank's file, if the ids are bad
            raise DumpError(f"{where}: cannot merge ranks: {exc}") from None

    def _gathered(
        self, step: int, info: fmt.StepInfo, owner: dict[int, int], *, where: str, like: Routes | None, gather: bool
    ) -> tuple[Routes, list[torch.Tensor | None]] | None:
        """``_merged`` of layers each held by the one rank ``owner[layer]``; None where a rank's token order is
        not a permutation of the micro-batch's tokens (the general merge then says what is wrong)."""
        seq_len, batch = self._geometry(step, info)
        found = {
            (rank, mb): self._order(rank, seq_len=seq_len[mb], batch=batch)
            for rank in owner.values()
            for mb in range(info.microbatches)
        }
        orders = {key: order for key, order in found.items() if order is not None}
        if len(orders) != len(found):
            return None
        held = {
            layer: [
                read(self._index[(rank, step, mb, layer, "ids")], order_T=orders[(rank, mb)][0] if gather else None)
                for mb in range(info.microbatches)
            ]
            for layer, rank in owner.items()
        }
        try:
            routes = Routes.adopt(held, num_experts=self.model.num_experts, topk=self.model.topk, like=like)
        except RouteError as exc:
            for rank in sorted(self.coords):
                self._local(rank, step, tuple(owner), checked=True)  # raises naming the rank's file
            raise DumpError(f"{where}: cannot merge ranks: {exc}") from None
        tokens: list[torch.Tensor | None] = [None] * info.microbatches
        if not gather:
            holder = next(iter(owner.values()))  # gather=False: one layer, so one rank
            tokens = [orders[(holder, mb)][1] for mb in range(info.microbatches)]
        if any(t is not None for t in tokens):
            return routes.in_order("router"), tokens
        return routes.in_order("sequence" if self.layout.dp(self.world_size) * batch > 1 else None), tokens

    def _order(self, rank: int, *, seq_len: int, batch: int) -> tuple[torch.Tensor | None, ...] | None:
        key = (rank, seq_len, batch)  # cached: the same for every layer and micro-batch
        if key not in self._orders:
            self._orders[key] = sequence_order(
                self.layout,
                self.coords[rank],
                seq_len=seq_len,
                batch=batch,
                zigzag=self.zigzag,
                tokens=self.layout.dp(self.world_size) * batch * seq_len,
            )
        return self._orders[key]

    def _geometry(self, step: int, info: fmt.StepInfo) -> tuple[tuple[int, ...], int]:
        """``(seq_len, batch)`` of ``step``; DumpError where they were not recorded (ranks cannot be merged)."""
        if info.seq_len is None or info.batch is None:
            raise DumpError(
                f"{self.path}: step {step}: seq_len/batch were not recorded, so {self.world_size} ranks "
                f"cannot be merged; record them with RankWriter.add_tokens(seq_len=, batch=)"
            )
        return info.seq_len, info.batch

    # -- validation -------------------------------------------------------------------------------
    def _index_file(self, rank: int, file: Mapping) -> None:
        if not isinstance(file, Mapping):
            raise DumpError(f"{self.path / fmt.MANIFEST}: rank {rank} file entry {file!r} is not an object")
        where = f"{self.path / fmt.MANIFEST}: rank {rank}"
        path = self.path / fmt.checked_file_name(file.get("name"), rank=rank, where=str(self.path / fmt.MANIFEST))
        fmt.check_regular_file(path, rank=rank, directory=self.path)
        packed = (
            fmt.packed_layers(file, path=path, rank=rank, manifest=self.path / fmt.MANIFEST)
            if self.version >= 2
            else None
        )
        expected_bytes = fmt.strict_int(file.get("bytes"), where=where, key=f"file {path.name} bytes", lo=0)
        expected_tensors = fmt.strict_int(file.get("tensors"), where=where, key=f"file {path.name} tensors", lo=1)
        size = path.stat().st_size
        if size != expected_bytes:
            raise DumpError(f"{path}: truncated or altered: expected {expected_bytes} bytes, got {size}")
        try:
            with safe_open(path, framework="pt") as handle:
                meta = handle.metadata() or {}
                entries = {name: handle.get_slice(name) for name in handle.keys()}
                # a dtype outside the table keeps the file's own name (``I8``), so that messages say what it holds
                entries = {
                    n: (SAFETENSORS.get(s.get_dtype(), s.get_dtype()), tuple(s.get_shape())) for n, s in entries.items()
                }
            spans = data_spans(path)  # where each tensor's bytes lie: the reads take them from there
        except (SafetensorError, OSError, ValueError, KeyError, TypeError, IndexError) as exc:
            raise DumpError(f"{path}: not a readable safetensors file: {exc}") from None
        got = (meta.get("schema"), meta.get("version"), meta.get("rank"))
        if got != (fmt.SCHEMA, str(self.version), str(rank)):
            raise DumpError(
                f"{path}: metadata schema/version/rank {'/'.join(repr(g) for g in got)} != expected "
                f"{fmt.SCHEMA!r}/'{self.version}'/'{rank}' (the manifest's format version)"
            )
        for name, (dtype, shape) in entries.items():
            try:
                step, mb, layer, kind = fmt.parse_tensor_name(name)
            except DumpError as exc:
                raise DumpError(f"{path}: {exc}") from None
            if kind in fmt.KINDS and (layer is None) != (packed is not None):
                want = "step{S}/mb{M}/" + (
                    f"{kind} (v2, layers packed)"
                    if packed is not None
                    else f"layer{{L}}/{kind} (v1, one tensor per layer)"
                )
                raise DumpError(f"{path}: tensor {name}: not a format v{self.version} name; expected {want}")
            if kind in fmt.KINDS and packed is not None:
                self._index_packed(
                    path,
                    name,
                    rank=rank,
                    step=step,
                    mb=mb,
                    kind=kind,
                    dtype=dtype,
                    shape=shape,
                    layers=packed,
                    span=spans[name],
                )
                continue
            key = (rank, step, mb, layer, kind)
            if key in self._index:
                raise DumpError(f"{path}: tensor {name} also in {self._index[key].file.name}")
            self._check_tensor(path, name, kind, dtype, shape)
            offset = checked_offset(
                path,
                name,
                spans[name],
                index=None,
                layers=1,
                layer_bytes=dtype.itemsize * int(torch.Size(shape).numel()),
            )
            self._index[key] = Entry(file=path, name=name, dtype=dtype, shape=shape, offset=offset, label=name)
        self._tensor_counts.append((path, rank, len(entries), expected_tensors))

    def _index_packed(
        self,
        path: Path,
        name: str,
        *,
        rank: int,
        step: int,
        mb: int,
        kind: str,
        dtype: torch.dtype | None,
        shape: tuple,
        layers: tuple[int, ...],
        span: tuple[int, int],
    ) -> None:
        """One index entry per layer of a v2 ``[L, T, K]`` tensor, after checking its dtype and shape."""
        where = f"{path}: tensor {name} (step {step}, mb {mb}, layers {list(layers)})"
        want = fmt.ID_DTYPE_NAMES[self.ids_dtype] if kind == "ids" else "a float dtype"
        if dtype is None or ((dtype != self.ids_dtype) if kind == "ids" else (dtype not in fmt.PROB_DTYPES)):
            raise DumpError(f"{where}: dtype {dtype} != expected {want}")
        if len(shape) != 3 or shape[2] != self.model.topk:
            raise DumpError(f"{where}: shape {shape} != expected (L={len(layers)}, T, K={self.model.topk})")
        if shape[0] != len(layers):
            raise DumpError(
                f"{where}: shape {shape} packs {shape[0]} layer(s), but the file's layer list names "
                f"{len(layers)}: expected (L={len(layers)}, T, K={self.model.topk})"
            )
        layer_bytes = dtype.itemsize * shape[1] * shape[2]
        for index, layer in enumerate(layers):
            key = (rank, step, mb, layer, kind)
            label = fmt.layer_label(step=step, mb=mb, kind=kind, layer=layer, version=self.version)
            if key in self._index:
                raise DumpError(
                    f"{path}: tensor {label} (step {step}, mb {mb}, layer {layer}) also in {self._index[key].file.name}"
                )
            self._index[key] = Entry(
                file=path,
                name=name,
                dtype=dtype,
                shape=tuple(shape[1:]),
                index=index,
                offset=checked_offset(path, name, span, index=index, layers=len(layers), layer_bytes=layer_bytes),
                label=label,
            )

    def _check_tensor(self, path: Path, name: str, kind: str, dtype: torch.dtype | None, shape: tuple) -> None:
        if kind == "ids":
            want, ok = fmt.ID_DTYPE_NAMES[self.ids_dtype], dtype == self.ids_dtype
            shape_ok = len(shape) == 2 and shape[1] == self.model.topk
            want_shape = f"(T, K={self.model.topk})"
        elif kind == "probs":
            want, ok = "a float dtype", dtype in fmt.PROB_DTYPES
            shape_ok, want_shape = len(shape) == 2 and shape[1] == self.model.topk, f"(T, K={self.model.topk})"
        else:
            want, ok = "int64", dtype == fmt.INDEX_DTYPE
            shape_ok, want_shape = len(shape) == 1, "(T,)"
        if not ok:
            raise DumpError(f"{path}: tensor {name}: dtype {dtype} != expected {want}")
        if not shape_ok:
            raise DumpError(f"{path}: tensor {name}: shape {shape} != expected {want_shape}")

    def _check_rank_complete(self, rank: int) -> None:
        """Strict: a rank holds exactly its layers x micro-batches of every step; token counts agree."""
        expected: set[tuple[int, int, int, int | None, str]] = set()
        layers = self._layers(rank)
        for step, info in self.steps.items():
            expected.update((rank, step, mb, layer, "ids") for mb in range(info.microbatches) for layer in layers)
        held = {k for k in self._index if k[0] == rank}
        missing = sorted(expected - {k for k in held if k[4] == "ids"}, key=str)
        unexpected = sorted(
            {
                k
                for k in held
                if k[1] not in self.steps
                or k[2] >= self.steps[k[1]].microbatches
                or (k[3] is not None and k[3] not in layers)
            },
            key=str,
        )
        if missing or unexpected:

            def names(keys):
                return [
                    fmt.layer_label(step=k[1], mb=k[2], layer=k[3], kind=k[4], version=self.version) for k in keys[:4]
                ]

            raise DumpError(
                f"{self._rank_files(rank)}: rank {rank} (pp{self.coords[rank].pp}, layers {list(layers)}) "
                f"missing {len(missing)} tensor(s) {names(missing)}, unexpected {len(unexpected)} "
                f"{names(unexpected)}"
            )
        self._check_token_counts(rank, layers)
        for (r, step, mb, layer, kind), entry in self._index.items():
            if r != rank or kind in ("ids", fmt.FINGERPRINTS):  # fingerprints: one per sequence, not per token
                continue
            ref = self._index.get((rank, step, mb, layer if kind == "probs" else layers[0] if layers else None, "ids"))
            if ref is not None and entry.shape[0] != ref.shape[0]:
                raise DumpError(
                    f"{entry.file}: tensor {entry.label}: {entry.shape[0]} tokens != {ref.shape[0]} in {ref.label}"
                )

    def _check_token_counts(self, rank: int, layers: tuple[int, ...]) -> None:
        c = self.coords[rank]
        for step, info in self.steps.items():
            for mb in range(info.microbatches):
                counts = {layer: self._index[(rank, step, mb, layer, "ids")].shape[0] for layer in layers}
                want = None
                if info.seq_len is not None and info.batch is not None:
                    want = views.token_index(
                        self.layout,
                        tp_rank=c.tp,
                        cp_rank=c.cp,
                        seq_len=info.seq_len[mb],
                        batch=info.batch,
                        zigzag=self.zigzag,
                    ).numel()
                for layer, got in counts.items():
                    want = got if want is None else want
                    if got != want:
                        entry = self._index[(rank, step, mb, layer, "ids")]
                        raise DumpError(
                            f"{entry.file}: tensor {entry.label}: shape ({got}, {self.model.topk}) != "
                            f"expected (T={want}, K={self.model.topk}) (inconsistent token count)"
                        )

    def _check_token_ids(self, rank: int, step: int, info: fmt.StepInfo) -> None:
        """Recorded positions/seq_ids, where present, must be where the layout says the tokens are."""
        c = self.coords[rank]
        seq_len, batch = self._geometry(step, info)
        for mb in range(info.microbatches):
            idx_T = views.token_index(
                self.layout,
                tp_rank=c.tp,
                cp_rank=c.cp,
                dp_rank=c.dp,
                seq_len=seq_len[mb],
                batch=batch,
                zigzag=self.zigzag,
            )
            for kind, want_T in (("positions", idx_T % seq_len[mb]), ("seq_ids", idx_T // seq_len[mb])):
                if (rank, step, mb, None, kind) not in self._index:
                    continue
                got_T = self._read(rank, step, mb, None, kind)
                if not torch.equal(got_T, want_T):
                    entry = self._index[(rank, step, mb, None, kind)]
                    bad = int((got_T != want_T).nonzero()[0]) if got_T.shape == want_T.shape else -1
                    raise DumpError(
                        f"{entry.file}: tensor {entry.name}: token {bad} is {kind} "
                        f"{got_T[bad].item() if bad >= 0 else tuple(got_T.shape)}, the layout "
                        f"{self.layout.name(self.world_size)} puts it at "
                        f"{want_T[bad].item() if bad >= 0 else tuple(want_T.shape)}"
                    )

    # -- helpers ----------------------------------------------------------------------------------
    @staticmethod
    def _dtype_of(manifest: Mapping, key: str, *, where: str) -> torch.dtype:
        name = manifest[key]
        table = fmt.ID_DTYPE_NAMES if key == "ids_dtype" else fmt.PROB_DTYPES
        for dtype, dtype_name in table.items():
            if dtype_name == name:
                return dtype
        raise DumpError(f"{where}: {key} {name!r:.80} is not one of {sorted(table.values())}")

    def _rank_coords(self, coords: Mapping, *, rank: int, where: str) -> views.RankCoords:
        """Rank ``rank``'s coords: integers, ``rank`` equal to its key, each inside the layout."""
        fields = [f.name for f in dataclasses.fields(views.RankCoords)]
        unknown, absent = sorted(set(coords) - set(fields)), [f for f in fields if f not in coords]
        if unknown or absent:
            raise DumpError(f"{where}: rank {rank}: coords keys unexpected {unknown}, missing {absent}")
        values = {f: fmt.strict_int(coords[f], where=where, key=f"rank {rank} coords.{f}", lo=0) for f in fields}
        if values["rank"] != rank:
            raise DumpError(f"{where}: coords.rank {values['rank']} != its key {rank}")
        sizes = {
            "tp": self.layout.tp,
            "pp": self.layout.pp,
            "cp": self.layout.cp,
            "dp": self.layout.dp(self.world_size),
            "ep": self.layout.ep,
        }
        for name, size in sizes.items():
            if values[name] >= size:
                raise DumpError(
                    f"{where}: rank {rank}: {name} rank {values[name]} outside [0, {size}) of layout "
                    f"{self.layout.name(self.world_size)}"
                )
        return views.RankCoords(**values)

    def _layers(self, rank: int) -> tuple[int, ...]:
        if rank not in self._held:  # asked for every layer read: computed once
            self._held[rank] = views.layers_of(
                self.layout,
                pp_rank=self.coords[rank].pp,
                num_layers=self.model.num_layers,
                moe_layers=self.model.moe_layers,
            )
        return self._held[rank]

    def _step(self, step: int) -> fmt.StepInfo:
        if step not in self.steps:
            raise DumpError(f"{self.path}: step {step} not in dump; steps held: {sorted(self.steps)}")
        return self.steps[step]

    def _rank_files(self, rank: int, step: int | None = None) -> str:
        """The file of ``rank`` that holds ``step`` (or any of its files when none is named): several when the
        step spans parts, listed."""
        files = sorted({e.file.name for k, e in self._index.items() if k[0] == rank and step in (None, k[1])})
        if not files:
            return str(self.path / fmt.rank_file(rank))
        if len(files) == 1:
            return str(self.path / files[0])
        return f"{self.path}/{{{', '.join(files)}}}"

    def _read(self, rank: int, step: int, mb: int, layer: int | None, kind: str) -> torch.Tensor:
        return read(self._index[(rank, step, mb, layer, kind)])


def load(path: str | os.PathLike) -> Dump:
    """Open and validate a dump directory (see module docstring)."""
    path = Path(path)
    if not path.is_dir():
        raise DumpError(f"{path}: not a dump directory")
    manifest_path = path / fmt.MANIFEST
    if manifest_path.is_symlink():  # as a rank file: a dump never reads outside its directory
        raise DumpError(
            f"{manifest_path}: a symbolic link (to {os.readlink(manifest_path)!r:.120}); a dump never reads outside "
            "its directory: copy the file in instead"
        )
    if manifest_path.exists() and not manifest_path.is_file():  # a FIFO would block, a directory is no manifest
        raise DumpError(f"{manifest_path}: not a regular file (a FIFO, device or directory)")
    if not manifest_path.is_file():
        hint = (
            (
                f"; rank records are there: `moeverify dump finalize {path}` commits them "
                f"(`--drop-uncommitted` discards them)"
            )
            if any(path.glob("rank*.json"))
            else ""
        )
        raise DumpError(f"{manifest_path}: missing manifest: the dump is incomplete (written last by finalize()){hint}")
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, ValueError) as exc:
        raise DumpError(f"{manifest_path}: not valid JSON: {exc}") from None
    except RecursionError:
        raise DumpError(f"{manifest_path}: not valid JSON: nested too deeply to be a manifest") from None
    if not isinstance(manifest, dict) or manifest.get("schema") != fmt.SCHEMA:
        got = manifest.get("schema") if isinstance(manifest, dict) else type(manifest).__name__
        raise DumpError(f"{manifest_path}: schema {got!r} != expected {fmt.SCHEMA!r}")
    if type(manifest.get("version")) is not int or manifest.get("version") not in fmt.VERSIONS:
        raise DumpError(
            f"{manifest_path}: schema version {manifest.get('version')!r} not supported; this moeverify "
            f"reads versions {', '.join(map(str, fmt.VERSIONS))}"
        )
    absent = [key for key in _REQUIRED if key not in manifest]
    if absent:
        raise DumpError(f"{manifest_path}: missing key(s) {absent}")
    for key, kind in (("steps", dict), ("ranks", dict), ("model", dict), ("layout", dict), ("world_size", int)):
        if not isinstance(manifest[key], kind) or isinstance(manifest[key], bool):
            raise DumpError(
                f"{manifest_path}: {key} must be a JSON {'object' if kind is dict else 'integer'}, "
                f"got {type(manifest[key]).__name__} {manifest[key]!r:.80}"
            )
    for rank, entry in manifest["ranks"].items():
        if (
            not isinstance(entry, dict)
            or not isinstance(entry.get("files"), list)
            or not isinstance(entry.get("coords"), dict)
        ):
            raise DumpError(
                f"{manifest_path}: ranks[{rank!r}] must be an object with 'coords' (object) and 'files' (list)"
            )
    fmt.check_provenance(manifest, where=str(manifest_path))
    for step, info in manifest["steps"].items():
        if not isinstance(info, dict):
            raise DumpError(f"{manifest_path}: steps[{step!r}] must be an object, got {type(info).__name__}")
    try:
        return Dump(path, manifest)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise DumpError(f"{manifest_path}: malformed manifest: {exc!r}") from None
