"""Mutators of routing-dump inputs for ``test_dump_bad_inputs_fuzz.py``: each takes a copied input (a file or a
directory) and damages it one way, returning the name of what it damaged."""

from __future__ import annotations

import json
import os
import random
import shutil
import struct
import zipfile
from collections.abc import Callable
from pathlib import Path

import numpy as np

S, B, K, E, LAYERS, MBS = 4, 2, 2, 8, (0, 1, 2), 2
T = S * B


class _Pickled:
    """Unpickling this writes a marker file: reading a user's file must never unpickle it."""

    marker = ""

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _jsonl(path: Path, recs: list) -> None:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in recs))


# ------------------------------------------------------------------------------------------ mutators
# A mutator takes the copied input path (file or directory) and damages it; it returns the bad file's name.
def _m_file(fn: Callable[[bytes], bytes]):
    def mutate(path: Path) -> str:
        path.write_bytes(fn(path.read_bytes()))
        return path.name

    return mutate


def _flip(seed: int, n: int):
    def fn(data: bytes) -> bytes:
        rng = random.Random(seed)
        out = bytearray(data)
        for _ in range(n):
            i = rng.randrange(min(len(out), 256))
            out[i] ^= 0xFF
        return bytes(out)

    return fn


def _to_dir(path: Path) -> str:
    path.unlink()
    path.mkdir()
    return path.name


def _to_dangling(path: Path) -> str:
    path.unlink()
    path.symlink_to(path.parent / "nowhere")
    return path.name


def _to_fifo(path: Path) -> str:
    path.unlink()
    os.mkfifo(path)
    return path.name


FILE_MUTATORS = {
    "empty": _m_file(lambda d: b""),
    "8 bytes": _m_file(lambda d: d[:8]),
    "half": _m_file(lambda d: d[: len(d) // 2]),
    "last byte cut": _m_file(lambda d: d.rstrip(b"\n")[:-1]),
    "garbage appended": _m_file(lambda d: d + b"\x00garbage\xff" * 3),
    "flip 1": _m_file(_flip(1, 1)),
    "flip 8": _m_file(_flip(2, 8)),
    "random": _m_file(lambda d: random.Random(3).randbytes(max(len(d), 64))),
    "is a dir": _to_dir,
    "dangling symlink": _to_dangling,
    "fifo": _to_fifo,
}


# Safetensors: a header of 8-byte length + JSON.
def _st_header(mutate_header):
    def mutate(path: Path) -> str:
        data = path.read_bytes()
        (n,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8 : 8 + n])
        mutate_header(header)
        raw = json.dumps(header).encode()
        path.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n :])
        return path.name

    return mutate


def _st_first(header) -> dict:
    return header[next(k for k in sorted(header) if k != "__metadata__")]


def _st_set(field, value):
    return _st_header(lambda h: _st_first(h).__setitem__(field, value))


SAFETENSORS_MUTATORS = {
    "st len huge": _m_file(lambda d: struct.pack("<Q", 2**62) + d[8:]),
    "st len 0": _m_file(lambda d: struct.pack("<Q", 0) + d[8:]),
    "st len past end": _m_file(lambda d: struct.pack("<Q", len(d)) + d[8:]),
    "st dtype F32": _st_set("dtype", "F32"),
    "st dtype BOOL": _st_set("dtype", "BOOL"),
    "st dtype junk": _st_set("dtype", "Q99"),
    "st dtype int": _st_set("dtype", 5),
    "st shape neg": _st_header(lambda h: _st_first(h).__setitem__("shape", [-1] + _st_first(h)["shape"][1:])),
    "st shape huge": _st_header(lambda h: _st_first(h).__setitem__("shape", [2**40] + _st_first(h)["shape"][1:])),
    "st shape str": _st_set("shape", "abc"),
    "st shape 1d": _st_header(lambda h: _st_first(h).__setitem__("shape", [int(np.prod(_st_first(h)["shape"]))])),
    "st offsets swapped": _st_header(
        lambda h: _st_first(h).__setitem__("data_offsets", _st_first(h)["data_offsets"][::-1])
    ),
    "st offsets huge": _st_header(lambda h: _st_first(h).__setitem__("data_offsets", [0, 2**40])),
    "st offsets neg": _st_header(lambda h: _st_first(h).__setitem__("data_offsets", [-8, 8])),
    "st offsets float": _st_header(lambda h: _st_first(h).__setitem__("data_offsets", [0.0, 8.0])),
    "st no metadata": _st_header(lambda h: h.pop("__metadata__", None)),
    "st metadata list": _st_header(lambda h: h.__setitem__("__metadata__", [1, 2])),
    "st metadata empty": _st_header(lambda h: h.__setitem__("__metadata__", {})),
    "st tensor renamed": _st_header(
        lambda h: h.__setitem__("zzz", h.pop(next(k for k in sorted(h) if k != "__metadata__")))
    ),
    "st tensor dropped": _st_header(lambda h: h.pop(next(k for k in sorted(h) if k != "__metadata__"))),
    "st header list": _st_header(lambda h: (h.clear(), h.__setitem__("x", []))),
}


