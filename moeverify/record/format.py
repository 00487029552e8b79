"""The routing dump format, versions 1 and 2: names, the dtype table and the manifest.

A dump is a directory::

    manifest.json                 written last: a dump without it is incomplete
    rank00000.safetensors         one file per rank (``rank00000.p001.safetensors`` ... for later parts)
    rank00000.json                the rank's own record, folded into the manifest by ``finalize``

Version 2 (written) packs the MoE layers of one (step ``S``, micro-batch ``M``) into one tensor. The file's
entry in the rank record and the manifest (``{"name", "bytes", "tensors", "layers"}``) lists the global MoE
layers (0-based) of its packed tensors, in the order of their leading dimension; every ``ids``/``probs``
tensor of that file holds exactly those layers::

    step{S}/mb{M}/ids             [L, T, K] expert ids, dtype from ``ids_dtype_for(num_experts)``
    step{S}/mb{M}/probs           [L, T, K] float router probabilities of those experts (optional)
    step{S}/mb{M}/positions       [T] int64 position of each local token in its sequence (optional)
    step{S}/mb{M}/seq_ids         [T] int64 sequence of each local token (optional)
    step{S}/mb{M}/fingerprints    [B] int64 token identity of each input sequence of the micro-batch (optional):
                                  a 64-bit fingerprint of its token ids and length (and slot, packed), per row
                                  of the model chunk's ``input_ids`` (``moeverify.patches.token_keys``)

The layers of one (step, micro-batch) may be spread over several part files (a writer flushed between
them), never repeated. Version 1 (read only) holds one tensor per layer, and its file entries no ``layers``::

    step{S}/mb{M}/layer{L}/ids    [T, K]
    step{S}/mb{M}/layer{L}/probs  [T, K]

``T`` is the rank's local token count in local router order (see ``moeverify.routing.views``).
Legend: L = packed layers, T = tokens, K = top-k.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import itertools
import os
import re
import stat
from collections.abc import Mapping
from pathlib import Path

import torch

from moeverify import __version__
from moeverify.errors import DumpError
from moeverify.runtime import dtypes

SCHEMA = "moeverify.routing_dump"
VERSION = 2  # written
VERSIONS = (1, 2)  # read
MANIFEST = "manifest.json"

# The ids' dtype: the narrowest integer dtype that holds ids in [0, num_experts); the names are runtime.dtypes'.
_ID_DTYPES = ((256, torch.uint8), (2**15, torch.int16), (2**31, torch.int32))
ID_DTYPE_NAMES = {d: dtypes.name(d) for _, d in _ID_DTYPES}
PROB_DTYPES = {d: dtypes.name(d) for d in (torch.float16, torch.bfloat16, torch.float32)}
INDEX_DTYPE = torch.int64  # positions and seq_ids
KINDS = ("ids", "probs")
TOKEN_KINDS = ("positions", "seq_ids", "fingerprints")
FINGERPRINTS = "fingerprints"  # [B] per micro-batch, not per token: a dump without them has token identity unknown

_N = r"(0|[1-9]\d*)"  # a canonical decimal: the writer never writes leading zeros, so ``layer01`` is not ours
_NAME_RE = re.compile(rf"^step{_N}/mb{_N}/(?:(?:layer{_N}/)?(ids|probs)|(positions|seq_ids|fingerprints))$")
_CANONICAL_INT = re.compile(r"^(0|[1-9]\d*)$")
MAX_LAYERS = 2**20  # a bound on num_layers checked before anything is sized by it
MAX_TOKENS = 2**40  # a bound on batch and seq_len checked before token counts are computed from them
MAX_EXPERTS = 2**31  # the largest id dtype (int32) holds ids in [0, 2**31)


def strict_int(value: object, *, where: str, key: str, lo: int | None = None, hi: int | None = None) -> int:
    """``value`` if it is a JSON integer (not a bool, float or string) in ``[lo, hi)``; else ``DumpError`` naming
    ``where`` and ``key``."""
    if type(value) is not int:
        raise DumpError(f"{where}: {key} must be an integer, got {type(value).__name__} {value!r:.80}")
    if (lo is not None and value < lo) or (hi is not None and value >= hi):
        bounds = f"[{lo if lo is not None else '-inf'}, {hi if hi is not None else 'inf'})"
        raise DumpError(f"{where}: {key} {value} outside {bounds}")
    return value


def strict_bool(value: object, *, where: str, key: str) -> bool:
    """``value`` if it is a JSON true/false; else ``DumpError``."""
    if type(value) is not bool:
        raise DumpError(f"{where}: {key} must be true or false, got {type(value).__name__} {value!r:.80}")
    return value


def strict_int_list(
    value: object, *, where: str, key: str, lo: int | None = None, hi: int | None = None, ascending: bool = False
) -> tuple[int, ...]:
    """``value`` as a tuple if it is a JSON list of integers in ``[lo, hi)`` (strictly ascending if asked)."""
    if not isinstance(value, list):
        raise DumpError(f"{where}: {key} must be a list of integers, got {type(value).__name__} {value!r:.80}")
    out = tuple(strict_int(x, where=where, key=f"{key}[{i}]", lo=lo, hi=hi) for i, x in enumerate(value))
    if ascending and any(a >= b for a, b in itertools.pairwise(out)):
        raise DumpError(f"{where}: {key} {list(out)!r:.120} must be strictly ascending (as the writer writes it)")
    return out


def int_key(key: object, *, where: str, what: str) -> int:
    """A JSON object key that names a step or rank: a canonical decimal (``"0"``, ``"12"``; never ``"00"``,
    ``" 0"`` or ``"-0"``), so that two spellings cannot name one step."""
    if not isinstance(key, str) or not _CANONICAL_INT.match(key):
        raise DumpError(f"{where}: {what} key {key!r} is not a canonical non-negative integer (e.g. '0', '12')")
    return int(key)


def ids_dtype_for(num_experts: int) -> torch.dtype:
    """Narrowest integer dtype for expert ids in ``[0, num_experts)``: uint8 up to 256, then int16, int32."""
    if num_experts < 1:
        raise DumpError(f"num_experts must be >= 1, got {num_experts}")
    for limit, dtype in _ID_DTYPES:
        if num_experts <= limit:
            return dtype
    raise DumpError(f"num_experts {num_experts} exceeds the largest id dtype (int32)")


def tensor_name(*, step: int, mb: int, kind: str, layer: int | None = None) -> str:
    """The version-1 name of one layer's tensor (also the name of one layer in messages), or a token tensor's."""
    if kind in KINDS:
        return f"step{step}/mb{mb}/layer{layer}/{kind}"
    if kind in TOKEN_KINDS:
        return f"step{step}/mb{mb}/{kind}"
    raise DumpError(f"unknown tensor kind {kind!r}; known: {KINDS + TOKEN_KINDS}")


def packed_name(*, step: int, mb: int, kind: str) -> str:
    """The version-2 name of a micro-batch's packed ``[L, T, K]`` tensor (or of a token tensor)."""
    if kind not in KINDS + TOKEN_KINDS:
        raise DumpError(f"unknown tensor kind {kind!r}; known: {KINDS + TOKEN_KINDS}")
    return f"step{step}/mb{mb}/{kind}"


