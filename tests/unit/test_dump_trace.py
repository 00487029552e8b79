"""Megatron-Core ``router_trace`` imports that could go silently wrong: activation recompute records a
micro-batch twice, and a pipeline stage without MoE layers leaves an empty trace."""

import json

import pytest
import torch

from moeverify import record
from moeverify.cli import main
from moeverify.errors import DumpError
from moeverify.record import importers

S, B, K, E = 4, 2, 2, 8


def _ids(seed, tokens=S * B):
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(tokens, E, generator=gen).topk(K, dim=1).indices


def _rec(layer, ids, *, step=0, rank=0):
    return {
        "step": step,
        "stage": "pre_dispatch",
        "block": "decoder",
        "layer": layer,
        "rank": rank,
        "num_tokens": ids.shape[0],
        "topk": ids.shape[1],
        "top_indices": ids.tolist(),
    }


def _write(path, recs):
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


def _forward(mb, layers=(0, 1, 2)):
    return [(layer, _ids(10 * mb + layer)) for layer in layers]


def _recompute_trace(tmp_path, *, order="descending", differ=False):
    """Two micro-batches, each recorded in forward and again in backward's recompute (PP1 schedule)."""
    recs = []
    for mb in range(2):
        fwd = _forward(mb)
        recs += [_rec(layer, ids) for layer, ids in fwd]
        again = fwd[::-1] if order == "descending" else fwd
        for layer, ids in again:
            ids = ids.flip(0) if differ and mb == 1 and layer == 1 else ids
            recs.append(_rec(layer, ids))
    return _write(tmp_path / "router_trace_rank0.jsonl", recs)


def test_router_trace_recompute_records_are_refused_without_microbatches(tmp_path, capsys):
    trace = _recompute_trace(tmp_path)
    assert main(["dump", "convert", str(trace), str(tmp_path / "d"), "--num-experts", str(E)]) == 2
    err = capsys.readouterr().err
    assert "step 0: the records from line 4 pass layer(s) [2]" in err and "--microbatches N" in err
    assert not (tmp_path / "d").exists()


def test_router_trace_recompute_records_are_dropped_with_microbatches(tmp_path):
    for order in ("descending", "ascending"):  # layer-wise recompute, and one block recomputing the whole stage
        trace = _recompute_trace(tmp_path / order if (tmp_path / order).mkdir() is None else None, order=order)
        steps = importers.read_router_trace(trace, num_experts=E, microbatches=2)
        assert steps[0].microbatches == 2
        for mb in range(2):
            for layer, ids in _forward(mb):
                assert torch.equal(steps[0].get(layer, mb), ids)


def test_router_trace_whole_stage_recompute_is_refused_without_microbatches(tmp_path):
    trace = _recompute_trace(tmp_path, order="ascending")  # passes look whole: only their equal ids give them away
    with pytest.raises(
        DumpError,
        match=r"step 0: 4 passes over the traced layers \(lines 1, 4, 7, 10\): "
        r"micro-batches, or forwards and their recomputes .* Give --microbatches N",
    ):
        importers.read_router_trace(trace, num_experts=E)


def test_router_trace_whole_stage_recompute_that_routes_otherwise_is_refused_without_microbatches(tmp_path):
    # the recompute bug itself: recompute passes differ from their forwards, so each reads as one more micro-batch
    trace = _recompute_trace(tmp_path, order="ascending", differ=True)
    with pytest.raises(DumpError, match=r"4 passes over the traced layers .*\(a recompute that routed otherwise"):
        importers.read_router_trace(trace, num_experts=E)


def test_router_trace_recompute_that_routes_otherwise_is_refused_not_guessed(tmp_path):
    trace = _recompute_trace(tmp_path, differ=True)
    with pytest.raises(DumpError, match=r"layer 1: 4 records .* no other record with the same ids"):
        importers.read_router_trace(trace, num_experts=E, microbatches=2)


def test_router_trace_microbatch_count_is_checked(tmp_path):
    trace = _write(tmp_path / "t.jsonl", [_rec(layer, ids) for mb in range(3) for layer, ids in _forward(mb)])
    assert importers.read_router_trace(trace, num_experts=E, microbatches=3)[0].microbatches == 3
    with pytest.raises(DumpError, match=r"3 passes over the traced layers"):
        importers.read_router_trace(trace, num_experts=E)
    with pytest.raises(DumpError, match=r"layer 0 has 3 record\(s\) \(lines 1..7\) != expected --microbatches 2"):
        importers.read_router_trace(trace, num_experts=E, microbatches=2)


def _pp2_traces(tmp_path):
    """PP2 over 4 decoder layers; stage 0 (layers 0, 1) is dense, stage 1 holds MoE layers 2, 3 (local 0, 1)."""
    tdir = tmp_path / "traces"
    tdir.mkdir()
    (tdir / "router_trace_rank0.jsonl").write_text("")  # what the tracer leaves on a stage without routers
    recs = [_rec(local, ids, rank=1) for mb in range(2) for local, ids in _forward(mb, layers=(0, 1))]
    _write(tdir / "router_trace_rank1.jsonl", recs)
    return tdir


def _convert_pp2(tdir, dst, *extra):
    return main(
        [
            "dump",
            "convert",
            str(tdir),
            str(dst),
            "--layout",
            "pp2",
            "--world-size",
            "2",
            "--num-layers",
            "4",
            "--seq-len",
            str(S),
            "--batch",
            str(B),
            "--num-experts",
            str(E),
            "--microbatches",
            "2",
            *extra,
        ]
    )


def test_router_trace_dense_stage_empty_trace_is_accepted_when_the_moe_layers_say_so(tmp_path, capsys):
    tdir = _pp2_traces(tmp_path)
    assert _convert_pp2(tdir, tmp_path / "d", "--moe-layers", "2,3") == 0
    assert "rank(s) [0] hold no MoE layer" in capsys.readouterr().out
    dump = record.load(tmp_path / "d")
    assert dump.model.moe_layers == (2, 3)
    routes = dump.routes(step=0)
    for mb in range(2):
        for local, ids in _forward(mb, layers=(0, 1)):  # router order s * B + b -> sequence order b * S + s
            assert torch.equal(routes.get(2 + local, mb), ids.view(S, B, K).transpose(0, 1).reshape(S * B, K))


def test_router_trace_empty_trace_refused_where_the_stage_has_moe_layers(tmp_path, capsys):
    tdir = _pp2_traces(tmp_path)
    assert _convert_pp2(tdir, tmp_path / "d") == 2
    assert (
        "router_trace_rank0.jsonl: no decoder router_trace records. If pipeline stage 0 (layers [0, 2)) holds no "
        "MoE layer, give --moe-layers" in capsys.readouterr().err
    )
    assert _convert_pp2(tdir, tmp_path / "d", "--moe-layers", "1,2,3") == 2
    assert "router_trace_rank0.jsonl: no decoder router_trace records" in capsys.readouterr().err
    assert _convert_pp2(tdir, tmp_path / "d", "--moe-layers", "2") == 2
    assert "traced MoE layer(s) [2, 3] != pipeline stage 1's MoE layers [2] of --moe-layers" in capsys.readouterr().err
    assert not (tmp_path / "d").exists()
