"""Dump format v2 (layers of one step and micro-batch packed into one [L, T, K] tensor): round trips, v1 dumps
still read, malformed packed files refused naming file/step/micro-batch/layer, one layer streamed alone."""

import json

import pytest
import torch
from dump_v1 import convert_to_v1, write_v1_dump
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from moeverify import record
from moeverify.errors import DumpError
from moeverify.record import format as fmt
from moeverify.record import reader
from moeverify.record.layer_read import data_spans
from moeverify.record.stream import DumpSource
from moeverify.record.writer import RankWriter
from moeverify.routing.routes import Routes


def _ids(*, experts, topk, layers=(1, 3), tokens=12, microbatches=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return {
        layer: [torch.rand(tokens, experts, generator=gen).topk(topk, dim=1).indices for _ in range(microbatches)]
        for layer in layers
    }


def _routes(**kw):
    ids = _ids(**kw)
    return Routes(ids, num_experts=kw["experts"], topk=kw["topk"])


def _manifest(path):
    return json.loads((path / "manifest.json").read_text())


def _rewrite(path, tensors, *, layers=None, name="rank00000.safetensors", version="2"):
    """Replace one rank-0 file's tensors with safetensors directly; fix its byte count (and ``layers``)."""
    save_file(tensors, path / name, metadata={"schema": fmt.SCHEMA, "version": version, "rank": "0"})
    manifest = _manifest(path)
    for file in manifest["ranks"]["0"]["files"]:
        if file["name"] == name:
            file["bytes"] = (path / name).stat().st_size
            if layers is not None:
                file["layers"] = layers
    (path / "manifest.json").write_text(json.dumps(manifest))


@pytest.fixture
def v2_dir(tmp_path):
    record.save(tmp_path / "d", _routes(experts=16, topk=2), step=0, num_layers=4)
    return tmp_path / "d"


# -- round trips ------------------------------------------------------------------------------------
def test_v2_writer_packs_layers_of_a_microbatch_into_one_tensor(tmp_path):
    ids = _ids(experts=16, topk=2)
    gen = torch.Generator().manual_seed(1)
    probs = {layer: [torch.rand(12, 2, generator=gen) for _ in range(2)] for layer in ids}
    model = fmt.ModelInfo(num_layers=4, moe_layers=(1, 3), num_experts=16, topk=2)
    with RankWriter(tmp_path / "d", model=model) as writer:
        for layer in (3, 1):  # any arrival order; packed in ascending layer order
            for mb in (1, 0):
                writer.add(step=0, mb=mb, layer=layer, ids_TK=ids[layer][mb], probs_TK=probs[layer][mb])
    record.finalize(tmp_path / "d")
    with safe_open(tmp_path / "d" / "rank00000.safetensors", framework="pt") as handle:
        assert sorted(handle.keys()) == ["step0/mb0/ids", "step0/mb0/probs", "step0/mb1/ids", "step0/mb1/probs"]
        assert handle.metadata()["version"] == "2"
        packed = handle.get_tensor("step0/mb1/ids")
    assert packed.shape == (2, 12, 2) and packed.dtype == torch.uint8
    assert torch.equal(packed[1].long(), ids[3][1])
    manifest = _manifest(tmp_path / "d")
    assert manifest["version"] == 2 and manifest["ranks"]["0"]["files"][0]["layers"] == [1, 3]
    dump = record.load(tmp_path / "d")
    assert dump.version == 2 and dump.routes(step=0) == Routes(ids, num_experts=16, topk=2)
    local = dump.local_probs()
    assert ids and {layer: len(local[layer]) for layer in ids} == {layer: len(probs[layer]) for layer in ids}
    assert [
        (layer, i)
        for layer in ids
        for i, (got, want) in enumerate(zip(local[layer], probs[layer], strict=True))
        if not torch.equal(got, want)
    ] == []


def test_v2_layers_of_one_microbatch_flushed_apart_read_back(tmp_path):
    ids = _ids(experts=8, topk=2, layers=(0, 1, 2))
    model = fmt.ModelInfo(num_layers=3, moe_layers=(0, 1, 2), num_experts=8, topk=2)
    with RankWriter(tmp_path / "d", model=model, background=False) as writer:
        writer.add(step=0, mb=0, layer=0, ids_TK=ids[0][0])
        writer.add(step=0, mb=1, layer=0, ids_TK=ids[0][1])
        writer.add(step=0, mb=1, layer=2, ids_TK=ids[2][1])  # mb 1 buffers other layers than mb 0
        writer.flush()
        for layer, mb in ((1, 0), (2, 0), (1, 1)):
            writer.add(step=0, mb=mb, layer=layer, ids_TK=ids[layer][mb])
    record.finalize(tmp_path / "d")
    files = _manifest(tmp_path / "d")["ranks"]["0"]["files"]
    assert [f["layers"] for f in files] == [[0], [0, 2], [1, 2], [1]]  # one part per distinct layer list
    assert record.load(tmp_path / "d").routes(step=0) == Routes(ids, num_experts=8, topk=2)


def test_v2_more_than_256_experts_top22_of_512_int16_roundtrip(tmp_path):
    routes = _routes(experts=512, topk=22, layers=(0, 2, 5), tokens=40)
    routes = routes.replace(2, 1, torch.arange(490, 512).repeat(40, 1))  # the largest ids survive
    record.save(tmp_path / "d", routes, step=0, num_layers=6)
    with safe_open(tmp_path / "d" / "rank00000.safetensors", framework="pt") as handle:
        packed = handle.get_tensor("step0/mb1/ids")
    assert packed.dtype == torch.int16 and packed.shape == (3, 40, 22)
    dump = record.load(tmp_path / "d")
    assert dump.routes(step=0) == routes
    assert dump.layer_routes(step=0, layer=2).get(2, 1).tolist() == [list(range(490, 512))] * 40
    report = record.diff_stream(DumpSource(dump), DumpSource(record.load(tmp_path / "d")))
    assert report.to_json()["tokens_diverging_any_layer"] == 0.0 and report.to_json()["num_experts"] == 512


def test_v2_append_new_step_and_finalize_after_crash(tmp_path):
    record.save(tmp_path / "d", _routes(experts=8, topk=2), step=0)
    record.save(tmp_path / "d", _routes(experts=8, topk=2, seed=1), step=1)
    dump = record.load(tmp_path / "d")
    assert [f["layers"] for f in dump.manifest["ranks"]["0"]["files"]] == [[1, 3], [1, 3]]
    assert dump.routes(step=1) == _routes(experts=8, topk=2, seed=1)


def test_v2_writer_refuses_layers_of_one_microbatch_with_different_token_counts(tmp_path):
    model = fmt.ModelInfo(num_layers=2, moe_layers=(0, 1), num_experts=8, topk=2)
    writer = RankWriter(tmp_path / "d", model=model, background=False)
    writer.add(step=0, mb=0, layer=0, ids_TK=torch.tensor([[0, 1], [2, 3]]))
    writer.add(step=0, mb=0, layer=1, ids_TK=torch.tensor([[0, 1]]))
    with pytest.raises(DumpError, match=r"rank 0 step 0 mb 0: layers hold different token counts \{0: 2, 1: 1\}"):
        writer.flush()


def test_v2_writer_refuses_probs_for_some_layers_only(tmp_path):
    model = fmt.ModelInfo(num_layers=2, moe_layers=(0, 1), num_experts=8, topk=2)
    writer = RankWriter(tmp_path / "d", model=model, background=False)
    writer.add(step=0, mb=0, layer=0, ids_TK=torch.tensor([[0, 1]]), probs_TK=torch.tensor([[0.5, 0.5]]))
    writer.add(step=0, mb=0, layer=1, ids_TK=torch.tensor([[0, 1]]))
    with pytest.raises(DumpError, match=r"step 0 mb 0: probs given for layer\(s\) \[0\] but not for \[1\]"):
        writer.flush()


# -- v1 dumps on disk --------------------------------------------------------------------------------
def test_v1_dump_written_without_moeverify_still_reads(tmp_path):
    ids = _ids(experts=16, topk=2)
    gen = torch.Generator().manual_seed(2)
    probs = {layer: [torch.rand(12, 2, generator=gen) for _ in range(2)] for layer in ids}
    write_v1_dump(tmp_path / "v1", ids, num_layers=4, num_experts=16, topk=2, probs=probs)
    dump = record.load(tmp_path / "v1")
    assert dump.version == 1 and dump.routes(step=0) == Routes(ids, num_experts=16, topk=2)
    assert dump.layer_routes(step=0, layer=3).get(3, 1).tolist() == ids[3][1].tolist()
    assert torch.equal(dump.local_probs()[3][0], probs[3][0])
    record.save(tmp_path / "v2", Routes(ids, num_experts=16, topk=2), step=0, num_layers=4)
    report = record.diff_stream(DumpSource(dump), DumpSource(record.load(tmp_path / "v2")))
    assert report.to_json()["tokens_diverging_any_layer"] == 0.0


def test_v1_dump_top22_of_512_still_reads(tmp_path):
    ids = _ids(experts=512, topk=22, tokens=10)
    write_v1_dump(tmp_path / "v1", ids, num_layers=4, num_experts=512, topk=22)
    assert record.load(tmp_path / "v1").routes(step=0) == Routes(ids, num_experts=512, topk=22)


def test_v1_dump_append_refused_naming_the_version(tmp_path):
    write_v1_dump(tmp_path / "v1", _ids(experts=16, topk=2), num_layers=4, num_experts=16, topk=2)
    with pytest.raises(
        DumpError,
        match=r"rank00000.json: cannot append: the dump is format version 1, this writer "
        r"writes version 2 .*new dump directory",
    ):
        record.save(tmp_path / "v1", _routes(experts=16, topk=2), step=1, num_layers=4)


def test_v1_dump_uncommitted_step_finalized_stays_v1(tmp_path):
    path = convert_to_v1(record.save(tmp_path / "d", _routes(experts=16, topk=2), step=0, num_layers=4))
    record.finalize(path)
    assert _manifest(path)["version"] == 1 and record.load(path).version == 1


# -- malformed v2 files ------------------------------------------------------------------------------
def test_v2_wrong_packed_shape_refused(v2_dir):
    tensors = load_file(v2_dir / "rank00000.safetensors")
    tensors["step0/mb1/ids"] = tensors["step0/mb1/ids"][:, :, :1].contiguous()
    _rewrite(v2_dir, tensors)
    with pytest.raises(
        DumpError,
        match=r"rank00000.safetensors: tensor step0/mb1/ids \(step 0, mb 1, layers "
        r"\[1, 3\]\): shape \(2, 12, 1\) != expected \(L=2, T, K=2\)",
    ):
        record.load(v2_dir)


def test_v2_packed_tensor_not_3d_refused(v2_dir):
    tensors = load_file(v2_dir / "rank00000.safetensors")
    tensors["step0/mb0/ids"] = tensors["step0/mb0/ids"][0].contiguous()
    _rewrite(v2_dir, tensors)
    with pytest.raises(
        DumpError,
        match=r"tensor step0/mb0/ids \(step 0, mb 0, layers \[1, 3\]\): shape \(12, 2\) "
        r"!= expected \(L=2, T, K=2\)",
    ):
        record.load(v2_dir)


def test_v2_layer_list_length_mismatch_refused(v2_dir):
    _rewrite(v2_dir, load_file(v2_dir / "rank00000.safetensors"), layers=[1])
    with pytest.raises(
        DumpError,
        match=r"tensor step0/mb0/ids \(step 0, mb 0, layers \[1\]\): shape \(2, 12, 2\) "
        r"packs 2 layer\(s\), but the file's layer list names 1: expected "
        r"\(L=1, T, K=2\)",
    ):
        record.load(v2_dir)


def test_v2_duplicate_layers_refused(v2_dir):
    _rewrite(v2_dir, load_file(v2_dir / "rank00000.safetensors"), layers=[3, 3])
    with pytest.raises(
        DumpError,
        match=r"rank00000.safetensors: rank 0: the file's layer list \[3, 3\] holds "
        r"layer\(s\) \[3\] more than once",
    ):
        record.load(v2_dir)


def test_v2_layer_list_absent_refused(v2_dir):
    manifest = _manifest(v2_dir)
    del manifest["ranks"]["0"]["files"][0]["layers"]
    (v2_dir / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(
        DumpError,
        match=r"manifest.json: rank 0 file rank00000.safetensors: 'layers' must be the "
        r"list of global layers its packed tensors hold \(format v2\), got None",
    ):
        record.load(v2_dir)


def test_v2_layer_in_two_files_refused(v2_dir):
    (v2_dir / "rank00000.p001.safetensors").write_bytes((v2_dir / "rank00000.safetensors").read_bytes())
    manifest = _manifest(v2_dir)
    files = manifest["ranks"]["0"]["files"]
    files.append({**files[0], "name": "rank00000.p001.safetensors"})
    (v2_dir / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(
        DumpError,
        match=r"rank00000.p001.safetensors: tensor step0/mb0/ids\[layer 1\] \(step 0, mb 0, "
        r"layer 1\) also in rank00000.safetensors",
    ):
        record.load(v2_dir)


def test_v2_dtype_mismatch_refused(v2_dir):
    tensors = load_file(v2_dir / "rank00000.safetensors")
    tensors["step0/mb0/ids"] = tensors["step0/mb0/ids"].to(torch.int64)
    _rewrite(v2_dir, tensors)
    with pytest.raises(
        DumpError,
        match=r"rank00000.safetensors: tensor step0/mb0/ids \(step 0, mb 0, layers "
        r"\[1, 3\]\): dtype torch.int64 != expected uint8",
    ):
        record.load(v2_dir)


def test_v2_probs_dtype_mismatch_refused(v2_dir):
    tensors = load_file(v2_dir / "rank00000.safetensors")
    tensors["step0/mb1/probs"] = torch.zeros(2, 12, 2, dtype=torch.int32)
    _rewrite(v2_dir, tensors)
    with pytest.raises(
        DumpError,
        match=r"tensor step0/mb1/probs \(step 0, mb 1, layers \[1, 3\]\): dtype "
        r"torch.int32 != expected a float dtype",
    ):
        record.load(v2_dir)


def test_v2_probs_token_count_mismatch_refused(v2_dir):
    tensors = load_file(v2_dir / "rank00000.safetensors")
    tensors["step0/mb0/probs"] = torch.rand(2, 11, 2)
    _rewrite(v2_dir, tensors)
    with pytest.raises(
        DumpError,
        match=r"tensor step0/mb0/probs\[layer 1\]: 11 tokens != 12 in "
        r"step0/mb0/ids\[layer 1\]",
    ):
        record.load(v2_dir)


def test_v2_missing_tensor_refused(v2_dir):
    tensors = load_file(v2_dir / "rank00000.safetensors")
    del tensors["step0/mb1/ids"]
    _rewrite(v2_dir, tensors)
    with pytest.raises(
        DumpError,
        match=r"rank00000.safetensors: rank 0 \(pp0, layers \[1, 3\]\) missing 2 "
        r"tensor\(s\) \['step0/mb1/ids\[layer 1\]', 'step0/mb1/ids\[layer 3\]'\]",
    ):
        record.load(v2_dir)


def test_v2_file_with_v1_names_refused(v2_dir):
    tensors = load_file(v2_dir / "rank00000.safetensors")
    tensors["step0/mb0/layer1/ids"] = tensors.pop("step0/mb0/ids")[0].contiguous()
    _rewrite(v2_dir, tensors)
    with pytest.raises(
        DumpError,
        match=r"tensor step0/mb0/layer1/ids: not a format v2 name; expected "
        r"step\{S\}/mb\{M\}/ids \(v2, layers packed\)",
    ):
        record.load(v2_dir)


def test_v2_file_with_v1_metadata_refused(v2_dir):
    _rewrite(v2_dir, load_file(v2_dir / "rank00000.safetensors"), version="1")
    with pytest.raises(
        DumpError,
        match=r"metadata schema/version/rank 'moeverify.routing_dump'/'1'/'0' != "
        r"expected 'moeverify.routing_dump'/'2'/'0'",
    ):
        record.load(v2_dir)


# -- streaming one layer -----------------------------------------------------------------------------
def _spy_reads(calls, real):
    """``layer_read.read`` recording the span of every tensor or layer read (installed after the index is built)."""

    def spy(entry, **kwargs):
        calls.append(("span", entry.name, entry.index, entry.offset, entry.nbytes))
        return real(entry, **kwargs)

    return spy


def test_v2_streaming_one_layer_reads_only_that_layer(v2_dir, monkeypatch):
    routes = _routes(experts=16, topk=2)
    tensors = load_file(v2_dir / "rank00000.safetensors")
    for mb in (0, 1):
        tensors[f"step0/mb{mb}/ids"][0] = 255  # layer 1's rows: out of range for 16 experts
    _rewrite(v2_dir, tensors)
    dump = record.load(v2_dir)  # validation reads headers only
    calls = []
    monkeypatch.setattr(reader, "read", _spy_reads(calls, reader.read))
    assert dump.layer_routes(step=0, layer=3) == Routes(
        {3: [routes.get(3, 0), routes.get(3, 1)]}, num_experts=16, topk=2
    )
    spans = data_spans(v2_dir / "rank00000.safetensors")
    layer_bytes = [(spans[f"step0/mb{mb}/ids"][1] - spans[f"step0/mb{mb}/ids"][0]) // 2 for mb in (0, 1)]
    assert calls == [
        ("span", f"step0/mb{mb}/ids", 1, spans[f"step0/mb{mb}/ids"][0] + layer_bytes[mb], layer_bytes[mb])
        for mb in (0, 1)
    ]  # layer 3 is the second of the packed [1, 3]
    with pytest.raises(DumpError, match=r"rank00000.safetensors: step 0: layer 1 rank 0 mb 0: expert id 255 out of"):
        dump.layer_routes(step=0, layer=1)
