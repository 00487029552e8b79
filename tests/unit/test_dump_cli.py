"""``moeverify dump inspect | diff | convert`` and the importers behind convert."""

import json

import numpy as np
import pytest
import torch

from moeverify import record
from moeverify.cli import main
from moeverify.errors import DumpError
from moeverify.record import importers
from moeverify.routing.routes import Routes


def _routes(seed=0, *, tokens=24, layers=(0, 1, 2), experts=8, topk=2, microbatches=1):
    gen = torch.Generator().manual_seed(seed)
    return Routes(
        {
            layer: [torch.rand(tokens, experts, generator=gen).topk(topk, dim=1).indices for _ in range(microbatches)]
            for layer in layers
        },
        num_experts=experts,
        topk=topk,
    )


@pytest.fixture
def two_dumps(tmp_path):
    a = _routes(0)
    b = a.replace(1, 0, torch.cat([a.get(1, 0)[:20], a.get(1, 0)[20:].flip(0)]))  # last 4 tokens swapped around
    record.save(tmp_path / "a", a, order="router", seq_len=12, batch=2)  # the geometry gives the dump its token order
    record.save(tmp_path / "b", b, order="router", seq_len=12, batch=2)
    return tmp_path / "a", tmp_path / "b", a, b


def test_cli_inspect_prints_and_writes_json(two_dumps, tmp_path, capsys):
    a_path = two_dumps[0]
    assert main(["dump", "inspect", str(a_path), "--json", str(tmp_path / "s.json")]) == 0
    out = capsys.readouterr().out
    assert "top-2 of 8" in out and "max/mean" in out
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["tokens"] == 24 and set(summary["load"]) == {"0", "1", "2"}
    assert sum(json.loads((tmp_path / "s.json").read_text())["load"]["0"].values()) > 0


def test_cli_diff_json_plot_and_fail_on_diff(two_dumps, tmp_path):
    a_path, b_path, a, b = two_dumps
    out = tmp_path / "d.json"
    assert main(["dump", "diff", str(a_path), str(b_path), "--json", str(out), "--plot", str(tmp_path / "d.png")]) == 0
    result = json.loads(out.read_text())
    expected = record.diff(a, b).to_json()
    assert result["layers"]["1"]["agreement"] == expected["layers"]["1"]["agreement"] < 1.0
    assert result["layers"]["0"]["agreement"] == 1.0
    assert (tmp_path / "d.png").stat().st_size > 1000
    assert main(["dump", "diff", str(a_path), str(b_path), "--fail-on-diff"]) == 1
    assert main(["dump", "diff", str(a_path), str(a_path), "--fail-on-diff"]) == 0


def test_cli_diff_corrupt_dump_exits_2(two_dumps, capsys):
    a_path, b_path = two_dumps[:2]
    (b_path / "manifest.json").unlink()
    assert main(["dump", "diff", str(a_path), str(b_path)]) == 2
    assert "missing manifest: the dump is incomplete" in capsys.readouterr().err