def _st_metadata_set(key, value):
    def mutate_header(header):
        meta = header.setdefault("__metadata__", {})
        keys = sorted(meta) or [key]
        meta[keys[0] if key == "*" else key] = value

    return _st_header(mutate_header)


def _st_ids(edit):
    """``edit(ids_bytes)`` in place on the first ids tensor's data (the header and byte counts unchanged)."""

    def mutate(path: Path) -> str:
        data = bytearray(path.read_bytes())
        (n,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8 : 8 + n])
        name = next(k for k in sorted(header) if k.endswith("/ids"))
        lo, hi = header[name]["data_offsets"]
        view = memoryview(data)[8 + n + lo : 8 + n + hi]
        edit(view)
        path.write_bytes(bytes(data))
        return path.name

    return mutate


def _st_copy(dst: int, src: int):
    def edit(view):
        view[dst] = view[src]

    return edit


def _st_put(index: int, value: int):
    def edit(view):
        view[index] = value

    return edit


SAFETENSORS_MUTATORS.update(
    {
        "st data id 255": _st_ids(_st_put(5, 255)),
        "st data id = E": _st_ids(_st_put(0, E)),
        "st data duplicate expert": _st_ids(_st_copy(1, 0)),
        "st data duplicate expert last row": _st_ids(lambda v: _st_copy(len(v) - 1, len(v) - 2)(v)),
        "st meta first=junk": _st_metadata_set("*", "junk"),
        "st meta first=json list": _st_metadata_set("*", "[1, 2]"),
        "st meta first=-1": _st_metadata_set("*", "-1"),
    }
)


# Manifest: walk every value, and damage it one way at a time.
def _paths(obj, prefix=()):
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj[:2]):
            yield from _paths(v, prefix + (i,))


def _manifest_mutator(path_keys, how):
    def mutate(path: Path) -> str:
        doc = json.loads(path.read_text())
        parent = doc
        for k in path_keys[:-1]:
            parent = parent[k]
        last = path_keys[-1]
        if how == "delete":
            del parent[last]
        else:
            parent[last] = how
        path.write_text(json.dumps(doc))
        return path.name

    return mutate


MANIFEST_VALUES = {
    "None": None,
    "str": "x",
    "neg": -1,
    "huge": 10**30,
    "nan": float("nan"),
    "float": 1.5,
    "list": [],
    "dict": {},
    "bool": True,
}


OPTIONAL_MANIFEST_KEYS = ("created", "versions", "probs_dtype")  # absent in older dumps: deleting them is legit


def manifest_mutators(manifest: dict, rng: random.Random) -> dict:
    out = {}
    for p in _paths(manifest):
        if not p:
            continue
        where = "/".join(map(str, p))
        if isinstance(p[-1], str) and not where.startswith(OPTIONAL_MANIFEST_KEYS):
            out[f"manifest del {where}"] = _manifest_mutator(p, "delete")
        for label in rng.sample(sorted(MANIFEST_VALUES), 3):
            if (where, label) in (("layout/vpp", "None"), ("versions", "dict")):  # no VPP; no versions known
                continue
            out[f"manifest {where}={label}"] = _manifest_mutator(p, MANIFEST_VALUES[label])
    return out


# Arrays.
def _np_replace(make):
    def mutate(path: Path) -> str:
        arr = np.load(path) if path.suffix == ".npy" else None
        new = make(arr)
        with open(path, "wb") as f:
            np.save(f, new, allow_pickle=isinstance(new, np.ndarray) and new.dtype == object)
        return path.name

    return mutate


def _set(index, value, dtype=None):
    def make(a):
        a = a.astype(dtype or a.dtype, copy=True)
        a[index] = value
        return a

    return make


def _object_array(a):
    obj = np.empty(a.shape[:1], dtype=object)
    for i in range(len(obj)):
        obj[i] = _Pickled()
    return obj


