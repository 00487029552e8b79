"""Mutators of the sources ``dump convert`` and ``dump diff`` import (router_trace JSONL, a job's trace directory,
expert maps), for ``test_dump_bad_inputs_fuzz.py``."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
from dump_bad_inputs import (
    E,
    K,
    T,
    _dir_emptied,
    _dir_to_file,
    _jsonl,
    _m_file,
    _np_replace,
    _object_array,
    _set,
    _to_dir,
    _to_fifo,
)


# router_trace JSONL.
def _trace_edit(edit):
    def mutate(path: Path) -> str:
        recs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        recs = edit(recs)
        _jsonl(path, recs)
        return path.name

    return mutate


def _rec_set(key, value, index=0):
    def edit(recs):
        recs[index][key] = value
        return recs

    return _trace_edit(edit)


def _rec_del(key):
    def edit(recs):
        del recs[0][key]
        return recs

    return _trace_edit(edit)


TRACE_MUTATORS = {
    "trace garbage line": _trace_edit(lambda r: r[:1] + ["{not json"] + r[1:]),
    "trace list line": _trace_edit(lambda r: r[:1] + ["[1, 2, 3]"] + r[1:]),
    "trace number line": _trace_edit(lambda r: ["42"] + r),
    "trace null line": _trace_edit(lambda r: ["null"] + r),
    "trace duplicated record": _trace_edit(lambda r: r + r[-1:]),
    "trace only mtp": _trace_edit(lambda r: [{**x, "block": "mtp"} for x in r]),
    "trace not utf8": _m_file(lambda d: d[:20] + b"\xff\xfe" + d[20:]),
    "trace NUL": _m_file(lambda d: d[:20] + b"\x00" + d[20:]),
    "trace huge line number": _rec_set("num_tokens", 10**30),
    "trace top_indices ragged": _trace_edit(
        lambda r: [{**r[0], "top_indices": [[1, 2], [3]] + r[0]["top_indices"][2:]}] + r[1:]
    ),
    "trace top_indices flat": _trace_edit(lambda r: [{**r[0], "top_indices": sum(r[0]["top_indices"], [])}] + r[1:]),
    "trace top_indices 3d": _trace_edit(lambda r: [{**r[0], "top_indices": [r[0]["top_indices"]]}] + r[1:]),
    "trace top_indices empty": _trace_edit(lambda r: [{**r[0], "top_indices": [], "num_tokens": 0}] + r[1:]),
    "trace top_indices dict": _rec_set("top_indices", {"a": 1}),
    "trace top_indices str": _rec_set("top_indices", "0,1"),
    "trace top_indices nested str": _trace_edit(
        lambda r: [{**r[0], "top_indices": [["0", "1"]] + r[0]["top_indices"][1:]}] + r[1:]
    ),
    "trace id float": _trace_edit(lambda r: [{**r[0], "top_indices": [[0.5, 1]] + r[0]["top_indices"][1:]}] + r[1:]),
    "trace id bool": _trace_edit(lambda r: [{**r[0], "top_indices": [[True, 1]] + r[0]["top_indices"][1:]}] + r[1:]),
    "trace id null": _trace_edit(lambda r: [{**r[0], "top_indices": [[None, 1]] + r[0]["top_indices"][1:]}] + r[1:]),
    "trace id -1": _trace_edit(lambda r: [{**r[0], "top_indices": [[-1, 1]] + r[0]["top_indices"][1:]}] + r[1:]),
    "trace id huge": _trace_edit(lambda r: [{**r[0], "top_indices": [[2**70, 1]] + r[0]["top_indices"][1:]}] + r[1:]),
    "trace id >= num_experts": _trace_edit(
        lambda r: [{**r[0], "top_indices": [[E, 1]] + r[0]["top_indices"][1:]}] + r[1:]
    ),
    "trace dup expert": _trace_edit(lambda r: [{**r[0], "top_indices": [[1, 1]] + r[0]["top_indices"][1:]}] + r[1:]),
    "trace topk mismatch": _rec_set("topk", K + 1),
    "trace tokens mismatch across layers": _trace_edit(
        lambda r: r[:1] + [{**r[1], "num_tokens": T - 1, "top_indices": r[1]["top_indices"][:-1]}] + r[2:]
    ),
    "trace steps out of order": _trace_edit(lambda r: r + [{**x, "step": 0} for x in r[:1]]),
    "trace empty": _m_file(lambda d: b""),
    "trace blank lines only": _m_file(lambda d: b"\n\n\n"),
}
for _key in ("step", "layer", "num_tokens", "topk", "block", "rank", "top_indices"):
    if _key not in ("block", "rank"):  # both optional: a record without them is a decoder record of its file
        TRACE_MUTATORS[f"trace del {_key}"] = _rec_del(_key)
    for _label, _value in (("str", "x"), ("neg", -1), ("float", 1.5), ("bool", True), ("None", None), ("list", [1])):
        if _key == "block" and _label == "str":
            _value = "encoder"
        TRACE_MUTATORS[f"trace {_key}={_label}"] = _rec_set(_key, _value)


def _traces_dir_mutators():
    def rm_rank(i):
        def mutate(path: Path) -> str:
            (path / f"router_trace_rank{i}.jsonl").unlink()
            return f"rank{i}"

        return mutate

    def extra(name):
        def mutate(path: Path) -> str:
            shutil.copy(path / "router_trace_rank0.jsonl", path / name)
            return name

        return mutate

    def inner(mutator, rank=1):
        def mutate(path: Path) -> str:
            mutator(path / f"router_trace_rank{rank}.jsonl")
            return f"router_trace_rank{rank}.jsonl"

        return mutate

    out = {
        "traces rank1 missing": rm_rank(1),
        "traces rank0 missing": rm_rank(0),
        "traces extra rank2": extra("router_trace_rank2.jsonl"),
        "traces rank00": extra("router_trace_rank00.jsonl"),
        "traces rank1 holds rank0 records": inner(_rec_set("rank", 0)),
        "traces rank1 other step": inner(_trace_edit(lambda r: [{**x, "step": 1} for x in r])),
        "traces rank1 layer outside": inner(_rec_set("layer", 7)),
        "traces rank1 empty": inner(_m_file(lambda d: b"")),
        "traces rank1 is dir": inner(_to_dir),
        "traces rank1 fifo": inner(_to_fifo),
        "traces rank1 garbage": inner(_m_file(lambda d: b"\x00\x01garbage")),
        "traces rank1 ids float": inner(
            _trace_edit(lambda r: [{**r[0], "top_indices": [[0.0, 1.0]] + r[0]["top_indices"][1:]}] + r[1:])
        ),
        "traces is a file": _dir_to_file,
        "traces empty dir": _dir_emptied,
    }
    return out


def _json_mutators(values: dict) -> dict:
    out = {}
    for label, value in values.items():

        def mutate(path: Path, value=value) -> str:
            path.write_text(json.dumps(value) if not isinstance(value, str) else value)
            return path.name

        out[label] = mutate
    return out


MAP_JSON_MUTATORS = _json_mutators(
    {
        "map float": [0.0] + list(range(1, E)),
        "map bool": [True] + list(range(1, E)),
        "map str": ["0"] + list(range(1, E)),
        "map null": [None] + list(range(1, E)),
        "map short": list(range(E - 1)),
        "map long": list(range(E + 1)),
        "map neg": [-1] + list(range(1, E)),
        "map >= P": [E] + list(range(1, E)),
        "map missing expert": [0] * E,
        "map empty": [],
        "map empty row": [[]],
        "map dict bad key": {"x": list(range(E))},
        "map dict missing layer": {"0": list(range(E))},
        "map dict extra layer": {str(i): list(range(E)) for i in range(5)},
        "map rows 2": [list(range(E))] * 2,
        "map rows 5": [list(range(E))] * 5,
        "map scalar": 3,
        "map string": '"abc"',
        "map huge": [2**70] + list(range(1, E)),
        "map nested deep": [[[list(range(E))]]],
        "map bad json": "[0, 1,",
        "map nan": "[NaN, 1, 2, 3, 4, 5, 6, 7]",
        "map wrapped bad": {"physical_to_logical_map": "x"},
        "map wrapped extra": {"physical_to_logical_map": list(range(E)), "other": 1},
        "map not utf8": "\udcff",
    }
)


def _map_npy(make):
    return _np_replace(lambda a: make(np.arange(E, dtype=np.int64)))


MAP_NPY_MUTATORS = {
    "mapnpy float": _map_npy(lambda a: a.astype(np.float32)),
    "mapnpy bool": _map_npy(lambda a: a.astype(bool) | True),
    "mapnpy object": _map_npy(_object_array),
    "mapnpy 3d": _map_npy(lambda a: a[None, None]),
    "mapnpy 0d": _map_npy(lambda a: np.array(0)),
    "mapnpy empty": _map_npy(lambda a: a[:0]),
    "mapnpy rows 0": _map_npy(lambda a: a[None][:0]),
    "mapnpy short": _map_npy(lambda a: a[:-1]),
    "mapnpy neg": _map_npy(_set(0, -1)),
    "mapnpy missing expert": _map_npy(lambda a: a * 0),
    "mapnpy uint64 huge": _map_npy(_set(0, 2**63, np.uint64)),
    "mapnpy rows 2": _map_npy(lambda a: np.stack([a, a])),
    "mapnpy str": _map_npy(lambda a: a.astype(str)),
}
