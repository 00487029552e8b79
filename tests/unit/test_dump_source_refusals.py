"""Bad data from other tools, refused naming the file and place instead of read as something else: dumps of
different expert counts, rollout arrays with garbage where capture gaps belong, router_trace records of unknown
blocks or with wrongly typed fields, finalize on what is not (or no longer) a set of rank records."""

import json
import re

import numpy as np
import pytest
import torch

from moeverify import record
from moeverify.cli import main
from moeverify.routing.routes import Routes

S, B, K, E, LAYERS = 6, 2, 2, 8, (0, 1, 2)


def _routes(experts=E, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return Routes(
        {layer: [torch.rand(S * B, E, generator=gen).topk(K, dim=1).indices] for layer in LAYERS},
        num_experts=experts,
        topk=K,
    )


def _dump(path, routes):
    record.save(path, routes, order="sequence", seq_len=S, batch=B, num_layers=len(LAYERS))
    return str(path)


def test_two_dumps_of_different_expert_counts_are_refused_not_widened(tmp_path, capsys):
    a, b = _dump(tmp_path / "a", _routes()), _dump(tmp_path / "b", _routes(experts=16))  # the same ids
    assert main(["dump", "diff", a, b, "--fail-on-diff"]) == 2
    assert f"A ({a}) has 8 experts, B ({b}) has 16: routes of different models" in capsys.readouterr().err
    assert main(["dump", "diff", a, _dump(tmp_path / "c", _routes()), "--fail-on-diff"]) == 0


def _rollout(tmp_path, mutate, dtype=np.int64):
    routes = _routes()
    stacked = routes.stacked(0).numpy().astype(dtype)
    requests = [stacked[b * S : (b + 1) * S - 1].copy() for b in range(B)]
    mutate(requests)
    np.savez(tmp_path / "ro.npz", **{f"r{i}": r for i, r in enumerate(requests)})
    return _dump(tmp_path / "train", routes), str(tmp_path / "ro.npz")


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda r: r[0].__setitem__((3, 1, 0), -5), r"request 0: position 3 layer 1 slot 0: id -5 is outside \[0, 8\)"),
        (lambda r: r[1].__setitem__((2, 2, 1), 8), r"request 1: position 2 layer 2 slot 1: id 8 is outside \[0, 8\)"),
        (lambda r: r[0].__setitem__((1, 0, 0), -1), r"request 0: position 1 is partly -1 .* layer\(s\) \[0\]"),
        (
            lambda r: r[0].__setitem__((4, 2), -1),
            r"request 0: position 4 is a capture gap in some layers only: "
            r"layer\(s\) \[2\]",
        ),
        (lambda r: r[1].__setitem__((0, 1), 0), r"request 1: position 0 is a capture gap in some layers only"),
    ],
)
def test_rollout_garbage_is_refused_not_counted_as_a_capture_gap(tmp_path, capsys, mutate, match):
    train, rollout = _rollout(tmp_path, mutate)
    assert main(["dump", "diff", train, rollout, "--rollout"]) == 2
    assert re.search(match, capsys.readouterr().err)


def test_rollout_uint64_ids_beyond_int64_are_named_as_they_are(tmp_path, capsys):
    def mutate(requests):
        requests[0][2, 0, 1] = np.uint64(2**64 - 1)

    train, rollout = _rollout(tmp_path, mutate, dtype=np.uint64)
    assert main(["dump", "diff", train, rollout, "--rollout"]) == 2
    assert "position 2 layer 0 slot 1: id 18446744073709551615 is outside [0, 8)" in capsys.readouterr().err


def test_rollout_whole_position_gaps_are_set_apart_and_the_rest_compared(tmp_path):
    def mutate(requests):
        requests[0][2] = -1  # every layer: not captured
        requests[1][3] = 0

    train, rollout = _rollout(tmp_path, mutate)
    out = tmp_path / "r.json"
    assert main(["dump", "diff", train, rollout, "--rollout", "--json", str(out), "--fail-on-diff"]) == 1  # gaps fail
    assert (
        main(["dump", "diff", train, rollout, "--rollout", "--json", str(out), "--fail-on-diff", "--gaps-expected"])
        == 0
    )
    summary = json.loads(out.read_text())["rollout"]
    assert summary["capture_gap_rows"] == 2 and summary["compared_tokens"] == B * (S - 1) - 2


def _trace(tmp_path, edit=None):
    recs = []
    for layer in LAYERS:
        ids = _routes().get(layer, 0)
        recs.append(
            {
                "step": 0,
                "stage": "pre_dispatch",
                "block": "decoder",
                "layer": layer,
                "rank": 0,
                "num_tokens": ids.shape[0],
                "topk": K,
                "top_indices": ids.tolist(),
            }
        )
    if edit:
        edit(recs)
    path = tmp_path / "router_trace_rank0.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


@pytest.mark.parametrize(
    "key, value, match",
    [
        ("block", None, r":2: not a router_trace record: block None is none of the tracer's \['decoder', 'mtp'\]"),
        ("block", "encoder", r":2: .*block 'encoder' is none of"),
        ("num_tokens", -1, r":2: .*num_tokens -1 is not a non-negative integer"),
        ("num_tokens", 11, r":2: .*num_tokens 11 / topk 2 do not describe the 12 row\(s\)"),
        ("num_tokens", "12", r":2: .*num_tokens '12' is not a non-negative integer"),
        ("layer", "1", r":2: .*layer '1' is not"),
        ("layer", True, r":2: .*layer True is not"),
        ("step", "0", r":2: .*step '0' is not"),
        ("topk", 2.0, r":2: .*topk 2.0 is not"),
    ],
)
def test_router_trace_records_of_unknown_blocks_or_wrong_types_are_refused(tmp_path, capsys, key, value, match):
    trace = _trace(tmp_path, lambda recs: recs[1].__setitem__(key, value))
    assert main(["dump", "convert", str(trace), str(tmp_path / "d"), "--num-experts", str(E)]) == 2
    assert re.search(match, capsys.readouterr().err)
    assert not (tmp_path / "d").exists()


