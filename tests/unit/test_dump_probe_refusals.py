"""Dump files a user probe wrote or read that moeverify accepted where it should refuse, or refused where the docs
promise a call works: what a reader refuses is never written, and the documented calls run as written."""

from __future__ import annotations

import numpy as np
import torch

from moeverify import record
from moeverify.cli import main
from moeverify.routing.routes import Routes


def _routes():
    gen = torch.Generator().manual_seed(0)
    return Routes({0: [torch.rand(8, 4, generator=gen).topk(2, dim=1).indices]}, num_experts=4, topk=2)


def test_convert_refuses_a_layer_count_the_reader_would_refuse(tmp_path, capsys):
    array = tmp_path / "a.npy"
    np.save(array, np.tile(np.array([0, 1]), (8, 3, 1)))  # [tokens, layers, topk]
    out = tmp_path / "big"
    argv = ["dump", "convert", str(array), str(out), "--seq-len", "4", "--batch", "2", "--order", "sequence"]
    assert main([*argv, "--moe-layers", "0,1,1000000000000"]) == 2
    assert "num_layers 1000000000001 outside" in capsys.readouterr().err and not out.exists()


def test_dump_routes_takes_the_step_as_the_docs_write_it(tmp_path):
    record.save(tmp_path / "d", _routes(), step=3, seq_len=4, batch=2, order="sequence")
    dump = record.load(tmp_path / "d")
    assert torch.equal(dump.routes(3).get(0, 0), dump.routes(step=3).get(0, 0))


def test_a_trace_record_of_another_rank_than_its_file_name_is_refused(tmp_path, capsys):
    import json

    rec = {"step": 0, "block": "decoder", "layer": 0, "num_tokens": 2, "topk": 2, "top_indices": [[0, 1], [1, 2]]}
    trace = tmp_path / "router_trace_rank0.jsonl"
    trace.write_text(json.dumps({**rec, "rank": 1}) + "\n")
    argv = ["dump", "convert", str(trace), str(tmp_path / "d"), "--seq-len", "2", "--batch", "1"]
    assert main(argv) == 2
    assert f"{trace}:1" in capsys.readouterr().err and not (tmp_path / "d").exists()
    trace.write_text(json.dumps({**rec, "rank": 0}) + "\n" + json.dumps({**rec, "layer": 1}) + "\n")  # rank omitted
    assert main(argv) == 0, capsys.readouterr().err


def test_a_manifest_that_is_a_link_is_refused_as_a_rank_file_is(tmp_path):
    import shutil

    import pytest

    from moeverify.errors import DumpError

    record.save(tmp_path / "d", _routes(), seq_len=4, batch=2, order="sequence")
    outside = tmp_path / "elsewhere.json"
    shutil.move(tmp_path / "d" / "manifest.json", outside)
    (tmp_path / "d" / "manifest.json").symlink_to(outside)
    with pytest.raises(DumpError, match="manifest.json: a symbolic link .* never reads outside its directory"):
        record.load(tmp_path / "d")
    loop = tmp_path / "d" / "manifest.json"
    loop.unlink()
    loop.symlink_to(loop)
    with pytest.raises(DumpError, match="a symbolic link"):  # a loop is named as such, not "missing manifest"
        record.load(tmp_path / "d")
