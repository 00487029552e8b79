"""``tools/setup.sh`` (``make setup``): the venv it makes has ``torchrun``, and a second run leaves it as it was.

Run on a copy of the setup script and the requirement files in a temporary directory, against the stack and tools
venvs this checkout's ``.venv`` already uses (the same requirement files hash to the same cache entries), so
nothing is installed: the test makes a fresh ``.venv`` and runs the setup twice.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from waiting import CHILD_S

ROOT = Path(__file__).resolve().parents[2]


def _cached_stack() -> Path | None:
    """The stack venv this checkout's ``.venv`` sees, when it is complete; else None."""
    marker = ROOT / ".venv" / ".moeverify-stack"
    if not marker.is_file():
        return None
    stack = Path(marker.read_text().strip())
    return stack if (stack / ".complete").is_file() else None


def _interpreter() -> str:
    """The Python 3.12 this checkout's ``.venv`` was made from (the stack's key includes its version)."""
    cfg = dict(
        line.split(" = ", 1) for line in (ROOT / ".venv" / "pyvenv.cfg").read_text().splitlines() if " = " in line
    )
    return cfg["executable"]


def _setup(repo: Path, cache: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "MOEVERIFY_CACHE_DIR": str(cache), "PYTHON": _interpreter()}
    return subprocess.run(
        ["bash", str(repo / "tools" / "setup.sh")], env=env, capture_output=True, text=True, timeout=CHILD_S
    )


def _snapshot(venv: Path) -> dict[str, tuple]:
    """Every file of the venv's bin/ and the .pth files: text (or link target), mode, inode and mtime."""
    paths = sorted((venv / "bin").iterdir()) + sorted(venv.glob("lib/python*/site-packages/*.pth"))
    paths.append(venv / "pyvenv.cfg")
    out = {}
    for p in paths:
        st = p.lstat()
        body = os.readlink(p) if p.is_symlink() else p.read_bytes()
        out[str(p.relative_to(venv))] = (body, st.st_mode, st.st_ino, st.st_mtime_ns)
    return out


@pytest.fixture
def repo_copy(tmp_path) -> Path:
    stack = _cached_stack()
    if stack is None:
        pytest.skip("no complete stack venv behind this checkout's .venv (run make setup first)")
    repo = tmp_path / "repo"
    (repo / "tools").mkdir(parents=True)
    shutil.copy2(ROOT / "tools" / "setup.sh", repo / "tools" / "setup.sh")
    shutil.copytree(ROOT / "requirements", repo / "requirements")
    return repo


@pytest.mark.timing
def test_setup_venv_has_torchrun_and_a_second_run_changes_nothing(repo_copy):
    cache = _cached_stack().parent
    first = _setup(repo_copy, cache)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "installing" not in first.stdout, first.stdout  # the cached stack and tools were found, not rebuilt
    venv = repo_copy / ".venv"
    torchrun = venv / "bin" / "torchrun"
    assert os.access(torchrun, os.X_OK), sorted(p.name for p in (venv / "bin").iterdir())
    assert torchrun.read_text().startswith(f"#!{venv}/bin/python\n")

    help_ = subprocess.run([str(torchrun), "--help"], capture_output=True, text=True, timeout=CHILD_S)
    assert help_.returncode == 0 and "--nproc-per-node" in help_.stdout, help_.stderr[-2000:]

    before = _snapshot(venv)
    second = _setup(repo_copy, cache)
    assert second.returncode == 0, second.stderr[-3000:]
    assert second.stdout.splitlines() == [line for line in first.stdout.splitlines() if "ready" in line]
    after = _snapshot(venv)
    changed = sorted(name for name in before.keys() | after.keys() if before.get(name) != after.get(name))
    assert not changed, f"a second setup changed {changed}"
