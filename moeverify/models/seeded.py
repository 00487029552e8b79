"""Seeded weights made per tensor on demand: a checkpoint directory with no weights file in it.

A model given as a ``config.json`` alone gets seeded weights. Written as safetensors, Qwen3-30B-A3B's 48 layers would
be a 61 GB file (a node's whole disk) and ``save_pretrained`` would hold the model in memory to write it. Instead
its directory holds ``config.json`` and ``MARKER``: the recipe, the seed and every tensor's name, shape and dtype
as ``save_pretrained`` would have written them (transformers' own reverse weight conversion applied to the model
built on the ``meta`` device: no memory, a few seconds at 48 layers). A tensor's values are made when it is read,
from a generator seeded by (seed, tensor name) alone, so any rank, any reader and any order get the same bits:
Megatron-Bridge's loader reads them through ``moeverify.models.seeded_state`` and the roundtrip check compares
the export with them.

Version assumptions (transformers 5.12.1): ``save_pretrained`` drops ``_keys_to_ignore_on_save``, removes tied
duplicates (``remove_tied_weights_from_state_dict``) and applies ``revert_weight_conversion`` (fused experts to
per-expert tensors); the names here follow the same three steps, and a test compares them with a real
``save_pretrained`` of a tiny model.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from moeverify.errors import MoEVerifyError

MARKER = "moeverify-seeded.json"
RECIPE = "per-tensor-1"  # bump when the values or the names below change (part of the cache fingerprint)
_DTYPES = {str(d): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64)}


def is_seeded(path) -> bool:
    """Whether ``path`` is a checkpoint directory of seeded weights made on demand."""
    return (Path(path) / MARKER).is_file()


def tensor_seed(seed: int, name: str) -> int:
    """The generator seed of tensor ``name``: depends on nothing but the model's seed and the name."""
    return int.from_bytes(hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest(), "little") >> 1


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
            raise MoEVerifyError(f"{where}: unreadable seeded-weights marker ({exc}); delete the directory to "
                                 "have it made again") from None
        if not isinstance(marker, dict) or marker.get("recipe") != RECIPE:
            got = marker.get("recipe") if isinstance(marker, dict) else type(marker).__name__
            raise MoEVerifyError(f"{where}: seeded-weights recipe {got!r}, expected {RECIPE!r}; delete the directory "
                                 "to have it made again")
        self.seed = int(marker["seed"])
        self._specs = {name: (tuple(shape), _DTYPES[dtype]) for name, (shape, dtype) in marker["tensors"].items()}

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
        noise = torch.randn(shape, generator=torch.Generator().manual_seed(tensor_seed(self.seed, name)),
                            dtype=torch.float32)
        return seeded_value(name, noise).to(dtype)

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
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", dir=dst.parent))
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
