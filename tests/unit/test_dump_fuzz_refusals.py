"""Refusals found by fuzzing the routing-dump inputs: every bad input is a DumpError naming where."""

from __future__ import annotations

import json
import os
import struct

import numpy as np
import pytest
import torch

from moeverify import record
from moeverify.errors import DumpError
from moeverify.record import format as fmt
from moeverify.routing.routes import Routes


def _routes(seed: int = 0) -> Routes:
    gen = torch.Generator().manual_seed(seed)
    return Routes(
        {layer: [torch.rand(24, 8, generator=gen).topk(2, dim=1).indices] for layer in (0, 1, 2)}, num_experts=8, topk=2
    )


@pytest.fixture
def dump_dir(tmp_path):
    path = tmp_path / "d"
    record.save(path, _routes(), order="router", seq_len=12, batch=2)
    return path


def _edit(path, mutate):
    manifest = json.loads((path / "manifest.json").read_text())
    mutate(manifest)
    (path / "manifest.json").write_text(json.dumps(manifest))


def _file(m):
    return m["ranks"]["0"]["files"][0]


MUTATIONS = {
    "topk float": (lambda m: m["model"].__setitem__("topk", 2.5), r"model\.topk must be an integer, got float"),
    "num_experts str": (lambda m: m["model"].__setitem__("num_experts", "8"), r"model\.num_experts must be an integer"),
    "moe_layers str": (lambda m: m["model"].__setitem__("moe_layers", ["0", 1, 2]), r"model\.moe_layers\[0\] must be"),
    "moe_layers float": (lambda m: m["model"].__setitem__("moe_layers", [0.0, 1, 2]), r"model\.moe_layers\[0\]"),
    "num_layers str": (lambda m: m["model"].__setitem__("num_layers", "3"), r"model\.num_layers must be an integer"),
    "version float": (lambda m: m.__setitem__("version", 2.0), r"schema version 2\.0 not supported"),
    "bytes str": (lambda m: _file(m).__setitem__("bytes", "304"), r"file rank00000\.safetensors bytes must be"),
    "bytes float": (lambda m: _file(m).__setitem__("bytes", 304.0), r"bytes must be an integer, got float"),
    "tensors -1": (lambda m: _file(m).__setitem__("tensors", -1), r"tensors -1 outside \[1, inf\)"),
    "tensors 2": (lambda m: _file(m).__setitem__("tensors", 2), r"holds 1 tensor\(s\) != 2 listed in"),
    "microbatches float": (
        lambda m: m["steps"]["0"].__setitem__("microbatches", 1.5),
        r"steps\['0'\]: microbatches must be an integer",
    ),
    "microbatches str": (lambda m: m["steps"]["0"].__setitem__("microbatches", "1"), r"microbatches must be"),
    "step key 00": (lambda m: m["steps"].__setitem__("00", m["steps"].pop("0")), r"steps key '00' is not a canonical"),
    "step key space": (lambda m: m["steps"].__setitem__(" 0", m["steps"].pop("0")), r"steps key ' 0' is not"),
    "rank key 00": (lambda m: m["ranks"].__setitem__("00", m["ranks"].pop("0")), r"ranks key '00' is not"),
    "rank key -0": (lambda m: m["ranks"].__setitem__("-0", m["ranks"].pop("0")), r"ranks key '-0' is not"),
    "coords.rank -1": (lambda m: m["ranks"]["0"]["coords"].__setitem__("rank", -1), r"coords\.rank -1 outside"),
    "coords.rank 1": (lambda m: m["ranks"]["0"]["coords"].__setitem__("rank", 1), r"coords\.rank 1 != its key 0"),
    "coords.rank None": (lambda m: m["ranks"]["0"]["coords"].__setitem__("rank", None), r"coords\.rank must be"),
    "coords.tp 1": (lambda m: m["ranks"]["0"]["coords"].__setitem__("tp", 1), r"rank 0: tp rank 1 outside \[0, 1\)"),
    "zigzag str": (lambda m: m.__setitem__("zigzag", "yes"), r"zigzag must be true or false, got str"),
    "layout empty": (lambda m: m.__setitem__("layout", {}), r"layout is missing key\(s\)"),
    "layers permuted": (lambda m: _file(m).__setitem__("layers", [2, 1, 0]), r"'layers' \[2, 1, 0\] is not ascending"),
    "world_size huge": (lambda m: m.__setitem__("world_size", 10**30), r"of world_size 10+ missing from the manifest"),
    "num_layers huge": (lambda m: m["model"].__setitem__("num_layers", 10**20), r"model\.num_layers 10+ outside"),
    "seq_len empty": (lambda m: m["steps"]["0"].__setitem__("seq_len", []), r"steps\['0'\]: seq_len \[\] holds 0"),
    "seq_len float": (lambda m: m["steps"]["0"].__setitem__("seq_len", [12.0]), r"steps\['0'\]: seq_len\[0\] must"),
    "batch 0": (lambda m: m["steps"]["0"].__setitem__("batch", 0), r"steps\['0'\]: batch 0 outside"),
    "ids_dtype": (lambda m: m.__setitem__("ids_dtype", "int64"), r"ids_dtype 'int64' is not one of"),
    "topk > experts": (lambda m: m["model"].__setitem__("topk", 9), r"model: need 1 <= topk <= num_experts"),
}


