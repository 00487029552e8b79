"""Garbage in every ``MOEVERIFY_*`` variable the package reads, and in plugin specs: each value is either used or
refused with a ``UsageError`` (a ``MoEVerifyError``) whose message names the variable (the spec); never another
exception, never a traceback from the command line.

Each variable is read by the package's own reader, the code that reads it where it is used (not a copy of its
rule), and a value it accepts is handed to what uses it (a timeout to ``timedelta`` and ``faulthandler``, the cache
directory created).
"""

from __future__ import annotations

import datetime
import faulthandler
import os
import random
import re
import string
import time
from pathlib import Path

import pytest

from moeverify import files
from moeverify.errors import MoEVerifyError, UsageError
from moeverify.spec import plugins, timeouts

ROOT = Path(__file__).resolve().parents[2]

FIXED = [
    "",
    " ",
    "\t",
    "abc",
    "-1",
    "0",
    "-0",
    "+3",
    "3",
    "007",
    "1.5",
    "1e-9",
    "1e300",
    "1e999",
    "inf",
    "-inf",
    "nan",
    "0x10",
    "1_000",
    "5s",
    " 5 ",
    "\u00b2",
    "\u0661\u0662",
    "\u0663",
    "9" * 5000,
    "\udcff",
    "a\nb",
    "\x01",
    "\u00e9",
    "\U0001f642",
    ":",
    "::",
    "record:",
    "replay:",
    "r2",
    "r3:",
    "r3:/nonexistent/dir",
    "record:/proc/x",
    "off",
    "chance",
    "first",
    "refuse",
    "true",
    "None",
    "null",
    "/",
    "/dev/null",
    "/etc/passwd/x",
    ".",
    "..",
    "-",
    "x" * 5000,
    "../../../../../../../../tmp",
]
_ALPHABET = string.printable.replace("\x0b", "").replace("\x0c", "") + "\u00b2\u0661\u00e9\U0001f642\udcff"
_RNG = random.Random(37)
RANDOM = ["".join(_RNG.choice(_ALPHABET) for _ in range(_RNG.randint(1, 12))) for _ in range(60)]
VALUES = FIXED + RANDOM


# ------------------------------------------------------------------------------------------ readers
def _timeout(name: str):
    def read(tmp: Path) -> None:
        seconds = getattr(timeouts, name)
        datetime.timedelta(seconds=seconds)  # a process group's, a store's timeout
        faulthandler.dump_traceback_later(max(seconds, 60.0), exit=False)  # a rank's watchdog (not fired here)
        faulthandler.cancel_dump_traceback_later()
        assert time.monotonic() + seconds > 0

    return read


def _cache(tmp: Path) -> None:
    files.check_cache_root()
    root = files.cache_root().absolute()
    if root.resolve().is_relative_to(tmp):  # created only inside this test's directory
        from moeverify.models import families

        assert families.cache_dir().is_dir()


def _router_replay(tmp: Path) -> None:
    from moeverify.patches import autopatch

    value = os.environ.get(autopatch.ENV)  # as autopatch.install_from_env reads it
    if value:
        autopatch.parse(value, os.environ.get(autopatch.MODEL_ENV))


def _injob(tmp: Path) -> None:
    from moeverify.patches import injob

    injob.InJobState(original=None, num_experts=4)


def _keep(tmp: Path) -> None:
    from moeverify.patches import rollout_source

    rollout_source.keep()


def _agreement(tmp: Path) -> None:
    from moeverify.patches import agreement

    for in_job in (False, True):
        try:
            agreement.from_env(in_job=in_job)
        finally:
            agreement.stop()


def _engine_python():
    from moeverify.engines import vllm_process

    vllm_process.engine_python()