NPY_MUTATORS = {
    "npy float32": _np_replace(lambda a: a.astype(np.float32)),
    "npy float nan": _np_replace(_set((0, 0, 0), np.nan, np.float64)),
    "npy float 0.5": _np_replace(_set((0, 0, 0), 0.5, np.float64)),
    "npy bool": _np_replace(lambda a: a.astype(bool)),
    "npy complex": _np_replace(lambda a: a.astype(np.complex64)),
    "npy str": _np_replace(lambda a: a.astype(str)),
    "npy object": _np_replace(_object_array),
    "npy structured": _np_replace(lambda a: np.zeros(a.shape[:1], dtype=[("x", "i8"), ("y", "f4")])),
    "npy uint64 2**63": _np_replace(_set((0, 0, 0), 2**63, np.uint64)),
    "npy int8 neg": _np_replace(_set((0, 0, 0), -5, np.int8)),
    "npy id -1": _np_replace(_set((1, 0, 0), -1)),
    "npy id -2": _np_replace(_set((1, 0, 0), -2)),
    "npy id huge": _np_replace(_set((1, 0, 0), 2**40)),
    "npy duplicate expert": _np_replace(lambda a: _dup(a)),
    "npy -1 in one layer": _np_replace(lambda a: _set((2, 0), -1)(a) if a.ndim == 3 else _set((2, 0, 1), -1)(a)),
    "npy 0d": _np_replace(lambda a: np.array(3)),
    "npy 1d": _np_replace(lambda a: a.reshape(-1)),
    "npy 2d": _np_replace(lambda a: a.reshape(a.shape[0], -1)),
    "npy 5d": _np_replace(lambda a: a[None, None]),
    "npy empty tokens": _np_replace(lambda a: a[:0]),
    "npy empty layers": _np_replace(lambda a: a[:, :0] if a.ndim == 3 else a[:, :, :0]),
    "npy empty topk": _np_replace(lambda a: a[..., :0]),
    "npy one token short": _np_replace(lambda a: a[:-1] if a.ndim == 3 else a[:, :-1]),
    "npy one token extra": _np_replace(
        lambda a: np.concatenate([a, a[:1]]) if a.ndim == 3 else np.concatenate([a, a[:, :1]], axis=1)
    ),
    "npy one layer short": _np_replace(lambda a: a[:, :-1] if a.ndim == 3 else a[:, :, :-1]),
    "npy topk 1 more": _np_replace(lambda a: np.concatenate([a, (a[..., :1] + 1) % E], axis=-1)),
    "npy fortran int32 neg": _np_replace(lambda a: np.asfortranarray(_set((0, 0, 1), -7, np.int32)(a))),
    "npy not npy text": _m_file(lambda d: b"[[1, 2], [3, 4]]\n"),
    "npy header bad": _m_file(lambda d: d[:10] + b"{'descr': 'zz', 'fortran_order': False, 'shape': (3,), }" + d[70:]),
    "npy header shape huge": _m_file(
        lambda d: d.replace(d[d.index(b"(") : d.index(b")") + 1], b"(99999999999, 3, 2)", 1)
    ),
    "npy header shape neg": _m_file(lambda d: d.replace(d[d.index(b"(") : d.index(b")") + 1], b"(-8, 3, 2)", 1)),
}


def _dup(a):
    a = a.copy()
    a[(0,) * (a.ndim - 1) + (1,)] = a[(0,) * (a.ndim - 1) + (0,)]
    return a


def _big(members: dict) -> str:
    """The last member that holds routes (an export also holds 1-d metadata)."""
    return [k for k in sorted(members) if members[k].ndim >= 2][-1]


def _npz_rewrite(make):
    def mutate(path: Path) -> str:
        with np.load(path) as z:
            members = {k: z[k] for k in z.files}
        members = make(members)
        if isinstance(members, bytes):
            path.write_bytes(members)
        else:
            with open(path, "wb") as f:
                np.savez(f, **members)
        return path.name

    return mutate


def _each_member(make):
    def whole(members):
        k = _big(members)
        out = dict(members)
        out[k] = make(members[k])
        return out

    return whole


def _npz_object_mutator(path: Path) -> str:
    with np.load(path) as z:
        members = {k: z[k] for k in z.files}
    members[sorted(members)[0]] = _object_array(members[sorted(members)[0]])
    with open(path, "wb") as f:
        np.savez(f, **members)  # savez pickles object members
    return path.name


def _npz_text_member(path: Path) -> str:
    with zipfile.ZipFile(path, "a") as z:
        z.writestr("zz_notes.txt", "not an array")
    return path.name


def _npz_raw_member(name: str, data: bytes):
    def mutate(path: Path) -> str:
        with zipfile.ZipFile(path, "a") as z:
            z.writestr(name, data)
        return path.name

    return mutate