def layer_label(*, step: int, mb: int, kind: str, layer: int | None, version: int) -> str:
    """How messages name one layer's tensor: its own name (v1), or its packed tensor and layer (v2)."""
    if version == 1 or layer is None:
        return tensor_name(step=step, mb=mb, layer=layer, kind=kind)
    return f"{packed_name(step=step, mb=mb, kind=kind)}[layer {layer}]"


def parse_tensor_name(name: str) -> tuple[int, int, int | None, str]:
    """``(step, mb, layer or None, kind)`` of a tensor name of either version (``layer`` only in a v1 name);
    ``DumpError`` if it is not one of ours."""
    m = _NAME_RE.match(name)
    if not m:
        raise DumpError(
            f"tensor name {name!r} is not step{{S}}/mb{{M}}/(ids|probs) (v2), "
            f"step{{S}}/mb{{M}}/layer{{L}}/(ids|probs) (v1) or step{{S}}/mb{{M}}/(positions|seq_ids|fingerprints)"
        )
    step, mb, layer, kind, token_kind = m.groups()
    return int(step), int(mb), None if layer is None else int(layer), kind or token_kind


def rank_file(rank: int, part: int = 0) -> str:
    return f"rank{rank:05d}.safetensors" if part == 0 else f"rank{rank:05d}.p{part:03d}.safetensors"


