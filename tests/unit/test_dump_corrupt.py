"""Corrupt, truncated, missing or inconsistent dumps raise DumpError naming the file, tensor, expected vs got.

The ``dump_dir`` dumps are in the v1 layout (one tensor per layer, as older dumps on disk): the reader keeps
refusing corrupt ones. Malformed v2 packed tensors: ``test_dump_format_v2.py``."""

import json

import pytest
import torch
from dump_v1 import convert_to_v1
from safetensors.torch import load_file, save_file
from test_dump_merge import write_rank_dumps

from moeverify import record
from moeverify.errors import DumpError
from moeverify.routing.routes import Routes
from moeverify.spec.layout import Layout


@pytest.fixture
def dump_dir(tmp_path):
    routes = Routes(
        {layer: [torch.tensor([[0, 1], [2, 3], [1, 3], [0, 2]])] * 2 for layer in (1, 2, 3, 5, 7)},
        num_experts=16,
        topk=2,
    )
    write_rank_dumps(tmp_path / "d", _tile(routes, 2), Layout(pp=2), 2)
    return convert_to_v1(tmp_path / "d")


def _tile(routes, times):
    data = {
        layer: [routes.get(layer, mb).repeat(times * 2, 1) for mb in range(routes.microbatches)]
        for layer in routes.layers
    }
    return Routes(data, num_experts=routes.num_experts, topk=routes.topk)


def _manifest(path):
    return json.loads((path / "manifest.json").read_text())


def _rewrite(path, name, tensors, *, fix_size=True):
    """Replace a rank file's tensors, keeping its metadata; update the manifest's byte count."""
    from safetensors import safe_open

    with safe_open(path / name, framework="pt") as handle:
        meta = handle.metadata()
    save_file(tensors, path / name, metadata=meta)
    if fix_size:
        manifest = _manifest(path)
        for entry in manifest["ranks"].values():
            for file in entry["files"]:
                if file["name"] == name:
                    file["bytes"] = (path / name).stat().st_size
        (path / "manifest.json").write_text(json.dumps(manifest))


def test_load_valid_dump_passes(dump_dir):
    assert record.load(dump_dir).routes(step=0).layers == (1, 2, 3, 5, 7)


def test_load_truncated_file_raises(dump_dir):
    data = (dump_dir / "rank00001.safetensors").read_bytes()
    (dump_dir / "rank00001.safetensors").write_bytes(data[:-7])
    with pytest.raises(DumpError, match=r"rank00001.safetensors: truncated or altered: expected \d+ bytes, got \d+"):
        record.load(dump_dir)


def test_load_truncated_file_with_matching_size_record_raises(dump_dir):
    data = (dump_dir / "rank00001.safetensors").read_bytes()
    (dump_dir / "rank00001.safetensors").write_bytes(data[:-7])
    manifest = _manifest(dump_dir)
    manifest["ranks"]["1"]["files"][0]["bytes"] = len(data) - 7
    (dump_dir / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DumpError, match=r"rank00001.safetensors: not a readable safetensors file: .*incomplete"):
        record.load(dump_dir)


def test_load_missing_rank_file_raises(dump_dir):
    (dump_dir / "rank00000.safetensors").unlink()
    with pytest.raises(DumpError, match=r"rank00000.safetensors: rank 0 file missing \(listed in the manifest\)"):
        record.load(dump_dir)


def test_load_rank_missing_from_manifest_raises(dump_dir):
    manifest = _manifest(dump_dir)
    del manifest["ranks"]["1"]
    (dump_dir / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DumpError, match=r"rank\(s\) \[1\] of world_size 2 missing from the manifest"):
        record.load(dump_dir)


def test_finalize_missing_rank_record_raises(tmp_path):
    routes = Routes(
        {layer: [torch.tensor([[0, 1], [2, 3], [1, 3], [0, 2]])] * 2 for layer in (1, 2, 3, 5, 7)},
        num_experts=16,
        topk=2,
    )
    write_rank_dumps(tmp_path / "d", _tile(routes, 2), Layout(pp=2), 2, finalize=False)
    (tmp_path / "d" / "rank00001.json").unlink()
    with pytest.raises(DumpError, match=r"rank record\(s\) missing for rank\(s\) \[1\] of world_size 2"):
        record.finalize(tmp_path / "d")


