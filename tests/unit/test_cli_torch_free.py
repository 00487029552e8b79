"""Parsing, listing and scenario validation import no torch: commands are loaded on demand.

Each case runs in a fresh interpreter whose import system refuses torch, megatron, transformers and
safetensors (a meta-path finder that raises), so a heavy import anywhere on the path fails the command.
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap

import pytest
from waiting import CHILD_S

pytestmark = pytest.mark.timing  # child processes, each with a bound
BLOCKED = ("torch", "megatron", "transformers", "safetensors")

PRELUDE = textwrap.dedent(f"""
    import sys

    class _Refuse:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in {BLOCKED!r}:
                raise ImportError(f"blocked import of {{name}}")
            return None

    sys.meta_path.insert(0, _Refuse())
""")


def _run(repo_root, code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", PRELUDE + textwrap.dedent(code)],
        cwd=repo_root,
        capture_output=True,
        text=True,
        timeout=CHILD_S,
    )


def _main(argv: list[str]) -> str:
    return f"from moeverify import cli\nsys.exit(cli.main({argv!r}))"


def test_help_lists_every_command_without_torch(repo_root):
    proc = _run(repo_root, _main(["--help"]))
    assert proc.returncode == 0, proc.stderr
    assert [w for w in ("run", "dump", "doctor", "bench") if w not in proc.stdout] == [], proc.stdout
    assert "routing dumps: inspect, diff, convert" in proc.stdout


def test_run_list_without_torch(repo_root):
    proc = _run(repo_root, _main(["run", "--list"]))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[0] == "qwen3_moe/tp1  1  roundtrip,export,replay"


def test_scenario_validation_of_every_shipped_file_without_torch(repo_root, tmp_path):
    """Every shipped scenario file. A ``pp_layout`` string is the one thing left to Megatron-Core's own parser
    (``layout._pp_layout_counts``), so in the copies validated here it becomes an uneven pipeline. A file naming
    a user model (``model: PATH``: its config is read through transformers) is validated in test_scenario.py."""
    files = []
    for path in sorted((repo_root / "scenarios").glob("*.yaml")):
        if re.search(r"^\s*(- )?model:", path.read_text(), re.M):
            continue
        text, n = re.subn(r', pp_layout: "[^"]*"', ", pp_last: 2", path.read_text())
        assert n <= 1 and "pp_layout:" not in re.sub(r"#.*", "", text), path  # one, in release.yaml
        (tmp_path / path.name).write_text(text)
        files.append(str(tmp_path / path.name))
    assert len(files) >= 5
    proc = _run(
        repo_root,
        f"""
        from moeverify.spec import scenario
        for f in {files!r}:
            print(f, len(scenario.load([f])))
    """,
    )
    assert proc.returncode == 0, proc.stderr
    counts = {line.rsplit(" ", 1)[0]: int(line.rsplit(" ", 1)[1]) for line in proc.stdout.splitlines()}
    assert sorted(counts) == files and min(counts.values()) > 0, counts


def test_scenario_validation_refuses_a_bad_layout_without_torch(repo_root, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("scenarios:\n  - {family: qwen3_moe, world_size: 2, layout: {tp: 3}}\n")
    proc = _run(repo_root, _main(["run", str(bad), "--list"]))
    assert proc.returncode == 2 and f"{bad}:2" in proc.stderr, proc.stderr
    assert "blocked import" not in proc.stderr


@pytest.mark.parametrize("argv", [["dump", "inspect", "x"]])
def test_blocker_refuses_a_command_that_needs_torch(repo_root, argv):
    """Control: the dump verbs do need torch, and the blocker makes them fail."""
    proc = _run(repo_root, _main(argv))
    assert proc.returncode != 0 and "blocked import of torch" in proc.stderr, proc.stderr