_RANK_FILE_RE = re.compile(r"^rank(\d{5})(?:\.p(\d{3}))?\.safetensors$")


def checked_file_name(name: object, *, rank: int, where: str) -> str:
    """``name`` if it is one of rank ``rank``'s file names (``rank00001.safetensors``, ``rank00001.p002...``):
    a bare name inside the dump directory, never a path that could lead out of it."""
    m = _RANK_FILE_RE.match(name) if isinstance(name, str) else None
    if not isinstance(name, str) or m is None or int(m.group(1)) != rank:
        raise DumpError(
            f"{where}: rank {rank} file name {name!r} is not rank{rank:05d}[.pNNN].safetensors "
            f"(a file of this rank, in the dump directory)"
        )
    return name


def rank_record_file(rank: int) -> str:
    return f"rank{rank:05d}.json"


def versions() -> dict[str, str]:
    """Versions of the packages that shape a dump, read from metadata (nothing imported)."""
    out = {}
    for dist in ("moeverify", "torch", "megatron-core", "megatron-bridge", "safetensors"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    if "moeverify" not in out:
        out["moeverify"] = __version__
    return out


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ModelInfo:
    """The model shape a dump was recorded from."""

    num_layers: int
    moe_layers: tuple[int, ...]
    num_experts: int
    topk: int

    def __post_init__(self) -> None:
        self._validate()

    def _validate(self) -> None:
        if not 1 <= self.num_layers <= MAX_LAYERS:  # what a reader refuses is never written
            raise DumpError(f"model: num_layers {self.num_layers} outside [1, {MAX_LAYERS}]")
        if self.num_experts < 1 or not 1 <= self.topk <= self.num_experts:
            raise DumpError(
                f"model: need 1 <= topk <= num_experts, got topk {self.topk}, num_experts {self.num_experts}"
            )
        bad = [layer for layer in self.moe_layers if not 0 <= layer < self.num_layers]
        if bad or list(self.moe_layers) != sorted(set(self.moe_layers)):
            raise DumpError(
                f"model: moe_layers {list(self.moe_layers)} must be sorted, unique and in "
                f"[0, num_layers={self.num_layers})"
            )

    def as_dict(self) -> dict:
        return {
            "num_layers": self.num_layers,
            "moe_layers": list(self.moe_layers),
            "num_experts": self.num_experts,
            "topk": self.topk,
        }

    @classmethod
    def from_dict(cls, obj: Mapping, *, where: str) -> ModelInfo:
        keys = ("num_layers", "moe_layers", "num_experts", "topk")
        if not isinstance(obj, Mapping) or any(k not in obj for k in keys):
            raise DumpError(
                f"{where}: model must hold num_layers, moe_layers, num_experts, topk; "
                f"got {dict(obj) if isinstance(obj, Mapping) else obj!r:.200}"
            )
        num_layers = strict_int(obj["num_layers"], where=where, key="model.num_layers", lo=1, hi=MAX_LAYERS)
        try:
            return cls(
                num_layers=num_layers,
                moe_layers=strict_int_list(obj["moe_layers"], where=where, key="model.moe_layers", lo=0, hi=num_layers),
                num_experts=strict_int(
                    obj["num_experts"], where=where, key="model.num_experts", lo=1, hi=MAX_EXPERTS + 1
                ),
                topk=strict_int(obj["topk"], where=where, key="model.topk", lo=1),
            )
        except DumpError as exc:
            if str(exc).startswith(where):
                raise
            raise DumpError(f"{where}: {exc}") from None


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class StepInfo:
    microbatches: int
    batch: int | None
    seq_len: tuple[int, ...] | None


def check_provenance(manifest: Mapping, *, where: str) -> None:
    """``versions`` ({package: version}) and ``created`` (ISO time), where present, are strings: a manifest
    damaged there is damaged, even if nothing reads them but ``inspect``."""
    versions = manifest.get("versions", {})
    if not isinstance(versions, dict) or any(not isinstance(v, str) for v in versions.values()):
        raise DumpError(f"{where}: versions must be an object of package -> version string, got {versions!r:.80}")
    if not isinstance(manifest.get("created", ""), str):
        raise DumpError(f"{where}: created must be an ISO time string, got {manifest['created']!r:.80}")


def step_info(info: Mapping, *, where: str) -> StepInfo:
    """One step's entry: ``microbatches`` >= 1; ``batch`` >= 1 and ``seq_len`` (one length >= 1 per micro-batch)
    where recorded, else null."""
    microbatches = strict_int(info.get("microbatches"), where=where, key="microbatches", lo=1)
    batch, seq_len = info.get("batch"), info.get("seq_len")
    batch = None if batch is None else strict_int(batch, where=where, key="batch", lo=1, hi=MAX_TOKENS)
    if (batch is None) != (seq_len is None):
        raise DumpError(
            f"{where}: batch {batch!r} and seq_len {seq_len!r:.80} must be recorded together (a step's "
            f"geometry) or both null"
        )
    if seq_len is not None:
        seq_len = strict_int_list(seq_len, where=where, key="seq_len", lo=1, hi=MAX_TOKENS)
        if len(seq_len) != microbatches:
            raise DumpError(
                f"{where}: seq_len {list(seq_len)!r:.80} holds {len(seq_len)} length(s) != microbatches "
                f"{microbatches} (one per micro-batch)"
            )
    return StepInfo(microbatches=microbatches, batch=batch, seq_len=seq_len)


def check_regular_file(path: Path, *, rank: int, directory: Path) -> None:
    """A rank file is a regular file in the dump directory itself: never a link (which could lead out of
    the dump), a FIFO (which would block) or a device."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise DumpError(f"{path}: rank {rank} file missing (listed in the manifest)") from None
    except OSError as exc:
        raise DumpError(f"{path}: rank {rank} file unreadable: {exc}") from None
    if stat.S_ISLNK(st.st_mode):
        raise DumpError(
            f"{path}: rank {rank} file is a symbolic link (to {os.readlink(path)!r:.120}); a dump "
            f"never reads outside its directory: copy the file in instead"
        )
    if not stat.S_ISREG(st.st_mode):
        raise DumpError(f"{path}: rank {rank} file is not a regular file (a FIFO, device or directory)")
    if path.resolve().parent != directory.resolve():
        raise DumpError(f"{path}: rank {rank} file resolves to {path.resolve()}, outside the dump directory")


def packed_layers(file: Mapping, *, path: Path, rank: int, manifest: Path) -> tuple[int, ...]:
    """A v2 file entry's ``layers``: the global layers of its packed tensors, in order; integers, unique."""
    layers = file.get("layers")
    if not isinstance(layers, list) or any(not isinstance(x, int) or isinstance(x, bool) for x in layers):
        raise DumpError(
            f"{manifest}: rank {rank} file {path.name}: 'layers' must be the list "
            f"of global layers its packed tensors hold (format v2), got {layers!r:.80}"
        )
    twice = sorted({x for x in layers if layers.count(x) > 1})
    if twice:
        raise DumpError(
            f"{path}: rank {rank}: the file's layer list {layers} holds layer(s) {twice} more than "
            f"once; expected each packed layer once"
        )
    if layers != sorted(layers):
        raise DumpError(
            f"{manifest}: rank {rank} file {path.name}: 'layers' {layers!r:.80} is "
            f"not ascending (the writer packs layers in ascending order); a reordered list would "
            f"relabel layers"
        )
    return tuple(layers)
