"""``moeverify`` command line: exit codes and messages, without starting torchrun."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap

import pytest
from waiting import CHILD_S

from moeverify import cli

GOOD = """
defaults: {checks: [roundtrip, export]}
scenarios:
  - {family: qwen3_moe, world_size: 2, layout: {ep: 2}, checks: [roundtrip, export, replay]}
  - {family: qwen2, world_size: 1, gpu_only: needs a GPU for this}
"""


@pytest.fixture
def good_file(tmp_path):
    path = tmp_path / "good.yaml"
    path.write_text(textwrap.dedent(GOOD))
    return str(path)


def _run(capsys, *argv):
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_main_list_prints_name_world_size_checks(capsys, good_file):
    code, out, err = _run(capsys, "run", good_file, "--list")
    assert code == 0 and err == ""
    assert out.splitlines() == [
        "qwen3_moe/ep2-dp2  2  roundtrip,export,replay",
        "qwen2/tp1  1  roundtrip,export  (gpu only: needs a GPU for this)",
    ]


def test_main_list_with_filter_and_check(capsys, good_file):
    code, out, _ = _run(capsys, "run", good_file, "--list", "--filter", "qwen3*", "--check", "replay")
    assert code == 0 and out.splitlines() == ["qwen3_moe/ep2-dp2  2  replay"]


def test_main_list_default_file_is_smoke(capsys, monkeypatch, repo_root):
    monkeypatch.chdir(repo_root)
    code, out, _ = _run(capsys, "run", "--list")
    assert code == 0 and "qwen3_moe/ep2-dp2  2  roundtrip,export,replay" in out


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["run", "{bad}"], r"bad\.yaml:3: unknown family 'llama'"),
        (
            ["run", "{good}", "--check", "nope"],
            r"--check 'nope': unknown check; known checks: roundtrip, export, replay, hf_parity",
        ),
        (["run", "{good}", "--filter", "zzz*"], r"--filter zzz\* matches none of the 2 scenarios"),
        (["run", "{good}", "--list", "--json", "x.json"], r"--list runs nothing, so --json has nothing to do"),
        (["run", "{good}", "--check", "roundtrip", "--subject", "sharded"], r"--subject applies to the export check"),
        (
            ["run", "{good}", "--check", "roundtrip", "--no-refresh"],
            r"--no-refresh applies to the export check.*drop --no-refresh",
        ),
        (["run", "{good}", "--refresh=yes"], r"argument --refresh/--no-refresh: ignored explicit argument 'yes'"),
        (
            ["run", "{good}", "--subject", "nocolon"],
            r"--subject: option subject: subject 'nocolon' is not bridge, sharded, gather, verl",
        ),
        (
            ["run", "{good}", "--replay-impl", "vllm"],
            r"--replay-impl: option replay_impl: replay implementation 'vllm' is not moeverify, native, verl",
        ),
        (["run", "{good}", "--timeout", "0"], r"argument --timeout: expected seconds > 0 \(and finite\), got '0'"),
        (["run", "{good}", "--timeout", "inf"], r"argument --timeout: expected seconds > 0 \(and finite\), got 'inf'"),
        (["run", "{good}", "--timeout", "nan"], r"argument --timeout: expected seconds > 0 \(and finite\), got 'nan'"),
        (["run", "{good}", "--timeout", "soon"], r"argument --timeout: expected seconds \(a number > 0\), got 'soon'"),
        (
            ["run", "{good}", "--json", "/no/such/dir/r.json"],
            r"--json /no/such/dir/r\.json: directory /no/such/dir does not exist",
        ),
        (["run", "{good}", "--json", "same.xml", "--junit", "same.xml"], r"--json and --junit name the same file"),
        (["run", "{good}", "--json", "{tmp}"], r"--json .*: .* is a directory; give the path of a file"),
        (["run", "{good}", "--junit", "/dev/full"], r"--junit /dev/full: /dev/full is not a regular file"),
        (["run", "{good}", "--run-dir", "{good}"], r"--run-dir .*good\.yaml: exists and is not a directory"),
        (["run", "{good}", "--run-dir", "{good}/sub"], r"--run-dir .*good\.yaml/sub: cannot write there"),
        (["run", "{good}", "--backend", "cuda"], r"--backend cuda: torch sees no GPU here"),
        (["frobnicate"], r"argument COMMAND: invalid choice: 'frobnicate'"),
        ([], r"the following arguments are required: COMMAND"),
        (["bench", "nope"], r"unknown benchmark\(s\) \['nope'\]"),
    ],
)
def test_main_usage_error_exits_2_with_message_and_no_traceback(capsys, tmp_path, good_file, argv, match):
    import re

    bad = tmp_path / "bad.yaml"
    bad.write_text("defaults: {checks: [export]}\nscenarios:\n  - {family: llama, world_size: 1}\n")
    code, out, err = _run(capsys, *(a.format(good=good_file, bad=bad, tmp=tmp_path) for a in argv))
    assert code == 2
    # a command line error names its (sub)command after its usage line; any other: "moeverify: error: "
    assert re.search(r"^moeverify( \w+)*: error: ", err, re.MULTILINE) and re.search(match, err), err
    assert "Traceback" not in err + out


def test_main_run_refuses_a_run_dir_holding_an_earlier_runs_groups(capsys, monkeypatch, tmp_path, good_file):
    """Its rank result files would be read as this run's results (they were, and reported, before)."""
    from moeverify.runner import launch

    def no_rank_may_start(*args, **kwargs):
        raise AssertionError("a torchrun group was started")

    monkeypatch.setattr(launch, "run_group", no_rank_may_start)
    (tmp_path / "old" / "world2" / "attempt1").mkdir(parents=True)
    code, _, err = _run(capsys, "run", good_file, "--run-dir", str(tmp_path / "old"))
    assert code == 2 and re.search(
        r"--run-dir .*old: holds world2 of an earlier run, whose result files would "
        r"be read as this run's: give a new or empty directory",
        err,
    ), err