READERS = {t.env: _timeout(t.name) for t in timeouts.TABLE if t.env}
READERS.update(
    {
        files.CACHE_ENV: _cache,
        "MOEVERIFY_ROUTER_REPLAY": _router_replay,
        "MOEVERIFY_ROUTER_REPLAY_MODEL": _router_replay,
        "MOEVERIFY_ROUTER_REPLAY_MAX_TOKENS": _injob,
        "MOEVERIFY_ROUTER_REPLAY_DUPLICATES": _injob,
        "MOEVERIFY_AGREEMENT": _agreement,
        "MOEVERIFY_AGREEMENT_MIN": _agreement,
        "MOEVERIFY_AGREEMENT_FLOOR": _agreement,
        "MOEVERIFY_AGREEMENT_NUMBERING": _agreement,
        "MOEVERIFY_AGREEMENT_LOG": _agreement,
        "MOEVERIFY_ROUTER_REPLAY_KEEP": _keep,
        "MOEVERIFY_VLLM_PYTHON": lambda _tmp: _engine_python(),
    }
)
# What the variable needs beside it to be read at all.
COMPANIONS = {
    "MOEVERIFY_ROUTER_REPLAY_MODEL": {"MOEVERIFY_ROUTER_REPLAY": "r2"},
    "MOEVERIFY_AGREEMENT_MIN": {"MOEVERIFY_AGREEMENT": "{tmp}/agreement.jsonl"},
    "MOEVERIFY_AGREEMENT_FLOOR": {"MOEVERIFY_AGREEMENT": "{tmp}/agreement.jsonl"},
}
# Read, but not fuzzed here: the variable is read deep inside a rollout step's loading (``patches/rollout_source.py``),
# with no reader of its own to call.
# MOEVERIFY_ENGINE_REPLY_FD: set by ``vllm_process.Engine`` for the engine's own process, which alone reads it.
NOT_FUZZED = {"MOEVERIFY_ROUTER_REPLAY_EXPERT_MAP", "MOEVERIFY_ENGINE_REPLY_FD"}


def _known_bad(env: str, value: str) -> bool:
    """Values a reader still raises another exception on (none now: the list stays for the next one found)."""
    return False


def test_every_variable_the_package_reads_is_fuzzed():
    named = set()
    for path in (ROOT / "moeverify").rglob("*.py"):
        named |= set(re.findall(r"""["'](MOEVERIFY_[A-Z_]+)["']""", path.read_text()))
    named |= {t.env for t in timeouts.TABLE if t.env}
    assert named - set(READERS) - NOT_FUZZED == set(), "add a reader for these variables"
    assert set(READERS) <= named