NPZ_MUTATORS = {
    "npz empty": _npz_rewrite(lambda m: {}),
    "npz object member": _npz_object_mutator,
    "npz text member": _npz_text_member,
    "npz truncated member": _npz_raw_member("zz.npy", b"\x93NUMPY\x01\x00"),
    "npz not a zip": _m_file(lambda d: b"PK\x03\x04" + d[100:]),
    "npz scalar member": _npz_rewrite(lambda m: {**m, "zz": np.array(1)}),
    "npz mixed layers": _npz_rewrite(lambda m: {**m, _big(m): m[_big(m)][..., :1, :]}),
    "npz mixed topk": _npz_rewrite(lambda m: {**m, _big(m): m[_big(m)][..., :1]}),
    "npz mixed dtype float": _npz_rewrite(lambda m: {**m, _big(m): m[_big(m)].astype(np.float32)}),
}
for _name, _make in [
    ("float32", lambda a: a.astype(np.float32)),
    ("bool", lambda a: a.astype(bool)),
    ("id -3", lambda a: _set((0,) * (a.ndim - 1), -3)(a)),
    ("id E", _set((0, 0, 0), E)),
    ("id 2**40", _set((0, 0, 0), 2**40)),
    ("id 2**62", _set((0, 0, 0), 2**62)),
    ("dup", _dup),
    ("empty", lambda a: a[:0]),
    ("2d", lambda a: a.reshape(len(a), -1)),
    ("4d", lambda a: a[None]),
    ("partial -1", _set((0, 0, 0), -1)),
    ("one layer -1", _set((0, 1), -1)),
    ("uint64 2**63", _set((0, 0, 0), 2**63, np.uint64)),
    ("str", lambda a: a.astype(str)),
    ("longer", lambda a: np.concatenate([a, a, a])),
    ("topk 0", lambda a: a[..., :0]),
]:
    NPZ_MUTATORS[f"npz member {_name}"] = _npz_rewrite(_each_member(_make))
NPZ_MUTATORS["npz one request dropped"] = _npz_rewrite(lambda m: {k: m[k] for k in sorted(m)[:-1]})
NPZ_MUTATORS["npz one request extra"] = _npz_rewrite(lambda m: {**m, "zzz": m[sorted(m)[0]]})


def _dir_to_file(path: Path) -> str:
    shutil.rmtree(path)
    path.write_text("{}")
    return path.name


def _dir_emptied(path: Path) -> str:
    for p in path.iterdir():
        p.unlink() if p.is_file() else shutil.rmtree(p)
    return path.name


def _resized(mutator):
    """``mutator`` on the rank file, with the manifest's byte count made to agree: the header itself is checked."""

    def mutate(path: Path) -> str:
        name = mutator(path / "rank00000.safetensors")
        doc = json.loads((path / "manifest.json").read_text())
        doc["ranks"]["0"]["files"][0]["bytes"] = (path / "rank00000.safetensors").stat().st_size
        (path / "manifest.json").write_text(json.dumps(doc))
        return name

    return mutate


def _dump_dir_mutators():
    def rm(name):
        def mutate(path: Path) -> str:
            (path / name).unlink()
            return name

        return mutate

    def extra_file(name, data=b"x"):
        def mutate(path: Path) -> str:
            (path / name).write_bytes(data)
            return name

        return mutate

    def link_out(path: Path) -> str:
        (path.parent / "outside.safetensors").write_bytes((path / "rank00000.safetensors").read_bytes())
        (path / "rank00000.safetensors").unlink()
        (path / "rank00000.safetensors").symlink_to(path.parent / "outside.safetensors")
        return "rank00000.safetensors"

    def manifest_file_outside(path: Path) -> str:
        doc = json.loads((path / "manifest.json").read_text())
        doc["ranks"]["0"]["files"][0]["name"] = "../dump2/rank00000.safetensors"
        (path / "manifest.json").write_text(json.dumps(doc))
        return "manifest.json"

    def manifest_file_nonutf8(path: Path) -> str:
        doc = json.loads((path / "manifest.json").read_text())
        doc["ranks"]["0"]["files"][0]["name"] = "rank\udcff.safetensors"
        (path / "manifest.json").write_bytes(json.dumps(doc, ensure_ascii=False).encode("utf-8", "surrogateescape"))
        return "manifest.json"

    def stale_rank_record(path: Path) -> str:
        (path / "rank00001.json").write_text("{garbage")
        return "rank00001.json"

    return {
        "dump no manifest": rm("manifest.json"),
        "dump no rank file": rm("rank00000.safetensors"),
        "dump rank file symlinked outside": link_out,
        "dump file name outside": manifest_file_outside,
        "dump file name not utf8": manifest_file_nonutf8,
        "dump garbage rank record": stale_rank_record,
        "dump is a file": _dir_to_file,
        "dump empty dir": _dir_emptied,
        "dump manifest non-utf8 bytes": lambda p: (
            FILE_MUTATORS["garbage appended"](p / "manifest.json"),
            "manifest.json",
        )[1],
        "dump manifest nan bytes": extra_file("manifest.json", b'{"version": NaN}'),
        "dump manifest deep": extra_file("manifest.json", b"[" * 100000 + b"]" * 100000),
        "dump manifest array": extra_file("manifest.json", b"[1, 2]"),
    }