def test_main_help_exits_0(capsys):
    code, out, _ = _run(capsys, "run", "--help")
    assert code == 0 and "--replay-impl" in out


def test_main_version_prints_the_package_version_and_exits_0(capsys, repo_root):
    code, out, err = _run(capsys, "--version")
    declared = re.search(r'^version = "(.+)"$', (repo_root / "pyproject.toml").read_text(), re.M).group(1)
    assert (code, out, err) == (0, f"moeverify {declared}\n", "")


def test_main_version_with_a_command_still_prints_only_the_version(capsys):
    code, out, _ = _run(capsys, "--version", "run", "--list")
    assert code == 0 and out.startswith("moeverify ") and len(out.splitlines()) == 1


def test_main_bench_list_names_scripts(capsys, repo_root):
    code, out, _ = _run(capsys, "bench", "--list")
    expected = sorted(p.stem for p in (repo_root / "bench").glob("*.py") if not p.name.startswith("_"))
    assert code == 0 and (out.split() == expected or (not expected and "no benchmarks" in out))


@pytest.mark.timing
def test_python_dash_m_moeverify_runs_main(good_file, repo_root):
    proc = subprocess.run(
        [sys.executable, "-m", "moeverify", "run", good_file, "--list", "--check", "export"],
        cwd=repo_root,
        capture_output=True,
        text=True,
        timeout=CHILD_S,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[0] == "qwen3_moe/ep2-dp2  2  export"


PLUGIN_FILE = """
scenarios:
  - {family: qwen3_moe, world_size: 1, checks: [export, replay]}
"""


@pytest.mark.parametrize(
    ("flags", "match"),
    [
        (["--subject", "no_such_mod:factory"], r"subject 'no_such_mod:factory': no module named 'no_such_mod'"),
        (["--subject", "moeverify.no_such:factory"], r"no module named 'moeverify.no_such'"),
        (["--subject", "{tmp}/broken.py:factory"], r"broken\.py:2: syntax error"),
        (["--subject", "{tmp}/fine.py:missing"], r"fine\.py defines no top-level 'missing'"),
        (["--subject", "{tmp}/absent.py:factory"], r"file .*absent\.py does not exist"),
        (["--replay-impl", "moeverify.oracles.replay.faulty:no_such"], r"faulty\.py defines no top-level 'no_such'"),
        (["--replay-impl", "not a module:f"], r"'not a module' is not a module name"),
    ],
)
def test_run_refuses_a_plugin_that_cannot_load_before_launch(capsys, tmp_path, flags, match):
    import re

    (tmp_path / "s.yaml").write_text(PLUGIN_FILE)
    (tmp_path / "broken.py").write_text("def factory(ctx):\n    return (\n")
    (tmp_path / "fine.py").write_text("def factory(ctx):\n    return iter(())\n")
    code, out, err = _run(capsys, "run", str(tmp_path / "s.yaml"), "--list", *(f.format(tmp=tmp_path) for f in flags))
    assert code == 2 and re.search(match, err), err
    assert "Traceback" not in err + out


@pytest.mark.parametrize(
    "flags",
    [
        ["--subject", "gather"],
        ["--subject", "verl"],
        ["--subject", "{tmp}/fine.py:factory"],
        ["--replay-impl", "moeverify.oracles.replay.faulty:fifo_recompute"],
        ["--replay-impl", "{tmp}/fine.py:factory"],
    ],
)
def test_run_accepts_every_documented_subject_and_replay_impl_form(capsys, tmp_path, flags):
    (tmp_path / "s.yaml").write_text(PLUGIN_FILE)
    (tmp_path / "fine.py").write_text("def factory(ctx=None):\n    return iter(())\n")
    code, out, err = _run(capsys, "run", str(tmp_path / "s.yaml"), "--list", *(f.format(tmp=tmp_path) for f in flags))
    assert code == 0, err
    assert out.startswith("qwen3_moe/tp1  1  export,replay")


@pytest.mark.timing
@pytest.mark.parametrize(
    ("source", "flags", "match"),
    [
        (
            "raise RuntimeError('no GPU here')\ndef factory(ctx):\n    return iter(())\n",
            ["--subject", "{tmp}/plug.py:factory"],
            r"subject '.*plug\.py:factory': loading .*plug\.py raised RuntimeError: no GPU here",
        ),
        (
            "factory = 3\n",
            ["--subject", "{tmp}/plug.py:factory"],
            r"subject '.*plug\.py:factory': .*plug\.py:factory is a int, not a callable factory",
        ),
        (
            "import sys\nsys.exit(4)\ndef factory(ctx):\n    pass\n",
            ["--replay-impl", "{tmp}/plug.py:factory"],
            r"replay implementation '.*plug\.py:factory': loading .*plug\.py raised SystemExit: 4",
        ),
        (
            "import os\nos._exit(9)\nfactory = None\n",
            ["--subject", "{tmp}/plug.py:factory"],
            r"subject '.*plug\.py:factory': loading it ended the process \(exit code 9\) before it could report",
        ),
    ],
)
def test_run_refuses_a_plugin_whose_loading_raises_before_launch(capsys, tmp_path, monkeypatch, source, flags, match):
    """What reading the source cannot tell (an import that raises, an attribute that is not callable) is found by
    loading the plugin in a child Python before any rank starts: exit 2, not a crash on every rank."""
    from moeverify.runner import launch

    def no_launch(*args, **kwargs):
        raise AssertionError("a group was launched")

    monkeypatch.setattr(launch, "run_group", no_launch)
    (tmp_path / "s.yaml").write_text(PLUGIN_FILE)
    (tmp_path / "plug.py").write_text(source)
    code, out, err = _run(
        capsys, "run", str(tmp_path / "s.yaml"), "--backend", "cpu", *(f.format(tmp=tmp_path) for f in flags)
    )
    assert code == 2 and re.search(match, err), err
    assert "Traceback" not in err
    # --list still reads the source only (no child process, no import of the user's code)
    code, out, err = _run(capsys, "run", str(tmp_path / "s.yaml"), "--list", *(f.format(tmp=tmp_path) for f in flags))
    assert code == 0, err
