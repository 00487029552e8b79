"""What ``moeverify`` writes and how its command line refuses: output paths never onto (or into) an input, plot
paths of an image format, a closed stdout that never changes the exit code, empty paths, existing convert
destinations, no option abbreviations, unknown arguments named by their subcommand, contradicting switches."""

from __future__ import annotations

import io
import json
import os
import re
import sys

import numpy as np
import pytest
import torch

from moeverify import record
from moeverify.cli import build_parser, main
from moeverify.routing.routes import Routes

S, B = 12, 2


def _routes(seed=0, *, tokens=S * B, layers=(0, 1, 2), experts=8, topk=2) -> Routes:
    gen = torch.Generator().manual_seed(seed)
    return Routes(
        {layer: [torch.rand(tokens, experts, generator=gen).topk(topk, dim=1).indices] for layer in layers},
        num_experts=experts,
        topk=topk,
    )


@pytest.fixture
def paths(tmp_path):
    """Two dumps that differ in one token, an array of A's routes, and A's export."""
    a = _routes(0)
    b = a.replace(1, 0, torch.cat([a.get(1, 0)[:20], a.get(1, 0)[20:].flip(0)]))
    record.save(tmp_path / "a", a, order="sequence", seq_len=S, batch=B)
    record.save(tmp_path / "b", b, order="sequence", seq_len=S, batch=B)
    np.save(tmp_path / "a.npy", torch.stack([a.get(layer, 0) for layer in a.layers], dim=1).numpy())
    assert main(["dump", "convert", str(tmp_path / "a"), str(tmp_path / "ex.npz")]) == 0
    return tmp_path


def _snapshot(root):
    return {p: p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _refused(capsys, argv, *match: str) -> str:
    code = main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err
    for m in match:
        assert re.search(m, err), (m, err)
    return err


# -- 1. an output that is an input, or inside an input dump directory ----------------------------------------------
@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["dump", "inspect", "{a}", "--json", "{a}/manifest.json"], r"--json .*a/manifest\.json: .*input PATH \(.*a\)"),
        (["dump", "inspect", "{a}", "--json", "{a}/rank00000.safetensors"], r"--json .*rank00000.*input PATH"),
        (["dump", "inspect", "{a}", "--json", "{a}/new.json"], r"lies inside the directory of input PATH"),
        (["dump", "diff", "{a}", "{b}", "--json", "{a}/manifest.json"], r"--json .*: lies inside .*input A \(.*a\)"),
        (["dump", "diff", "{a}", "{b}", "--plot", "{b}/p.png"], r"--plot .*: lies inside .*input B \(.*b\)"),
        (
            ["dump", "diff", "{npy}", "{npy}", "--assume-same-order", "--json", "{npy}"],
            r"--json .*a\.npy: is input A \(.*a\.npy\); writing it would destroy the input",
        ),
        (["dump", "diff", "{a}", "{ex}", "--json", "{ex}"], r"--json .*ex\.npz: is input B"),
        (["dump", "diff", "{a}", "{ex}", "--json", "{link}"], r"--json .*link\.json: is input B"),  # a symlink to it
        (["dump", "diff", "{a}", "{ex}", "--json", "{hard}"], r"--json .*hard\.npz: is input B"),  # a hard link
        (["dump", "diff", "{a}", "{b}", "--json", "{dirlink}/manifest.json"], r"lies inside .*input A"),
        (["dump", "convert", "{a}", "{a}/out.npz"], r"DST .*out\.npz: lies inside the directory of input SRC"),
    ],
)
def test_an_output_onto_or_into_an_input_is_refused_and_the_input_kept(paths, capsys, argv, match):
    (paths / "link.json").symlink_to(paths / "ex.npz")
    os.link(paths / "ex.npz", paths / "hard.npz")
    (paths / "dirlink").symlink_to(paths / "a")
    before = _snapshot(paths)
    names = {"a": paths / "a", "b": paths / "b", "npy": paths / "a.npy", "ex": paths / "ex.npz"}
    names |= {"link": paths / "link.json", "hard": paths / "hard.npz", "dirlink": paths / "dirlink"}
    _refused(capsys, [a.format(**names) for a in argv], match)
    assert _snapshot(paths) == before  # nothing written, nothing destroyed
    assert main(["dump", "inspect", str(paths / "a")]) == 0