def test_load_bad_schema_version_raises(dump_dir):
    manifest = _manifest(dump_dir)
    manifest["version"] = 3
    (dump_dir / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(
        DumpError,
        match=r"manifest.json: schema version 3 not supported; this moeverify reads "
        r"versions 1, 2",
    ):
        record.load(dump_dir)


def test_load_bad_schema_name_raises(dump_dir):
    manifest = _manifest(dump_dir)
    manifest["schema"] = "something.else"
    (dump_dir / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DumpError, match=r"schema 'something.else' != expected 'moeverify.routing_dump'"):
        record.load(dump_dir)


def test_load_wrong_dtype_raises(dump_dir):
    tensors = load_file(dump_dir / "rank00000.safetensors")
    tensors["step0/mb1/layer2/ids"] = tensors["step0/mb1/layer2/ids"].to(torch.int64)
    _rewrite(dump_dir, "rank00000.safetensors", tensors)
    with pytest.raises(
        DumpError,
        match=r"rank00000.safetensors: tensor step0/mb1/layer2/ids: dtype torch.int64 "
        r"!= expected uint8",
    ):
        record.load(dump_dir)


def test_load_inconsistent_shapes_raises(dump_dir):
    tensors = load_file(dump_dir / "rank00001.safetensors")
    tensors["step0/mb0/layer5/ids"] = tensors["step0/mb0/layer5/ids"][:-1].clone()
    _rewrite(dump_dir, "rank00001.safetensors", tensors)
    with pytest.raises(
        DumpError,
        match=r"rank00001.safetensors: tensor step0/mb0/layer5/ids: shape \(15, 2\) != "
        r"expected \(T=16, K=2\)",
    ):
        record.load(dump_dir)


def test_load_wrong_topk_shape_raises(dump_dir):
    tensors = load_file(dump_dir / "rank00001.safetensors")
    tensors["step0/mb0/layer5/ids"] = tensors["step0/mb0/layer5/ids"][:, :1].contiguous()
    _rewrite(dump_dir, "rank00001.safetensors", tensors)
    with pytest.raises(DumpError, match=r"tensor step0/mb0/layer5/ids: shape \(16, 1\) != expected \(T, K=2\)"):
        record.load(dump_dir)


def test_load_missing_tensor_raises(dump_dir):
    tensors = load_file(dump_dir / "rank00001.safetensors")
    del tensors["step0/mb1/layer7/ids"]
    _rewrite(dump_dir, "rank00001.safetensors", tensors)
    with pytest.raises(
        DumpError,
        match=r"rank 1 \(pp1, layers \[5, 7\]\) missing 1 tensor\(s\) "
        r"\['step0/mb1/layer7/ids'\]",
    ):
        record.load(dump_dir)


def test_load_unexpected_layer_raises(dump_dir):
    tensors = load_file(dump_dir / "rank00001.safetensors")
    tensors["step0/mb0/layer1/ids"] = tensors["step0/mb0/layer5/ids"].clone()
    _rewrite(dump_dir, "rank00001.safetensors", tensors)
    with pytest.raises(DumpError, match=r"unexpected 1 \['step0/mb0/layer1/ids'\]"):
        record.load(dump_dir)


def test_load_out_of_range_id_raises(dump_dir):
    tensors = load_file(dump_dir / "rank00001.safetensors")
    tensors["step0/mb0/layer5/ids"][3, 0] = 200
    _rewrite(dump_dir, "rank00001.safetensors", tensors)
    with pytest.raises(DumpError, match=r"rank00001.safetensors: step 0: layer 5 rank 1 mb 0: expert id 200 out of"):
        record.load(dump_dir).routes(step=0)
    with pytest.raises(DumpError, match=r"rank00001.safetensors: step 0: layer 5 rank 1 mb 0: expert id 200 out of"):
        record.load(dump_dir).layer_routes(step=0, layer=5)  # the streaming read names the file too


def test_load_duplicate_expert_in_a_row_raises_naming_the_file(dump_dir):
    tensors = load_file(dump_dir / "rank00000.safetensors")
    tensors["step0/mb1/layer2/ids"][5] = 3
    _rewrite(dump_dir, "rank00000.safetensors", tensors)
    with pytest.raises(
        DumpError,
        match=r"rank00000.safetensors: step 0: layer 2 rank 0 mb 1: token 5 routes to "
        r"expert\(s\) twice",
    ):
        record.load(dump_dir).routes(step=0)


def test_load_missing_manifest_raises(dump_dir):
    (dump_dir / "manifest.json").unlink()
    with pytest.raises(DumpError, match=r"manifest.json: missing manifest: the dump is incomplete"):
        record.load(dump_dir)


def test_load_non_safetensors_bytes_raises(dump_dir):
    junk = b"\x00\x01this is not a safetensors file at all" * 3
    (dump_dir / "rank00000.safetensors").write_bytes(junk)
    manifest = _manifest(dump_dir)
    manifest["ranks"]["0"]["files"][0]["bytes"] = len(junk)
    (dump_dir / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DumpError, match=r"rank00000.safetensors: not a readable safetensors file: "):
        record.load(dump_dir)


def test_load_manifest_not_json_raises(dump_dir):
    (dump_dir / "manifest.json").write_text("{not json")
    with pytest.raises(DumpError, match=r"manifest.json: not valid JSON"):
        record.load(dump_dir)


def test_load_foreign_rank_metadata_raises(dump_dir):
    tensors = load_file(dump_dir / "rank00001.safetensors")
    save_file(
        tensors,
        dump_dir / "rank00001.safetensors",
        metadata={"schema": "moeverify.routing_dump", "version": "1", "rank": "0"},
    )
    manifest = _manifest(dump_dir)
    manifest["ranks"]["1"]["files"][0]["bytes"] = (dump_dir / "rank00001.safetensors").stat().st_size
    (dump_dir / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(
        DumpError,
        match=r"rank00001.safetensors: metadata schema/version/rank "
        r"'moeverify.routing_dump'/'1'/'0' != expected 'moeverify.routing_dump'/'1'/'1'",
    ):
        record.load(dump_dir)


def _crash_before_manifest(path, routes, *, step):
    """What a run that dies after closing its writer but before finalize leaves: rank record, no manifest entry."""
    from moeverify.record import ModelInfo, RankWriter

    model = ModelInfo(
        num_layers=max(routes.layers) + 1, moe_layers=routes.layers, num_experts=routes.num_experts, topk=routes.topk
    )
    with RankWriter(path, model=model, background=False, append=True) as writer:
        writer.add_routes(routes, step=step)


def test_uncommitted_step_is_named_with_the_command_that_commits_or_drops_it(tmp_path, capsys):
    from moeverify.cli import main
    from moeverify.record import load, save

    routes = _routes_for_corrupt_tests()
    save(tmp_path / "d", routes, step=0)
    _crash_before_manifest(tmp_path / "d", routes, step=1)
    assert sorted(load(tmp_path / "d").steps) == [0]  # step 1 invisible
    with pytest.raises(DumpError, match=r"step\(s\) \[1\] were written but never committed.*dump finalize"):
        save(tmp_path / "d", routes, step=1)
    assert main(["dump", "finalize", str(tmp_path / "d")]) == 0
    assert sorted(load(tmp_path / "d").steps) == [0, 1]
    # the same crash, then discard: step 2 gone, its file deleted, and it can be written again
    _crash_before_manifest(tmp_path / "d", routes, step=2)
    files_before = sorted(p.name for p in (tmp_path / "d").iterdir())
    assert main(["dump", "finalize", str(tmp_path / "d"), "--drop-uncommitted"]) == 0
    assert "rank 0 step(s) [2]" in capsys.readouterr().out
    assert len(sorted(p.name for p in (tmp_path / "d").iterdir())) == len(files_before) - 1
    save(tmp_path / "d", routes, step=2)
    assert sorted(load(tmp_path / "d").steps) == [0, 1, 2]


def test_new_dump_without_manifest_says_how_to_recover(tmp_path, capsys):
    from moeverify.cli import main
    from moeverify.record import load

    _crash_before_manifest(tmp_path / "d", _routes_for_corrupt_tests(), step=0)
    with pytest.raises(DumpError, match=r"missing manifest.*dump finalize .* commits them"):
        load(tmp_path / "d")
    assert main(["dump", "finalize", str(tmp_path / "d"), "--drop-uncommitted"]) == 0
    assert list((tmp_path / "d").iterdir()) == []


@pytest.mark.parametrize(
    "name", ["../outside.safetensors", "/etc/passwd", "rank00001.safetensors", 7, "rank00000.safetensors/../../x"]
)
def test_manifest_file_names_never_leave_the_dump(tmp_path, name):
    import json

    from moeverify.record import load, save

    save(tmp_path / "d", _routes_for_corrupt_tests(), step=0)
    manifest = json.loads((tmp_path / "d" / "manifest.json").read_text())
    manifest["ranks"]["0"]["files"][0]["name"] = name
    (tmp_path / "d" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DumpError, match=r"is not rank00000\[\.pNNN\]\.safetensors"):
        load(tmp_path / "d")


@pytest.mark.parametrize(
    ("key", "value"),
    [("steps", []), ("ranks", "x"), ("steps", {"0": 3}), ("ranks", {"0": []}), ("world_size", "2"), ("model", None)],
)
def test_manifest_of_wrong_json_types_is_refused_by_name(tmp_path, key, value):
    import json

    from moeverify.record import load, save

    save(tmp_path / "d", _routes_for_corrupt_tests(), step=0)
    manifest = json.loads((tmp_path / "d" / "manifest.json").read_text())
    manifest[key] = value
    (tmp_path / "d" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DumpError, match=r"manifest\.json: (steps|ranks|world_size|model)"):
        load(tmp_path / "d")


def _routes_for_corrupt_tests():
    import torch

    from moeverify.routing.routes import Routes

    gen = torch.Generator().manual_seed(0)
    return Routes(
        {layer: [torch.rand(8, 4, generator=gen).topk(2, dim=1).indices] for layer in (0, 1)}, num_experts=4, topk=2
    )