def test_cli_diff_missing_output_dir_exits_2(two_dumps, tmp_path, capsys):
    assert main(["dump", "diff", str(two_dumps[0]), str(two_dumps[1]), "--json", str(tmp_path / "no" / "x.json")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_cli_convert_npy_to_dump_and_back_to_npz(tmp_path):
    routes = _routes(1)
    stacked = torch.stack([routes.get(layer, 0) for layer in routes.layers], dim=1).numpy().astype(np.int32)
    np.save(tmp_path / "r.npy", stacked)
    assert (
        main(
            [
                "dump",
                "convert",
                str(tmp_path / "r.npy"),
                str(tmp_path / "d"),
                "--num-experts",
                "8",
                "--moe-layers",
                "1,3,5",
                "--num-layers",
                "6",
            ]
        )
        == 0
    )
    dump = record.load(tmp_path / "d")
    assert dump.model.moe_layers == (1, 3, 5) and dump.model.num_layers == 6
    assert torch.equal(dump.routes().get(3, 0), routes.get(1, 0))
    assert main(["dump", "convert", str(tmp_path / "d"), str(tmp_path / "out.npz")]) == 0
    with np.load(tmp_path / "out.npz", allow_pickle=False) as npz:
        assert np.array_equal(npz["step0_mb0"], stacked) and npz["layers"].tolist() == [1, 3, 5]


def test_cli_convert_npz_arrays_become_microbatches(tmp_path):
    arrays = {
        f"seq{i}": np.stack([np.array([[0, 1]] * (3 + i)), np.array([[2, 3]] * (3 + i))], axis=1) for i in range(3)
    }
    np.savez(tmp_path / "r.npz", **arrays)
    assert main(["dump", "convert", str(tmp_path / "r.npz"), str(tmp_path / "d")]) == 0
    routes = record.load(tmp_path / "d").routes()
    assert routes.microbatches == 3 and routes.get(1, 2).shape == (5, 2) and routes.num_experts == 4


def test_cli_convert_router_trace_jsonl(tmp_path):
    # The record layout megatron-core 0.19.2's RouterTracer writes (one line per router call).
    lines = []
    for step in (0, 1):
        for mb in range(2):
            for layer in (0, 1):
                ids = [[(step + mb + layer + t) % 4, (step + mb + layer + t + 1) % 4] for t in range(3)]
                lines.append(
                    {
                        "step": step,
                        "stage": "pre_dispatch",
                        "block": "decoder",
                        "layer": layer,
                        "rank": 0,
                        "num_tokens": 3,
                        "topk": 2,
                        "top_indices": ids,
                    }
                )
        lines.append(
            {
                "step": step,
                "stage": "pre_dispatch",
                "block": "mtp",
                "mtp_idx": 0,
                "layer": 0,
                "rank": 0,
                "num_tokens": 3,
                "topk": 2,
                "top_indices": [[0, 1]] * 3,
            }
        )
    (tmp_path / "router_trace_rank0.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert (
        main(
            [
                "dump",
                "convert",
                str(tmp_path / "router_trace_rank0.jsonl"),
                str(tmp_path / "d"),
                "--num-experts",
                "4",
                "--layer-offset",
                "2",
                "--microbatches",
                "2",
            ]
        )
        == 0
    )
    dump = record.load(tmp_path / "d")
    assert sorted(dump.steps) == [0, 1] and dump.model.moe_layers == (2, 3)
    routes = dump.routes(step=1)
    assert routes.microbatches == 2 and routes.get(3, 1)[0].tolist() == [(1 + 1 + 1) % 4, (1 + 1 + 1 + 1) % 4]


def test_cli_convert_bad_input_exits_2(tmp_path, capsys):
    np.save(tmp_path / "f.npy", np.zeros((3, 2, 2), dtype=np.float32))
    assert main(["dump", "convert", str(tmp_path / "f.npy"), str(tmp_path / "d")]) == 2
    assert "dtype float32 != expected integer [tokens, layers, topk]" in capsys.readouterr().err
    np.save(tmp_path / "o.npy", np.array([{"a": 1}], dtype=object))
    assert main(["dump", "convert", str(tmp_path / "o.npy"), str(tmp_path / "d")]) == 2
    assert "cannot read as .npy" in capsys.readouterr().err
    (tmp_path / "x.bin").write_bytes(b"")
    assert main(["dump", "convert", str(tmp_path / "x.bin"), str(tmp_path / "d")]) == 2
    assert "pass --from" in capsys.readouterr().err


def test_cli_convert_dump_to_dump_refused(two_dumps, tmp_path, capsys):
    assert main(["dump", "convert", str(two_dumps[0]), str(tmp_path / "e")]) == 2
    assert "use --to npz" in capsys.readouterr().err


def test_cli_unknown_verb_exits_2(capsys):
    assert main(["dump", "frobnicate"]) == 2


def test_read_router_trace_bad_line_names_file_and_line(tmp_path):
    (tmp_path / "t.jsonl").write_text('{"step": 0, "layer": 0}\n')
    with pytest.raises(DumpError, match=r"t.jsonl:1: not a router_trace record"):
        importers.read_router_trace(tmp_path / "t.jsonl")


def test_routes_from_arrays_duplicate_expert_raises():
    with pytest.raises(DumpError, match=r"input: .*token 0 routes to expert\(s\) twice"):
        importers.routes_from_arrays([np.array([[[1, 1]]])], num_experts=4)


def _stacked(routes, mb=0):
    return torch.stack([routes.get(layer, mb) for layer in routes.layers], dim=1).numpy()


def test_cli_diff_refuses_sources_whose_token_order_is_unknown(tmp_path, capsys):
    r = _routes(2, tokens=32)
    record.save(tmp_path / "nogeo", r)
    np.save(tmp_path / "r.npy", _stacked(r))
    for argv in (
        ["dump", "diff", str(tmp_path / "nogeo"), str(tmp_path / "nogeo")],
        ["dump", "diff", str(tmp_path / "r.npy"), str(tmp_path / "r.npy")],
    ):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "cannot line the two sources up token for token" in err and "--assume-same-order" in err, err
        assert main([*argv, "--assume-same-order", "--fail-on-diff"]) == 0


def test_cli_diff_lines_up_router_order_and_sequence_order_token_for_token(tmp_path, capsys):
    # What Megatron's router sees (s * B + b) saved with its geometry, against a rollout-style array of the
    # same tokens in sequence order (b * S + s): the same routing, so full agreement, never 1 - 1/B.
    from moeverify.record.order import to_sequence_order

    seq_len, batch = 16, 2
    router_order = _routes(3, tokens=seq_len * batch)
    record.save(tmp_path / "train", router_order, order="router", seq_len=seq_len, batch=batch)
    sequence = to_sequence_order(router_order, order="router", seq_len=seq_len, batch=batch)
    np.save(tmp_path / "rollout.npy", _stacked(sequence))
    assert not torch.equal(sequence.get(0, 0), router_order.get(0, 0))  # the orders really differ
    train, rollout = str(tmp_path / "train"), str(tmp_path / "rollout.npy")
    assert main(["dump", "diff", train, rollout, "--order-b", "sequence", "--fail-on-diff"]) == 0
    np.save(tmp_path / "as_router.npy", _stacked(router_order))
    assert (
        main(
            [
                "dump",
                "diff",
                train,
                str(tmp_path / "as_router.npy"),
                "--order-b",
                "router",
                "--seq-len",
                str(seq_len),
                "--batch",
                str(batch),
                "--fail-on-diff",
            ]
        )
        == 0
    )
    # The wrong claim is caught as a difference, not passed: the rollout array read as router order.
    assert (
        main(
            [
                "dump",
                "diff",
                train,
                rollout,
                "--order-b",
                "router",
                "--seq-len",
                str(seq_len),
                "--batch",
                str(batch),
                "--fail-on-diff",
            ]
        )
        == 1
    )
    assert main(["dump", "diff", train, rollout, "--order-b", "router"]) == 2
    assert "need --seq-len and --batch" in capsys.readouterr().err


def test_cli_convert_records_the_token_order_it_is_given(tmp_path, capsys):
    from moeverify.record.order import to_sequence_order

    seq_len, batch = 8, 3
    router_order = _routes(4, tokens=seq_len * batch)
    record.save(tmp_path / "train", router_order, order="router", seq_len=seq_len, batch=batch)
    np.save(
        tmp_path / "seq.npy", _stacked(to_sequence_order(router_order, order="router", seq_len=seq_len, batch=batch))
    )
    assert main(["dump", "convert", str(tmp_path / "seq.npy"), str(tmp_path / "conv"), "--seq-len", "8"]) == 2
    assert "--seq-len and --batch go together" in capsys.readouterr().err
    assert (
        main(["dump", "convert", str(tmp_path / "seq.npy"), str(tmp_path / "conv"), "--seq-len", "8", "--batch", "3"])
        == 2
    )
    assert "give --order sequence" in capsys.readouterr().err
    assert not (tmp_path / "conv").exists()
    assert (
        main(
            [
                "dump",
                "convert",
                str(tmp_path / "seq.npy"),
                str(tmp_path / "conv"),
                "--seq-len",
                "8",
                "--batch",
                "3",
                "--order",
                "sequence",
                "--num-experts",
                "8",
            ]
        )
        == 0
    )
    assert record.load(tmp_path / "conv").token_order(0) == "sequence"
    assert main(["dump", "diff", str(tmp_path / "train"), str(tmp_path / "conv"), "--fail-on-diff"]) == 0


@pytest.mark.parametrize(
    ("make", "match"), [(lambda d: np.save(d / "src.npy", np.zeros((0, 2, 2), dtype=np.int64)), "hold no tokens")]
)
def test_cli_convert_bad_arrays_exit_2_and_leave_nothing(tmp_path, capsys, make, match):
    make(tmp_path)
    assert main(["dump", "convert", str(tmp_path / "src.npy"), str(tmp_path / "out")]) == 2
    assert match in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_cli_convert_refuses_repeated_layers_and_bad_destinations(tmp_path, capsys):
    np.save(tmp_path / "r.npy", _stacked(_routes(5, layers=(0, 1, 2, 3))))
    assert main(["dump", "convert", str(tmp_path / "r.npy"), str(tmp_path / "d"), "--moe-layers", "0,0,1,2"]) == 2
    assert "must be distinct" in capsys.readouterr().err and not (tmp_path / "d").exists()
    (tmp_path / "file").write_text("x")
    for dst, match in ((tmp_path / "no" / "d", "does not exist"), (tmp_path / "file", "is not a directory")):
        assert main(["dump", "convert", str(tmp_path / "r.npy"), str(dst)]) == 2
        assert match in capsys.readouterr().err
    assert main(["dump", "convert", str(tmp_path / "r.npy"), str(tmp_path / "d")]) == 0
    assert main(["dump", "convert", str(tmp_path / "d"), str(tmp_path / "file"), "--to", "npz"]) == 2
    assert "an export is a .npz file; give a DST ending in .npz" in capsys.readouterr().err  # np.savez would add .npz
    (tmp_path / "file.npz").write_text("x")
    assert main(["dump", "convert", str(tmp_path / "d"), str(tmp_path / "file.npz")]) == 2
    assert "convert never overwrites" in capsys.readouterr().err


def test_cli_convert_negative_ids_named_not_num_experts_0(tmp_path, capsys):
    arr = _stacked(_routes(6))
    arr = arr.astype(np.int64)
    arr[5, 1, 0] = -1
    np.save(tmp_path / "r.npy", arr)
    assert main(["dump", "convert", str(tmp_path / "r.npy"), str(tmp_path / "d")]) == 2
    err = capsys.readouterr().err
    assert "token 5 layer 1: expert id -1 < 0" in err and "num_experts 0" not in err, err


@pytest.mark.parametrize("target", ["{tmp}", "/dev/full"])
def test_cli_outputs_that_cannot_be_written_are_refused_before_work(two_dumps, tmp_path, capsys, target):
    out = target.format(tmp=tmp_path)
    assert main(["dump", "inspect", str(two_dumps[0]), "--json", out]) == 2
    assert main(["dump", "diff", str(two_dumps[0]), str(two_dumps[1]), "--plot", out]) == 2
    err = capsys.readouterr().err
    assert "is a directory" in err or "is not a regular file" in err, err
    assert "Traceback" not in err


def test_cli_convert_router_trace_refuses_non_integer_ids(tmp_path, capsys):
    rec = {
        "step": 0,
        "block": "decoder",
        "layer": 0,
        "rank": 0,
        "num_tokens": 2,
        "topk": 2,
        "top_indices": [[0.9, 2.5], [1, 3]],
    }
    trace = tmp_path / "router_trace_rank0.jsonl"
    for bad in ([[0.9, 2.5], [1, 3]], [[True, 2], [1, 3]]):
        trace.write_text(json.dumps({**rec, "top_indices": bad}) + "\n")
        capsys.readouterr()
        assert main(["dump", "convert", str(trace), str(tmp_path / "d")]) == 2
        err = capsys.readouterr().err
        assert f"{trace}:1" in err and "not integer expert ids" in err
        assert not (tmp_path / "d").exists()


def test_rollout_npy_keeps_an_interior_capture_gap_in_place(tmp_path, capsys):
    import numpy as np

    from moeverify import record
    from moeverify.routing.routes import Routes

    seq_TK = [[0, 1], [1, 2], [2, 3], [3, 0]]
    record.save(tmp_path / "train", Routes({0: [torch.tensor(seq_TK)]}, num_experts=4, topk=2), seq_len=4, batch=1)
    rollout_PLK = np.array(seq_TK)[:, None, :].copy()
    rollout_PLK[1] = -1  # a capture gap inside the request: later positions must not move up
    results = {}
    for kind, write in (
        ("npz", lambda p: np.savez(p, req0=rollout_PLK)),
        ("npy", lambda p: np.save(p, rollout_PLK[None])),
    ):
        path = tmp_path / f"rollout.{kind}"
        write(path)
        out = tmp_path / f"{kind}.json"
        assert (
            main(
                [
                    *("dump", "diff", str(tmp_path / "train"), str(path), "--rollout", "--json", str(out)),
                    *("--fail-on-diff", "--gaps-expected"),  # here the gap's place is under test, not its verdict
                ]
            )
            == 0
        ), capsys.readouterr().err
        results[kind] = json.loads(out.read_text())["rollout"]
    assert results["npy"] == results["npz"]
    assert results["npy"]["capture_gap_rows"] == 1 and results["npy"]["compared_tokens"] == 3


def test_cli_inspect_prints_the_dump_path_verbatim(tmp_path, capsys, monkeypatch):
    """A path is the user's text: rich must read neither ``:m:`` as an emoji nor ``[b]`` as markup."""
    monkeypatch.setenv("COLUMNS", "400")
    path = tmp_path / "run:m:[b]"
    record.save(path, _routes(0), order="router", seq_len=12, batch=2)
    assert main(["dump", "inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert str(path) in out and "\N{CIRCLED LATIN CAPITAL LETTER M}" not in out, out
