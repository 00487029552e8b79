"""Every timeout is declared once, in ``moeverify.spec.timeouts``: the docs table is rendered from it, no other module
declares a timeout literal, the public aliases read it, and a bad override is refused naming the variable."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest
from waiting import CHILD_S

from moeverify.errors import UsageError
from moeverify.spec import timeouts

ROOT = Path(__file__).resolve().parents[2]


def test_docs_table_is_the_module_table():
    text = (ROOT / "docs/design.md").read_text()
    got = re.search(r"<!-- timeouts:begin -->\n(.*?)<!-- timeouts:end -->", text, re.S)
    assert got, "docs/design.md lost its timeouts markers"
    assert got.group(1) == timeouts.markdown_table(), (
        "regenerate: python -c 'from moeverify.spec import timeouts; print(timeouts.markdown_table())'"
    )


def test_every_entry_is_a_module_value_with_at_most_one_override():
    names = [t.name for t in timeouts.TABLE]
    assert len(set(names)) == len(names)
    envs = [t.env for t in timeouts.TABLE if t.env]
    assert len(set(envs)) == len(envs) and all(e.startswith("MOEVERIFY_") for e in envs)
    for t in timeouts.TABLE:
        assert sum(x is not None for x in (t.env, t.flag, t.derived)) <= 1, t  # none: fixed (a protocol value)
        assert isinstance(getattr(timeouts, t.name), float) and t.meaning
    startup = next(t for t in timeouts.TABLE if t.name == "STARTUP_S")
    slack = next(t for t in timeouts.TABLE if t.name == "STARTUP_SLACK_S")
    assert slack.default_s == startup.default_s + 60 and timeouts.STARTUP_SLACK_S == timeouts.STARTUP_S + 60


def _timeout_literals(text: str, where: str) -> list[str]:
    """Module-level assignments of a number to a name that says timeout (``*TIMEOUT*``, ``*_SLACK_S``)."""
    found = []
    for node in ast.parse(text).body:
        if (
            isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, (int, float))
            and not isinstance(node.value.value, bool)
        ):
            for target in node.targets:
                if isinstance(target, ast.Name) and re.search(r"TIMEOUT|_SLACK_S$", target.id):
                    found.append(f"{where}:{node.lineno} {target.id}")
    return found


def test_no_module_declares_a_timeout_of_its_own():
    found = [
        hit
        for path in sorted((ROOT / "moeverify").rglob("*.py"))
        if path.name != "timeouts.py"
        for hit in _timeout_literals(path.read_text(), str(path.relative_to(ROOT)))
    ]
    assert not found, f"declare these in moeverify/spec/timeouts.py: {found}"


def test_the_literal_finder_finds_a_declaration():
    text = "JOIN_TIMEOUT_S = 300.0\nSTARTUP_SLACK_S = 1\nSLACK = 0.1\nX = timeouts.COLLECTIVE_S\n"
    assert _timeout_literals(text, "x.py") == ["x.py:1 JOIN_TIMEOUT_S", "x.py:2 STARTUP_SLACK_S"]


@pytest.mark.timing
def test_public_aliases_and_users_read_the_table():
    code = (
        "from moeverify import cli; from moeverify.spec import timeouts; "
        "from moeverify.runtime import outcome as agreement; import moeverify.runtime as r;"
        "from moeverify.runner import launch;"
        "print(cli.DEFAULT_TIMEOUT_S, r.DEFAULT_TIMEOUT_S, agreement.AGREE_TIMEOUT_S, launch.STARTUP_SLACK_S)"
    )
    env = {
        "MOEVERIFY_COLLECTIVE_TIMEOUT_S": "123",
        "MOEVERIFY_AGREE_TIMEOUT_S": "7.5",
        "MOEVERIFY_STARTUP_TIMEOUT_S": "40",
        "PATH": "/usr/bin:/bin",
    }
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=CHILD_S
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["600.0", "123.0", "7.5", "100.0"]


@pytest.mark.parametrize("raw", ["abc", "0", "-5", "inf", "nan", "1e300", "10000001"])
def test_bad_override_is_refused_naming_the_variable(raw):
    entry = next(t for t in timeouts.TABLE if t.name == "AGREE_S")
    with pytest.raises(
        UsageError,
        match=rf"MOEVERIFY_AGREE_TIMEOUT_S={raw!r}: expected a positive number of seconds, "
        r"at most 10000000",
    ):
        entry.seconds({"MOEVERIFY_AGREE_TIMEOUT_S": raw})
    assert entry.seconds({}) == 60.0 and entry.seconds({"MOEVERIFY_AGREE_TIMEOUT_S": "2"}) == 2.0
    assert entry.seconds({"MOEVERIFY_AGREE_TIMEOUT_S": "10000000"}) == timeouts.MAX_S


ENVS = [t.env for t in timeouts.TABLE if t.env]
# Every module that reads a timeout, and the public aliases: importing them reads none.
IMPORTS = (
    "import moeverify.cli, moeverify.runtime, moeverify.runtime.outcome, moeverify.runner.launch, "
    "moeverify.runner.worker, moeverify.runner.nodes, moeverify.oracles.export.oracle, "
    "moeverify.oracles.context, moeverify.patches.autopatch_dump"
)


@pytest.mark.timing
def test_bad_overrides_break_no_import_and_not_help():
    bad = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), **dict.fromkeys(ENVS, "soon")}
    out = subprocess.run(
        [sys.executable, "-c", IMPORTS], cwd=ROOT, env=bad, capture_output=True, text=True, timeout=CHILD_S
    )
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr[-3000:]
    out = subprocess.run(
        [sys.executable, "-m", "moeverify", "--help"],
        cwd=ROOT,
        env=bad,
        capture_output=True,
        text=True,
        timeout=CHILD_S,
    )
    assert out.returncode == 0 and "run" in out.stdout and not out.stderr, out.stderr[-3000:]


@pytest.mark.parametrize("env", ENVS)
def test_a_bad_override_is_refused_where_it_is_read(env, monkeypatch):
    import moeverify.runtime as rt
    from moeverify.runner import launch
    from moeverify.runtime import outcome

    monkeypatch.setenv(env, "-3")
    match = rf"^{env}='-3': expected a positive number of seconds"
    name = next(t.name for t in timeouts.TABLE if t.env == env)
    with pytest.raises(UsageError, match=match):
        getattr(timeouts, name)
    with pytest.raises(UsageError, match=match):
        timeouts.check()
    aliases = {
        "MOEVERIFY_COLLECTIVE_TIMEOUT_S": (rt, "DEFAULT_TIMEOUT_S"),
        "MOEVERIFY_AGREE_TIMEOUT_S": (outcome, "AGREE_TIMEOUT_S"),
        "MOEVERIFY_STARTUP_TIMEOUT_S": (launch, "STARTUP_SLACK_S"),
    }
    if env in aliases:
        with pytest.raises(UsageError, match=match):
            getattr(*aliases[env])
    monkeypatch.setenv(env, "12.5")
    assert getattr(timeouts, name) == 12.5 and timeouts.check() is None
    with pytest.raises(AttributeError, match="no attribute 'NO_SUCH_S'"):
        timeouts.NO_SUCH_S  # noqa: B018


@pytest.mark.parametrize("env", ENVS)
def test_run_refuses_a_bad_override_before_any_rank_starts(env, monkeypatch, capsys, repo_root):
    from moeverify import cli
    from moeverify.runner import launch

    def no_launch(*args, **kwargs):
        raise AssertionError("a group was launched")

    monkeypatch.setattr(launch, "run_group", no_launch)
    monkeypatch.setenv(env, "1e400")
    code = cli.main(["run", str(repo_root / "scenarios/smoke.yaml"), "--backend", "cpu"])
    err = capsys.readouterr().err
    assert code == 2 and f"moeverify: error: {env}='1e400': expected a positive number of seconds" in err, err
    assert "Traceback" not in err
    assert cli.main(["run", str(repo_root / "scenarios/smoke.yaml"), "--list"]) == 0  # --list launches nothing
