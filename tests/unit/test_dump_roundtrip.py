"""Dump format (v2 written): dtype table, save/load round trips, background writer, appending steps."""

import json

import pytest
import torch
from safetensors import safe_open

from moeverify import record
from moeverify.errors import DumpError
from moeverify.record import format as fmt
from moeverify.record.writer import RankWriter
from moeverify.routing.routes import Routes
from moeverify.routing.views import RankCoords


def _routes(*, experts, topk=2, layers=(1, 3), tokens=12, microbatches=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return Routes(
        {
            layer: [torch.rand(tokens, experts, generator=gen).topk(topk, dim=1).indices for _ in range(microbatches)]
            for layer in layers
        },
        num_experts=experts,
        topk=topk,
    )


@pytest.mark.parametrize(
    "experts,dtype",
    [(1, torch.uint8), (256, torch.uint8), (257, torch.int16), (2**15, torch.int16), (2**15 + 1, torch.int32)],
)
def test_ids_dtype_for_narrowest_fit(experts, dtype):
    assert fmt.ids_dtype_for(experts) == dtype


def test_ids_dtype_for_too_many_experts_raises():
    with pytest.raises(DumpError, match="exceeds the largest id dtype"):
        fmt.ids_dtype_for(2**31 + 1)


@pytest.mark.parametrize("experts", [8, 256, 257, 40000])
def test_save_load_roundtrip_every_dtype(tmp_path, experts):
    routes = _routes(experts=experts, tokens=6 if experts > 1000 else 12)
    if experts == 256 or experts == 40000:  # the largest id of the dtype must survive
        routes = routes.replace(1, 0, torch.tensor([[experts - 1, 0]] * routes.get(1, 0).shape[0]))
    record.save(tmp_path / "d", routes, step=0)
    dump = record.load(tmp_path / "d")
    assert dump.routes(step=0) == routes
    with safe_open(tmp_path / "d" / "rank00000.safetensors", framework="pt") as handle:
        assert handle.get_tensor("step0/mb0/ids").dtype == fmt.ids_dtype_for(experts)


def test_save_with_probs_roundtrip(tmp_path):
    routes = _routes(experts=8)
    probs = {layer: [torch.rand(12, 2) for _ in range(2)] for layer in routes.layers}
    record.save(tmp_path / "d", routes, probs=probs)
    dump = record.load(tmp_path / "d")
    assert dump.has_probs
    assert torch.equal(dump.local_probs(step=0, rank=0)[3][1], probs[3][1])


def test_save_appends_steps_in_new_part_files(tmp_path):
    a, b = _routes(experts=8, seed=1), _routes(experts=8, seed=2)
    record.save(tmp_path / "d", a, step=0)
    record.save(tmp_path / "d", b, step=7)
    dump = record.load(tmp_path / "d")
    assert sorted(dump.steps) == [0, 7]
    assert dump.routes(step=0) == a and dump.routes(step=7) == b
    assert (tmp_path / "d" / "rank00000.p001.safetensors").is_file()


def test_save_same_step_twice_raises(tmp_path):
    record.save(tmp_path / "d", _routes(experts=8), step=0)
    with pytest.raises(DumpError, match="step 0 is already in the dump"):
        record.save(tmp_path / "d", _routes(experts=8), step=0)


def test_manifest_holds_shape_layout_ranks_versions(tmp_path):
    record.save(tmp_path / "d", _routes(experts=8), step=3, num_layers=4)
    manifest = json.loads((tmp_path / "d" / "manifest.json").read_text())
    assert manifest["schema"] == "moeverify.routing_dump" and manifest["version"] == fmt.VERSION == 2
    assert manifest["model"] == {"num_layers": 4, "moe_layers": [1, 3], "num_experts": 8, "topk": 2}
    assert manifest["world_size"] == 1 and list(manifest["ranks"]) == ["0"]
    assert manifest["steps"]["3"]["microbatches"] == 2
    assert "torch" in manifest["versions"] and manifest["ids_dtype"] == "uint8"


def test_rank_writer_background_thread_flush_parts(tmp_path):
    model = fmt.ModelInfo(num_layers=2, moe_layers=(0, 1), num_experts=4, topk=1)
    writer = RankWriter(tmp_path / "d", model=model, background=True, queue_size=2)
    buf = torch.zeros(5, 1, dtype=torch.int64)
    for step in range(3):
        for layer in (0, 1):
            buf.fill_(step + layer)  # the writer must have copied: the buffer is reused
            writer.add(step=step, mb=0, layer=layer, ids_TK=buf)
        writer.flush()
    writer.close()
    record.finalize(tmp_path / "d")
    dump = record.load(tmp_path / "d")
    assert len(dump.manifest["ranks"]["0"]["files"]) == 3
    assert [int(dump.routes(step=s).get(1, 0)[0, 0]) for s in range(3)] == [1, 2, 3]


def test_rank_writer_background_error_raised_on_next_call(tmp_path):
    model = fmt.ModelInfo(num_layers=1, moe_layers=(0,), num_experts=4, topk=1)
    writer = RankWriter(tmp_path / "d", model=model)
    writer.add(step=0, mb=0, layer=0, ids_TK=torch.tensor([[9]]))
    with pytest.raises(Exception, match=r"layer 0 rank 0 mb 0: expert id 9 out of range \[0, 4\)"):
        writer.flush()


def test_rank_writer_duplicate_tensor_raises(tmp_path):
    model = fmt.ModelInfo(num_layers=1, moe_layers=(0,), num_experts=4, topk=1)
    writer = RankWriter(tmp_path / "d", model=model, background=False)
    writer.add(step=0, mb=0, layer=0, ids_TK=torch.tensor([[1]]))
    with pytest.raises(DumpError, match="recorded step0/mb0/layer0/ids twice"):
        writer.add(step=0, mb=0, layer=0, ids_TK=torch.tensor([[1]]))


def test_rank_writer_non_moe_layer_raises(tmp_path):
    model = fmt.ModelInfo(num_layers=2, moe_layers=(1,), num_experts=4, topk=1)
    writer = RankWriter(tmp_path / "d", model=model, background=False)
    with pytest.raises(DumpError, match=r"layer 0 is not an MoE layer of the model \[1\]"):
        writer.add(step=0, mb=0, layer=0, ids_TK=torch.tensor([[1]]))


def test_atomic_write_leaves_no_temp_files_and_finalize_folds_the_rank_records_in(tmp_path):
    record.save(tmp_path / "d", _routes(experts=8))
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == ["manifest.json", "rank00000.safetensors"]


def test_append_to_a_finalized_dump_rebuilds_the_rank_record_from_the_manifest(tmp_path):
    routes = _routes(experts=8)
    record.save(tmp_path / "d", routes, step=0)
    record.save(tmp_path / "d", routes, step=1)
    dump = record.load(tmp_path / "d")
    assert sorted(dump.steps) == [0, 1] and dump.routes(step=0) == routes and dump.routes(step=1) == routes
    assert not list((tmp_path / "d").glob("rank*.json"))
    with pytest.raises(DumpError, match=r"step 1|already"):
        record.save(tmp_path / "d", routes, step=1)
    assert record.finalize(tmp_path / "d")["steps"].keys() == {"0", "1"}  # again: nothing to fold, still whole


def test_append_as_a_rank_the_manifest_does_not_hold_is_refused(tmp_path):
    record.save(tmp_path / "d", _routes(experts=8))
    with pytest.raises(DumpError, match=r"manifest.json: cannot append: rank 3 is not in the dump's ranks \['0'\]"):
        RankWriter(
            tmp_path / "d",
            model=record.load(tmp_path / "d").model,
            coords=RankCoords(rank=3),
            append=True,
            background=False,
        )


def test_parse_tensor_name_rejects_foreign_names():
    assert fmt.parse_tensor_name("step2/mb1/layer5/ids") == (2, 1, 5, "ids")
    assert fmt.parse_tensor_name("step2/mb1/positions") == (2, 1, None, "positions")
    with pytest.raises(DumpError, match="tensor name 'weights' is not"):
        fmt.parse_tensor_name("weights")


@pytest.mark.parametrize("read", ["routes", "layer_routes"])
def test_reader_validates_each_tensor_once(tmp_path, monkeypatch, read):
    import moeverify.routing.routes as routes_mod

    routes = _routes(experts=8, microbatches=2)
    record.save(tmp_path / "d", routes, seq_len=6, batch=2, order="router")
    dump = record.load(tmp_path / "d")
    calls = []
    real = routes_mod.validate_topk_ids
    monkeypatch.setattr(routes_mod, "validate_topk_ids", lambda *a, **k: calls.append(k["layer"]) or real(*a, **k))
    if read == "routes":
        assert dump.routes(step=0).microbatches == 2
        assert sorted(calls) == [1, 1, 3, 3]  # one check per (layer, micro-batch), not one per read and one per merge
    else:
        dump.layer_routes(step=0, layer=3)
        assert calls == [3, 3]


def test_save_with_geometry_requires_the_token_order(tmp_path):
    from moeverify.errors import UsageError

    routes = _routes(experts=8, tokens=12, microbatches=1)
    with pytest.raises(
        UsageError,
        match=r"with seq_len and batch 2 say which order the routes are in: "
        r"order='router'.*order='sequence'",
    ):
        record.save(tmp_path / "d", routes, seq_len=6, batch=2)
    with pytest.raises(UsageError, match=r"order='router' needs seq_len and batch"):
        record.save(tmp_path / "d", routes, order="router")
    with pytest.raises(UsageError, match=r"layer 1 micro-batch 0: 12 tokens != seq_len 5 x batch 2 = 10"):
        record.save(tmp_path / "d", routes, seq_len=5, batch=2, order="router")
    with pytest.raises(UsageError, match=r"order='sequence' is for one process's global routes"):
        record.save(tmp_path / "d", routes, seq_len=6, batch=2, order="sequence", world_size=2)
    assert not (tmp_path / "d").exists()
    record.save(tmp_path / "one", routes, seq_len=12, batch=1)  # one sequence per micro-batch: both orders agree


def test_save_sequence_order_reads_back_as_given(tmp_path):
    from moeverify.record.order import to_sequence_order

    router = _routes(experts=8, tokens=12, microbatches=2)
    sequence = to_sequence_order(router, order="router", seq_len=6, batch=2)
    record.save(tmp_path / "r", router, seq_len=6, batch=2, order="router")
    record.save(tmp_path / "s", sequence, seq_len=6, batch=2, order="sequence")
    assert record.load(tmp_path / "r").routes() == sequence  # Dump.routes() is sequence order
    assert record.load(tmp_path / "s").routes() == sequence  # so saving what it returns round-trips


def test_a_bad_id_is_named_in_the_part_file_that_holds_its_step(tmp_path):
    # step 0 in rank00000.safetensors, step 7 in rank00000.p001.safetensors: a bad id of step 0 was blamed on the
    # part file (the rank's files sorted, p001 first)
    from moeverify.record.layer_read import data_spans

    record.save(tmp_path / "d", _routes(experts=8, seed=1), step=0)
    record.save(tmp_path / "d", _routes(experts=8, seed=2), step=7)
    first = tmp_path / "d" / "rank00000.safetensors"
    start, _ = data_spans(first)["step0/mb0/ids"]
    data = bytearray(first.read_bytes())
    data[start] = 200  # uint8 ids of 8 experts
    first.write_bytes(bytes(data))
    with pytest.raises(DumpError, match=r"d/rank00000\.safetensors: step 0: layer \d+ rank 0 mb 0: expert id 200"):
        record.load(tmp_path / "d").routes(step=0)
    assert record.load(tmp_path / "d").routes(step=7).microbatches == 2