@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_load_manifest_value_refused(dump_dir, name):
    mutate, pattern = MUTATIONS[name]
    _edit(dump_dir, mutate)
    with pytest.raises(DumpError, match=pattern) as info:
        record.load(dump_dir)
    assert "manifest.json" in str(info.value)


def test_load_probs_without_probs_dtype_refused(tmp_path):
    path = tmp_path / "p"
    probs = {layer: [torch.rand(24, 2)] for layer in (0, 1, 2)}
    record.save(path, _routes(), order="router", seq_len=12, batch=2, probs=probs)
    _edit(path, lambda m: m.__setitem__("probs_dtype", None))
    with pytest.raises(DumpError, match=r"probs in the file, but .*manifest\.json has probs_dtype null"):
        record.load(path)


def test_parse_tensor_name_leading_zero_refused():
    with pytest.raises(DumpError, match=r"tensor name 'step0/mb0/layer01/ids' is not"):
        fmt.parse_tensor_name("step0/mb0/layer01/ids")


def test_load_symlinked_rank_file_refused(dump_dir, tmp_path):
    other = tmp_path / "o"
    record.save(other, _routes(1), order="router", seq_len=12, batch=2)
    (dump_dir / "rank00000.safetensors").unlink()
    os.symlink(other / "rank00000.safetensors", dump_dir / "rank00000.safetensors")
    with pytest.raises(DumpError, match=r"rank00000\.safetensors: rank 0 file is a symbolic link"):
        record.load(dump_dir)


def test_load_fifo_rank_file_not_regular(dump_dir):
    (dump_dir / "rank00000.safetensors").unlink()
    os.mkfifo(dump_dir / "rank00000.safetensors")
    with pytest.raises(DumpError, match=r"rank 0 file is not a regular file"):
        record.load(dump_dir)


def test_load_deeply_nested_manifest_refused(dump_dir):
    (dump_dir / "manifest.json").write_text("[" * 100000 + "]" * 100000)
    with pytest.raises(DumpError, match=r"manifest\.json: not valid JSON"):
        record.load(dump_dir)


def _header(path):
    data = (path / "rank00000.safetensors").read_bytes()
    return data, struct.unpack("<Q", data[:8])[0]


@pytest.mark.parametrize(
    ("code", "named"),
    [("I8", "torch.int8"), ("F8_E4M3", "F8_E4M3")],  # a dtype of the one table, and one outside it (its own code)
)
def test_load_unknown_safetensors_dtype_named(dump_dir, code, named):
    data, n = _header(dump_dir)
    header = data[8 : 8 + n].replace(b'"U8"', f'"{code}"'.encode())
    edited = struct.pack("<Q", len(header)) + header + data[8 + n :]
    (dump_dir / "rank00000.safetensors").write_bytes(edited)
    _edit(dump_dir, lambda m: _file(m).__setitem__("bytes", len(edited)))  # a longer code: the size it now has
    with pytest.raises(DumpError, match=rf"dtype {named} != expected uint8"):
        record.load(dump_dir)


def test_routes_out_of_range_id_names_rank_and_token(dump_dir):
    data, n = _header(dump_dir)
    raw = bytearray(data)
    raw[8 + n + (1 * 24 + 5) * 2] = 8  # layer 1, token 5, slot 0 -> expert 8 of 8
    (dump_dir / "rank00000.safetensors").write_bytes(bytes(raw))
    with pytest.raises(DumpError, match=r"layer 1 rank 0 mb 0: expert id 8 out of range \[0, 8\) \(token 5\)"):
        record.load(dump_dir).routes()


# -- importers: arrays and exports ---------------------------------------------------------------------------
from moeverify.record import importers  # noqa: E402

GOOD_NLK = np.stack([_routes().get(layer, 0).numpy() for layer in (0, 1, 2)], axis=1).astype(np.int32)


