"""Every ``moeverify dump`` option that would be silently ignored is refused (exit 2, naming it), and a dump
exported to ``.npz`` is read back by ``dump diff`` in its own token order."""

import json

import numpy as np
import pytest
import torch

from moeverify import record
from moeverify.cli import main
from moeverify.routing.routes import Routes

S, B = 6, 2


def _routes(seed=0, *, tokens=S * B, layers=(0, 1), experts=8, topk=2, microbatches=2):
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
def paths(tmp_path):
    routes = _routes()
    record.save(tmp_path / "a", routes, seq_len=S, batch=B, order="router")
    record.save(tmp_path / "b", routes, seq_len=S, batch=B, order="router")
    np.save(tmp_path / "r.npy", routes.stacked(0).numpy())
    trace = [
        {
            "step": 0,
            "block": "decoder",
            "layer": 0,
            "rank": 0,
            "num_tokens": 2,
            "topk": 2,
            "top_indices": [[0, 1], [2, 3]],
        }
    ]
    (tmp_path / "t.jsonl").write_text("".join(json.dumps(r) + "\n" for r in trace))
    return tmp_path


@pytest.mark.parametrize(
    "argv,match",
    [
        (["diff", "{a}", "{npy}", "--order-b", "sequence", "--step-b", "1"], "--step-b: does not apply: B ("),
        (
            ["diff", "{npy}", "{a}", "--order-a", "sequence", "--step", "1"],
            "--step: does not apply: --step is A's step",
        ),
        (["diff", "{a}", "{b}", "--seq-len", "6", "--batch", "2"], "--seq-len, --batch: do not apply"),
        (["diff", "{a}", "{npy}", "--seq-len", "6", "--batch", "2"], "--seq-len, --batch: do not apply"),
        (
            ["diff", "{a}", "{b}", "--assume-same-order"],
            "--assume-same-order: does not apply: both sides' token orders",
        ),
        (["diff", "{a}", "{b}", "--rollout", "--step-b", "0"], "--step-b: does not apply: a rollout holds one step"),
        (["convert", "{a}", "{out}", "--num-experts", "8"], "--num-experts: does not apply: {a} is a dump"),
        (["convert", "{a}", "{out}", "--step", "0", "--seq-len", "6"], "--step, --seq-len: do not apply"),
        (
            ["convert", "{npy}", "{dst}", "--layer-offset", "2"],
            "--layer-offset: does not apply: they apply to router_trace",
        ),
        (["convert", "{npy}", "{dst}", "--microbatches", "2"], "--microbatches: does not apply"),
        (
            ["convert", "{npy}", "{dst}", "--world-size", "2"],
            "--world-size: does not apply: it gives the ranks of --layout",
        ),
        (["convert", "{jsonl}", "{dst}", "--step", "3"], "--step: does not apply: router_trace records its own steps"),
        (
            ["convert", "{jsonl}", "{dst}", "--order", "sequence", "--seq-len", "1", "--batch", "2"],
            "--order sequence: router_trace holds Megatron's router order",
        ),
        (
            ["convert", "{jsonl}", "{dst}", "--from", "npz", "--layout", "ep2"],
            "--layout reads every rank's router_trace",
        ),
        (["finalize", "{a}", "--drop-uncommitted", "--world-size", "1"], "--world-size: does not apply"),
    ],
)
def test_options_that_would_be_ignored_are_refused(paths, capsys, argv, match):
    names = {
        "a": paths / "a",
        "b": paths / "b",
        "npy": paths / "r.npy",
        "jsonl": paths / "t.jsonl",
        "out": paths / "out.npz",
        "dst": paths / "dst",
    }
    argv = [arg.format(**names) for arg in argv]
    assert main(["dump", *argv]) == 2
    assert match.format(**names) in capsys.readouterr().err
    assert not (paths / "out.npz").exists() and not (paths / "dst").exists()


def test_exported_npz_is_diffed_in_its_dumps_token_order(paths, capsys):
    out = paths / "a.npz"
    assert main(["dump", "convert", str(paths / "a"), str(out)]) == 0
    report = paths / "r.json"
    assert main(["dump", "diff", str(out), str(paths / "b"), "--json", str(report), "--fail-on-diff"]) == 0
    result = json.loads(report.read_text())
    assert result["tokens"] == 2 * S * B and result["sequences"] is not None and len(result["sequences"]) == 2 * B
    # a side that differs is found at its layer: the export is compared token for token, not by position
    changed = record.load(paths / "a").routes().stacked(1).numpy()
    changed[3, 1] = [e for e in range(8) if e not in changed[3, 1]][:2]
    with np.load(out) as npz:
        arrays = dict(npz)
    arrays["step0_mb1"] = changed.astype(arrays["step0_mb1"].dtype)
    np.savez(paths / "c.npz", **arrays)
    assert main(["dump", "diff", str(paths / "b"), str(paths / "c.npz"), "--json", str(report)]) == 0
    result = json.loads(report.read_text())
    assert result["first_divergent_layer"] == {"1": 1}
    assert result["worst_tokens"][0]["microbatch"] == 1 and result["worst_tokens"][0]["token_in_microbatch"] == 3
    capsys.readouterr()
    assert main(["dump", "diff", str(out), str(paths / "b"), "--order-a", "sequence"]) == 2
    assert "is an export of a dump, which records its own token order" in capsys.readouterr().err
    assert main(["dump", "convert", str(out), str(paths / "back")]) == 2
    assert "is an export of a dump" in capsys.readouterr().err


def test_export_of_a_dump_without_geometry_is_refused_as_unknown_order(tmp_path, capsys):
    record.save(tmp_path / "n", _routes())
    assert main(["dump", "convert", str(tmp_path / "n"), str(tmp_path / "n.npz")]) == 0
    capsys.readouterr()
    assert main(["dump", "diff", str(tmp_path / "n.npz"), str(tmp_path / "n")]) == 2
    assert "its dump's step was saved without seq_len/batch" in capsys.readouterr().err
