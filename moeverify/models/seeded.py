"""Seeded weights made per tensor on demand: a checkpoint directory with no weights file in it.

A model given as a ``config.json`` alone gets seeded weights. Written as safetensors, Qwen3-30B-A3B's 48 layers would
be a 61 GB file (a node's whole disk) and ``save_pretrained`` would hold the model in memory to write it. Instead
its directory holds ``config.json`` and ``MARKER``: the recipe, the seed and every tensor's name, shape and dtype
as ``save_pretrained`` would have written them (transformers' own reverse weight conversion applied to the model
built on the ``meta`` device: no memory, a few seconds at 48 layers). A tensor's values are made when it is read,
a counter-based hash of (seed, tensor name, element index) in 64-bit integer arithmetic (``noise``), so any rank,
any reader, any order and any device get the same bits; they are made on the GPU where there is one (a 48-layer
model is 30 G values: a CPU generator takes minutes per pass, the GPU a second). Megatron-Bridge's loader reads them
through ``moeverify.models.seeded_state`` and the roundtrip check compares the export with them.

Version assumptions (transformers 5.12.1): ``save_pretrained`` drops ``_keys_to_ignore_on_save``, removes tied
duplicates (``remove_tied_weights_from_state_dict``) and applies ``revert_weight_conversion`` (fused experts to
per-expert tensors); the names here follow the same three steps, and a test compares them with a real
``save_pretrained`` of a tiny model.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from moeverify import files
from moeverify.errors import MoEVerifyError
from moeverify.runtime import hash64
from moeverify.runtime.dtypes import BY_NAME

MARKER = "moeverify-seeded.json"
RECIPE = "per-tensor-2"  # bump when the values or the names below change (part of the cache fingerprint)


def is_seeded(path) -> bool:
    """Whether ``path`` is a checkpoint directory of seeded weights made on demand."""
    return (Path(path) / MARKER).is_file()


def tensor_seed(seed: int, name: str) -> int:
    """The key of tensor ``name``'s values: depends on nothing but the model's seed and the name (63 bits)."""
    return int.from_bytes(hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest(), "little") >> 1


_BLOCK = 1 << 24  # elements per step: bounds the int64 temporaries (8 bytes each, a few alive)
_SQRT12 = 12**0.5


def noise(key: int, numel: int, *, device=None) -> torch.Tensor:
    """``numel`` fp32 values of mean 0 and variance 1 (uniform on [-sqrt 3, sqrt 3)), element i a function of (key, i)
    alone: splitmix64 of ``key + (i + 1) * golden`` in wrapping 64-bit arithmetic, its top 24 bits as the fraction.
    Only integer operations, one exact int-to-float conversion and two correctly rounded fp32 operations, so the CPU
    path (numpy uint64, blocks on threads) and the GPU path (torch int64) give the same bits (``test_seeded_weights``
    holds both to a pure-Python reference)."""
    device = torch.device(device or "cpu")
    if device.type == "cpu":
        return torch.from_numpy(_noise_numpy(key, numel))
    return _noise_torch(key, numel, device)


def _noise_torch(key: int, numel: int, device: torch.device) -> torch.Tensor:
    out = torch.empty(numel, dtype=torch.float32, device=device)
    for start in range(0, numel, _BLOCK):
        x = torch.arange(start + 1, min(start + _BLOCK, numel) + 1, dtype=torch.int64, device=device)
        x = hash64.mix(x * hash64.GOLDEN + key)
        u = hash64.shr(x, 40).to(torch.float32) * (1.0 / (1 << 24))  # exact: 24 bits, a power-of-two scale
        out[start : start + len(u)] = (u - 0.5) * _SQRT12
    return out


def _noise_numpy(key: int, numel: int):
    out = np.empty(numel, dtype=np.float32)
    g, m1, m2 = (np.uint64(c & ((1 << 64) - 1)) for c in (hash64.GOLDEN, hash64.MIX1, hash64.MIX2))

    def block(start: int) -> None:
        x = np.arange(start + 1, min(start + _CPU_BLOCK, numel) + 1, dtype=np.uint64)
        x *= g
        x += np.uint64(key)
        x ^= x >> np.uint64(30)
        x *= m1
        x ^= x >> np.uint64(27)
        x *= m2
        x ^= x >> np.uint64(31)
        u = (x >> np.uint64(40)).astype(np.float32)
        u *= np.float32(1.0 / (1 << 24))
        u -= np.float32(0.5)
        u *= np.float32(_SQRT12)
        out[start : start + len(u)] = u

    starts = range(0, numel, _CPU_BLOCK)
    if len(starts) == 1:
        block(0)
    else:
        list(_pool().map(block, starts))  # numpy releases the GIL in its loops
    return out


_CPU_BLOCK = 1 << 22


_POOLS: dict[int, ThreadPoolExecutor] = {}


def _pool() -> ThreadPoolExecutor:
    """This process's pool (per pid: a forked child inherits the parent's pool object but none of its threads)."""
    pid = os.getpid()
    if pid not in _POOLS:
        _POOLS[pid] = ThreadPoolExecutor(
            max_workers=min(16, os.cpu_count() or 1), thread_name_prefix="moeverify-seeded"
        )
    return _POOLS[pid]


def noise_reference(key: int, index: int) -> float:
    """Element ``index`` of ``noise(key, ...)`` in plain Python integers and float32 rounding (the tests' oracle)."""
    mask = (1 << 64) - 1
    x = ((index + 1) * 0x9E3779B97F4A7C15 + key) & mask
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & mask
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & mask
    x ^= x >> 31
    u = np.float32(x >> 40) * np.float32(1.0 / (1 << 24))
    return float((u - np.float32(0.5)) * np.float32(_SQRT12))


def _device():
    """Where values are made: the current GPU once this process uses one, else the CPU (the same bits)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def write(seed: int, dst: Path, *, specs: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> None:
    """Write the marker into ``dst`` (its config files written already)."""
    tensors = {name: [list(shape), str(dtype)] for name, (shape, dtype) in sorted(specs.items())}
    marker = {"recipe": RECIPE, "seed": seed, "tensors": tensors}
    tmp = dst / f".{MARKER}.tmp"
    tmp.write_text(json.dumps(marker))
    os.replace(tmp, dst / MARKER)


class SeededWeights:
    """The tensors of a seeded directory, each made when read (``get_tensor``); nothing is kept."""

    def __init__(self, path) -> None:
        self.path = Path(path)
        where = self.path / MARKER
        try:
            marker = json.loads(where.read_text())
        except (OSError, ValueError) as exc:
            raise MoEVerifyError(
                f"{where}: unreadable seeded-weights marker ({exc}); delete the directory to have it made again"
            ) from None
        if not isinstance(marker, dict) or marker.get("recipe") != RECIPE:
            got = marker.get("recipe") if isinstance(marker, dict) else type(marker).__name__
            raise MoEVerifyError(
                f"{where}: seeded-weights recipe {got!r}, expected {RECIPE!r}; delete the directory "
                "to have it made again"
            )
        self.seed = int(marker["seed"])
        self._specs = {
            name: (tuple(shape), BY_NAME[dtype.removeprefix("torch.")])
            for name, (shape, dtype) in marker["tensors"].items()
        }

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: shape for name, (shape, _) in self._specs.items()}

    def dtypes(self) -> dict[str, torch.dtype]:
        return {name: dtype for name, (_, dtype) in self._specs.items()}

    def names(self) -> list[str]:
        return list(self._specs)

    def get_tensor(self, name: str) -> torch.Tensor:
        if name not in self._specs:
            raise KeyError(f"{self.path}: no seeded tensor {name!r}")
        shape, dtype = self._specs[name]
        values = noise(tensor_seed(self.seed, name), math.prod(shape), device=_device()).view(shape)
        return seeded_value(name, values).to(dtype).cpu()

    def close(self) -> None:
        pass


def seeded_value(name: str, noise: torch.Tensor) -> torch.Tensor:
    """The recipe: seeded fp32 values for the HF tensor ``name`` from standard-normal ``noise``."""
    if name.endswith("norm.weight") or "layernorm" in name:
        return 1.0 + 0.1 * noise
    if "e_score_correction_bias" in name:
        return 0.05 * noise  # non-zero so that bias-aware routing differs from bias-free
    if name.endswith(".bias"):
        return 0.02 * noise
    if ".gate.weight" in name or name.endswith("gate.weight"):
        return 0.5 * noise  # router: spread logits so that top-k choices are well separated
    return 0.05 * noise


def make(dst: Path, seed: int, *, describe) -> Path:
    """The seeded directory ``dst`` (made once, atomically): ``describe(folder)`` writes the config files into
    ``folder`` and returns every tensor's ``{name: (shape, dtype)}``."""
    if is_seeded(dst):
        return dst
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = files.cache_tempdir(dst.parent, prefix=f".{dst.name}.")
    try:
        write(seed, tmp, specs=describe(tmp))
        try:
            os.rename(tmp, dst)  # atomic; another rank may have won the race, which is fine
        except OSError:
            if not is_seeded(dst):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dst