def test_an_output_is_refused_before_any_input_is_read(paths, capsys, monkeypatch):
    def no_read(*args, **kwargs):
        raise AssertionError("an input was read before the output paths were checked")

    monkeypatch.setattr(record, "load", no_read)
    _refused(capsys, ["dump", "inspect", paths / "a", "--json", paths / "a" / "manifest.json"], r"input PATH")
    _refused(capsys, ["dump", "diff", paths / "a", paths / "b", "--json", paths / "b" / "x.json"], r"input B")


# -- 2. --json and --plot naming one file ----------------------------------------------------------------------------
def test_json_and_plot_naming_the_same_file_are_refused(paths, capsys):
    out = paths / "r.png"
    _refused(capsys, ["dump", "diff", paths / "a", paths / "b", "--json", out, "--plot", out], r"name the same file")
    assert not out.exists()
    out.write_bytes(b"x")
    os.link(out, paths / "r2.png")
    _refused(capsys, ["dump", "diff", paths / "a", paths / "b", "--json", out, "--plot", paths / "r2.png"], "same file")


# -- 3. --plot paths ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("plot", "match"),
    [
        ("p.txt", r"--plot .*p\.txt: \.txt is not an image format --plot writes; give a path ending in \.png"),
        ("x.out", r"\.out is not an image format"),
        ("x.safetensors", r"\.safetensors is not an image format"),
        ("plotfile", r"--plot .*plotfile: no suffix.*would write .*plotfile\.png instead.*e\.g\. .*plotfile\.png"),
        ("missing/p.png", r"--plot .*: directory .*missing does not exist"),
        ("a.npy/p.png", r"--plot .*: .*a\.npy is not a directory"),
    ],
)
def test_a_plot_path_that_cannot_be_an_image_is_refused_up_front(paths, capsys, monkeypatch, plot, match):
    from moeverify.commands import dump_diff

    monkeypatch.setattr(dump_diff, "_routes_of", lambda *a, **k: pytest.fail("the diff ran before --plot was checked"))
    _refused(capsys, ["dump", "diff", paths / "a", paths / "a", "--fail-on-diff", "--plot", paths / plot], match)
    assert not list(paths.glob("p*")) and not (paths / "x.out").exists()


def test_plot_writes_exactly_the_path_named_in_its_suffixs_format(paths):
    assert main(["dump", "diff", str(paths / "a"), str(paths / "b"), "--plot", str(paths / "d.svg")]) == 0
    assert (paths / "d.svg").read_bytes().lstrip().startswith(b"<?xml")
    assert not list(paths.glob("d.svg.*"))


# -- 4. a closed stdout -----------------------------------------------------------------------------------------------
class _ClosedPipe(io.TextIOBase):
    """A stdout whose reader has gone, like ``| head`` after its lines."""

    def write(self, text):
        raise BrokenPipeError(32, "Broken pipe")

    def flush(self):
        raise BrokenPipeError(32, "Broken pipe")


@pytest.mark.parametrize(("b", "fail_on_diff", "code"), [("a", True, 0), ("b", True, 1), ("b", False, 0)])
def test_a_closed_stdout_keeps_the_verdict_and_the_json_is_written(paths, monkeypatch, b, fail_on_diff, code):
    monkeypatch.setattr(sys, "stdout", _ClosedPipe())
    out = paths / "d.json"
    argv = ["dump", "diff", str(paths / "a"), str(paths / b), "--json", str(out)] + ["--fail-on-diff"] * fail_on_diff
    assert main(argv) == code
    assert json.loads(out.read_text())["tokens"] == S * B


