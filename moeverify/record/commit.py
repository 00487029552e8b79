"""Committing routing dumps: ``finalize`` folds every rank's record into ``manifest.json`` (written last,
atomically) and removes the records; an uncommitted step (rank files written, the manifest not) is named
to every later writer and can be committed or dropped. An append rebuilds a finalized rank's record from
the manifest (``record_from_manifest``).
"""

from __future__ import annotations

import datetime
import json
import os
from pathlib import Path

from moeverify.errors import DumpError
from moeverify.files import atomic_write
from moeverify.record import format as fmt


def write_json(path: Path, obj: dict) -> None:
    """A manifest or rank record, compact (no indentation: its bytes count in every dump's size)."""
    atomic_write(path, (json.dumps(obj, separators=(",", ":"), sort_keys=True) + "\n").encode())


def _read_json(path: Path, *, what: str):
    """``path``'s JSON; ``DumpError`` naming the file (a nesting too deep to parse, not UTF-8, included)."""
    try:
        return json.loads(path.read_bytes())
    except (OSError, ValueError, RecursionError) as exc:
        reason = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
        raise DumpError(f"{path}: {what}: {reason}") from None


def _read_record(rec_path: Path) -> tuple[int, dict]:
    rec = _read_json(rec_path, what="unreadable rank record")
    rank = rec.get("rank") if isinstance(rec, dict) else None
    if type(rank) is not int or rank < 0 or rec_path.name != fmt.rank_record_file(rank):
        raise DumpError(f"{rec_path}: unreadable rank record: rank {rank!r} is not the file's own")
    return rank, rec


def read_manifest(path: Path) -> dict | None:
    manifest_path = path / fmt.MANIFEST
    if not manifest_path.is_file():
        return None
    manifest = _read_json(manifest_path, what="not valid JSON")
    if not isinstance(manifest, dict) or not isinstance(manifest.get("steps"), dict):
        raise DumpError(f"{manifest_path}: not a dump manifest (no 'steps' mapping)")
    return manifest


def uncommitted_steps(path: str | os.PathLike, rank_record: dict) -> list[int]:
    """Steps a rank record holds that the manifest does not (written, then the run ended before finalize)."""
    manifest = read_manifest(Path(path))
    done = set() if manifest is None else {int(s) for s in manifest["steps"]}
    return sorted(int(s) for s in rank_record.get("steps", {}) if int(s) not in done)


def drop_uncommitted(path: str | os.PathLike) -> dict[int, list[int]]:
    """Bring every rank record back to what the manifest commits, deleting files it does not list.

    Returns ``{rank: dropped steps}``. With no manifest at all, every rank record and rank file goes.
    """
    path = Path(path)
    manifest = read_manifest(path)
    dropped: dict[int, list[int]] = {}
    records = sorted(path.glob("rank*.json"))
    if manifest is None and not records:
        orphans = sorted(p.name for p in path.glob("rank*.safetensors"))
        raise DumpError(
            f"{path}: no manifest and no rank record: nothing was committed, and nothing says which "
            f"files a run wrote"
            + (
                f" ({len(orphans)} rank file(s) without a record: "
                f"{', '.join(orphans[:4])}{', ...' if len(orphans) > 4 else ''}; "
                f"delete the directory to start over)"
                if orphans
                else ""
            )
        )
    for rec_path in records:
        rank, rec = _read_record(rec_path)
        steps = uncommitted_steps(path, rec)
        if not steps:
            continue
        dropped[rank] = steps
        keep = None if manifest is None else manifest["ranks"].get(str(rank))
        kept_files = {f["name"] for f in keep["files"]} if keep else set()
        for file in rec["files"]:
            if file["name"] not in kept_files:
                (path / fmt.checked_file_name(file["name"], rank=rank, where=str(rec_path))).unlink(missing_ok=True)
        if keep is None:
            rec_path.unlink()
            continue
        rec["files"] = keep["files"]
        rec["steps"] = {s: i for s, i in rec["steps"].items() if int(s) not in steps}
        write_json(rec_path, rec)
    return dropped