def test_router_trace_mtp_records_are_still_skipped(tmp_path):
    def add_mtp(recs):
        recs.append({**recs[0], "block": "mtp", "mtp_idx": 0})

    trace = _trace(tmp_path, add_mtp)
    assert main(["dump", "convert", str(trace), str(tmp_path / "d"), "--num-experts", str(E)]) == 0
    assert record.load(tmp_path / "d").model.moe_layers == LAYERS


def test_router_trace_not_utf8_or_not_a_regular_file_is_refused(tmp_path, capsys):
    import os

    trace = _trace(tmp_path)
    trace.write_bytes(trace.read_bytes() + b"\xff\xfe\n")
    assert main(["dump", "convert", str(trace), str(tmp_path / "d"), "--num-experts", str(E)]) == 2
    assert "router_trace_rank0.jsonl:4: not UTF-8 text" in capsys.readouterr().err
    fifo = tmp_path / "fifo" / "router_trace_rank0.jsonl"
    fifo.parent.mkdir()
    os.mkfifo(fifo)  # reading it would block for ever
    assert main(["dump", "convert", str(fifo), str(tmp_path / "e"), "--num-experts", str(E)]) == 2
    assert "router_trace_rank0.jsonl: not a regular file" in capsys.readouterr().err


def test_finalize_of_a_committed_dump_checks_world_size(tmp_path, capsys):
    path = _dump(tmp_path / "d", _routes())
    assert main(["dump", "finalize", path]) == 0
    assert main(["dump", "finalize", path, "--world-size", "4"]) == 2
    assert "manifest.json: world_size 1 != --world-size 4" in capsys.readouterr().err


def test_drop_uncommitted_without_manifest_or_records_is_refused_naming_the_orphans(tmp_path, capsys):
    path = _dump(tmp_path / "d", _routes())
    (tmp_path / "d" / "manifest.json").unlink()
    assert main(["dump", "finalize", path, "--drop-uncommitted"]) == 2
    assert "no manifest and no rank record: nothing was committed" in capsys.readouterr().err
    assert (tmp_path / "d" / "rank00000.safetensors").exists()  # nothing deleted on a guess


def test_a_rank_record_nested_too_deeply_or_of_another_rank_is_refused(tmp_path, capsys):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "rank00000.json").write_text("[" * 100_000 + "]" * 100_000)
    assert main(["dump", "finalize", str(tmp_path / "d")]) == 2
    assert "rank00000.json: unreadable rank record: nested too deeply" in capsys.readouterr().err
    (tmp_path / "d" / "rank00000.json").write_text(json.dumps({"rank": 3}))
    assert main(["dump", "finalize", str(tmp_path / "d")]) == 2
    assert "rank00000.json: unreadable rank record: rank 3 is not the file's own" in capsys.readouterr().err


def test_diff_of_mismatched_sides_names_a_and_b(tmp_path, capsys):
    a = _dump(tmp_path / "a", _routes())
    b = _dump(tmp_path / "b", _routes().select([0, 1]))
    assert main(["dump", "diff", a, b]) == 2
    err = capsys.readouterr().err
    assert "cannot diff: layers: A [0, 1, 2], B [0, 1]" in err and f"(A: {a}, B: {b})" in err


def test_convert_names_what_the_source_is(tmp_path, capsys):
    (tmp_path / "x.npy").mkdir()
    assert main(["dump", "convert", str(tmp_path / "x.npy"), str(tmp_path / "d")]) == 2
    assert "x.npy is a directory, not a .npy file" in capsys.readouterr().err
    np.save(tmp_path / "r.npy", _routes().stacked(0).numpy())
    assert main(["dump", "convert", str(tmp_path / "r.npy"), str(tmp_path / "e"), "--layout", "ep2"]) == 2
    assert "r.npy is a .npy array (drop --layout)" in capsys.readouterr().err


def test_an_expert_map_nested_too_deeply_is_refused(tmp_path, capsys):
    a, b = _dump(tmp_path / "a", _routes()), _dump(tmp_path / "b", _routes())
    (tmp_path / "m.json").write_text("[" * 100_000 + "]" * 100_000)
    assert main(["dump", "diff", a, b, "--expert-map-b", str(tmp_path / "m.json")]) == 2
    assert "m.json: not valid JSON: nested too deeply to be an expert map" in capsys.readouterr().err


def test_convert_of_an_npz_names_the_member_whose_token_count_is_wrong(tmp_path, capsys):
    stacked = _routes().stacked(0).numpy()
    np.savez(tmp_path / "r.npz", mb0=stacked, mb1=stacked[:-1])
    assert (
        main(
            [
                "dump",
                "convert",
                str(tmp_path / "r.npz"),
                str(tmp_path / "d"),
                "--seq-len",
                str(S),
                "--batch",
                str(B),
                "--order",
                "sequence",
            ]
        )
        == 2
    )
    assert f"r.npz: npz key 'mb1': {S * B - 1} tokens != --seq-len {S} x --batch {B}" in capsys.readouterr().err
    assert not (tmp_path / "d").exists()
