"""The one reader of an HF checkpoint directory's layout: which safetensors file holds which tensor.

``model.safetensors.index.json``'s ``weight_map`` decides where there is one (sharded checkpoints);
otherwise every ``*.safetensors`` file's header lists its own tensors (a single-file checkpoint).
Only headers are read; tensors are loaded by the caller, lazily.
"""

from __future__ import annotations

import json
from pathlib import Path

from moeverify.errors import MoEVerifyError

INDEX = "model.safetensors.index.json"


def tensor_files(hf_path) -> dict[str, Path]:
    """Tensor name -> the safetensors file of ``hf_path`` that holds it."""
    hf_path = Path(hf_path)
    index = hf_path / INDEX
    if index.exists():
        return {name: hf_path / fname for name, fname in json.loads(index.read_text())["weight_map"].items()}
    from safetensors import safe_open

    files = sorted(hf_path.glob("*.safetensors"))
    if not files:
        raise MoEVerifyError(f"{hf_path}: no {INDEX} and no *.safetensors file; expected an HF checkpoint directory")
    found: dict[str, Path] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            found.update(dict.fromkeys(f.keys(), path))
    return found


def checkpoint_shapes(hf_path) -> dict[str, tuple[int, ...]]:
    """Names and shapes of the checkpoint's tensors, read from safetensors headers only."""
    from safetensors import safe_open

    by_file: dict[Path, list[str]] = {}
    for name, path in tensor_files(hf_path).items():
        by_file.setdefault(path, []).append(name)
    shapes = {}
    for path, names in sorted(by_file.items()):
        with safe_open(str(path), framework="pt") as f:
            for name in names:
                shapes[name] = tuple(f.get_slice(name).get_shape())
    return shapes
