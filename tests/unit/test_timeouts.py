"""Every timeout is declared once, in ``moeverify.timeouts``: the docs table is rendered from it, no other module
declares a timeout literal, the public aliases read it, and a bad override is refused naming the variable."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from moeverify import timeouts
from moeverify.errors import UsageError

ROOT = Path(__file__).resolve().parents[2]


def test_docs_table_is_the_module_table():
    text = (ROOT / "docs/design.md").read_text()
    got = re.search(r"<!-- timeouts:begin -->\n(.*?)<!-- timeouts:end -->", text, re.S)
    assert got, "docs/design.md lost its timeouts markers"
    assert got.group(1) == timeouts.markdown_table(), "regenerate: python -c 'from moeverify import timeouts; " \
                                                      "print(timeouts.markdown_table())'"


def test_every_entry_is_a_module_value_with_one_override():
    names = [t.name for t in timeouts.TABLE]
    assert len(set(names)) == len(names)
    envs = [t.env for t in timeouts.TABLE if t.env]
    assert len(set(envs)) == len(envs) and all(e.startswith("MOEVERIFY_") for e in envs)
    for t in timeouts.TABLE:
        assert sum(x is not None for x in (t.env, t.flag, t.derived)) == 1, t
        assert isinstance(getattr(timeouts, t.name), float) and t.meaning
    startup = next(t for t in timeouts.TABLE if t.name == "STARTUP_S")
    slack = next(t for t in timeouts.TABLE if t.name == "STARTUP_SLACK_S")
    assert slack.default_s == startup.default_s + 60 and timeouts.STARTUP_SLACK_S == timeouts.STARTUP_S + 60


def _timeout_literals(text: str, where: str) -> list[str]:
    """Module-level assignments of a number to a name that says timeout (``*TIMEOUT*``, ``*_SLACK_S``)."""
    found = []
    for node in ast.parse(text).body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and \
                isinstance(node.value.value, (int, float)) and not isinstance(node.value.value, bool):
            for target in node.targets:
                if isinstance(target, ast.Name) and re.search(r"TIMEOUT|_SLACK_S$", target.id):
                    found.append(f"{where}:{node.lineno} {target.id}")
    return found


def test_no_module_declares_a_timeout_of_its_own():
    found = [hit for path in sorted((ROOT / "moeverify").rglob("*.py")) if path.name != "timeouts.py"
             for hit in _timeout_literals(path.read_text(), str(path.relative_to(ROOT)))]
    assert not found, f"declare these in moeverify/timeouts.py: {found}"


def test_the_literal_finder_finds_a_declaration():
    text = "JOIN_TIMEOUT_S = 300.0\nSTARTUP_SLACK_S = 1\nSLACK = 0.1\nX = timeouts.COLLECTIVE_S\n"
    assert _timeout_literals(text, "x.py") == ["x.py:1 JOIN_TIMEOUT_S", "x.py:2 STARTUP_SLACK_S"]


def test_public_aliases_and_users_read_the_table():
    code = ("from moeverify import cli, timeouts; from moeverify.runtime import agreement; import moeverify.runtime as r;"
            "from moeverify.runner import launch;"
            "print(cli.DEFAULT_TIMEOUT_S, r.DEFAULT_TIMEOUT_S, agreement.AGREE_TIMEOUT_S, launch.STARTUP_SLACK_S)")
    env = {"MOEVERIFY_COLLECTIVE_TIMEOUT_S": "123", "MOEVERIFY_AGREE_TIMEOUT_S": "7.5",
           "MOEVERIFY_STARTUP_TIMEOUT_S": "40", "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["600.0", "123.0", "7.5", "100.0"]


@pytest.mark.parametrize("raw", ["abc", "0", "-5", "inf", "nan"])
def test_bad_override_is_refused_naming_the_variable(raw):
    entry = next(t for t in timeouts.TABLE if t.name == "AGREE_S")
    with pytest.raises(UsageError, match=rf"MOEVERIFY_AGREE_TIMEOUT_S={raw!r}: expected a positive number"):
        entry.seconds({"MOEVERIFY_AGREE_TIMEOUT_S": raw})
    assert entry.seconds({}) == 60.0 and entry.seconds({"MOEVERIFY_AGREE_TIMEOUT_S": "2"}) == 2.0
