"""Commands live in ``cli.py`` and ``commands/``; ``record/`` is the dump format as a library (no argparse, and
importing it loads no command)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
from waiting import CHILD_S


def _argparse_users(package: Path) -> list[str]:
    """Modules that import argparse or declare command-line arguments (``add_argument``/``add_parser`` calls)."""
    out = []
    for path in sorted(package.rglob("*.py")):
        tree = ast.parse(path.read_text())
        imports = any(
            isinstance(n, ast.Import)
            and any(a.name == "argparse" for a in n.names)
            or isinstance(n, ast.ImportFrom)
            and n.module == "argparse"
            for n in ast.walk(tree)
        )
        declares = any(
            isinstance(n, ast.Call)
            and isinstance(n.func, ast.Attribute)
            and n.func.attr in ("add_argument", "add_parser")
            for n in ast.walk(tree)
        )
        if imports or declares:
            out.append(path.relative_to(package).as_posix())
    return out


def test_argparse_code_only_in_cli_and_commands(repo_root):
    users = _argparse_users(repo_root / "moeverify")
    assert "cli.py" in users and "commands/dump.py" in users  # the walk sees them
    assert [u for u in users if u != "cli.py" and not u.startswith("commands/")] == []


@pytest.mark.timing
def test_importing_the_dump_format_loads_no_command(repo_root):
    code = (
        "import sys, moeverify.record, moeverify.record.reader, moeverify.record.importers\n"
        "print(sorted(m for m in sys.modules if m == 'moeverify.cli' or m.startswith('moeverify.commands')))"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=repo_root, capture_output=True, text=True, timeout=CHILD_S)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_argparse_walk_finds_a_declaration_without_the_import(tmp_path):
    """Control: a module that only calls ``add_argument`` on a parser it was given is found."""
    (tmp_path / "record").mkdir()
    (tmp_path / "record" / "verbs.py").write_text("def register(p):\n    p.add_argument('--x')\n")
    (tmp_path / "record" / "plain.py").write_text("import json\n")
    assert _argparse_users(tmp_path) == ["record/verbs.py"]
