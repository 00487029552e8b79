"""The one reader of an HF checkpoint directory's layout: which safetensors file holds which tensor.

``model.safetensors.index.json``'s ``weight_map`` decides where there is one (sharded checkpoints);
otherwise every ``*.safetensors`` file's header lists its own tensors (a single-file checkpoint).
Only headers are read; tensors are loaded by the caller, lazily.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import torch

from moeverify.errors import MoEVerifyError
from moeverify.models import seeded
from moeverify.runtime.dtypes import SAFETENSORS

INDEX = "model.safetensors.index.json"


def open_tensors(hf_path):
    """A reader of the checkpoint's tensors (``names()``, ``get_tensor(name)``, ``close()``): safetensors files read
    by ``pread``, or seeded weights made on demand (``moeverify.models.seeded``)."""
    if seeded.is_seeded(hf_path):
        return seeded.SeededWeights(hf_path)
    return _FileTensors(tensor_files(hf_path))


class _FileTensors:
    def __init__(self, files: dict[str, Path]) -> None:
        self._files = files
        self._readers: dict[Path, TensorReader] = {}

    def names(self) -> list[str]:
        return list(self._files)

    def get_tensor(self, name: str):
        path = self._files[name]
        if path not in self._readers:
            self._readers[path] = TensorReader(path)  # not mmap: pages read stay out of RSS
        return self._readers[path].get_tensor(name)

    def close(self) -> None:
        for reader in self._readers.values():
            reader.close()
        self._readers.clear()


def tensor_files(hf_path) -> dict[str, Path]:
    """Tensor name -> the safetensors file of ``hf_path`` that holds it."""
    hf_path = Path(hf_path)
    index = hf_path / INDEX
    if index.exists():
        return {name: hf_path / fname for name, fname in json.loads(index.read_text())["weight_map"].items()}
    from safetensors import safe_open  # lazy: safetensors

    files = sorted(hf_path.glob("*.safetensors"))
    if not files:
        raise MoEVerifyError(f"{hf_path}: no {INDEX} and no *.safetensors file; expected an HF checkpoint directory")
    found: dict[str, Path] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            found.update(dict.fromkeys(f.keys(), path))
    return found


def checkpoint_shapes(hf_path) -> dict[str, tuple[int, ...]]:
    """Names and shapes of the checkpoint's tensors, read from safetensors headers only (or the seeded marker)."""
    from safetensors import safe_open  # lazy: safetensors

    if seeded.is_seeded(hf_path):
        return seeded.SeededWeights(hf_path).shapes()

    by_file: dict[Path, list[str]] = {}
    for name, path in tensor_files(hf_path).items():
        by_file.setdefault(path, []).append(name)
    shapes = {}
    for path, names in sorted(by_file.items()):
        with safe_open(str(path), framework="pt") as f:
            for name in names:
                shapes[name] = tuple(f.get_slice(name).get_shape())
    return shapes


class TensorReader:
    """One safetensors file read tensor by tensor with ``pread`` into fresh memory.

    ``safe_open(...).get_tensor`` maps the file: every page read stays in the process's resident set while the
    handle is open, so a check that reads a whole checkpoint through one handle holds an extra model's bytes of
    RSS (docs/memory.md). A read here leaves only the returned tensor.
    """

    def __init__(self, path) -> None:
        self.path = str(path)
        self._fd = os.open(self.path, os.O_RDONLY)
        (n,) = struct.unpack("<Q", os.pread(self._fd, 8, 0))
        self._header = json.loads(os.pread(self._fd, n, 8))
        self._base = 8 + n

    def get_tensor(self, name: str):
        entry = self._header[name]
        begin, end = entry["data_offsets"]
        dtype = SAFETENSORS.get(entry["dtype"])
        if dtype is None:
            raise MoEVerifyError(
                f"{self.path}: tensor {name!r} has dtype {entry['dtype']!r}; expected one of {sorted(SAFETENSORS)}"
            )
        buf = bytearray(end - begin)
        view, got = memoryview(buf), 0
        while got < len(buf):
            chunk = os.preadv(self._fd, [view[got:]], self._base + begin + got)
            if chunk == 0:
                raise MoEVerifyError(f"{self.path}: tensor {name!r} ends past the end of the file")
            got += chunk
        flat = torch.frombuffer(buf, dtype=dtype) if buf else torch.empty(0, dtype=dtype)
        return flat.reshape(entry["shape"])

    def close(self) -> None:
        os.close(self._fd)
