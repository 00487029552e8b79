"""Format-v1 routing dumps made with safetensors and json directly (no moeverify writer), as dumps written
before format v2 lie on users' disks: one ``step{S}/mb{M}/layer{L}/ids`` ``[T, K]`` tensor per layer."""

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

SCHEMA = "moeverify.routing_dump"
_ID_DTYPES = ((256, torch.uint8, "uint8"), (2**15, torch.int16, "int16"), (2**31, torch.int32, "int32"))


def _ids_dtype(num_experts):
    return next((dtype, name) for limit, dtype, name in _ID_DTYPES if num_experts <= limit)


def write_v1_dump(path, ids, *, num_layers, num_experts, topk, probs=None, step=0):
    """A one-rank v1 dump of ``ids = {layer: [ids_TK per micro-batch]}`` (``probs`` alike), no geometry."""
    path = Path(path)
    path.mkdir(parents=True)
    dtype, dtype_name = _ids_dtype(num_experts)
    tensors = {}
    for layer, per_mb in ids.items():
        for mb, ids_TK in enumerate(per_mb):
            tensors[f"step{step}/mb{mb}/layer{layer}/ids"] = ids_TK.to(dtype).contiguous()
            if probs is not None:
                tensors[f"step{step}/mb{mb}/layer{layer}/probs"] = probs[layer][mb].contiguous()
    save_file(tensors, path / "rank00000.safetensors", metadata={"schema": SCHEMA, "version": "1", "rank": "0"})
    microbatches = len(next(iter(ids.values())))
    files = [
        {
            "name": "rank00000.safetensors",
            "bytes": (path / "rank00000.safetensors").stat().st_size,
            "tensors": len(tensors),
        }
    ]
    coords = {"rank": 0, "tp": 0, "pp": 0, "cp": 0, "ep": 0, "dp": 0}
    shared = {
        "schema": SCHEMA,
        "version": 1,
        "world_size": 1,
        "zigzag": True,
        "ids_dtype": dtype_name,
        "layout": {"tp": 1, "pp": 1, "vpp": None, "ep": 1, "etp": None, "cp": 1, "sp": False},
        "model": {"num_layers": num_layers, "moe_layers": sorted(ids), "num_experts": num_experts, "topk": topk},
        "probs_dtype": None if probs is None else str(next(iter(probs.values()))[0].dtype).split(".")[1],
    }
    steps = {str(step): {"microbatches": microbatches, "batch": None, "seq_len": None}}
    record = {**shared, "rank": 0, "coords": coords, "files": files, "steps": steps}
    manifest = {
        **shared,
        "steps": steps,
        "ranks": {"0": {"coords": coords, "files": files}},
        "versions": {"moeverify": "0.1.0"},
        "created": "2026-01-01T00:00:00+00:00",
    }
    (path / "rank00000.json").write_text(json.dumps(record))
    (path / "manifest.json").write_text(json.dumps(manifest))
    return path


def convert_to_v1(path):
    """Rewrite a (v2) dump directory in the v1 layout, every rank and file, keeping its data and records."""
    path = Path(path)
    manifest = json.loads((path / "manifest.json").read_text())
    sizes = {}
    for rank, entry in manifest["ranks"].items():
        for file in entry["files"]:
            tensors = {}
            for name, t in load_file(path / file["name"]).items():
                head, kind = name.rsplit("/", 1)
                if kind in ("ids", "probs"):
                    tensors.update(
                        {f"{head}/layer{layer}/{kind}": t[i].clone() for i, layer in enumerate(file["layers"])}
                    )
                else:
                    tensors[name] = t
            save_file(tensors, path / file["name"], metadata={"schema": SCHEMA, "version": "1", "rank": rank})
            sizes[file["name"]] = ((path / file["name"]).stat().st_size, len(tensors))
    for obj_path in [path / "manifest.json", *sorted(path.glob("rank*.json"))]:
        obj = json.loads(obj_path.read_text())
        obj["version"] = 1
        entries = obj["ranks"].values() if "ranks" in obj else [obj]
        for entry in entries:
            for file in entry["files"]:
                file.pop("layers")
                file["bytes"], file["tensors"] = sizes[file["name"]]
        obj_path.write_text(json.dumps(obj))
    return path