def test_read_arrays_fifo_refused(tmp_path):
    path = tmp_path / "x.npy"
    os.mkfifo(path)
    with pytest.raises(DumpError, match=r"x\.npy: not a regular file"):
        importers.read_arrays(path)


def test_read_arrays_npz_member_not_npy_refused(tmp_path):
    import io
    import zipfile

    path = tmp_path / "x.npz"
    with zipfile.ZipFile(path, "w") as z:
        buf = io.BytesIO()
        np.save(buf, GOOD_NLK)
        z.writestr("mb0.npy", buf.getvalue())
        z.writestr("notes.txt", "hello")
    with pytest.raises(DumpError, match=r"x\.npz: npz member 'notes\.txt' is not a \.npy array"):
        importers.read_arrays(path)


@pytest.mark.parametrize("huge, dtype", [(2**62, np.int64), (2**31, np.uint32), (2**64 - 1, np.uint64)])
def test_routes_from_arrays_huge_id_refused_before_widening(huge, dtype):
    arr = np.where(GOOD_NLK == 0, dtype(huge), GOOD_NLK.astype(dtype))
    token, column = (int(x[0]) for x in np.nonzero((arr == huge).any(axis=2)))
    with pytest.raises(
        DumpError,
        match=rf"f\.npy: array 0: token {token} layer {column}: expert id {huge} out of "
        rf"range \[0, 2147483648\)",
    ):
        importers.routes_from_arrays([arr], where="f.npy")


def _export(tmp_path, mutate):
    src = tmp_path / "src"
    record.save(src, _routes(), order="router", seq_len=12, batch=2)
    out = importers.export_npz(record.load(src), tmp_path / "e.npz")
    with np.load(out) as z:
        arrays = {k: z[k] for k in z.files}
    mutate(arrays)
    path = tmp_path / "t.npz"
    np.savez(path, **arrays)
    return path


EXPORT_MUTATIONS = {
    "layers float": (
        lambda a: a.__setitem__("layers", np.array([0.5, 1.0, 2.0])),
        r"'layers' shape \(3,\) dtype float",
    ),
    "layers permuted": (lambda a: a.__setitem__("layers", np.array([2, 1, 0])), r"'layers' \[2, 1, 0\] must be"),
    "layers scalar": (lambda a: a.__setitem__("layers", np.array(0)), r"'layers' shape \(\)"),
    "layers str": (
        lambda a: a.__setitem__("layers", np.array(["0", "1", "2"])),
        r"'layers\.npy': cannot read as \.npy: dtype <U1 is not a numeric",
    ),
    "layers missing": (lambda a: a.pop("layers"), r"not a valid export: 'layers' missing"),
    "batch float": (lambda a: a.__setitem__("step0_batch", np.array([2.7])), r"'step0_batch' shape \(1,\) dtype float"),
    "batch missing": (lambda a: a.pop("step0_batch"), r"step0_seq_len and step0_batch must be both present"),
    "batch empty": (lambda a: a.__setitem__("step0_batch", np.zeros(0, np.int64)), r"'step0_batch' shape \(0,\)"),
    "seq_len float": (lambda a: a.__setitem__("step0_seq_len", np.array([12.9])), r"'step0_seq_len' shape \(1,\) "),
    "seq_len 2-D": (lambda a: a.__setitem__("step0_seq_len", np.array([[12]])), r"'step0_seq_len' shape \(1, 1\)"),
    "version 2": (lambda a: a.__setitem__("moeverify_export", np.array([2])), r"moeverify_export version 2 unknown"),
    "experts float": (lambda a: a.__setitem__("num_experts", np.array([8.5])), r"'num_experts' shape \(1,\) dtype f"),
    "experts empty": (lambda a: a.__setitem__("num_experts", np.zeros(0, np.int64)), r"'num_experts' shape \(0,\)"),
    "key step00": (lambda a: a.__setitem__("step00_mb0", a.pop("step0_mb0")), r"key\(s\) \['step00_mb0'\] unexpected"),
    "extra key": (lambda a: a.__setitem__("zzz", np.array([1])), r"not a valid export: key\(s\) \['zzz'\] unexpected"),
}


@pytest.mark.parametrize("name", sorted(EXPORT_MUTATIONS))
def test_read_export_tampered_refused(tmp_path, name):
    mutate, pattern = EXPORT_MUTATIONS[name]
    path = _export(tmp_path, mutate)
    assert importers.is_export(path)
    with pytest.raises(DumpError, match=pattern) as info:
        importers.read_export(path, step=None)
    assert "t.npz" in str(info.value)