@pytest.mark.parametrize("env", sorted(READERS))
def test_garbage_in_a_variable_is_used_or_refused_naming_it(env, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name in list(os.environ):
        if name.startswith("MOEVERIFY_") and name != "MOEVERIFY_TEST_BACKEND":
            monkeypatch.delenv(name)
    for name, value in COMPANIONS.get(env, {}).items():
        monkeypatch.setenv(name, value.format(tmp=tmp_path))
    wrong, still = [], []
    for value in VALUES:
        monkeypatch.setenv(env, value)
        try:
            READERS[env](tmp_path)
        except MoEVerifyError as exc:
            if not isinstance(exc, UsageError) or env not in str(exc):
                wrong.append(f"{value[:40]!r}: {type(exc).__name__}: {str(exc)[:200]}")
        except Exception as exc:  # noqa: BLE001 (what the fuzz looks for)
            (still if _known_bad(env, value) else wrong).append(f"{value[:40]!r}: {type(exc).__name__}: {exc}"[:300])
        else:
            if _known_bad(env, value):
                wrong.append(f"{value[:40]!r}: accepted now: drop it from _known_bad")
    assert wrong == [], f"{env}: {len(wrong)} value(s) neither used nor refused naming it:\n" + "\n".join(wrong)
    assert len(still) == sum(_known_bad(env, v) for v in VALUES)


# ------------------------------------------------------------------------------------------ plugin specs
SPECS = [
    "",
    ":",
    "::",
    "a:",
    ":f",
    "a:b:c",
    "a.:f",
    ".a:f",
    "a..b:f",
    "a b:f",
    "1a:f",
    "a:1f",
    "a:f-g",
    "json:",
    "json:dumps",
    "json:nope",
    "os:sep",
    "os.path:join",
    "moeverify.errors:UsageError",
    "moeverify:__version__",
    "no_such_pkg_xyz:f",
    "no_such_pkg_xyz.sub:f",
    "json.no_such:f",
    "/:f",
    "/etc/passwd:f",
    "/dev/null.py:f",
    "{tmp}/missing.py:f",
    "{tmp}/ok.py:factory",
    "{tmp}/ok.py:value",
    "{tmp}/ok.py:nope",
    "{tmp}/raises.py:f",
    "{tmp}/syntax.py:f",
    "{tmp}/binary.py:f",
    "{tmp}:f",
    "{tmp}/dir.py:f",
    "\udcff:f",
    "a\nb:f",
    "é:f",
    "x" * 300 + ":f",
    "bridge",
    "sharded",
    "Bridge",
    "gather ",
    "verl:verl",
]
_SPEC_ALPHABET = string.ascii_letters + string.digits + "._:/- \u00e9"
SPECS += ["".join(_RNG.choice(_SPEC_ALPHABET) for _ in range(_RNG.randint(1, 16))) for _ in range(40)]
RUN_FILE = "scenarios:\n  - {family: qwen3_moe, world_size: 1, checks: [export, replay]}\n"


def _plugin_files(tmp: Path) -> None:
    (tmp / "ok.py").write_text("value = 3\ndef factory(ctx=None):\n    return iter(())\n")
    (tmp / "raises.py").write_text("raise KeyError('at import')\ndef f(ctx=None):\n    pass\n")
    (tmp / "syntax.py").write_text("def f(:\n")
    (tmp / "binary.py").write_bytes(b"\xff\xfe\x00garbage")
    (tmp / "dir.py").mkdir()
    (tmp / "s.yaml").write_text(RUN_FILE)


@pytest.mark.parametrize(
    ("flag", "what"), [("--subject", "subject"), ("--replay-impl", "replay implementation"), ("--receiver", "receiver")]
)
def test_garbage_plugin_specs_are_used_or_refused_naming_them(flag, what, tmp_path, capsys):
    from moeverify import cli
    from moeverify.spec.options import OPTIONS

    _plugin_files(tmp_path)
    option = next(o for o in OPTIONS.values() if o.flag == flag)
    wrong = []
    for raw in SPECS:
        spec = raw.format(tmp=tmp_path)
        code = cli.main(["run", str(tmp_path / "s.yaml"), "--list", flag, spec])
        out, err = capsys.readouterr()
        if code not in (0, 2) or "Traceback" in err or (code == 2 and flag not in err and what not in err):
            wrong.append(f"{flag} {spec[:60]!r}: exit {code}: {err.strip()[-300:]}")
        try:
            plugins.check(spec, what=what, builtins=option.plugin[1])
        except UsageError as exc:
            if what not in str(exc) and repr(spec) not in str(exc):
                wrong.append(f"check {spec[:60]!r}: {exc}")
        except Exception as exc:  # noqa: BLE001
            wrong.append(f"check {spec[:60]!r}: {type(exc).__name__}: {exc}")
    assert wrong == [], "\n".join(wrong)


@pytest.mark.timing
@pytest.mark.parametrize(
    ("spec", "loads"),
    [
        ("json:dumps", True),
        ("moeverify.errors:UsageError", True),
        ("{tmp}/ok.py:factory", True),
        ("os:sep", False),
        ("{tmp}/ok.py:value", False),
        ("{tmp}/raises.py:f", False),
        ("moeverify:__version__", False),
    ],
)
def test_plugins_that_pass_the_source_check_are_loaded_or_refused_naming_them(spec, loads, tmp_path):
    from moeverify.runner import probe

    _plugin_files(tmp_path)
    spec = spec.format(tmp=tmp_path)
    plugins.check(spec, what="subject")
    if loads:
        probe.probe(spec, what="subject")
    else:
        with pytest.raises(UsageError, match=rf"^subject {re.escape(repr(spec))}: "):
            probe.probe(spec, what="subject")
