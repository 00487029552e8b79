"""``dump diff --rollout``: a request the engine captured nothing of (no row, or capture gaps alone) is refused
naming it: its routes would go unseen, and a step of such requests compared zero tokens and read as agreement."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moeverify import record
from moeverify.cli import main
from moeverify.routing.routes import Routes


def _train(tmp_path):
    seq_TK = [[0, 1], [1, 2], [2, 3], [3, 0]]
    both = torch.tensor(seq_TK + [[1, 3], [2, 0], [0, 2], [3, 1]])  # two sequences of 4, batch 2
    record.save(tmp_path / "train", Routes({0: [both]}, num_experts=4, topk=2), seq_len=4, batch=2, order="sequence")
    return np.array(seq_TK)[:, None, :]


@pytest.mark.parametrize(
    ("what", "second"),
    [
        ("no row", np.zeros((0, 1, 2), dtype=np.int64)),
        ("every one a capture gap", np.full((3, 1, 2), -1, dtype=np.int64)),
    ],
)
def test_a_request_with_nothing_captured_is_refused(tmp_path, capsys, what, second):
    first = _train(tmp_path)
    path = tmp_path / "rollout.npz"
    np.savez(path, req0=first[:3], req1=second)
    assert main(["dump", "diff", str(tmp_path / "train"), str(path), "--rollout", "--fail-on-diff"]) == 2
    err = capsys.readouterr().err
    assert "request 1 holds" in err and what in err and "none of its routes can be compared" in err, err


def test_a_padded_array_of_padding_alone_compares_nothing_and_is_refused(tmp_path, capsys):
    _train(tmp_path)
    path = tmp_path / "rollout.npy"
    np.save(path, np.full((2, 4, 1, 2), -1, dtype=np.int64))
    assert main(["dump", "diff", str(tmp_path / "train"), str(path), "--rollout", "--fail-on-diff"]) == 2
    assert "request 0 holds no row" in capsys.readouterr().err


def test_each_request_with_a_row_is_compared(tmp_path, capsys):
    first = _train(tmp_path)
    path = tmp_path / "rollout.npz"
    np.savez(path, req0=first[:3], req1=np.array([[[1, 3]]]))
    assert main(["dump", "diff", str(tmp_path / "train"), str(path), "--rollout", "--fail-on-diff"]) == 0
    assert "4 token(s) compared" in capsys.readouterr().out


def test_dumps_of_models_of_different_depths_are_not_compared(tmp_path, capsys):
    """The same MoE layer numbers in models of 3 and 5 decoder layers are not the same layers: refused, not passed."""
    gen = torch.Generator().manual_seed(0)
    routes = Routes({0: [torch.rand(8, 4, generator=gen).topk(2, dim=1).indices]}, num_experts=4, topk=2)
    same = dict(seq_len=4, batch=2, order="sequence")
    record.save(tmp_path / "a", routes, num_layers=3, **same)
    record.save(tmp_path / "b", routes, num_layers=5, **same)
    assert main(["dump", "diff", str(tmp_path / "a"), str(tmp_path / "b"), "--fail-on-diff"]) == 2
    err = capsys.readouterr().err
    assert "3 decoder layers" in err and "of 5" in err, err
    record.save(tmp_path / "c", routes, num_layers=3, **same)
    assert main(["dump", "diff", str(tmp_path / "a"), str(tmp_path / "c"), "--fail-on-diff"]) == 0


def test_a_capture_gap_fails_the_diff_unless_expected(tmp_path, capsys):
    """An engine that left part of a request uncaptured (vllm-ascend #15451's shape): the rows it did capture agree,
    so the diff once read 0.00 % diverging and --fail-on-diff exited 0 on the very bug it exists for."""
    first = _train(tmp_path)
    gapped = first[:3].copy()
    gapped[1] = -1  # position 1 never captured
    path = tmp_path / "rollout.npz"
    np.savez(path, req0=gapped, req1=np.array([[[1, 3]]]))
    train, args = str(tmp_path / "train"), ["--rollout", "--fail-on-diff"]
    assert main(["dump", "diff", train, str(path), *args]) == 1
    out = capsys.readouterr().out
    assert "1 capture-gap row(s) set apart" in out and "FAIL: 1 capture-gap row(s)" in out, out
    assert main(["dump", "diff", train, str(path), *args, "--gaps-expected"]) == 0
    assert "(expected: --gaps-expected)" in capsys.readouterr().out
    assert main(["dump", "diff", train, str(path), "--rollout"]) == 0  # counted, reported; no verdict asked
    assert main(["dump", "diff", train, str(path), "--rollout", "--gaps-expected"]) == 2
    assert "--gaps-expected: does not apply without --fail-on-diff" in capsys.readouterr().err
    np.savez(path, req0=first[:3], req1=np.array([[[1, 3]]]))
    assert main(["dump", "diff", train, str(path), *args]) == 0  # no gap: the same diff passes
    assert main(["dump", "diff", train, train, "--fail-on-diff", "--gaps-expected"]) == 2
    assert "--gaps-expected: does not apply: only a rollout" in capsys.readouterr().err