def test_a_closed_pipe_on_the_stdout_file_descriptor_goes_to_devnull(paths, monkeypatch):
    read_fd, write_fd = os.pipe()
    os.close(read_fd)  # the reader has gone
    stdout = open(write_fd, "w", buffering=1)  # noqa: SIM115 - closed below
    monkeypatch.setattr(sys, "stdout", stdout)
    try:
        assert main(["dump", "inspect", str(paths / "a"), "--json", str(paths / "s.json")]) == 0
        print("more output after the command")
        stdout.flush()  # the interpreter's flush at exit: no BrokenPipeError any more (the fd is /dev/null's)
    finally:
        monkeypatch.undo()
        stdout.close()
    assert json.loads((paths / "s.json").read_text())["tokens"] == S * B


# -- 5. empty output paths ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "argv",
    [
        ["dump", "inspect", "{a}", "--json", ""],
        ["dump", "diff", "{a}", "{b}", "--json", ""],
        ["dump", "diff", "{a}", "{b}", "--plot", ""],
        ["dump", "convert", "{npy}", "", "--seq-len", "12", "--batch", "2", "--order", "sequence"],
        ["run", "--list", "--json", ""],
        ["run", "--junit", ""],
        ["run", "--run-dir", ""],
    ],
)
def test_an_empty_output_path_is_refused(paths, capsys, argv):
    names = {"a": paths / "a", "b": paths / "b", "npy": paths / "a.npy"}
    _refused(capsys, [a.format(**names) for a in argv], r"expected a path to write, got ''")


# -- 6. convert never writes into an existing directory ---------------------------------------------------------
def test_convert_into_an_existing_empty_directory_is_refused(paths, capsys):
    (paths / "empty").mkdir()
    argv = ["dump", "convert", paths / "a.npy", paths / "empty", "--seq-len", S, "--batch", B, "--order", "sequence"]
    _refused(capsys, argv, r"empty exists; convert never writes into an existing directory: give a new one")
    assert not list((paths / "empty").iterdir())
    argv[3] = paths / "new"
    assert main([str(a) for a in argv]) == 0 and (paths / "new" / "manifest.json").exists()


# -- 7. the command line -----------------------------------------------------------------------------------------
def test_options_are_never_abbreviated(paths, capsys):
    _refused(capsys, ["dump", "diff", paths / "a", paths / "b", "--fail"], r"unrecognized arguments: --fail\b")
    _refused(capsys, ["run", "--lis"], r"moeverify run: error: unrecognized arguments: --lis")


@pytest.mark.parametrize(
    ("argv", "prog"),
    [
        (["dump", "diff", "{a}", "{a}", "--bogus"], "moeverify dump diff"),
        (["dump", "inspect", "{a}", "--bogus"], "moeverify dump inspect"),
        (["run", "--bogus"], "moeverify run"),
        (["doctor", "--bogus"], "moeverify doctor"),
    ],
)
def test_an_unknown_argument_is_named_by_its_subcommand_with_its_usage(paths, capsys, argv, prog):
    err = _refused(capsys, [a.format(a=paths / "a") for a in argv])
    assert err.startswith(f"usage: {prog} "), err
    assert f"\n{prog}: error: unrecognized arguments: --bogus" in err
    assert "moeverify: error: moeverify" not in err


def test_contradicting_switches_are_refused(capsys):
    _refused(
        capsys, ["run", "--list", "--refresh", "--no-refresh"], r"--refresh and --no-refresh contradict each other"
    )
    assert build_parser("run").parse_args(["run", "--no-refresh", "--no-refresh"]).refresh is False  # repeated: fine


def test_bench_list_refuses_an_unknown_name(capsys):
    _refused(capsys, ["bench", "--list", "nosuch"], r"unknown benchmark\(s\) \['nosuch'\]; available: .*dumps")