def finalize(path: str | os.PathLike, *, world_size: int | None = None) -> dict:
    """Fold every rank's record into ``manifest.json`` (written last, atomically) and return it.

    Raises ``DumpError`` naming missing ranks or records that disagree on model, layout or steps.
    """
    path = Path(path)
    records = {}
    for rec_path in sorted(path.glob("rank*.json")):
        rank, rec = _read_record(rec_path)
        records[rank] = rec
    if not records:
        manifest = read_manifest(path)
        if manifest is not None:  # finalized before: its records were folded in and removed
            if world_size is not None and manifest.get("world_size") != world_size:
                raise DumpError(
                    f"{path / fmt.MANIFEST}: world_size {manifest.get('world_size')!r} != --world-size "
                    f"{world_size} (the dump is committed; nothing is left to fold in)"
                )
            return manifest
        raise DumpError(f"{path}: no rank records (rank*.json); did every rank close() its writer?")
    first = records[min(records)]
    world = world_size or first["world_size"]
    missing = sorted(set(range(world)) - set(records))
    if missing:
        raise DumpError(f"{path}: rank record(s) missing for rank(s) {missing} of world_size {world}")
    steps: dict[str, dict] = {}
    for rank, rec in sorted(records.items()):
        for key in ("version", "model", "layout", "world_size", "zigzag", "ids_dtype"):
            if rec.get(key) != first.get(key):
                raise DumpError(f"{path}: rank {rank} {key} {rec[key]!r} != rank {min(records)} {first[key]!r}")
        for step, info in rec["steps"].items():
            merged = steps.setdefault(step, {"microbatches": 0, "batch": None, "seq_len": None})
            _merge_step(merged, info, where=f"{path}: rank {rank} step {step}")
    if first.get("version") not in fmt.VERSIONS:
        raise DumpError(
            f"{path}: rank {min(records)} record is format version {first.get('version')!r}; "
            f"this moeverify knows versions {list(fmt.VERSIONS)}"
        )
    manifest = {  # the records' version: finalising an old dump's uncommitted step keeps its format
        "schema": fmt.SCHEMA,
        "version": first["version"],
        "model": first["model"],
        "layout": first["layout"],
        "world_size": world,
        "zigzag": first["zigzag"],
        "ids_dtype": first["ids_dtype"],
        "probs_dtype": next((r["probs_dtype"] for r in records.values() if r["probs_dtype"]), None),
        "steps": dict(sorted(steps.items(), key=lambda kv: int(kv[0]))),
        "ranks": {str(r): {"coords": rec["coords"], "files": rec["files"]} for r, rec in sorted(records.items())},
        "versions": fmt.versions(),
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }
    write_json(path / fmt.MANIFEST, manifest)
    # The manifest now holds all they said (an append rebuilds a rank's record from it): removing them
    # keeps a dump's fixed size to the manifest. A crash before this leaves records equal to the manifest.
    for rec_path in sorted(path.glob("rank*.json")):
        rec_path.unlink(missing_ok=True)
    return manifest


def record_from_manifest(path: Path, rank: int) -> dict | None:
    """A finalized rank's record, rebuilt from the manifest (None: no manifest; the rank starts afresh)."""
    manifest = read_manifest(path)
    if manifest is None:
        return None
    where = path / fmt.MANIFEST
    try:
        mine = manifest["ranks"].get(str(rank))
        if mine is None:
            raise DumpError(
                f"{where}: cannot append: rank {rank} is not in the dump's ranks "
                f"{sorted(manifest['ranks'], key=int)} (world_size {manifest.get('world_size')!r})"
            )
        return {
            "version": manifest["version"],
            "model": manifest["model"],
            "layout": manifest["layout"],
            "world_size": manifest["world_size"],
            "files": list(mine["files"]),
            "probs_dtype": manifest.get("probs_dtype"),
            "steps": manifest["steps"],
        }
    except (KeyError, TypeError, AttributeError) as exc:
        raise DumpError(f"{where}: cannot append: not a complete dump manifest ({exc!r} missing)") from None


def _merge_step(merged: dict, info: dict, *, where: str) -> None:
    if info["microbatches"] and merged["microbatches"] and info["microbatches"] != merged["microbatches"]:
        raise DumpError(f"{where}: {info['microbatches']} micro-batch(es) != {merged['microbatches']} on other ranks")
    merged["microbatches"] = max(merged["microbatches"], info["microbatches"])
    for key in ("batch", "seq_len"):
        if info[key] is None:
            continue
        if merged[key] is not None and merged[key] != info[key]:
            raise DumpError(f"{where}: {key} {info[key]} != {merged[key]} on other ranks")
        merged[key] = info[key]
